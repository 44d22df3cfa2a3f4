"""A Lightning DDP job with verified checkpoints and the SDC guard at its defaults: an MLP with dropout on random data.

    torchrun --nproc-per-node 3 examples/lightning_train.py --run-url /tmp/pl-run            # 3 epochs, a save per epoch
    torchrun --nproc-per-node 3 examples/lightning_train.py --run-url /tmp/pl-run --resume   # continue from the run

``--grad-fault RANK:STEP:FACTOR`` multiplies one rank's gradient of the first layer's weight at one step, once, the
way a faulty GPU would hand back a wrong result (a hook on the parameter, not the guard's own injection); the guard
raises, the incident is recorded, and the job exits 4. ``--accumulate N`` and ``--schedule`` (linear warm-up, then
cosine decay, stepped every optimizer step) are Lightning's own options. ``--story DIR`` runs what the test suite
checks in one launch: a 60-step clean run with gradient accumulation and the schedule, then an uninterrupted run,
a run with a gradient fault at a step that is not an audit step, and its resume from the rollback target; then the
same model under Lightning's ``ModelParallelStrategy`` with FSDP2 (``fully_shard`` in ``configure_model``, ``--fsdp``),
clean and with a wrong reduced gradient shard on rank 1; rank 0 writes ``DIR/story.json``.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Any

import story_cli
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from verified_ckpt import CheckpointManager, GuardConfig, SilentCorruptionDetected, state_fingerprint
from verified_ckpt.integrations.lightning import SDCGuardCallback, VerifiedCheckpointIO

BATCH = 4


class MLP(LightningModule):
    def __init__(self, batches_per_epoch: int = 4, schedule: bool = False, fault: str | None = None,
                 fsdp: bool = False) -> None:
        super().__init__()
        self.batches_per_epoch, self.schedule, self.fsdp = batches_per_epoch, schedule, fsdp
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(32, 4))
        if fault:
            rank, step, factor = fault.split(":")
            self._arm(int(rank), int(step), float(factor))

    def _arm(self, rank: int, step: int, factor: float) -> None:
        fired = []

        def wrong(g: torch.Tensor) -> torch.Tensor:
            if fired or int(os.environ.get("RANK", "0")) != rank or self.trainer.global_step + 1 != step:
                return g
            fired.append(step)  # a transient fault: this step's first gradient only, never its recomputation
            return g * factor

        self.net[0].weight.register_hook(wrong)

    def configure_model(self) -> None:
        if self.fsdp:  # as Lightning's docs shard a model: each layer, then the whole, over the data-parallel mesh
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        if not self.schedule:
            return opt
        total, warmup = self.trainer.estimated_stepping_batches, 10

        def factor(step: int) -> float:
            return (step + 1) / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / total))

        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, factor),
                                                   "interval": "step"}}

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        n = BATCH * self.batches_per_epoch * int(os.environ.get("WORLD_SIZE", "1"))
        data = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
        return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)


def fit(run: str, out: str, epochs: int, resume: bool, *, fault: str | None = None, accumulate: int = 1,
        batches_per_epoch: int = 4, schedule: bool = False) -> MLP:
    seed_everything(0, workers=True, verbose=False)
    model = MLP(batches_per_epoch, schedule, fault)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    io = VerifiedCheckpointIO(run)
    trainer = Trainer(strategy="ddp" if world > 1 else "auto", accelerator="cpu", devices=world, max_epochs=epochs,
                      plugins=[io], default_root_dir=out, logger=False, accumulate_grad_batches=accumulate,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[SDCGuardCallback(), ModelCheckpoint(dirpath=out, every_n_epochs=1, save_top_k=-1)])
    trainer.fit(model, ckpt_path=io.resume_path() if resume else None)
    return model


def fit_fsdp(out: str, epochs: int, config: GuardConfig | None = None, accumulate: int = 2) -> dict[str, Any]:
    """The model under ``ModelParallelStrategy`` with FSDP2 and the guard's callback (saves through
    ``VerifiedCheckpointIO`` under it: tests/test_integrations_lightning_tp.py); what the guard counted, or what it
    caught."""
    seed_everything(0, workers=True, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    callback = SDCGuardCallback(config)
    trainer = Trainer(strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                      accelerator="cpu", devices=world, max_epochs=epochs, default_root_dir=out, logger=False,
                      accumulate_grad_batches=accumulate, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=[callback])
    try:
        trainer.fit(MLP(fsdp=True))
    except SilentCorruptionDetected as e:
        return {"caught": caught(e)}
    assert callback.guard is not None
    counts = callback.guard.counters()
    return {"layout": callback.guard.layout.kind, "checks": {k: c.passed for k, c in counts.items()},
            "failed": sum(c.failed for c in counts.values())}


def caught(e: SilentCorruptionDetected) -> dict[str, Any]:
    return {"kind": e.incident.kind, "ranks": list(e.incident.ranks), "step": e.incident.detected_step}


def story(root: str, epochs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:  # 60 optimizer steps of 2 accumulated batches each, with warm-up and cosine decay: nothing to find
        fit(os.path.join(root, "long"), os.path.join(root, "out-long"), 4, False, accumulate=2, batches_per_epoch=30,
            schedule=True)
        out["long"] = None
    except SilentCorruptionDetected as e:
        out["long"] = caught(e)
    clean = fit(os.path.join(root, "clean"), os.path.join(root, "out-clean"), epochs, False)
    out["clean"] = str(state_fingerprint({"model": clean}))
    faulty = os.path.join(root, "faulty")
    try:
        fit(faulty, os.path.join(root, "out-faulty"), epochs, False, fault="1:6:10")
        out["caught"] = None
    except SilentCorruptionDetected as e:
        out["caught"] = caught(e)
    resumed = fit(faulty, os.path.join(root, "out-resumed"), epochs, True)
    out["resumed"] = str(state_fingerprint({"model": resumed}))
    out["checkpoints"] = [(c.step, c.status.value, c.manifest.resumed_from if c.manifest else None)
                          for c in CheckpointManager(faulty).list()]
    # 3 epochs of 4 batches, 2 accumulated: 6 optimizer steps; the fault is the guard's own injection at FSDP's hook.
    out["fsdp"] = fit_fsdp(os.path.join(root, "out-fsdp"), epochs)
    out["fsdp_fault"] = fit_fsdp(os.path.join(root, "out-fsdp-fault"), epochs, GuardConfig(faults=["allreduce:1:4:elem=10"]))
    return out


def main() -> int:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    ap = story_cli.parser(__doc__)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--grad-fault", metavar="RANK:STEP:FACTOR", help="one rank's wrong gradient at one step")
    ap.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    ap.add_argument("--schedule", action="store_true", help="linear warm-up, then cosine decay")
    a = ap.parse_args()
    if a.inject:
        ap.error("--inject is the other examples' guard-side injection; this one takes --grad-fault RANK:STEP:FACTOR")
    return story_cli.run(ap, a, lambda root: story(root, a.epochs), lambda out: fit(
        a.run, out, a.epochs, a.resume, fault=a.grad_fault, accumulate=a.accumulate, schedule=a.schedule))


if __name__ == "__main__":
    sys.exit(main())
