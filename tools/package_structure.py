"""What the installed package's import graph looks like: modules, edges, cycles, size.

    python tools/package_structure.py [PACKAGE_DIR]     # default: axolotl_fastqwen next to this folder

Every `import` / `from ... import` statement of the package counts as an edge, at module level or
inside a function (a lazy import is still a dependency), except those under `if TYPE_CHECKING:`;
so does any string literal that is exactly the dotted name of a package module (what
`importlib.import_module` lists and plugin tables hold). `--type-checking` counts the imports under
`if TYPE_CHECKING:` too. A cycle is a strongly connected component of more than one module. Used
by tests/test_package_structure.py and for the numbers in the closing note of issue 16.
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


def main(argv: list[str] | None = None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    type_checking = "--type-checking" in args
    args = [a for a in args if a != "--type-checking"]
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent / "axolotl_fastqwen"
    edges = graph(root, type_checking)
    size = lines(root)
    print(json.dumps({"modules": len(edges), "lines": sum(size.values()), "cycles": cycles(edges)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
