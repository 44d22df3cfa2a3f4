"""Every module is named where a reader looks for it: in its package's docstring and in docs/DESIGN.md's module table.

A module the map leaves out is one a reader cannot place (the layering, the "change it for" column); the map is
only kept whole when a test fails the day a module is added without its row.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"verified_ckpt": ROOT / "verified_ckpt", "cli": ROOT / "cli"}
NAME = re.compile(r"`+([A-Za-z_]\w*(?:/\w+)*)/?(?:\.py)?`+")


def modules() -> list[tuple[str, pathlib.Path]]:
    """``(path in the table's spelling, file)`` for every module: ``errors``, ``guard/abft/norms``, ``cli/main``."""
    out = []
    for top, root in PACKAGES.items():
        for p in sorted(root.rglob("*.py")):
            if p.name == "__init__.py":
                continue
            parts = list(p.relative_to(root).with_suffix("").parts)
            out.append(("/".join(([top] if top == "cli" else []) + parts), p))
    return out


def table_rows(text: str) -> list[tuple[str, str]]:
    """(module cell, description cell) of each row of the table under ``## Modules``."""
    section = text.split("\n## Modules", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 2:
            rows.append((cells[0], cells[1]))
    return rows


def named_in_table(rows: list[tuple[str, str]]) -> set[str]:
    """The modules the table names. A cell may abbreviate (```guard/nonfinite`, `checksum` `` is guard/checksum); a
    package's row (```store/` ``) may name its modules in its description instead."""
    out: set[str] = set()
    for cell, description in rows:
        names = NAME.findall(cell)
        if not names:
            continue
        prefix = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0] else ""
        for n in names:
            out.add(n if "/" in n or not prefix else prefix + n)
        if re.fullmatch(r"`[\w/]+/`.*", cell):  # a package's row: its modules named in the description
            package = names[0]
            out.update(f"{package}/{n}" for n in NAME.findall(description) if "/" not in n)
    return out


def docstring_names(init: pathlib.Path) -> set[str]:
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    return set(NAME.findall(doc))


def test_every_module_is_a_row_of_the_design_table():
    named = named_in_table(table_rows((ROOT / "docs" / "DESIGN.md").read_text()))
    missing = [m for m, _ in modules() if m not in named]
    assert missing == [], f"docs/DESIGN.md's module table does not name: {missing}"


def test_every_module_is_named_in_its_package_docstring():
    missing = []
    for _, path in modules():
        if path.stem not in docstring_names(path.parent / "__init__.py"):
            missing.append(str(path.relative_to(ROOT)))
    assert missing == [], f"not named in their package's docstring (__init__.py): {missing}"


def test_the_table_reader_sees_abbreviations_package_rows_and_a_missing_module():
    rows = table_rows("# x\n\n## Modules\n\n| module | holds |\n|---|---|\n| `errors` | e |\n"
                      "| `guard/nonfinite`, `checksum` | checks |\n| `store/` | the seam: `backend`, `paths` |\n\n## Next\n"
                      "| `later` | not the table |\n")
    assert named_in_table(rows) == {"errors", "guard/nonfinite", "guard/checksum", "store", "store/backend",
                                    "store/paths"}
