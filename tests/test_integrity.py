"""Integrity under races and crashes: writers as strict as readers, commits that re-check, gc that cannot race a
save, retention that reads back first, verify as strict as restore, reads a truncated file cannot kill, ledgers
bounded by what they store. Each race is made deterministic with a hook, never a timer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from helpers import resealed
from verified_ckpt import CheckpointManager, CorruptCheckpoint, InvalidState, Status, StorageError
from verified_ckpt.checkpoint import saving
from verified_ckpt_cli.main import main as vckpt

pytestmark = pytest.mark.timeout(120)


def saved(run: str, *steps: int) -> CheckpointManager:
    mgr = CheckpointManager(run)
    for s in steps:
        torch.manual_seed(s)
        mgr.save(s, {"w": torch.randn(1000), "b": torch.randn(8)})
    return mgr


# ------------------------------------------------------------- writers as strict as readers
REFUSED = [  # (CLI arguments, API body, the field the refusal names)
    (["--from-step", "5", "--rank", "-1"], {"from_step": 5, "ranks": [-1]}, "ranks"),
    (["--from-step", "5", "--rank", "99999999999"], {"from_step": 5, "ranks": [99999999999]}, "ranks"),
    (["--from-step", str(2**70)], {"from_step": 2**70}, "step"),
    (None, {"from_step": 1, "ranks": "x"}, "ranks"),
    (None, {"from_step": 1, "ranks": [1e10]}, "ranks"),
    (None, {"from_step": 1, "ranks": {"a": 1}}, "ranks"),
    (None, {"from_step": 1, "to_step": 1.5}, "to_step"),
    (["--from-step", "1", "--reason", "r" * (65 << 10)], {"from_step": 1, "reason": "r" * (65 << 10)}, "reason"),
    (None, {"from_step": 1e400}, "from_step"),
]


CLI_REFUSED = [r for r in REFUSED if r[0] is not None]  # the others only an API body can carry (test_service.py)


@pytest.mark.parametrize("cli,body,field", CLI_REFUSED, ids=[f"{i}-{r[2]}" for i, r in enumerate(CLI_REFUSED)])
def test_a_flag_the_reader_would_refuse_is_refused_by_the_cli_naming_the_field_and_nothing_is_written(tmp_path, cli,
                                                                                                       body, field):
    run = str(tmp_path / "run")
    saved(run, 1)
    args = ["flag", run, *cli] + ([] if "--reason" in cli else ["--reason", "x"])
    r = CliRunner().invoke(vckpt, args)
    assert r.exit_code == 2, r.output
    assert field in r.output and "Traceback" not in r.output
    assert CheckpointManager(run).incidents() == [] and not os.path.exists(os.path.join(run, "records", "incident"))


def test_the_library_refuses_what_the_reader_would_refuse_before_sealing(tmp_path):
    mgr = saved(str(tmp_path / "run"), 1)
    for kwargs, field in [({"ranks": [-1]}, "ranks"), ({"to_step": 1.5}, "to_step"), ({"reason": "\ud800"}, "JSON")]:
        with pytest.raises(InvalidState, match=field):
            mgr.flag(1, **{"reason": "x", **kwargs})
    assert mgr.incidents() == []


# -------------------------------------------------------------- commits and gc
def test_gc_never_deletes_a_running_saves_shards_whatever_its_grace(tmp_path):
    run = str(tmp_path / "run")
    mgr = saved(run, 1)
    reached, go = threading.Event(), threading.Event()
    commit = saving.Saver.commit

    def paused(self, job, reports):  # every shard written, the manifest not yet: where gc used to strike
        reached.set()
        assert go.wait(30)
        return commit(self, job, reports)

    saving.Saver.commit = paused
    try:
        result: dict = {}
        t = threading.Thread(target=lambda: result.update(info=mgr.save(2, {"w": torch.randn(1000)})))
        t.start()
        assert reached.wait(30)
        removed = CheckpointManager(run).gc(grace_s=0)  # the --grace 1 of the report, and less
        go.set()
        t.join(30)
    finally:
        saving.Saver.commit = commit
    assert removed == []
    [ok] = CheckpointManager(run).verify(2)
    assert ok.ok and result["info"].step == 2
    assert not any(n == "lease.json" for n in os.listdir(os.path.join(run, "checkpoints", result["info"].id)))


def test_a_commit_whose_shard_is_gone_is_refused_and_nothing_is_listed(tmp_path):
    run = str(tmp_path / "run")
    mgr = saved(run, 1)
    commit = saving.Saver.commit

    def shard_lost(self, job, reports):
        folder = os.path.join(run, "checkpoints", job.cid)
        os.unlink(os.path.join(folder, next(n for n in os.listdir(folder) if n.endswith(".safetensors"))))
        return commit(self, job, reports)

    saving.Saver.commit = shard_lost
    try:
        with pytest.raises(StorageError, match="is missing"):
            mgr.save(2, {"w": torch.randn(1000)})
    finally:
        saving.Saver.commit = commit
    assert [i.step for i in CheckpointManager(run).list()] == [1]


def rotten(rank: int, world: int, run: str) -> dict:
    """keep_last=1 on 3 guarded ranks; the bytes of the save at step 10 rot on disk after their digest was taken."""
    import ddp_train
    from torch.nn.parallel import DistributedDataParallel as DDP

    from verified_ckpt import GuardConfig, SDCGuard

    model = DDP(ddp_train.build_model(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig())
    mgr = CheckpointManager(run, guard=guard, keep_last=1)
    write_shard = saving.write_shard

    def rotting(f, tensors):
        written = write_shard(f, tensors)
        f.seek(written.size - 2)
        f.write(b"\xff\xff")
        return written

    for step in range(1, 11):
        guard.backward(ddp_train.make_batch(0, step, rank), step=step)
        guard.step()
        opt.zero_grad()
        if step % 5 == 0:
            saving.write_shard = rotting if step == 10 else write_shard
            try:
                mgr.save(step, {"model": model.module, "optim": opt})
            finally:
                saving.write_shard = write_shard
    mgr.wait()  # retention runs after the commit, off the save
    return {"statuses": [(i.step, i.status.value) for i in CheckpointManager(run).list()]}


def test_keep_last_reads_the_newest_back_before_deleting_and_keeps_the_old_when_the_new_has_rotted(tmp_path):
    from dist_harness import run_ranks

    got = run_ranks(rotten, 3, str(tmp_path / "run"))
    # The read-back found step 10 rotten (corrupt now), so step 5, the only good one, was not deleted.
    assert got[0]["statuses"] == [[5, "restorable"], [10, "corrupt"]], got[0]


# ------------------------------------------------------------------ verify = restore without applying
def test_verify_refuses_a_sharded_layout_that_no_restore_would_accept(tmp_path):
    from torch.distributed.tensor import DTensor  # noqa: F401 - the sharded writer needs it importable

    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    mgr.save(1, {"w": torch.randn(16)})
    [info] = mgr.list()
    path = os.path.join(run, "checkpoints", info.id, "manifest.json")
    doc = json.load(open(path))
    doc["tensors"]["w@0"] = dict(doc["tensors"].pop("w"), shape=[8])
    doc["tensors"]["w@4"] = dict(doc["tensors"]["w@0"])
    doc["shards"][0]["tensors"] = ["w@0", "w@4"]
    doc["layout"] = {"w": {"dtype": "float32", "shape": [16],
                           "chunks": [{"offsets": [0], "tensor": "w@0"}, {"offsets": [4], "tensor": "w@4"}]}}
    json.dump(doc, open(path, "w"))
    got = CliRunner().invoke(vckpt, ["verify", run, "--json"])
    assert got.exit_code == 1 and "exactly once" in got.stdout  # an overlap at 4..8 and a gap at 12..16: refused


# --------------------------------------------------------------- reads a truncated file cannot kill
TRUNCATE = r"""
import os, sys, blake3
from verified_ckpt import CheckpointManager, shards
from verified_ckpt.checkpoint import reading
shards.CHUNK = 1 << 20  # read in 1 MiB steps: the truncation lands between two of them
run = sys.argv[1]
[info] = CheckpointManager(run).list()
shard = os.path.join(run, "checkpoints", info.id, info.manifest.shards[0].path)

real = blake3.blake3

class Truncating:  # the shard shrinks under the reader while its first bytes are hashed
    def __init__(self):
        self.h, self.done = real(), False
    def update(self, chunk):
        if not self.done:
            self.done = True
            os.truncate(shard, 100)
        self.h.update(chunk)
    def hexdigest(self):
        return self.h.hexdigest()

reading.blake3 = type("blake3", (), {"blake3": Truncating})  # the reader's hashing only, not every blake3 user
[result] = CheckpointManager(run).verify()
print("ok" if result.ok else "refused: " + "; ".join(p.kind for p in result.problems))
"""


def test_a_shard_truncated_while_it_is_verified_is_a_finding_not_a_dead_process(tmp_path):
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    mgr.save(1, {"w": torch.randn(1 << 20)})  # 4 MiB: read in more than one chunk
    done = subprocess.run([sys.executable, "-c", TRUNCATE, run], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # SIGBUS was -7
    assert done.stdout.startswith("refused: ") and "read" in done.stdout
    assert CheckpointManager(run).list()[0].status is Status.CORRUPT


# ----------------------------------------------------------------------- ledgers bounded by what they store
def test_a_ledger_whose_chunks_declare_far_more_rows_than_they_store_is_refused(tmp_path):
    import zarr

    from verified_ckpt.ledger import CHUNK_ROWS, read_ledger
    from verified_ckpt.store import RunStore

    run = str(tmp_path / "run")
    saved(run, 1)
    group = zarr.open_group(os.path.join(run, "ledger.zarr"), mode="w", zarr_format=3)
    rows = 64 * CHUNK_ROWS  # a million rows of constants: chunks of a few bytes each
    from verified_ckpt.history import KINDS, VERDICTS, Columns

    sample = Columns.of([])
    for name in ("step", "kind", "rank", "verdict", "lanes", "loss", "grad_norm", "time"):
        shape, chunks = ((rows, 2), (CHUNK_ROWS, 2)) if name == "lanes" else ((rows,), (CHUNK_ROWS,))
        arr = group.create_array(name, shape=shape, chunks=chunks, dtype=getattr(sample, name).dtype, fill_value=0)
        arr[:] = np.zeros(shape, dtype=arr.dtype)  # every chunk written: the chunk count matches the rows
    group.attrs.update({"schema": 1, "kinds": KINDS, "verdicts": VERDICTS, "rows": rows})
    with pytest.raises(CorruptCheckpoint, match="stored bytes do not hold"):
        read_ledger(RunStore(run))


def test_a_lease_from_the_future_is_reported_and_stale_once_it_has_not_moved_for_the_ttl_on_gcs_clock(tmp_path,
                                                                                                         monkeypatch):
    """A save that died on a host whose clock runs an hour ahead left its shards and a lease dated in the future:
    gc says so, keeps it while it moves (a live save re-puts it), and removes it once it has stood still for the
    stale period on gc's own clock, counted across gc runs. The clock is moved by the test, never waited for."""
    import types

    from verified_ckpt.checkpoint import housekeeping, lease

    run = str(tmp_path / "run")
    saved(run, 1)
    cid = "step-0000000002-0000beef"
    folder = os.path.join(run, "checkpoints", cid)
    os.makedirs(folder)
    start = __import__("time").time()
    clock = types.SimpleNamespace(time=lambda: start)
    monkeypatch.setattr(housekeeping, "time", clock)

    def left(body: bytes) -> None:
        for name, data in [("shard-00000.safetensors", b"x" * 64), (lease.LEASE, body)]:
            path = os.path.join(folder, name)
            open(path, "wb").write(data)
            os.utime(path, (start + 3600, start + 3600))

    def gc() -> dict:
        r = CliRunner().invoke(vckpt, ["gc", run, "--grace", "0", "--json"])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    left(b'{"at": "one"}')
    first = gc()
    assert first["removed"] == [] and "dated 3600 s in the future" in first["notes"][0]
    assert gc()["removed"] == []  # the same look again: still within the stale period
    clock.time = lambda: start + lease.TTL_S + 1
    left(b'{"at": "two"}')  # refreshed meanwhile: a save on the skewed host is alive
    assert gc()["removed"] == [] and os.path.exists(os.path.join(folder, lease.LEASE))
    clock.time = lambda: start + 2 * lease.TTL_S + 2
    last = gc()
    assert sorted(last["removed"]) == [f"{cid}/{n}" for n in sorted([lease.LEASE, lease.LEASE_SEEN,
                                                                     "shard-00000.safetensors"])]
    assert "treated as stale" in last["notes"][0] and not os.path.exists(folder)
    assert [i.step for i in CheckpointManager(run).list()] == [1]


# ------------------------------------------------------------------------------- records compaction
def test_scrubs_keep_the_record_listing_bounded_and_compaction_changes_no_status(tmp_path):
    run = str(tmp_path / "run")
    mgr = saved(run, 1, 2, 3)
    folder = os.path.join(run, "records", "verification")
    for _ in range(20):  # twenty scrub passes
        assert all(r.ok for r in mgr.verify())
    assert len(os.listdir(folder)) == 3  # one per checkpoint, not sixty
    [first] = [i for i in mgr.list() if i.step == 1]
    shard = os.path.join(run, "checkpoints", first.id, first.manifest.shards[0].path)
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    mgr.verify()
    data[-1] ^= 0xFF  # put right again: the failure is permanent, and compaction must keep it so
    open(shard, "wb").write(bytes(data))
    for _ in range(3):
        mgr.verify()
    assert {i.step: i.status for i in CheckpointManager(run).list()}[1] is Status.CORRUPT
    assert len(os.listdir(folder)) == 4  # the newest of each, and step 1's first failure
    CheckpointManager(run, keep_last=1)  # retention runs at saves; a deleted checkpoint's records go with it
    import shutil

    shutil.rmtree(os.path.join(run, "checkpoints", first.id))
    mgr.verify()
    assert len(os.listdir(folder)) == 2


def test_every_record_the_reader_refuses_is_refused_when_written(tmp_path):
    """The hostile-record corpus the readers are tested with, written through the one writer: each record that
    the reader would refuse (parse fails) is refused before anything is stored."""
    from test_hostile import _record_variants

    from verified_ckpt.checkpoint.catalog import Catalog
    from verified_ckpt.records import _LIMITS, _PARSERS, decode_object
    from verified_ckpt.signing import Signer
    from verified_ckpt.store import RunStore

    run = str(tmp_path / "run")
    saved(run, 1)
    catalog = Catalog(RunStore(run), Signer.from_env({}), 1)
    refused = 0
    for kind, raw in _record_variants():
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            continue  # not JSON a writer could be handed
        if not isinstance(doc, dict):
            continue
        try:
            _PARSERS[kind](decode_object(raw, _LIMITS))
            continue  # the reader takes it
        except Exception:  # noqa: BLE001 - any refusal by the reader
            pass
        with pytest.raises(InvalidState):
            catalog.append(kind, doc)
        refused += 1
    assert refused >= 300, refused
    assert not os.path.isdir(os.path.join(run, "records")) or all(
        not os.listdir(os.path.join(run, "records", d)) for d in os.listdir(os.path.join(run, "records")))


# ------------------------------------------- compaction keeps what decides a status (issue 37, finding 2)
KEY = b"k" * 32


def _restorable_run(run: str, steps: tuple[int, ...] = (1, 2, 3)) -> CheckpointManager:
    """A signed run of restorable checkpoints: saved unguarded (unverified), then re-sealed as restorable with the
    run's own key (whoever holds the key can sign anything: this stands in for a guarded job's saves)."""
    from verified_ckpt.signing import Signer

    mgr = CheckpointManager(run, signing_key=KEY)
    for s in steps:
        mgr.save(s, {"w": torch.full((4,), float(s))})
    for info in mgr.list():
        path = os.path.join(run, "checkpoints", info.id, "manifest.json")
        doc = json.load(open(path))
        doc.update(status="restorable", reasons=[])
        open(path, "w").write(json.dumps(Signer.of(KEY).seal(resealed(doc))))  # its digest too: a writer's seal
    return CheckpointManager(run, signing_key=KEY)


def _verification(cid: str, step: int, at: str, kinds: tuple[str, ...]) -> dict:
    from verified_ckpt.records import Problem, VerificationResult

    return VerificationResult(cid, step, not kinds, [Problem(k, f"{k} found") for k in kinds], at).to_record()


def _seen(run: str) -> tuple:
    """What a user acts on: every status, the rollback target, the hosts to exclude, what could not be read."""
    view = CheckpointManager(run, signing_key=KEY).view()
    target, _ = view.rollback_target()
    return ({i.id: i.status for i in view.infos}, target.id if target else None, view.exclude_hosts(),
            len(view.incidents), sorted(view.unreadable))


def _compact(run: str) -> int:
    from verified_ckpt.checkpoint import housekeeping

    return housekeeping.compact(CheckpointManager(run, signing_key=KEY)._catalog)


def test_compaction_keeps_the_worst_failure_so_a_digest_failure_between_non_finite_ones_stays_corrupt(tmp_path):
    from verified_ckpt.records import VERIFICATION

    run = str(tmp_path / "run")
    mgr = _restorable_run(run, (1,))
    [info] = mgr.list()
    for second, kinds in enumerate([("nonfinite",), ("digest",), ("nonfinite",)]):  # the red team's sequence
        mgr._catalog.append(VERIFICATION, _verification(info.id, 1, f"2026-01-01T00:00:0{second}+00:00", kinds))
    assert _seen(run)[0][info.id] is Status.CORRUPT
    assert _compact(run) == 0  # the newest, the first failure and the worst are three records: all decide
    assert _seen(run)[0][info.id] is Status.CORRUPT
    mgr._catalog.append(VERIFICATION, _verification(info.id, 1, "2026-01-01T00:00:09+00:00", ()))
    assert _compact(run) == 1 and _seen(run)[0][info.id] is Status.CORRUPT  # the old newest goes, not the digest one


def test_compaction_cannot_race_a_commit_whose_failure_is_recorded_between_its_two_listings(tmp_path, monkeypatch):
    """A checkpoint committed and verified corrupt while compaction runs keeps its failure record: the hook lands
    the commit and the record right after compaction's listing of the checkpoints, wherever that listing falls."""
    from verified_ckpt.records import VERIFICATION
    from verified_ckpt.store import RunStore

    run = str(tmp_path / "run")
    mgr = _restorable_run(run, (1, 2))
    real, armed = RunStore.committed, [True]

    def listed_then_committed(self):
        out = real(self)
        if armed and armed.pop():
            info = CheckpointManager(run, signing_key=KEY).save(3, {"w": torch.zeros(4)})
            mgr._catalog.append(VERIFICATION, _verification(info.id, 3, "2026-01-01T00:00:00+00:00", ("digest",)))
        return out

    monkeypatch.setattr(RunStore, "committed", listed_then_committed)
    _compact(run)
    monkeypatch.setattr(RunStore, "committed", real)
    assert not armed
    statuses, target, *_ = _seen(run)
    [new] = [cid for cid in statuses if cid.startswith("step-0000000003")]
    assert statuses[new] is Status.CORRUPT and target != new


def _record_ops():
    from hypothesis import strategies as st

    # Verifications weigh most (a status turns on the order of several failures of one checkpoint's), each
    # passing, corrupting (the stored bytes) or making suspect (what was found in them).
    verdict = st.sampled_from([(), (), ("digest",), ("size",), ("fingerprint", "read"), ("nonfinite",), ("ledger",),
                               ("signature",), ("nonfinite", "ledger")])
    verification = st.tuples(st.just("verification"), st.sampled_from([0, 0, 0, 1, 3]), verdict)
    incident = st.tuples(st.just("incident"), st.integers(0, 4), st.one_of(st.none(), st.integers(0, 4)),
                         st.lists(st.integers(0, 2), max_size=2, unique=True))
    rollback = st.tuples(st.just("rollback"), st.integers(0, 3), st.integers(0, 3))
    other = st.tuples(st.sampled_from(["untrusted-verification", "untrusted-incident", "unreadable"]),
                      st.integers(0, 3))
    return st.lists(st.tuples(st.one_of(verification, verification, verification, incident, rollback, other),
                              st.booleans()), min_size=6, max_size=16)


def _write_ops(run: str, ops) -> None:
    """Records of every kind through the library's own writer (``Catalog.append``), and hostile ones beside them."""
    from verified_ckpt.hosts import Host
    from verified_ckpt.jsonx import canonical_json
    from verified_ckpt.records import INCIDENT, ROLLBACK, VERIFICATION, Incident, Rollback
    from verified_ckpt.signing import Signer

    mgr = CheckpointManager(run, signing_key=KEY)
    cat, infos = mgr._catalog, mgr.list()
    ids = [i.id for i in infos] + ["step-0000000009-0000dead"]  # and a checkpoint no longer stored
    incidents: list[str] = []
    clock = 0
    for op, tie in ops:
        clock += 0 if tie else 1
        at = f"2026-01-01T00:{clock // 60:02d}:{clock % 60:02d}+00:00"
        kind, pick = op[0], op[1]
        if kind == "verification":
            cat.append(VERIFICATION, _verification(ids[pick], 1 + pick, at, op[2]))
        elif kind == "incident":
            start, length, ranks = op[1], op[2], op[3]
            rid = f"inc{len(incidents)}"
            incidents.append(rid)
            cat.append(INCIDENT, Incident(kind="manual", detected_step=start, first_suspect_step=start, ranks=ranks,
                                          hosts=[Host(r, f"node-{r}", "cpu") for r in ranks], detail="d", id=rid,
                                          to_step=None if length is None else start + length, at=at,
                                          source="manual").to_record())
        elif kind == "rollback":
            to = infos[pick] if pick < len(infos) else None
            cat.append(ROLLBACK, Rollback(at=at, to_checkpoint_id=to.id if to else None, to_step=to.step if to else 0,
                                          answers=incidents[-1 - op[2]:] if incidents else []).to_record())
        elif kind == "unreadable":
            cat.store.records.append(VERIFICATION if pick % 2 else INCIDENT, b"{not json")
        else:  # sealed with a key this run does not hold: untrusted
            rec = (_verification(ids[pick], 1 + pick, at, ()) if kind == "untrusted-verification" else
                   Incident(kind="manual", detected_step=1, first_suspect_step=1, ranks=[], hosts=[], detail="d",
                            id=f"forged{pick}", at=at).to_record())
            cat.store.records.append(VERIFICATION if kind == "untrusted-verification" else INCIDENT,
                                     canonical_json(Signer.of(b"x" * 32).seal(rec)))


def test_compaction_changes_no_status_rollback_target_or_excluded_host_for_any_sequence_of_records(tmp_path_factory):
    import shutil

    from hypothesis import HealthCheck, given, settings

    base = str(tmp_path_factory.mktemp("compaction") / "base")
    _restorable_run(base)

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(ops=_record_ops())
    def check(ops):
        run = str(tmp_path_factory.mktemp("example") / "run")
        shutil.copytree(base, run)
        _write_ops(run, ops)
        before = _seen(run)
        _compact(run)
        assert _seen(run) == before
        _compact(run)  # and again: compaction of a compacted run changes nothing either
        assert _seen(run) == before

    check()
