"""The tools that hold the house rules: the untyped-dict bound fails above it, and the import-circle drawer sees every
kind of import (function-level and ``TYPE_CHECKING`` ones too), on small packages written here."""

from __future__ import annotations

import pathlib
import sys

import any_dicts
import import_cycles
import pytest

pytestmark = pytest.mark.timeout(30)


def write(root: pathlib.Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_any_dicts_exits_nonzero_above_its_bound_and_zero_at_it(tmp_path, monkeypatch, capsys):
    write(tmp_path, {"verified_ckpt/inner.py": "from typing import Any\n\n\ndef f(x: dict[str, Any]) -> None:\n    pass\n",
                     "cli/__init__.py": ""})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(any_dicts, "BOUND", 0)
    assert any_dicts.main([]) == 1
    assert "1 dict[str, Any] inside the library over the bound of 0" in capsys.readouterr().err
    monkeypatch.setattr(any_dicts, "BOUND", 1)
    assert any_dicts.main([]) == 0


def test_the_library_meets_the_untyped_dict_bound(monkeypatch):
    monkeypatch.chdir(import_cycles.ROOT)
    assert any_dicts.main([]) == 0


def test_import_cycles_finds_circles_through_late_and_type_checking_imports(tmp_path):
    write(tmp_path, {
        "lib/__init__.py": "from .pkg import a\n",
        "lib/pkg/__init__.py": "from .a import A\n",
        # a -> b only under TYPE_CHECKING, b -> a only inside a function: still one circle
        "lib/pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\nA = 1\n",
        "lib/pkg/b.py": "def f():\n    from . import a\n    return a\n",
        "lib/pkg/c.py": "from ..pkg import a\nfrom lib.other import x\n",  # c -> a, c -> other: no circle
        "lib/other.py": "from .pkg.a import A\nx = A\n",
    })
    edges = import_cycles.graph(tmp_path, "lib")
    assert edges["lib.pkg.b"] == {"lib.pkg.a"} and edges["lib.pkg.c"] == {"lib.pkg.a", "lib.other"}
    assert import_cycles.circles(edges, "lib.pkg", {"lib.pkg"}) == [["lib.pkg.a", "lib.pkg.b"]]
    # a circle between packages is not one inside either
    assert import_cycles.circles(edges, "lib.other") == []


def test_import_cycles_sees_no_circle_in_a_package_without_one(tmp_path):
    write(tmp_path, {"lib/__init__.py": "", "lib/pkg/__init__.py": "", "lib/pkg/a.py": "from . import b\n",
                     "lib/pkg/b.py": "x = 1\n"})
    assert import_cycles.circles(import_cycles.graph(tmp_path, "lib"), "lib.pkg") == []


def test_suite_cpu_counts_a_child_by_its_kind_and_passes_its_exit_status_on(capsys, monkeypatch):
    """``tools/bench/suite_cpu.py``: a child spinning for half a CPU-second is counted under its kind, and a forked
    rank is told from its forkserver by its grandparent (a pytest worker's)."""
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "tools" / "bench"))
    import suite_cpu

    worker = "/venv/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))"
    server = "/venv/bin/python -c from multiprocessing.forkserver import main; main(3, 5)"
    assert suite_cpu.kind_of(server, worker).startswith("ranks of tests/dist_harness.py")
    assert suite_cpu.kind_of(server, "bash").startswith("other forkservers")
    assert suite_cpu.kind_of(worker, "bash").startswith("the pytest-xdist workers")  # a worker is no rank
    assert suite_cpu.kind_of("python -m torch.distributed.run --nproc-per-node 2 x.py", "") == "torchrun agents"
    spin = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\nsys.exit(3)"
    monkeypatch.setattr(sys, "argv", ["suite_cpu.py", "--", sys.executable, "-c", spin])
    suite_cpu.main()
    out = capsys.readouterr().out
    assert out.startswith("exit 3,"), out
    row = next(line for line in out.splitlines() if line.startswith("| other Python children"))
    assert float(row.split("|")[3]) >= 0.4, out
