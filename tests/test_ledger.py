"""The zarr ledger: appends and flushes, crash behaviour, plain-zarr readability, and the ledger
of a real guarded 3-rank run through `vckpt ledger`, `vckpt verify --all` and `vckpt report`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner

from verified_ckpt import CheckpointManager
from verified_ckpt.history import KINDS, Event
from verified_ckpt.ledger import Ledger, read_ledger
from verified_ckpt.store import RunStore
from verified_ckpt_cli.main import main

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["memory", "local"])
def url(request, memory_url, local_url):
    return memory_url if request.param == "memory" else local_url


def steps(lo: int, hi: int, world: int = 2) -> list[Event]:
    return [Event(s, "step", r, "pass", (s, r), float(s), 1.0) for s in range(lo, hi) for r in range(world)]


def test_flushes_append_and_reads_see_only_flushed_rows(url):
    store = RunStore(url)
    ledger = Ledger(store)
    assert read_ledger(store) is None
    ledger.append(steps(0, 3))
    assert read_ledger(store) is None  # buffered, not written
    ledger.flush()
    ledger.append(steps(3, 5))
    assert read_ledger(store).step.tolist() == [0, 0, 1, 1, 2, 2]
    ledger.flush()
    cols = read_ledger(store)
    assert cols.step.tolist() == [s for s in range(5) for _ in range(2)]
    assert cols.lanes[3].tolist() == [1, 1] and cols.loss[9] == 4.0
    assert Ledger(store).pending == 0
    Ledger(store).flush()  # nothing buffered: writes nothing, changes nothing
    assert len(read_ledger(store)) == 10


def test_plain_zarr_reads_the_ledger(local_url):
    ledger = Ledger(RunStore(local_url))
    ledger.append([Event(7, "consensus", 1, "fail", (2**64 - 1, 5))])
    ledger.flush()
    g = zarr.open_group(os.path.join(local_url, "ledger.zarr"), mode="r")
    n = g.attrs["rows"]
    assert n == 1 and g.attrs["kinds"][int(g["kind"][0])] == "consensus"
    assert g.attrs["verdicts"][int(g["verdict"][0])] == "fail"
    assert g["lanes"][:n].tolist() == [[2**64 - 1, 5]] and g["lanes"].dtype == np.uint64


CRASH_CHILD = textwrap.dedent(r"""
    import os, signal, sys
    import zarr
    from verified_ckpt.history import Event
    from verified_ckpt.ledger import Ledger
    from verified_ckpt.store import RunStore
    url, mode = sys.argv[1], sys.argv[2]
    ledger = Ledger(RunStore(url))
    ledger.append([Event(s, "step", 0, "pass", (s, 0), 1.0, 1.0) for s in range(100)])
    ledger.flush()
    ledger.append([Event(s, "step", 0, "pass", (s, 0), 1.0, 1.0) for s in range(100, 150)])
    if mode == "mid-flush":
        # die after some arrays took the new rows and before the row count moved
        real, calls = zarr.Array.append, [0]
        def dying(self, data, axis=0):
            calls[0] += 1
            if calls[0] == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, data, axis=axis)
        zarr.Array.append = dying
        ledger.flush()
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("mode", ["before-flush", "mid-flush"])
def test_a_crash_keeps_every_event_up_to_the_last_flush(local_url, mode):
    proc = subprocess.run([sys.executable, "-c", CRASH_CHILD, local_url, mode], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    store = RunStore(local_url)
    cols = read_ledger(store)
    assert cols.step.tolist() == list(range(100))  # flushed rows intact; the lost batch invisible
    if mode == "mid-flush":
        g = zarr.open_group(os.path.join(local_url, "ledger.zarr"), mode="r")
        assert g["step"].shape[0] > 100  # the interrupted flush did write some arrays...
    ledger = Ledger(store)  # ...and the next writer continues cleanly after the flushed rows
    ledger.append([Event(500, "save", -1, "pass")])
    ledger.flush()
    cols = read_ledger(store)
    assert cols.step.tolist() == list(range(100)) + [500] and KINDS[int(cols.kind[-1])] == "save"
    assert all(len(getattr(cols, f)) == 101 for f in ("rank", "verdict", "loss", "grad_norm", "time"))


@pytest.fixture(scope="module")
def guarded_run(tmp_path_factory):
    """A real 3-rank gloo run with an injected gradient fault, rolled back in process, saving every 5 steps."""
    run = os.fspath(tmp_path_factory.mktemp("ledger") / "run")
    cmd = [sys.executable, "examples/ddp_train.py", "--world-size", "3", "--steps", "30", "--audit-every", "5",
           "--consensus-every", "5", "--save-every", "5", "--inject", "grad:1:13:scale=10", "--run", run,
           "--on-incident", "rollback", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def test_guarded_run_ledger_records_every_check(guarded_run):
    cols = CheckpointManager(guarded_run).ledger()
    kinds = [KINDS[int(k)] for k in cols.kind]
    step_rows = [(int(s), int(r)) for s, r, k in zip(cols.step, cols.rank, kinds) if k == "step"]
    assert {s for s, _ in step_rows} == set(range(1, 31)) and all(r in (0, 1, 2) for _, r in step_rows)
    assert not np.isnan(cols.loss[[k == "step" for k in kinds]]).any()
    r = invoke("ledger", guarded_run, "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    # the fault, caught by ABFT among the step's checks (the step's rows, then the check's own)
    assert s["divergence"] == [{"step": 13, "kind": "step", "ranks": [1]}, {"step": 13, "kind": "abft", "ranks": [1]}]
    assert s["counts"]["incident"] == {"checks": 1, "failed": 1}
    # every per-step check has its own rows: one check per step it ran (step 13 twice: caught, then replayed)
    assert {k: s["counts"][k]["failed"] for k in ("nonfinite", "checksum", "abft")} == {"nonfinite": 0, "checksum": 0, "abft": 1}
    assert s["counts"]["checksum"]["checks"] == s["counts"]["step"]["checks"] - 1
    assert s["counts"]["save"]["checks"] == 6  # steps 5, 10, 15, 20, 25, 30 (the rollback to 10 saves nothing)
    assert s["counts"]["restore"]["checks"] == 1
    assert s["last_unanimous_consensus"] == 30
    # the schedule the budget chose and what it measured, once every check's cost was known
    assert s["schedule"] and all(p["overhead"] > 0 and p["abft_share"] == 1.0 for p in s["schedule"]), s["schedule"]
    human = invoke("ledger", guarded_run)
    assert human.exit_code == 0 and "divergence points" in human.output and "abft" in human.output
    assert "budget schedule (step " in human.output


def test_verify_all_cross_checks_the_ledger_and_flags_a_forged_claim(guarded_run, tmp_path):
    r = invoke("verify", guarded_run, "--all", "--jobs", "2", "--json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)) == 6 and all(x["ok"] for x in json.loads(r.stdout))
    # A copy of the run whose ledger lost the consensus rows of step 20: the manifest claims what the ledger lacks.
    import shutil

    copy = os.fspath(tmp_path / "copy")
    shutil.copytree(guarded_run, copy)
    g = zarr.open_group(os.path.join(copy, "ledger.zarr"), mode="r+")
    n = g.attrs["rows"]
    kinds, step = g["kind"][:n], g["step"][:n]
    lanes = g["lanes"][:n]
    lanes[(kinds == KINDS.index("consensus")) & (step == 20)] += np.uint64(1)
    g["lanes"][:n] = lanes
    r = invoke("verify", copy, "--all", "--json")
    assert r.exit_code == 1, r.output
    bad = [x for x in json.loads(r.stdout) if not x["ok"]]
    assert [x["step"] for x in bad] == [20] and "ledger records no such consensus" in json.dumps(bad)
    listed = {x["step"]: x["status"] for x in json.loads(invoke("list", copy, "--json").stdout)}
    assert listed[20] == "suspect" and listed[15] == "restorable"  # bytes fine, evidence not: never restorable


def test_report_of_the_guarded_run(guarded_run, tmp_path):
    out = os.fspath(tmp_path / "report.html")
    r = invoke("report", guarded_run, "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["incidents"] == 1 and json.loads(r.stdout)["steps"] == 30
    page = open(out, encoding="utf-8").read()
    assert 'data-testid="incident-0"' in page and 'data-testid="rollback-marker"' in page
    assert "http://" not in page and "https://" not in page
    # Three replicas: the all-reduce checksum compared them at every step, so the band says they agreed.
    assert 'class="agree-agree"' in page and 'class="agree-uncompared"' not in page and "single replica" not in page
    bad = invoke("report", guarded_run, "--out", os.fspath(tmp_path / "no" / "such" / "dir" / "r.html"))
    assert bad.exit_code == 2 and "cannot write" in bad.output and "Traceback" not in bad.output


def test_the_ledger_doc_lists_every_kind_at_its_code():
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "LEDGER.md"), encoding="utf-8") as f:
        doc = f.read()
    table = doc.split("### Kinds", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| `([a-z]+)` \|", table, flags=re.M)
    assert [(int(code), kind) for code, kind in rows] == list(enumerate(KINDS))


def test_ledger_of_an_unguarded_run_is_a_one_line_error(local_url):
    CheckpointManager(local_url).save(1, {"w": torch.ones(2)})
    r = invoke("ledger", local_url)
    assert r.exit_code == 2 and "no ledger" in r.output and "Traceback" not in r.output
    assert invoke("verify", local_url, "--all", "--step", "1").exit_code == 2


VERIFY_CHILD = textwrap.dedent(r"""
    import gc, sys, torch
    sys.path.insert(0, "tests")
    from memprobe import peak_growth
    from verified_ckpt import CheckpointManager
    torch.set_num_threads(1)
    mgr = CheckpointManager(sys.argv[1], shard_bytes=1 << 20, io_workers=2)
    for step in range(50):  # 50 checkpoints x 4 MiB in 1 MiB shards = 200 MiB
        mgr.save(step, {f"w{i}": torch.full((1 << 18,), float(step * 4 + i)) for i in range(4)})
    gc.collect()
    results, growth = peak_growth(lambda: mgr.verify(jobs=4), "VmRSS")
    assert len(results) == 50 and all(r.ok for r in results), [r.problems for r in results if not r.ok][:2]
    print(growth >> 20)
""")


def test_verify_all_of_50_checkpoints_stays_in_bounded_memory(local_url):
    """Resident memory (anonymous and mapped) grows by far less than the 200 MiB the run holds."""
    proc = subprocess.run([sys.executable, "-c", VERIFY_CHILD, local_url], capture_output=True, text=True, timeout=110,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    growth = int(proc.stdout.strip().splitlines()[-1])
    assert growth < 64, f"verify of 50 checkpoints (200 MiB) grew resident memory by {growth} MiB"


@pytest.mark.parametrize("forge", ["rows", "dtype", "codes"])
def test_a_crafted_ledger_is_refused_before_it_is_believed(local_url, forge):
    import tracemalloc

    from verified_ckpt import CorruptCheckpoint

    ledger = Ledger(RunStore(local_url))
    ledger.append(steps(0, 5))
    ledger.flush()
    g = zarr.open_group(os.path.join(local_url, "ledger.zarr"), mode="r+")
    if forge == "rows":  # metadata claims 10^10 rows: zarr would hand out fill values for all of them
        for name in ("step", "kind", "rank", "verdict", "lanes", "loss", "grad_norm", "time"):
            g[name].resize((10**10, *g[name].shape[1:]))
        g.attrs["rows"] = 10**10
    elif forge == "dtype":
        del g["loss"]
        g.create_array("loss", shape=(10,), chunks=(16384,), dtype="float32")
    else:
        g["kind"][0] = 200
    tracemalloc.start()
    with pytest.raises(CorruptCheckpoint, match="ledger"):
        read_ledger(RunStore(local_url))
    assert tracemalloc.get_traced_memory()[1] < 64 << 20
    tracemalloc.stop()
    r = invoke("ledger", local_url)
    assert r.exit_code == 1 and "ledger" in r.output and "Traceback" not in r.output


def test_choosing_a_rollback_and_reporting_read_each_manifest_once(guarded_run, tmp_path, monkeypatch):
    """One view of the run per operation: on S3 every manifest read is a request."""
    import shutil

    from verified_ckpt import store as store_mod

    copy = os.fspath(tmp_path / "copy")
    shutil.copytree(guarded_run, copy)
    mgr = CheckpointManager(copy)
    ids = sorted(i.id for i in mgr.list())
    mgr.flag(22, reason="bad node")  # an open incident, so the rollback is recorded
    reads = []
    real = store_mod.RunStore.read_manifest
    monkeypatch.setattr(store_mod.RunStore, "read_manifest", lambda self, cid: reads.append(cid) or real(self, cid))
    target, skipped = CheckpointManager(copy).record_rollback()  # a fresh manager: no manifest parsed yet
    assert target.step == 20 and [s for _, s, _ in skipped] == [30, 25]
    assert sorted(reads) == ids
    reads.clear()
    CheckpointManager(copy).history_report()
    assert sorted(reads) == ids
    # rollback() on rank 0 restores the target it chose, without listing the run again
    import ddp_train

    from verified_ckpt import RNGState

    model = ddp_train.build_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.7)
    state = {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "progress": {"step": 0}}
    mgr.flag(21, reason="again")
    reads.clear()
    info = CheckpointManager(copy).rollback(state)
    assert info.step == 20 and state["progress"]["step"] == 20 and sorted(reads) == ids
