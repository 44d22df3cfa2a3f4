"""Hold the house's size rules (docs/DESIGN.md): concepts that stay readable, counted as code, not as lines.

    python tools/size_check.py verified_ckpt cli

- a module has at most 450 lines, with no exemption (one concept per module: a bigger one is two);
- a class has at most 280 statements, and a function at most 60 (statements nested inside count; line breaks
  and comments do not, so re-wrapping code never changes a count);
- a facade has at most its number of public methods (``FACADES``): a new public verb there is a design
  decision, taken by raising the number here, in review.

Exit 1 with one line per breach.
"""

from __future__ import annotations

import ast
import pathlib
import sys

MODULE_LINES, CLASS_STATEMENTS, FUNCTION_STATEMENTS = 450, 280, 60
FACADES = {"CheckpointManager": 25, "SDCGuard": 18}  # public methods (and properties) of the public facades


def statements(node: ast.AST) -> int:
    """Statements inside ``node`` (not ``node`` itself), however they are wrapped over lines."""
    return sum(isinstance(n, ast.stmt) for n in ast.walk(node)) - 1


def public_methods(cls: ast.ClassDef) -> list[str]:
    return [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")]


def breaches(path: pathlib.Path) -> list[str]:
    text = path.read_text()
    tree = ast.parse(text)
    out = []
    lines = len(text.splitlines())
    if lines > MODULE_LINES:
        out.append(f"{path}: {lines} lines, more than {MODULE_LINES}; split it into modules of one concept each")
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            n = statements(node)
            if n > CLASS_STATEMENTS:
                out.append(f"{path}:{node.lineno}: class {node.name} has {n} statements, more than {CLASS_STATEMENTS}")
            limit = FACADES.get(node.name)
            if limit is not None and len(public_methods(node)) > limit:
                out.append(f"{path}:{node.lineno}: facade {node.name} has {len(public_methods(node))} public methods, "
                           f"more than {limit}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = statements(node)
            if n > FUNCTION_STATEMENTS:
                out.append(f"{path}:{node.lineno}: function {node.name} has {n} statements, more than {FUNCTION_STATEMENTS}")
    return out


def main(roots: list[str]) -> int:
    found = [b for root in roots for p in sorted(pathlib.Path(root).rglob("*.py")) for b in breaches(p)]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["verified_ckpt", "cli"]))
