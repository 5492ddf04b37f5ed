"""The installed package's shape: no import cycle, only runtime code, every family fact in one place.

The import graph is read statically (tools/package_structure.py): every import statement, lazy
ones included, and every literal module name, `TYPE_CHECKING` imports too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import package_structure  # noqa: E402

PACKAGE = ROOT / "axolotl_fastqwen"


@pytest.mark.parametrize("type_checking", [False, True], ids=["runtime", "with-type-checking"])
def test_the_package_has_no_import_cycle(type_checking):
    edges = package_structure.graph(PACKAGE, type_checking)
    assert len(edges) > 40  # the graph was read
    assert package_structure.cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    """The check above must be able to fail: a two-module cycle, through a lazy import."""
    pkg = tmp_path / "axolotl_fastqwen"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    assert package_structure.cycles(package_structure.graph(pkg)) == [["axolotl_fastqwen.a", "axolotl_fastqwen.b"]]


def test_asset_builders_and_test_helpers_are_outside_the_package():
    names = {p.stem for p in PACKAGE.rglob("*.py")}
    assert not (PACKAGE / "tools").exists()
    assert not {"tiny_assets", "bench_packer"} & names


def test_each_family_fact_is_written_once():
    """A family's class names appear in its family module and nowhere else in the package (the
    docs and the benchmark's Axolotl paths read them from there)."""
    from axolotl_fastqwen import registry

    for family in registry.families():
        home = PACKAGE / "families" / f"{family.name}.py"
        for fact in (family.causal_lm, family.gated_deltanet, family.attention, family.decoder, family.text_config,
                     family.modeling_module, family.axolotl.packing[1]):
            where = [p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py")
                     if p != home and f'"{fact}"' in p.read_text()]
            assert where == [], (fact, where)
