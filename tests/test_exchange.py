"""A save's report exchange when no collective may run (``checkpoint/exchange.ThroughStore``): a rank whose write
fails reaches every other rank through the store, so none waits out its bound.

The blocking save's counterpart (``Collective``) is pinned in ``tests/test_session.py``
(``test_a_rank_that_fails_its_part_of_a_blocking_save_fails_every_rank_at_once``).
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

from verified_ckpt import CheckpointManager

pytestmark = pytest.mark.timeout(120)

BOUND_S = 60  # each rank's wait for a report or the manifest; the failure must arrive well inside it


def failing_in_background(rank: int, world: int, run: str) -> dict:
    """A non-blocking 3-rank save whose shard write fails on rank 1 (on the save's background thread)."""
    import time

    from verified_ckpt.checkpoint import saving

    mgr = CheckpointManager(run, shard_bytes=256, report_timeout_s=BOUND_S)  # six shards: every rank writes two
    real_write = saving.write_shard

    def broken_write(f, tensors):
        raise OSError("disk full on node-2")

    if rank == 1:
        saving.write_shard = broken_write
    t0 = time.monotonic()
    try:
        mgr.save(3, {f"w{i}": torch.full((64,), float(i)) for i in range(6)}, blocking=False).result(timeout=90)
        got = {"error": None}
    except Exception as e:  # what each rank raised is the result
        got = {"error": f"{type(e).__name__}: {e}"}
    finally:
        saving.write_shard = real_write
    return {**got, "seconds": time.monotonic() - t0}


def test_a_rank_that_fails_its_part_of_a_non_blocking_save_fails_every_rank_without_waiting_out_the_bound(tmp_path):
    run = str(tmp_path / "run")
    got = run_ranks(failing_in_background, 3, run)
    assert all(r["error"] for r in got), got
    assert all(r["seconds"] < BOUND_S / 2 for r in got), [r["seconds"] for r in got]  # no rank waited for a report
    assert "disk full on node-2" in got[1]["error"]
    # Rank 0 read rank 1's failure beside the shards; rank 2, awaiting the manifest, read rank 0's.
    assert all("rank 1 failed to write its shards" in r["error"] and "disk full" in r["error"] for r in (got[0], got[2]))
    assert CheckpointManager(run).list() == []
