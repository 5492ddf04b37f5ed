"""Guards for the one place the plugin relies on Axolotl beyond its hooks (integration/bare_name.py).

Axolotl has no public way to alias a plugin name; the bare `plugins: [axolotl_fastqwen]` works only
because (1) Axolotl cannot load that name itself, (2) `PluginManager()` is its singleton whose
documented `plugins` table `prepare_plugins` consults before loading, and (3) installed entry-point
plugins are registered before the configured names are. If any of these changes, a test here fails
and says which, before a user meets it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("axolotl")
pytestmark = pytest.mark.axolotl

PROBE = r"""
import json
from axolotl.integrations.base import PluginManager, load_plugin
from axolotl.utils.config import prepare_plugins
from axolotl.utils.dict import DictDefault

out = {}
try:
    load_plugin("axolotl_fastqwen")
    out["bare_name_loads"] = True
except Exception as exc:
    out["bare_name_loads"] = False
out["singleton"] = PluginManager() is PluginManager() and PluginManager.get_instance() is PluginManager()
prepare_plugins(DictDefault({"plugins": ["axolotl_fastqwen"]}))
plugins = PluginManager.get_instance().plugins
out["table"] = {name: type(plugin).__name__ for name, plugin in plugins.items() if "fastqwen" in name}
real = plugins.get("axolotl_fastqwen.FastQwenPlugin")
out["active"] = bool(real is not None and real.active)
print("RESULT " + json.dumps(out))
"""


def test_the_bare_plugin_name_resolves_through_axolotls_plugin_table():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-4000:]
    out = json.loads(line[len("RESULT "):])
    assert out["bare_name_loads"] is False, (
        "Axolotl now loads a bare module name itself: drop integration.bare_name.alias_bare_name")
    assert out["singleton"], "PluginManager() is no longer Axolotl's singleton: the alias lands in a stray table"
    assert out["table"] == {"axolotl_fastqwen.FastQwenPlugin": "FastQwenPlugin", "axolotl_fastqwen": "BareNameAlias"}
    assert out["active"], "the real plugin did not see itself named by the bare name"
