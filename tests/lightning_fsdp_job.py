"""Run under torchrun by ``test_integrations_lightning.py``: Lightning's ``ModelParallelStrategy`` with FSDP2
(``fully_shard`` inside ``configure_model``, as Lightning's docs set it up) and ``SDCGuardCallback()`` at the
guard's defaults, with gradient accumulation: a clean run, then a run whose rank 1 hands back a wrong reduced
gradient shard at step 5. Prints one JSON line per rank."""

from __future__ import annotations

import json
import sys
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from verified_ckpt import GuardConfig, SilentCorruptionDetected
from verified_ckpt.integrations.lightning import SDCGuardCallback


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(16, 1))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for m in self.net:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(world: int, faults: list[str]) -> dict:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randn(96, 1, generator=g))
    # The defaults, plus a fault only where the run asks for one (the guard's own injection at FSDP's all-reduce hook).
    cb = SDCGuardCallback(GuardConfig(faults=faults) if faults else None)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(data_parallel_size=world,
                         tensor_parallel_size=1), max_steps=12, accumulate_grad_batches=2, callbacks=[cb], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=4))
    except SilentCorruptionDetected as e:
        return {"caught": [e.incident.kind, e.incident.ranks, e.incident.detected_step]}
    assert cb.guard is not None
    return {"layout": cb.guard.layout.kind, "checks": {k: c.passed for k, c in cb.guard.counters().items()},
            "failed": sum(c.failed for c in cb.guard.counters().values())}


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    world = int(sys.argv[1])
    out = {"clean": fit(world, []), "faulty": fit(world, ["allreduce:1:5:elem=10"])}
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
