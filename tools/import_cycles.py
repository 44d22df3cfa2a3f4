"""Print every import circle inside a package of the library, as drawn from the code's own imports.

    python tools/import_cycles.py [PACKAGE ...]     (default: verified_ckpt.guard verified_ckpt.checkpoint)

Every ``import`` and ``from ... import`` counts: at module level, inside functions, and under ``TYPE_CHECKING``,
because each is a dependency a reader has to hold in mind even where Python resolves it late. A circle is a
strongly connected component of more than one module among a package's modules (its subpackages' modules
included, its ``__init__`` facades left out: they re-export, they are not a layer). Exit status 1 when any
circle is found, 0 otherwise.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = "verified_ckpt"
DEFAULT = ("verified_ckpt.guard", "verified_ckpt.checkpoint")


def modules(root: pathlib.Path = ROOT, library: str = LIBRARY) -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the library (a package under its own name)."""
    out = {}
    for p in sorted((root / library).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _base(name: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = name.split(".") if is_package else name.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The library modules ``name`` imports anywhere in its text (a ``from X import y`` names X.y when y is a module)."""
    out: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = _base(name, is_package, node)
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    out.add(f"{base}.{a.name}")
                elif base in known:
                    out.add(base)
    out.discard(name)
    return out


def graph(root: pathlib.Path = ROOT, library: str = LIBRARY) -> dict[str, set[str]]:
    found = modules(root, library)
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def circles(edges: dict[str, set[str]], package: str, facades: set[str] | frozenset[str] = frozenset()) -> list[list[str]]:
    """Strongly connected components of more than one module among ``package``'s modules (Tarjan's, iterative)."""
    inside = {m for m in edges if m.startswith(package + ".") and m not in facades}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(inside):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start] & inside)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child] & inside))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def main(argv: list[str]) -> int:
    packages = argv or list(DEFAULT)
    found_modules = modules()
    edges = graph()
    facades = {m for m, p in found_modules.items() if p.name == "__init__.py"}
    status = 0
    for package in packages:
        if package not in found_modules:
            print(f"{package}: no such package of {LIBRARY}; name one such as {DEFAULT[0]}", file=sys.stderr)
            return 2
        for component in circles(edges, package, facades):
            status = 1
            short = [m[len(package) + 1:] for m in component]
            print(f"{package}: a circle of {len(component)} modules: {', '.join(short)}")
    if status == 0:
        print(f"no import circle inside {', '.join(packages)}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
