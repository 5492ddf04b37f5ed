"""What the installed package's import graph looks like: modules, edges, cycles, size.

    python tools/package_structure.py [PACKAGE_DIR]     # default: axolotl_fastqwen next to this folder

Every `import` / `from ... import` statement of the package counts as an edge, at module level or
inside a function (a lazy import is still a dependency), except those under `if TYPE_CHECKING:`;
so does any string literal that is exactly the dotted name of a package module (what
`importlib.import_module` lists and plugin tables hold). `--type-checking` counts the imports under
`if TYPE_CHECKING:` too. A cycle is a strongly connected component of more than one module. Used
by tests/test_package_structure.py and for the numbers in the closing notes of issues 16 and 33
(modules, lines, the largest module, functions over 80 lines, cycles, imports running up the floors).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(root: Path, path: Path, type_checking: bool = False) -> set[str]:
    """Package modules imported by one file."""
    package = root.name
    name = module_name(root, path)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    literals: set[str] = set()  # kept apart: a literal counts only if it is exactly a module's name

    def resolve(level: int, module: str | None) -> str:
        if not level:
            return module or ""
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                # `from pkg import x`: the module pkg.x if there is one, else pkg (resolved in graph());
                # a module's own parent packages are imported implicitly and are not counted
                target = resolve(child.level, child.module)
                out.update(f"{target}.{a.name}" for a in child.names)
            elif (isinstance(child, ast.Constant) and isinstance(child.value, str)
                  and child.value.startswith(package + ".")):
                literals.add(child.value)
            visit(child)

    visit(tree)
    return {m for m in out if m == package or m.startswith(package + ".")}, literals


def graph(root: Path, type_checking: bool = False) -> dict[str, set[str]]:
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    edges = {}
    for name, path in files.items():
        targets = set()
        found, literals = imports(root, path, type_checking)
        targets.update(t for t in literals if t in files and t != name)
        for target in found:
            # `from pkg import name` names a module only if it is one
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in edges:
        if v not in index:
            strong(v)
    return out


def lines(root: Path) -> dict[str, int]:
    return {module_name(root, p): len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}


# The package's rooms (top-level modules and subpackages), bottom floor first: a module imports only
# from its own room or from a room on a lower floor (tests/test_package_structure.py). A new room
# must be given a floor here.
FLOORS = (
    ("hookspecs", "devices", "boundaries", "report_text"),  # no import of the package's own
    ("families", "ops", "packing"),  # what a model family is; one module per op; the packer
    ("registry",),  # built-in and installed families and kernels (pluggy)
    ("transformers_functions", "memory"),  # transformers' own functions; activation memory
    ("layers",),  # the replacement forwards
    ("kernel_choice",),  # a kernel per op, proven by the self-check
    ("patching",),  # patch_model and what runs once per forward
    ("integration", "diagnostics"),  # Axolotl's room; doctor
    ("__init__", "__main__"),
)


def room(module: str) -> str:
    """The room of `axolotl_fastqwen.a.b`: `a` (`__init__` for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor_of(module: str, floors=FLOORS) -> int | None:
    return next((i for i, rooms in enumerate(floors) if room(module) in rooms), None)


def upward_imports(edges: dict[str, set[str]], floors=FLOORS) -> list[tuple[str, str]]:
    """Imports between rooms that do not run down the floors (a room without a floor counts as up)."""
    out = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            if room(source) == room(target):
                continue
            a, b = floor_of(source, floors), floor_of(target, floors)
            if a is None or b is None or a <= b:
                out.append((source, target))
    return out


def long_functions(root: Path, limit: int = 80) -> list[tuple[str, str, int]]:
    """(module, function, lines) of every function longer than `limit` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    out.append((module_name(root, path), node.name, length))
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    type_checking = "--type-checking" in args
    args = [a for a in args if a != "--type-checking"]
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent / "axolotl_fastqwen"
    edges = graph(root, type_checking)
    size = lines(root)
    largest = max(size, key=size.get)
    print(json.dumps({"modules": len(edges), "lines": sum(size.values()), "largest": [largest, size[largest]],
                      "functions_over_80_lines": long_functions(root), "cycles": cycles(edges),
                      "upward_imports": upward_imports(edges)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
