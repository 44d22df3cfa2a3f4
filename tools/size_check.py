"""Hold the house's size rules (docs/DESIGN.md): modules, classes and functions that stay readable.

    python tools/size_check.py verified_ckpt cli

A module over 450 lines needs a reason written at its top (a line starting
``Size:`` in its docstring); a class over 350 lines, a function over 60 and
``CheckpointManager``'s module over 350 fail. A strict parser that is a flat
checklist (one check per field) may say so with ``# size: flat checklist`` on
its ``def`` line. Exit 1 with one line per breach.
"""

from __future__ import annotations

import ast
import pathlib
import sys

MODULE, CLASS, FUNCTION, FACADE = 450, 350, 60, 350
FACADE_MODULE = "verified_ckpt/checkpoint/manager.py"


def breaches(path: pathlib.Path) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    doc = ast.get_docstring(tree) or ""
    out = []
    limit = FACADE if path.as_posix().endswith(FACADE_MODULE) else MODULE
    if len(lines) > limit and not any(line.startswith("Size:") for line in doc.splitlines()):
        out.append(f"{path}: {len(lines)} lines, more than {limit}, and no 'Size:' reason in its docstring")
    for node in ast.walk(tree):
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        n = (node.end_lineno or node.lineno) - node.lineno + 1
        if isinstance(node, ast.ClassDef) and n > CLASS:
            out.append(f"{path}:{node.lineno}: class {node.name} has {n} lines, more than {CLASS}")
        elif not isinstance(node, ast.ClassDef) and n > FUNCTION and "# size: flat checklist" not in lines[node.lineno - 1]:
            out.append(f"{path}:{node.lineno}: function {node.name} has {n} lines, more than {FUNCTION}")
    return out


def main(roots: list[str]) -> int:
    found = [b for root in roots for p in sorted(pathlib.Path(root).rglob("*.py")) for b in breaches(p)]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["verified_ckpt", "cli"]))
