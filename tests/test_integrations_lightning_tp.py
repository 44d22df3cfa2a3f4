"""The Lightning integration under ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)``: FSDP2 +
tensor parallel on 4 gloo ranks, a 2x2 mesh, with ``VerifiedCheckpointIO`` and ``SDCGuardCallback()`` at the guard's
defaults. The model is parallelised in ``configure_model`` as Lightning's docs do it: a colwise and a rowwise Linear
on the ``tensor_parallel`` mesh, a LayerNorm and a head replicated across it, then ``fully_shard`` over
``data_parallel``.

One launch runs clean (30 steps, a save per epoch of 10), a x10 gradient element in the colwise (TP-sharded) Linear
on rank 1 at step 6, and a bit flip in rank 2's shard of that Linear's weight after step 5's update. A second launch
kills rank 1 by SIGKILL during step 14 (after the save at step 10), and a third resumes from the run; both with
``save_distributed_checkpoint=False``, which the plugin overrides (Lightning would hand ranks 1-3 nothing to save).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from dist_harness import run_ranks

from verified_ckpt import CheckpointManager

BATCH, BATCHES, EPOCHS = 4, 10, 3  # per data-parallel rank: 10 batches an epoch, 30 steps, a save per epoch
KILL_AT = 14


def _lightning_module(fault: tuple[str, int, int] | None) -> Any:
    """The module: ``fault`` is (what, rank, step): ``grad`` multiplies one element of the colwise Linear's weight
    gradient by 10 on that rank at that step (a hook on the unsharded parameter, as a faulty GPU's wrong product
    would arrive, not the guard's own injection); ``flip`` flips bit 22 of that rank's shard of the weight after the
    step's update (at rest); ``kill`` SIGKILLs that rank as the step starts."""
    import signal

    from lightning.pytorch import LightningModule
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class TPMLP(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16),
                                           torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
            self.fired: list[int] = []

        def configure_model(self) -> None:
            tp, dp = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
            parallelize_module(self.net, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            for i in (0, 2, 3, 4):
                fully_shard(self.net[i], mesh=dp)
            fully_shard(self.net, mesh=dp)
            if fault is not None and fault[0] == "grad":
                self.net[0].register_forward_pre_hook(self._arm)

        def _due(self, what: str) -> bool:
            return (fault is not None and fault[0] == what and not self.fired and self.global_rank == fault[1]
                    and self.trainer.global_step + 1 == fault[2])

        def _arm(self, mod: torch.nn.Module, args: Any) -> None:
            if not self._due("grad"):
                return
            self.fired.append(1)  # once: the step's first gradient, never an audit's recomputation

            def wrong(g: torch.Tensor) -> torch.Tensor:
                handle.remove()  # this step's gradient only
                local = g.to_local().clone()
                # The largest element: behind the ReLU a given element can be exactly 0 at a step, and 10 x 0 is
                # no fault (with 10 batches an epoch, element 3 was, at step 6).
                local.view(-1)[local.abs().argmax()] *= 10
                return DTensor.from_local(local, g.device_mesh, g.placements, shape=g.shape, stride=g.stride())

            handle = mod.weight.register_hook(wrong)  # the unsharded parameter FSDP bound for this forward

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if self._due("kill"):
                os.kill(os.getpid(), signal.SIGKILL)

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if fault is not None and fault[0] == "flip" and self.global_rank == fault[1] \
                    and self.trainer.global_step == fault[2] - 1 and not self.fired:
                self.fired.append(1)
                with torch.no_grad():
                    self.net[0].weight.to_local().view(-1).view(torch.int32)[5] ^= 1 << 22

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(0)
            n = BATCH * BATCHES * 2
            data = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
            return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)

    return TPMLP()


def _full(module: Any) -> list[list[int]]:
    """Every parameter and AdamW moment as a full tensor's bits (collective), in a fixed order."""
    opt = module.trainer.optimizers[0]
    params = list(module.parameters())
    out = [p.full_tensor() for p in params]
    out += [v.full_tensor() for p in params for _, v in sorted(opt.state[p].items()) if v.dim()]
    return [t.reshape(-1).view(torch.int32).tolist() for t in out]


def fit(rank: int, world: int, run: str, fault: tuple[str, int, int] | None = None,
        resume: bool = False, full_file: bool = False) -> dict[str, Any]:
    """One ``Trainer.fit`` on the 2x2 mesh; what it caught, or the full state it ended with. ``full_file``:
    ``save_distributed_checkpoint=False`` (Lightning's one full file on rank 0; the plugin stores the run its way)."""
    import warnings

    from lightning.pytorch import Trainer, seed_everything
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    from verified_ckpt import SilentCorruptionDetected
    from verified_ckpt.integrations.lightning import SDCGuardCallback, VerifiedCheckpointIO

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # Lightning reuses the harness's process group
    seed_everything(0, verbose=False)
    module = _lightning_module(fault)
    io = VerifiedCheckpointIO(run)
    out = os.path.join(run + "-out", str(rank))
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2,
                                     save_distributed_checkpoint=not full_file)
    trainer = Trainer(strategy=strategy,
                      accelerator="cpu", devices=world, max_epochs=EPOCHS, plugins=[io], default_root_dir=out,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[SDCGuardCallback(), ModelCheckpoint(dirpath=out, every_n_epochs=1, save_top_k=-1)])
    try:
        trainer.fit(module, ckpt_path=io.resume_path() if resume else None)
    except SilentCorruptionDetected as e:
        return {"caught": [e.incident.kind, e.incident.ranks, e.incident.detected_step]}
    except RuntimeError as e:  # gloo, when a peer was killed: this rank's collective fails (or times out)
        if fault is None or fault[0] != "kill":
            raise
        return {"peer died": type(e).__name__}
    full = _full(module)  # collective: every rank gathers, rank 0 reports
    return {"state": full if rank == 0 else None, "steps": trainer.global_step}


def story(rank: int, world: int, root: str) -> dict[str, Any]:
    return {"clean": fit(rank, world, os.path.join(root, "clean")),
            "grad": fit(rank, world, os.path.join(root, "grad"), ("grad", 1, 6)),
            "flip": fit(rank, world, os.path.join(root, "flip"), ("flip", 2, 6))}


@pytest.fixture(scope="module")
def story_2x2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("pl-tp"))
    got = run_ranks(story, 4, root, timeout=200, retire=True)  # TP: DTensor's plans must not outlive the group
    assert all({k: v for k, v in r.items() if k != "clean"} == {k: v for k, v in got[0].items() if k != "clean"}
               for r in got), got  # every rank reaches the same verdict
    return root, got[0]


@pytest.mark.timeout(240)
def test_lightning_fsdp2_with_tensor_parallel_2x2_saves_restorable_and_names_a_wrong_gradient_and_a_flipped_shard(
        story_2x2):
    root, s = story_2x2
    assert s["clean"]["steps"] == BATCHES * EPOCHS
    clean = CheckpointManager(os.path.join(root, "clean"))
    assert [(c.step, c.status.value) for c in clean.list()] == [(10, "restorable"), (20, "restorable"),
                                                                (30, "restorable")]
    assert clean.incidents() == []
    assert s["grad"]["caught"] == ["abft", [1], 6], s["grad"]  # at its step, before FSDP's reduce-scatter
    assert s["flip"]["caught"] == ["chain", [2], 6], s["flip"]  # at rest after step 5: named at the next step


@pytest.mark.timeout(240)
def test_lightning_fsdp2_with_tensor_parallel_2x2_resumes_after_a_sigkill_bitwise_equal_to_a_clean_run(
        story_2x2, tmp_path):
    _, s = story_2x2
    run = str(tmp_path / "killed")
    # save_distributed_checkpoint=False in this run: Lightning would gather a full state dict on rank 0 only.
    died = run_ranks(fit, 4, run, ("kill", 1, KILL_AT), False, True, killed=frozenset({1}), timeout=120)
    assert died[1] is None and all("peer died" in d for d in (died[0], died[2], died[3])), died
    assert [(c.step, c.status.value) for c in CheckpointManager(run).list()] == [(10, "restorable")]
    resumed = run_ranks(fit, 4, run, None, True, True, timeout=120, retire=True)[0]
    assert resumed["steps"] == BATCHES * EPOCHS
    assert resumed["state"] == s["clean"]["state"]  # every parameter and AdamW moment, bit for bit
    assert [(c.step, c.status.value) for c in CheckpointManager(run).list()] == [
        (10, "restorable"), (20, "restorable"), (30, "restorable")]


def test_the_guards_view_of_a_framework_optimizer_is_one_the_update_oracle_can_slice():
    """The integrations hand the guard a view of the optimizer whose ``step`` is the original; hidden behind it, the
    AdamW under Lightning's ModelParallelStrategy had no update oracle, and every FSDP2 + TP save was ``unverified``
    ("state without a replica has no witness of its updates")."""
    from verified_ckpt.guard.oracle import elementwise_optimizer
    from verified_ckpt.integrations.stepping import _Unguarded

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    assert elementwise_optimizer(_Unguarded(opt, opt.step)) is opt
