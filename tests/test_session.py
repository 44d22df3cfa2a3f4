"""The public two-phase save and checked open, used as a framework's own save path would use them.

``begin_save`` → ``write`` (each rank) → ``commit`` (rank 0) → ``publish`` (every rank), and ``open`` →
``read`` → ``applied``, on real gloo ranks; a blocking save reads only what it wrote (retention runs after
the commit, off the save); rank reports decode within bounds.
"""

from __future__ import annotations

import threading

import pytest
import torch
from dist_harness import run_ranks

from verified_ckpt import CheckpointManager, CorruptCheckpoint, InvalidState, ManifestError, RankReport, Status
from verified_ckpt.checkpoint.catalog import Catalog
from verified_ckpt.store import RecordObjects, RunStore

pytestmark = pytest.mark.timeout(120)


def sessions(rank: int, world: int, run: str) -> dict:
    """Each rank writes a tensor of its own through a session; rank 0 commits; every rank opens and reads them."""
    import torch.distributed as dist

    mgr = CheckpointManager(run)
    session = mgr.begin_save(7)
    report = session.write({f"t{rank}": torch.full((4,), float(rank))}, f"mine-r{rank:05d}")
    reports = [RankReport.from_json(b, r) for r, b in enumerate(mgr.comm.gather_bytes(report.to_json()))]
    refused = None
    state = {f"t{r}": {"stateful": False, "value": {"__tensor__": f"t{r}"}} for r in range(world)}
    if rank == 1:
        try:
            session.commit(reports, state=state)
        except InvalidState as e:
            refused = str(e)
    committed = session.commit(reports, state=state) if rank == 0 else None
    published = session.publish()
    opened = mgr.open(allow_unverified=True)
    got = opened.read({f"t{r}" for r in range(world)})
    opened.applied()
    dist.barrier()
    return {"id": session.id, "published": published.id, "committed": committed.id if committed else None,
            "opened": opened.info.id, "values": {n: t.tolist() for n, t in sorted(got.items())},
            "resumed_from": mgr.resumed_from, "status": published.status.value, "refused": refused}


def test_a_save_written_by_the_caller_through_a_session_commits_once_and_every_rank_opens_it(tmp_path):
    got = run_ranks(sessions, 3, str(tmp_path / "run"))
    ids = {r["id"] for r in got}
    assert len(ids) == 1 and {r["published"] for r in got} == ids == {r["opened"] for r in got} == {got[0]["committed"]}
    assert all(r["values"] == {f"t{i}": [float(i)] * 4 for i in range(3)} for r in got)
    assert {r["resumed_from"] for r in got} == ids and got[0]["status"] == "unverified"
    assert "commit() runs on rank 0 only (this is rank 1)" in got[1]["refused"]
    [info] = CheckpointManager(str(tmp_path / "run")).list()
    assert info.step == 7 and sorted(info.manifest.tensors) == ["t0", "t1", "t2"]


def test_a_blocking_save_does_not_read_the_run_and_retention_runs_after_it(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run, keep_last=1)
    mgr.save(1, {"w": torch.ones(3)})
    mgr.wait()
    reads: list[str] = []
    for cls, name in [(RunStore, "committed"), (RecordObjects, "listing"), (Catalog, "view")]:
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *a, _real=real, _name=name, **k: reads.append(_name) or _real(*a, **k))
    from verified_ckpt.checkpoint.saving import Saver

    gate = threading.Event()
    real_housekeep = Saver.housekeep

    def held(self, info):  # the step after the commit waits until the save has returned (bounded)
        assert gate.wait(30), "the save waited for its housekeeping"
        real_housekeep(self, info)

    monkeypatch.setattr(Saver, "housekeep", held)
    info = mgr.save(2, {"w": torch.zeros(3)})
    assert reads == [] and info.step == 2  # the save read nothing of the run: no listing, no records, no view
    gate.set()
    mgr.wait()
    assert "view" in reads  # retention read the run, after the save
    # keep_last=1 keeps the newest restorable; both are unverified (no guard), so retention keeps them both
    assert [i.step for i in CheckpointManager(run).list()] == [1, 2]


def test_a_failed_retention_is_logged_and_does_not_fail_the_next_save(tmp_path, monkeypatch, caplog):
    mgr = CheckpointManager(str(tmp_path / "run"), keep_last=1)
    from verified_ckpt.checkpoint.saving import Saver as saver

    def broken(self, info):
        raise OSError("store gone")

    monkeypatch.setattr(saver, "housekeep", broken)
    mgr.save(1, {"w": torch.ones(3)})
    with caplog.at_level("WARNING", logger="verified_ckpt"):
        assert mgr.save(2, {"w": torch.ones(3)}).step == 2
        mgr.wait()
    assert "retention after" in caplog.text and "store gone" in caplog.text


@pytest.mark.parametrize("data", [b"", b"[]", b'{"shards": 1}', b'{"shards": [], "fps": {}, "specs": {"a": ["f", [-1]]}}',
                                  b'{"shards": [{"path": "a"}], "fps": {}, "specs": {}}', b"[" * 100000,
                                  b'{"shards": [], "fps": {"a": 3}, "specs": {}}'])
def test_a_malformed_rank_report_is_refused_in_one_line(data):
    with pytest.raises(ManifestError, match="rank 2's shard report is malformed"):
        RankReport.from_json(data, 2)


def test_a_rank_report_round_trips():
    from verified_ckpt.manifest import ShardEntry

    r = RankReport((ShardEntry("a.safetensors", 10, "ab", ["x"]),), {"x": "00"}, {"y": ("float32", (2, 3))})
    assert RankReport.from_json(r.to_json(), 0) == r


def test_open_reads_refuse_flipped_bytes_and_applied_records_nothing_until_called(tmp_path):
    import os

    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    info = mgr.save(1, {"w": torch.arange(64, dtype=torch.float32)})
    folder = os.path.join(run, "checkpoints", info.id)
    shard = os.path.join(folder, info.manifest.shards[0].path)
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    opened = mgr.open(allow_unverified=True)
    assert opened.info.id == info.id and opened.info.status is Status.UNVERIFIED
    with pytest.raises(CorruptCheckpoint, match="failed its"):
        opened.read()
    assert mgr.resumed_from is None


def test_the_rendezvous_stops_at_a_posted_error_and_bounds_a_missing_report(memory_url):
    from verified_ckpt.checkpoint.session import Rendezvous
    from verified_ckpt.errors import StorageError
    from verified_ckpt.store import RunStore

    from verified_ckpt.signing import Signer

    store = RunStore(memory_url)
    rdv = Rendezvous(store, "c1", 3, timeout_s=600, seal=Signer(b"s" * 32))
    rdv.post(0, RankReport())
    rdv.post_error(1, "disk full on node-2")
    with pytest.raises(StorageError, match="rank 1 failed to write its shards of c1: disk full on node-2"):
        rdv.collect()  # at once: the error, not the 600 s bound
    store.delete_file("c1", "rank-00001.error")
    rdv.post(1, RankReport())
    with pytest.raises(StorageError, match="rank 2's shard report for c1 did not appear within 0s"):
        rdv.collect(timeout_s=0.05)
    rdv.post(2, RankReport())
    assert rdv.collect() == [RankReport()] * 3
    store.write_aside("c1", "rank-00002.json", RankReport().to_json())  # unsealed: not the rank's
    with pytest.raises(ManifestError, match="rank 2's shard report of c1 in the store is not the one rank 2 wrote"):
        rdv.collect()
    rdv.clear()
    assert store.read_optional("c1", "rank-00000.json") is None


def failing(rank: int, world: int, run: str, where: str) -> dict:
    """A blocking 3-rank save whose shard write fails on rank 1, or whose commit fails on rank 0."""
    import time

    from verified_ckpt.checkpoint import saving
    from verified_ckpt.errors import StorageError

    mgr = CheckpointManager(run, shard_bytes=256)  # six shards: every rank writes two
    real_write, real_commit = saving.write_shard, saving.Saver.commit

    def broken_write(f, tensors):
        raise OSError("disk full on node-2")

    def broken_commit(self, job, reports):
        raise StorageError("the bucket went read-only; save again")

    if where == "write" and rank == 1:
        saving.write_shard = broken_write
    if where == "commit" and rank == 0:
        saving.Saver.commit = broken_commit
    t0 = time.monotonic()
    try:
        mgr.save(3, {f"w{i}": torch.full((64,), float(i)) for i in range(6)})
        got = {"error": None}
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        got = {"error": f"{type(e).__name__}: {e}"}
    finally:
        saving.write_shard, saving.Saver.commit = real_write, real_commit
    return {**got, "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("where", ["write", "commit"])
def test_a_rank_that_fails_its_part_of_a_blocking_save_fails_every_rank_at_once(tmp_path, where):
    run = str(tmp_path / "run")
    got = run_ranks(failing, 3, run, where)
    assert all(r["error"] for r in got) and all(r["seconds"] < 30 for r in got)  # no rank waits out a timeout
    if where == "write":
        assert "disk full on node-2" in got[1]["error"]
        assert all("rank 1 failed to write its shards" in r["error"] and "disk full" in r["error"] for r in (got[0], got[2]))
    else:
        assert len({r["error"] for r in got}) == 1 and "StorageError: the bucket went read-only" in got[0]["error"]
    assert CheckpointManager(run).list() == []


EXITING = """
import concurrent.futures, sys, threading, time, torch
from verified_ckpt import CheckpointManager
from verified_ckpt.checkpoint import saving
run, marker = sys.argv[1], sys.argv[2]
real = saving.Saver.housekeep

def at_exit(self, info):
    deadline = time.monotonic() + 30
    while not threading._SHUTTING_DOWN and time.monotonic() < deadline:  # run once the interpreter begins to exit
        time.sleep(0.01)
    assert threading._SHUTTING_DOWN
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # what retention's read-back does
        pool.submit(real, self, info).result()
    open(marker, "w").write(info.id)

saving.Saver.housekeep = at_exit
CheckpointManager(run, keep_last=1).save(1, {"w": torch.ones(2)})  # and the script ends, with no wait()
"""


def test_what_the_last_save_leaves_running_finishes_before_the_interpreter_exits(tmp_path):
    import subprocess
    import sys

    run, marker = str(tmp_path / "run"), str(tmp_path / "housekept")
    proc = subprocess.run([sys.executable, "-c", EXITING, run, marker], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "failed" not in proc.stderr, proc.stderr[-2000:]
    assert open(marker).read() == CheckpointManager(run).list()[0].id


def test_a_report_set_that_cannot_make_one_checkpoint_is_refused_before_any_manifest(tmp_path):
    from verified_ckpt import InvalidState
    from verified_ckpt.manifest import ShardEntry

    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    session = mgr.begin_save(1)
    a = session.write({"a": torch.zeros(4)}, "p0")
    with pytest.raises(InvalidState, match="prefix='p0' was written already"):
        session.write({"b": torch.ones(4)}, "p0")
    with pytest.raises(InvalidState, match="not a plain file-name prefix"):
        session.write({"b": torch.ones(4)}, "../up")
    for reports, needle in [([a, a], "shard p0-00000.safetensors was written by ranks 0 and 1"),
                            ([a + a], "written twice by rank 0"),
                            ([a, RankReport((ShardEntry("p1-00000.safetensors", 1, "00", ["a"]),), {"a": "0" * 32},
                                            {"a": ("float32", (4,))})], "tensor a is in shards"),
                            ([RankReport((ShardEntry("g-00000.safetensors", 1, "00", ["ghost"]),), {}, {})],
                             "lists tensor ghost in shard g-00000.safetensors without its fingerprint")]:
        with pytest.raises(InvalidState, match=needle):
            session.commit(reports, state={"a": {"stateful": False, "value": {"__tensor__": "a"}}})
    assert mgr.list() == [] and CheckpointManager(run).gc(grace_s=0) != []  # nothing committed; gc takes the orphans


def test_a_commit_without_a_state_or_with_one_no_reader_takes_is_refused_and_nothing_is_committed(tmp_path):
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    session = mgr.begin_save(1)
    report = session.write({"a": torch.zeros(4)}, "p0")
    with pytest.raises(InvalidState, match="pass state="):
        session.commit([report])
    with pytest.raises(InvalidState, match="pass state="):
        session.commit([report], state={})
    ghost = {"a": {"stateful": False, "value": {"__tensor__": "ghost"}}}
    with pytest.raises(InvalidState, match="would not read back.*ghost"):
        session.commit([report], state=ghost)
    assert mgr.list() == []
    with pytest.raises(InvalidState, match="state is empty"):
        mgr.save(2, {})
    session = mgr.begin_save(3)
    session.commit([session.write({"a": torch.ones(4)}, "p0")],
                   state={"a": {"stateful": False, "value": {"__tensor__": "a"}}})
    assert session.publish().step == 3
    opened = mgr.open(allow_unverified=True)
    assert opened.read(["a"])["a"].tolist() == [1.0] * 4


def test_read_takes_any_iterable_and_refuses_a_name_the_checkpoint_lacks(tmp_path):
    from verified_ckpt import InvalidState

    mgr = CheckpointManager(str(tmp_path / "run"))
    mgr.save(1, {"w": torch.arange(3.0)})
    opened = mgr.open(allow_unverified=True)
    assert opened.read(["w"])["w"].tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(InvalidState, match="holds no tensor 'nope'"):
        opened.read(["w", "nope"])


# ----------------------------------------- no unverified bytes under a signature (issue 37, finding 6)
KEY = b"k" * 32


def _forge(rendezvous, rank: int, reseal: bool) -> str:
    """A store writer without the key: one tensor of rank ``rank``'s shard rewritten in place (all 42.0, header
    untouched), and its report rewritten with the shard's new digest, size and fingerprint (``lanes_of`` is
    public). ``reseal``: the attacker holds the save's in-memory seal too (the fingerprint check alone must hold)."""
    import json
    import os
    import time

    import blake3

    from verified_ckpt.jsonx import canonical_json
    from verified_ckpt.lanes import lanes_of

    folder = rendezvous.store.checkpoint_dir(rendezvous.cid)
    report = os.path.join(folder, f"rank-{rank:05d}.json")
    deadline = time.monotonic() + 60
    while not os.path.exists(report):  # the rank posts it once its shards are written (a bounded wait for it)
        assert time.monotonic() < deadline, "the report never appeared"
        time.sleep(0.01)
    doc = json.load(open(report))
    shard = next(s for s in doc["shards"] if any(t.startswith("model/") for t in s["tensors"]))
    path = os.path.join(folder, shard["path"])
    data = bytearray(open(path, "rb").read())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(t for t in shard["tensors"] if t.startswith("model/") and header[t]["dtype"] == "F32")
    lo, hi = (8 + n + o for o in header[name]["data_offsets"])
    forged = torch.full(header[name]["shape"], 42.0)
    data[lo:hi] = forged.numpy().tobytes()
    open(path, "wb").write(bytes(data))
    shard["digest"], shard["size"] = blake3.blake3(bytes(data)).hexdigest(), len(data)
    doc["fps"][name] = str(lanes_of([forged])[0])
    doc.pop("signature", None)
    open(report, "wb").write(canonical_json(rendezvous.seal.seal(doc)) if reseal else json.dumps(doc).encode())
    return name


def forged_save(rank: int, world: int, run: str, target: int, reseal: bool) -> dict:
    """2 guarded ranks, a signed run, a non-blocking save; the store is forged (``_forge``) after rank ``target``
    posted its report and before rank 0 collects the reports."""
    import ddp_train
    from torch.nn.parallel import DistributedDataParallel as DDP

    from verified_ckpt import GuardConfig, SDCGuard
    from verified_ckpt.checkpoint.session import Rendezvous

    model = DDP(ddp_train.build_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig())
    # Small shards: every rank writes some of the replicated state (the model is tiny).
    mgr = CheckpointManager(run, guard=guard, signing_key=KEY, report_timeout_s=60, shard_bytes=2048)
    for s in range(1, 6):
        guard.backward(ddp_train.make_batch(0, s, rank), step=s)
        guard.step()
        opt.zero_grad()
    forged: list[str] = []
    if rank == 0:
        real = Rendezvous.collect

        def attacked(self, *args, **kwargs):
            forged.append(_forge(self, target, reseal))
            return real(self, *args, **kwargs)

        Rendezvous.collect = attacked
    try:
        info = mgr.save(5, {"model": model.module, "optim": opt}, blocking=False).result(timeout=90)
        outcome = {"committed": info.status.value}
    except Exception as e:  # noqa: BLE001 - the outcome is the test's
        outcome = {"refused": type(e).__name__, "why": str(e)}
    finally:
        if rank == 0:
            Rendezvous.collect = real  # the harness reuses its processes
    return {**outcome, "forged": forged}


@pytest.mark.parametrize("target,reseal", [(1, False), (1, True), (0, False)],
                         ids=["rank-1-report", "rank-1-report-resealed", "rank-0-own-report"])
def test_a_forged_shard_and_report_in_the_store_never_commit_as_a_restorable_checkpoint(tmp_path, target, reseal):
    from click.testing import CliRunner

    from verified_ckpt_cli.main import main as vckpt

    run = str(tmp_path / "run")
    got = run_ranks(forged_save, 2, run, target, reseal)
    assert len(got) == 2 and got[0]["forged"], f"the attack did not run: {got}"
    env = {"VCKPT_SIGNING_KEY": KEY.decode()}
    if target == 1:  # rank 0 reads rank 1's report from the store: refused, on every rank, nothing committed
        needle = "agreed on" if reseal else "is not the one rank 1 wrote"
        assert all("refused" in r and needle in r["why"] for r in got), [r.get("why") for r in got]
        assert CheckpointManager(run, signing_key=KEY).list() == []
    else:  # rank 0 never reads its own report back: the manifest names the shard it wrote, so the forgery is found
        assert got[0].get("committed") == got[1].get("committed") == "restorable", got
        r = CliRunner(env=env).invoke(vckpt, ["verify", run, "--json"])
        assert r.exit_code == 1 and "digest" in r.output, r.output
        [info] = CheckpointManager(run, signing_key=KEY).list()
        assert info.status is Status.CORRUPT
        assert CheckpointManager(run, signing_key=KEY).view().rollback_target()[0] is None
