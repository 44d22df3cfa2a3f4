"""One restore decision for every rank, and all or nothing across ranks (real gloo ranks).

Rank 0 chooses and broadcasts the manifest's bytes; the other ranks never list the run, so a status change
between two ranks' looks cannot send them to different checkpoints. Every rank reads and checks its share, the
ranks agree, and only then does anything that cannot be put back get applied: a failure on one rank, at any
stage, leaves every rank's live objects bitwise unchanged and raises the same error on every rank.
"""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_ranks

from verified_ckpt import CheckpointManager, CorruptCheckpoint, state_fingerprint
from verified_ckpt.checkpoint import loading, reading
from verified_ckpt.checkpoint.catalog import Catalog
from verified_ckpt.records import Problem
from verified_ckpt.store import RunStore

pytestmark = pytest.mark.timeout(240)
WIDTHS = [12, 15, 9, 6]


def build(sharded: str | None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model replicated (``None``: DDP-style), sharded over every rank (``"fsdp"``) or HSDP (3 replicas x 1)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in itertools.pairwise(WIDTHS)])
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,)) if sharded == "fsdp" else \
            init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, WIDTHS[0], generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer, extra: dict) -> str:
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    plain = {k: full(v) for k, v in model.state_dict().items()}
    moments = {f"{i}.{k}": full(v) for i, st in enumerate(opt.state.values()) for k, v in st.items()}
    return str(state_fingerprint({"m": plain, "o": moments, "x": extra}))


# ------------------------------------------------------------------ one decision
def raced(rank: int, world: int, run: str) -> dict:
    """Two restorable-enough checkpoints (10, 20). Rank 0 chooses, then flags step 20 suspect before any other
    rank looks; the other ranks, were they to look, would wait for that flag first (a hook, not a timer)."""
    model, opt = build(None)
    mgr = CheckpointManager(run)
    for s in (10, 20):
        step(model, opt, s)
        mgr.save(s, {"m": model, "o": opt})
    dist.barrier()
    flagged = os.path.join(os.path.dirname(run), "flagged")
    original = Catalog.restorable

    def restorable(self, *args, **kwargs):
        if rank == 0:
            chosen = original(self, *args, **kwargs)
            CheckpointManager(run).flag(15, reason="a bad node")  # a status change right after rank 0's look
            open(flagged, "w").close()
            return chosen
        deadline = time.monotonic() + 30
        while not os.path.exists(flagged) and time.monotonic() < deadline:  # bounded: the flag comes first
            time.sleep(0.01)
        return original(self, *args, **kwargs)

    committed = RunStore.committed

    def no_listing(self):
        if rank != 0:
            raise AssertionError(f"rank {rank} listed the run")
        return committed(self)

    Catalog.restorable, RunStore.committed = restorable, no_listing
    try:
        fresh, opt2 = build(None)
        info = CheckpointManager(run).restore({"m": fresh, "o": opt2}, allow_unverified=True)
    finally:
        Catalog.restorable, RunStore.committed = original, committed
    return {"step": info.step, "fingerprint": fingerprint(fresh, opt2, {})}


def test_every_rank_restores_rank_0s_choice_and_the_others_do_not_list_the_run(tmp_path):
    got = run_ranks(raced, 3, str(tmp_path / "run"))
    assert [r["step"] for r in got] == [20, 20, 20]  # each rank's own look would have found 20 suspect
    assert len({r["fingerprint"] for r in got}) == 1


def resumed(rank: int, world: int, run: str) -> dict:
    """Guarded saves at 10 and 20 and an open incident from 15: resume must roll back to 10 and answer it. Counts
    how often each rank lists the run's checkpoints and builds a view of the run while resuming."""
    import ddp_train
    from torch.nn.parallel import DistributedDataParallel as DDP

    from verified_ckpt import GuardConfig, SDCGuard

    def job() -> tuple[CheckpointManager, torch.nn.Module, torch.optim.Optimizer, SDCGuard]:
        model = DDP(ddp_train.build_model(0))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig())
        return CheckpointManager(run, guard=guard), model, opt, guard

    mgr, model, opt, guard = job()
    for s in range(1, 21):
        guard.backward(ddp_train.make_batch(0, s, rank), step=s)
        guard.step()
        opt.zero_grad()
        if s % 10 == 0:
            mgr.save(s, {"model": model.module, "optim": opt})
    mgr.wait()
    if rank == 0:
        mgr.flag(15, reason="a bad node")
    dist.barrier()
    counts = {"committed": 0, "view": 0}
    committed, view = RunStore.committed, Catalog.view

    def counting_committed(self):
        counts["committed"] += 1
        return committed(self)

    def counting_view(self):
        counts["view"] += 1
        return view(self)

    RunStore.committed, Catalog.view = counting_committed, counting_view
    try:
        resumer, fresh, opt2, _ = job()
        nxt = resumer.resume({"model": fresh.module, "optim": opt2})
    finally:
        RunStore.committed, Catalog.view = committed, view
    return {"next": nxt, "counts": counts, "fingerprint": fingerprint(fresh.module, opt2, {}),
            "open": [i.id for i in CheckpointManager(run).view().open_incidents()] if rank == 0 else None}


def test_at_resume_rank_0_reads_the_run_once_and_every_rank_restores_from_its_manifest_bytes(tmp_path):
    got = run_ranks(resumed, 3, str(tmp_path / "run"))
    assert [r["next"] for r in got] == [11, 11, 11] and len({r["fingerprint"] for r in got}) == 1
    assert got[0]["counts"] == {"committed": 1, "view": 1}  # the rollback answers the incident from that one read
    assert [r["counts"] for r in got[1:]] == [{"committed": 0, "view": 0}] * 2
    assert got[0]["open"] == []


# -------------------------------------------------------------- all or nothing
class Custom:
    """A stateful object of the user's own."""

    def __init__(self) -> None:
        self.value = torch.zeros(3)
        self.fail = False

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        if self.fail:
            raise RuntimeError("the user's load_state_dict refuses")
        self.value = sd["value"].clone()


def injected(stage: str, rank: int, target: int) -> tuple[list, Custom]:
    """Patches making ``stage`` fail on rank ``target`` only; returns them (to undo) and the custom object."""
    custom = Custom()
    patches: list = []
    if rank != target:
        return patches, custom
    if stage == "read":
        original = RunStore.read_shard

        def read_shard(self, *a, **k):
            raise OSError(5, "Input/output error")  # the store failed under this rank

        patches.append((RunStore, "read_shard", original))
        RunStore.read_shard = read_shard
    elif stage in ("digest", "fingerprint"):
        original = reading.Reader._one

        def one(self, m, s, *a, **k):
            tensors, probs = original(self, m, s, *a, **k)
            return {}, [*probs, Problem(stage, f"{s.path}: injected on this rank")]

        patches.append((reading.Reader, "_one", original))
        reading.Reader._one = one
    elif stage == "apply":
        custom.fail = True
    elif stage == "after":  # the post-load fingerprint check fails on this rank
        original = loading.check_after

        def check_after(state, m):
            raise CorruptCheckpoint("after loading, a value does not match (injected)")

        patches.append((loading, "check_after", original))
        loading.check_after = check_after
    return patches, custom


def failed_restore(rank: int, world: int, run: str, sharded: str | None, stage: str) -> dict:
    model, opt = build(sharded)
    step(model, opt, 1)
    mgr = CheckpointManager(run)
    extra = {"tensor": torch.arange(4.0), "data": {"epoch": 1, "seen": [1, 2]}}
    mgr.save(1, {"m": model, "o": opt, "t": extra["tensor"], "d": extra["data"], "c": Custom()})
    step(model, opt, 2)  # live state moves on: a restore would change it
    extra["tensor"].add_(1)
    extra["data"]["epoch"] = 2
    patches, custom = injected(stage, rank, 1)
    custom.value = torch.full((3,), 7.0)
    before = fingerprint(model, opt, {**extra, "c": custom.value})
    state = {"m": model, "o": opt, "t": extra["tensor"], "d": extra["data"], "c": custom}
    try:
        mgr.restore(state, allow_unverified=True)
        error = None
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        error = (type(e).__name__, str(e))
    finally:
        for owner, name, original in patches:
            setattr(owner, name, original)
    after = fingerprint(model, opt, {"tensor": state["t"], "data": state["d"], "c": custom.value})
    return {"error": error, "unchanged": before == after, "data": state["d"]}


STAGES = ["read", "digest", "fingerprint", "apply", "after"]


@pytest.mark.parametrize("sharded", [None, "fsdp", "hsdp"], ids=["ddp", "fsdp2", "hsdp"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_failure_on_one_rank_at_any_stage_leaves_every_rank_unchanged_and_raises_the_same_error(tmp_path, sharded,
                                                                                                   stage):
    got = run_ranks(failed_restore, 3, str(tmp_path / "run"), sharded, stage)
    assert all(r["unchanged"] for r in got), [r["unchanged"] for r in got]
    assert all(r["data"] == {"epoch": 2, "seen": [1, 2]} for r in got)  # the plain dict too
    errors = {tuple(r["error"]) for r in got if r["error"]}
    assert len(errors) == 1 and all(r["error"] for r in got), [r["error"] for r in got]
    [(kind, message)] = errors
    assert message.startswith("rank 1: "), message
    if stage in ("digest", "fingerprint"):
        assert kind == "CorruptCheckpoint" and stage in message


def test_in_one_process_a_failed_post_load_check_puts_back_torch_modules_tensors_and_plain_dicts(tmp_path):
    model, opt = build(None)
    mgr = CheckpointManager(str(tmp_path / "run"))
    t, d = torch.arange(4.0), {"epoch": 1}
    mgr.save(1, {"m": model, "t": t, "d": d, "c": Custom()})
    with torch.no_grad():
        model[0].weight.add_(1)
    t.add_(1)
    d["epoch"] = 2

    class Altering(Custom):
        def load_state_dict(self, sd: dict) -> None:
            self.value = sd["value"] + 1  # alters what it was given: the post-load check must see it

    before = fingerprint(model, opt, {"t": t, "d": d})
    state = {"m": model, "t": t, "d": d, "c": Altering()}
    with pytest.raises(CorruptCheckpoint, match="altered the values"):
        mgr.restore(state, allow_unverified=True)
    assert fingerprint(model, opt, {"t": state["t"], "d": state["d"]}) == before and d == {"epoch": 2}
