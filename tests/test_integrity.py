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
        size, digest = write_shard(f, tensors)
        f.seek(size - 2)
        f.write(b"\xff\xff")
        return size, digest

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

reading.blake3.blake3 = Truncating
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
