"""The size rule counts code, not lines: re-wrapping never changes a verdict, and no module is exempt."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("size_check", ROOT / "tools" / "size_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rewrapping_a_call_over_lines_does_not_change_the_count(tmp_path):
    size = _tool()
    one = tmp_path / "one.py"
    one.write_text("def f():\n    return g(1, 2, 3, 4)\n")
    wrapped = tmp_path / "wrapped.py"
    wrapped.write_text("def f():\n    return g(\n        1,\n        2,\n        3,\n        4,\n    )\n")
    import ast

    counts = [size.statements(ast.parse(p.read_text()).body[0]) for p in (one, wrapped)]
    assert counts == [1, 1]


def test_a_long_module_is_a_breach_even_with_a_written_reason(tmp_path):
    size = _tool()
    p = tmp_path / "big.py"
    p.write_text('"""Big.\n\nSize: it is one seam.\n"""\n' + "x = 1\n" * 460)
    [breach] = size.breaches(p)
    assert "more than 450" in breach


def test_a_class_with_too_many_statements_and_a_facade_with_too_many_verbs_are_breaches(tmp_path):
    size = _tool()
    p = tmp_path / "c.py"
    body = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(30))
    p.write_text("class CheckpointManager:\n" + body)
    assert any("public methods" in b for b in size.breaches(p))
    q = tmp_path / "d.py"
    q.write_text("class Big:\n    def f(self):\n" + "".join(f"        a{i} = {i}\n" for i in range(300)))
    got = size.breaches(q)
    assert any("class Big has" in b for b in got) and any("function f has" in b for b in got)


def test_the_library_and_the_cli_hold_the_rule():
    size = _tool()
    assert [b for root in ("verified_ckpt", "cli") for p in sorted((ROOT / root).rglob("*.py"))
            for b in size.breaches(p)] == []
