"""Verification on a Dask cluster where the cluster is not what it should be (issue 48, Integrity 5): workers that lack
verified-ckpt or have another version are found before any task runs (one line, exit 2); a scheduler that never
answers, and a read whose workers are all lost, end within the documented bound; a relative run path reaches workers
whose directory is another. Real parts throughout: a scheduler, ``dask worker`` processes (one started by a Python that
cannot import the package, one that imports another version of it), a TCP listener that never answers."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from click.testing import CliRunner

from verified_ckpt import CheckpointManager, InvalidConfig, __version__
from verified_ckpt_cli.main import main

distributed = pytest.importorskip("distributed")

pytestmark = pytest.mark.timeout(180)

SITE = sysconfig.get_paths()["purelib"]  # this venv's packages: with ``python -S``, without the editable install's hook


@pytest.fixture
def scheduler() -> Iterator[tuple[str, object]]:
    """A scheduler with no worker of its own; each test starts the workers it needs."""
    with distributed.LocalCluster(n_workers=0, dashboard_address=None, silence_logs=40) as c, \
            distributed.Client(c) as client:
        yield c.scheduler_address, client


@contextlib.contextmanager
def workers(address: str, tmp: str, *kinds: Sequence[str] | None) -> Iterator[list[subprocess.Popen]]:
    """One ``dask worker`` process (no nanny, so a dead one stays dead) per kind, each in a folder of its own:
    ``None``, this venv's Python; a list, ``python -S`` with exactly those folders on its path (``site`` never runs,
    so the editable install of verified-ckpt is not found)."""
    procs = []
    try:
        for i, path in enumerate(kinds):
            cwd = os.path.join(tmp, f"worker-{i}")
            os.makedirs(cwd, exist_ok=True)
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            if path is not None:
                env["PYTHONPATH"] = os.pathsep.join(path)
            cmd = [sys.executable, *(["-S"] if path is not None else []), "-m", "distributed.cli.dask_worker", address,
                   "--nworkers", "1", "--nthreads", "1", "--no-nanny", "--no-dashboard"]
            with open(os.path.join(cwd, "log"), "wb") as log:
                procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=log))
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def a_run(url: str) -> list:
    mgr = CheckpointManager(url)
    return [mgr.save(step, {"w": torch.arange(300.0) * step}) for step in (1, 2)]


def read_tasks(client) -> list[str]:
    """The read tasks the scheduler has ever been given."""
    return client.run_on_scheduler(lambda dask_scheduler: sorted(
        k for k in dask_scheduler.task_prefixes if k.startswith("vckpt-verify")))


def test_workers_without_the_package_or_with_another_version_are_refused_before_any_task_runs(tmp_path, scheduler):
    """Before: the worker without the package died unpickling its first task, the scheduler reported "Lost all
    workers", and the CLI printed nothing and never returned."""
    address, client = scheduler
    url = str(tmp_path / "run")
    a_run(url)
    other = tmp_path / "other" / "verified_ckpt"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text('__version__ = "0.0.0-other"\n')
    with workers(address, str(tmp_path), [SITE], [str(other.parent), SITE]) as procs:
        client.wait_for_workers(2, timeout=90)
        addresses = sorted(client.scheduler_info()["workers"])
        done = subprocess.run([sys.executable, "-m", "verified_ckpt_cli.main", "verify", url, "--dask", address,
                               "--json"], capture_output=True, text=True, timeout=120, check=False)
        assert all(p.poll() is None for p in procs)  # both still up: neither was handed a task
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout[-500:], done.stderr[-2000:])
    line = done.stderr
    assert line.count("\n") == 1 and "Traceback" not in line, line
    assert f"every Dask worker needs verified-ckpt {__version__}" in line
    assert "cannot import it (ModuleNotFoundError: No module named 'verified_ckpt')" in line
    assert "has '0.0.0-other'" in line and all(a in line for a in addresses), line
    assert read_tasks(client) == []
    assert not os.path.exists(os.path.join(url, "records", "verification"))


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A TCP port that takes connections (the kernel completes them from the backlog) and never answers a byte."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as s:
        yield s.getsockname()[1]


def test_verify_on_a_scheduler_that_never_answers_is_exit_2_within_the_bound(local_url, monkeypatch):
    """Before: Dask's connect read the handshake with no timeout, and the command ran on past its 30 s."""
    from verified_ckpt.checkpoint import fleet

    assert fleet.TIMEOUT_S == 30.0  # the bound docs/CLI.md and docs/SERVICE.md state
    monkeypatch.setattr(fleet, "TIMEOUT_S", 2.0)  # shortened: that the wait has a bound is under test, not its size
    a_run(local_url)
    with silent_listener() as port:
        began = time.monotonic()
        r = CliRunner().invoke(main, ["verify", local_url, "--dask", f"tcp://127.0.0.1:{port}"])
        took = time.monotonic() - began
    assert r.exit_code == 2 and r.stdout == "", (r.exit_code, r.output, r.exception)
    assert r.stderr.count("\n") == 1 and "no answer from the Dask scheduler" in r.stderr and "within 2 s" in r.stderr
    assert took < 2.0 + 15, took


def test_a_read_whose_workers_are_all_lost_ends_within_the_bound_and_so_do_the_reads_after_it(tmp_path, scheduler):
    """The only worker dies (SIGKILL) in the read, and no worker comes back: the read raises once the cluster has had
    no worker for ``timeout_s``, and the next read raises at once, so a verify of many checkpoints ends there."""
    from verified_ckpt.checkpoint.fleet import DaskReads

    address, client = scheduler
    infos = a_run(str(tmp_path / "run"))

    def dying(*args):  # pickled by value: the worker runs it
        import signal

        os.kill(os.getpid(), signal.SIGKILL)

    with workers(address, str(tmp_path), None):
        client.wait_for_workers(1, timeout=90)
        reads = DaskReads(client, str(tmp_path / "run"), None, timeout_s=3.0, task=dying)
        began = time.monotonic()
        with pytest.raises(InvalidConfig, match="no worker for 3 s"):
            reads(infos[0])
        assert time.monotonic() - began < 3.0 + 30
        began = time.monotonic()
        with pytest.raises(InvalidConfig, match="no worker for 3 s"):
            reads(infos[1])
        assert time.monotonic() - began < 1.0


def test_a_relative_run_path_is_read_where_this_process_means_it(tmp_path, scheduler, monkeypatch):
    """The worker's directory is not this process's: the run goes to it as an absolute URL. Before, ``run`` resolved in
    the worker's own directory."""
    address, client = scheduler
    (tmp_path / "here").mkdir()
    a_run(str(tmp_path / "here" / "run"))
    with workers(address, str(tmp_path), None):
        client.wait_for_workers(1, timeout=90)
        monkeypatch.chdir(tmp_path / "here")
        results = CheckpointManager("run").verify(cluster=client)
    assert [(r.step, r.ok, r.problems) for r in results] == [(1, True, []), (2, True, [])]
    assert read_tasks(client) != []  # the reads ran on the cluster
    recorded = [json.loads(p.read_text()) for p in (tmp_path / "here" / "run" / "records" / "verification").iterdir()]
    assert len(recorded) == 2
