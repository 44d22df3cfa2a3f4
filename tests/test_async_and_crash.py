"""Non-blocking saves, and crash consistency: a SIGKILL at any point of a save leaves the
previous checkpoints intact and no new checkpoint listed."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from verified_ckpt import CheckpointManager, state_fingerprint

pytestmark = pytest.mark.timeout(120)


def test_async_save_snapshots_then_commits_in_the_background(local_url):
    mgr = CheckpointManager(local_url)
    live = {"w": torch.arange(1000.0)}
    snap = state_fingerprint(live)
    fut = mgr.save(5, live, blocking=False)
    live["w"].mul_(-1)  # training goes on right away
    info = mgr.wait()
    assert fut.done() and info.step == 5 and info.manifest.state_fingerprint == str(snap)
    into = {"w": torch.zeros(1000)}
    mgr.restore(into, allow_unverified=True)
    assert torch.equal(into["w"], torch.arange(1000.0))
    assert mgr.wait() is None  # nothing pending


def test_back_to_back_async_saves_each_keep_their_own_values(local_url):
    """Host buffers are reused between non-blocking saves; no save may see a later save's values."""
    mgr = CheckpointManager(local_url, shard_bytes=1 << 12)  # several shards per save
    live = {"a": torch.arange(4096.0), "b": torch.arange(2048, dtype=torch.int64), "c": torch.ones(3, 5).t()}
    expected = {}
    for step in range(1, 5):
        expected[step] = state_fingerprint(live)
        mgr.save(step, live, blocking=False)  # waits for the previous one, then overwrites its buffers
        for t in live.values():
            t.mul_(3).add_(1)  # training mutates the live tensors at once
    mgr.wait()
    assert {i.step: i.manifest.state_fingerprint for i in mgr.list()} == {s: str(f) for s, f in expected.items()}
    into = {"a": torch.zeros(4096), "b": torch.zeros(2048, dtype=torch.int64), "c": torch.zeros(5, 3)}
    mgr.restore(into, step=2, allow_unverified=True)
    assert torch.equal(into["a"], torch.arange(4096.0) * 3 + 1)


def test_a_failed_background_save_surfaces_and_never_commits(local_url, monkeypatch):
    mgr = CheckpointManager(local_url)
    mgr.save(1, {"w": torch.ones(4)})
    from verified_ckpt.checkpoint import saving as manager_mod

    def broken(f, items, metadata=None):
        raise OSError("disk full")

    monkeypatch.setattr(manager_mod, "write_shard", broken)
    mgr.save(2, {"w": torch.zeros(4)}, blocking=False)
    with pytest.raises(OSError, match="disk full"):
        mgr.save(3, {"w": torch.zeros(4)}, blocking=False)  # the next save surfaces it first
    monkeypatch.undo()
    assert [i.step for i in mgr.list()] == [1]
    assert mgr.wait() is None


CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    from verified_ckpt import CheckpointManager, shards, store
    from verified_ckpt.checkpoint import saving as manager
    point, url, blocking = sys.argv[1], sys.argv[2], sys.argv[3] == "sync"
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    mgr = CheckpointManager(url, shard_bytes=1 << 16)
    state = {f"w{i}": torch.full((1 << 14,), float(i)) for i in range(6)}
    if point == "first-shard-written":
        real = manager.write_shard
        calls = []
        def write_then_maybe_die(f, items, metadata=None):
            calls.append(1)
            if len(calls) == 2:
                die()
            return real(f, items, metadata)
        manager.write_shard = write_then_maybe_die
    elif point == "mid-shard":
        real_write = shards._raw_bytes
        def half(t):
            mv = real_write(t)
            if t.numel() and float(t.reshape(-1)[0]) == 3.0:
                die()
            return mv
        shards._raw_bytes = half
    elif point == "before-manifest":
        store.RunStore.commit_manifest = lambda self, cid, data: die()
    elif point == "during-manifest":
        def partial(self, cid, data):
            path = f"{self.checkpoint_dir(cid)}/manifest.json"
            with self.backend.fs.open(path, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                die()
        store.RunStore.commit_manifest = partial
    elif point == "after-snapshot":
        manager.Saver.finish = lambda self, job, **kw: die()
    out = mgr.save(2, state, blocking=blocking)
    if not blocking:
        mgr.wait()
    sys.exit(3)  # never reached: every point dies
""")


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("point", ["first-shard-written", "mid-shard", "before-manifest", "during-manifest", "after-snapshot"])
def test_sigkill_during_a_save_leaves_previous_checkpoints_and_commits_nothing(local_url, point, mode):
    mgr = CheckpointManager(local_url)
    previous = mgr.save(1, {"w0": torch.ones(1 << 14)})
    proc = subprocess.run([sys.executable, "-c", CHILD, point, local_url, mode], timeout=90,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    infos = mgr.list()
    restorable_or_unverified = [i for i in infos if i.status.value in ("restorable", "unverified")]
    assert [i.id for i in restorable_or_unverified] == [previous.id]
    assert all(i.status.value == "corrupt" for i in infos if i.id != previous.id)  # a torn manifest is never usable
    into = {"w0": torch.zeros(1 << 14)}
    assert mgr.restore(into, allow_unverified=True).id == previous.id
    assert torch.equal(into["w0"], torch.ones(1 << 14))
    mgr.gc(grace_s=0)
    assert [i.id for i in mgr.list() if i.status.value != "corrupt"] == [previous.id]
