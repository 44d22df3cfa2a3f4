"""A Lightning DDP job with verified checkpoints and the SDC guard: an MLP with dropout on random data.

    torchrun --nproc-per-node 3 examples/lightning_train.py --run /tmp/pl-run            # 3 epochs, a save per epoch
    torchrun --nproc-per-node 3 examples/lightning_train.py --run /tmp/pl-run --resume   # continue from the run

``--inject SPEC`` injects a fault (``grad:1:6:scale=10``); the guard raises, the incident is recorded, and
the job exits 4. ``--story DIR`` runs what the test suite checks in one launch: an uninterrupted run, a
run with a gradient fault at an audit step, and its resume from the rollback target; rank 0 writes
``DIR/story.json``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import story_cli
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from verified_ckpt import CheckpointManager, GuardConfig, SilentCorruptionDetected, state_fingerprint
from verified_ckpt.integrations.lightning import SDCGuardCallback, VerifiedCheckpointIO

BATCH, STEPS_PER_EPOCH = 4, 4


class MLP(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(32, 4))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def train_dataloader(self) -> Any:
        g = torch.Generator().manual_seed(0)
        n = BATCH * STEPS_PER_EPOCH * int(os.environ.get("WORLD_SIZE", "1"))
        data = torch.utils.data.TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
        return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)


def fit(run: str, out: str, epochs: int, faults: list[str], resume: bool) -> MLP:
    seed_everything(0, workers=True, verbose=False)
    model = MLP()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    io = VerifiedCheckpointIO(run)
    trainer = Trainer(strategy="ddp" if world > 1 else "auto", accelerator="cpu", devices=world, max_epochs=epochs,
                      plugins=[io], default_root_dir=out, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      callbacks=[SDCGuardCallback(GuardConfig(audit_every=2, consensus_every=4, abft=False,
                                                              faults=tuple(faults))),
                                 ModelCheckpoint(dirpath=out, every_n_epochs=1, save_top_k=-1)])
    trainer.fit(model, ckpt_path=io.resume_path() if resume else None)
    return model


def story(root: str, epochs: int) -> dict[str, Any]:
    clean = fit(os.path.join(root, "clean"), os.path.join(root, "out-clean"), epochs, [], False)
    out: dict[str, Any] = {"clean": str(state_fingerprint({"model": clean}))}
    faulty = os.path.join(root, "faulty")
    try:
        fit(faulty, os.path.join(root, "out-faulty"), epochs, ["grad:1:6:scale=10"], False)
        out["caught"] = None
    except SilentCorruptionDetected as e:
        out["caught"] = {"kind": e.incident.kind, "ranks": list(e.incident.ranks), "step": e.incident.detected_step}
    resumed = fit(faulty, os.path.join(root, "out-resumed"), epochs, [], True)
    out["resumed"] = str(state_fingerprint({"model": resumed}))
    out["checkpoints"] = [(c.step, c.status.value, c.manifest.resumed_from if c.manifest else None)
                          for c in CheckpointManager(faulty).list()]
    return out


def main() -> int:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    ap = story_cli.parser(__doc__)
    ap.add_argument("--epochs", type=int, default=3)
    a = ap.parse_args()
    return story_cli.run(ap, a, lambda root: story(root, a.epochs),
                         lambda out: fit(a.run, out, a.epochs, a.inject, a.resume))


if __name__ == "__main__":
    sys.exit(main())
