"""The installed package's shape: no import cycle, every import running down the floors, Axolotl and
its config met in one room, only runtime code, names that do not collide, every family fact in one
place.

The import graph is read statically (tools/package_structure.py): every import statement, lazy
ones included, and every literal module name, `TYPE_CHECKING` imports too.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
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


@pytest.mark.parametrize("type_checking", [False, True], ids=["runtime", "with-type-checking"])
def test_every_import_runs_down_the_floors(type_checking):
    edges = package_structure.graph(PACKAGE, type_checking)
    rooms = {package_structure.room(m) for m in edges}
    placed = {r for floor in package_structure.FLOORS for r in floor}
    assert rooms <= placed, f"give these rooms a floor in tools/package_structure.py: {sorted(rooms - placed)}"
    assert package_structure.upward_imports(edges) == []


def test_the_floor_check_finds_an_import_running_up(tmp_path):
    """The check above must be able to fail: `packing` (floor 1) reaching into `integration` (7)."""
    pkg = tmp_path / "axolotl_fastqwen"
    (pkg / "packing").mkdir(parents=True)
    (pkg / "integration").mkdir()
    for init in (pkg / "__init__.py", pkg / "packing" / "__init__.py", pkg / "integration" / "__init__.py"):
        init.write_text("")
    (pkg / "integration" / "keys.py").write_text("BUDGET = 64\n")
    (pkg / "packing" / "planner.py").write_text("def budget():\n    from ..integration.keys import BUDGET\n")
    edges = package_structure.graph(pkg)
    assert package_structure.upward_imports(edges) == [("axolotl_fastqwen.packing.planner",
                                                       "axolotl_fastqwen.integration.keys")]


def _modules_outside(room: str):
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] != room:
            yield path


def test_only_the_axolotl_room_imports_axolotl():
    """Everything that talks to Axolotl is in `integration/`; the rest runs without it."""
    found = []
    for path in _modules_outside("integration"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] == "axolotl"]
    assert found == []
    room = "\n".join(p.read_text() for p in (PACKAGE / "integration").glob("*.py"))
    assert "from axolotl." in room  # the check reads real imports


def test_only_the_axolotl_room_reads_the_config():
    """The YAML is read once (integration/settings.py) into `Settings`; nothing below takes `cfg`."""
    pattern = re.compile(r"\bcfg(\.get\(|\[|\.[a-z_]+\b)")
    found = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in _modules_outside("integration")
             for line in p.read_text().splitlines() if pattern.search(line)]
    assert found == []
    assert pattern.search((PACKAGE / "integration" / "settings.py").read_text())


def test_no_two_modules_share_a_name():
    stems = Counter(p.stem for p in PACKAGE.rglob("*.py") if p.stem != "__init__")
    assert [stem for stem, n in stems.items() if n > 1] == []


def test_asset_builders_benchmark_and_test_helpers_are_outside_the_package():
    names = {p.stem for p in PACKAGE.rglob("*.py")}
    assert not (PACKAGE / "tools").exists() and not (PACKAGE / "bench").exists()
    assert not {"tiny_assets", "bench_packer", "run", "paths", "axolotl_best", "profile"} & names


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
