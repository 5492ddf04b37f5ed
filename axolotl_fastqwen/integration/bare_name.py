"""The one place where the plugin relies on Axolotl beyond its plugin hooks.

`plugins: [axolotl_fastqwen]` (the bare module name) cannot be loaded by Axolotl 0.21: it splits a
configured name on its last dot into `module.Class`. Axolotl offers no public hook to alias a
plugin name, but its `prepare_plugins` skips loading any name already in the plugin table, and it
registers every installed `axolotl.plugins` entry point (ours) before that. So the plugin, when
Axolotl creates it, puts an inert twin into the table under the bare name, through the table's
documented attribute (`PluginManager().plugins`; `PluginManager()` returns Axolotl's singleton).
tests/test_axolotl_compat.py fails loudly if Axolotl changes any of this.
"""

from __future__ import annotations

from axolotl.integrations.base import BasePlugin, PluginManager

BARE_NAME = "axolotl_fastqwen"


class BareNameAlias(BasePlugin):
    """Holds the bare name's place in Axolotl's plugin table; every hook is BasePlugin's no-op, so
    nothing runs twice."""


def alias_bare_name() -> None:
    """Make `plugins: [axolotl_fastqwen]` resolve to the plugin Axolotl registered from our entry point."""
    PluginManager().plugins.setdefault(BARE_NAME, BareNameAlias())
