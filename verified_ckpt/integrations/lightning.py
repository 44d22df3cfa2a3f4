"""PyTorch Lightning with verified checkpoints and the SDC guard: a ``CheckpointIO`` plugin and a ``Callback``.

    io = VerifiedCheckpointIO("s3://bucket/runs/exp42")
    trainer = Trainer(strategy="ddp", plugins=[io], callbacks=[SDCGuardCallback()])
    trainer.fit(model, ckpt_path=io.resume_path())   # RESUME to continue from the run, None on a fresh start

- **Saves** go through Lightning's own checkpointing (``ModelCheckpoint``, ``trainer.save_checkpoint``) into a
  :class:`~verified_ckpt.CheckpointManager`: the module's ``state_dict`` as the ``model`` entry, the rest of
  Lightning's checkpoint (optimizer and scheduler states, loops, callbacks) as ``lightning``, and every
  rank's RNG. Step N is ``trainer.global_step``. Lightning writes checkpoints from rank 0 only; a verified
  save is collective (the guard's consensus runs first, every rank writes its share of the shards), so the
  callback makes the strategy hand the checkpoint to the plugin on every rank.
- **Loads**: ``ckpt_path=RESUME`` continues through ``CheckpointManager.resume`` (the rollback target after an
  incident, recording the rollback; otherwise the newest restorable checkpoint), verified before Lightning
  sees a byte. Any other ``ckpt_path`` names a step or checkpoint id of the run, restored as ``restore`` does.
  ``ModelParallelStrategy`` (FSDP2, with or without tensor parallel) loads checkpoints itself, never through its
  ``CheckpointIO``; the callback routes its loads to the plugin, which restores into the live sharded model and
  optimizers in place.
- **The guard** (:class:`SDCGuardCallback`) wraps the strategy's DDP model when training starts. Lightning's
  closure still runs ``training_step`` and its backward hooks; the guard records each batch (and the RNG
  state) before the forward, runs the backward, and the optimizer's ``step`` becomes ``guard.step()``: the
  checks pass, or the update is withheld and :class:`~verified_ckpt.SilentCorruptionDetected` is raised out of
  ``fit`` on every rank. Audits recompute a batch with the module's own ``training_step``.

Limits (docs/INTEGRATIONS.md): automatic optimization with one optimizer, DDP, one device or FSDP2 (+ TP) under
``ModelParallelStrategy``, no loss-scaling precision (``16-mixed``); each is refused when
training starts, with what to use instead. Gradient accumulation
(``accumulate_grad_batches``) is supported. Resuming restarts an interrupted epoch from its start in Lightning,
so save at epoch ends (``ModelCheckpoint(every_n_epochs=1)``) for a bit-identical resume.
The plugin and callback reach into ``Strategy`` internals; the supported range is pinned in the
``lightning`` extra.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch import Callback, LightningModule, Trainer

from .. import CheckpointManager, GuardConfig, RNGState, SDCGuard
from ..checkpoint.export import MODEL_ENTRY
from .stepping import guarded_steps

__all__ = ["RESUME", "SDCGuardCallback", "VerifiedCheckpointIO"]

RESUME = "vckpt:resume"  # ckpt_path that continues from the run
LIGHTNING_ENTRY = "lightning"  # everything of Lightning's checkpoint but the module's state_dict

log = logging.getLogger("verified_ckpt")


class VerifiedCheckpointIO(CheckpointIO):
    """Lightning's checkpoints as verified checkpoints of the run at ``run`` (any fsspec URL).

    Without :class:`SDCGuardCallback` saves still commit, but as ``unverified`` (no consensus evidence).
    """

    def __init__(self, run: str, *, storage_options: dict[str, Any] | None = None, keep_last: int | None = None) -> None:
        self.run, self.storage_options, self.keep_last = run, storage_options, keep_last
        self.manager = CheckpointManager(run, storage_options=storage_options, keep_last=keep_last)
        self.resumed_from: str | None = None

    def attach(self, guard: SDCGuard) -> None:
        """Save with ``guard``'s evidence from now on (the callback calls this)."""
        resumed = self.resumed_from
        self.manager = CheckpointManager(self.run, storage_options=self.storage_options, keep_last=self.keep_last,
                                         guard=guard)
        self.manager.resumed_from = resumed  # the lineage continues from what was restored

    def resume_path(self) -> str | None:
        """``RESUME`` when the run holds a checkpoint to continue from, else ``None`` (a fresh start), for
        ``trainer.fit(model, ckpt_path=io.resume_path())`` on every start. Call it on every rank. A fresh start
        after an incident with nothing to roll back to is recorded as the rollback that answers it."""
        if self.manager.rollback_target()[0] is not None:
            return RESUME
        self.manager.resume({})  # nothing to restore: records the fresh start if an incident is open
        return None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        self.manager.save(int(checkpoint.get("global_step", 0)),
                          {MODEL_ENTRY: checkpoint["state_dict"], LIGHTNING_ENTRY: rest, "rng": RNGState()})

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        return self._load(path, {MODEL_ENTRY: {}, LIGHTNING_ENTRY: {}, "rng": RNGState()})

    def load_sharded(self, path: Any, model: torch.nn.Module, optimizers: list[Any]) -> dict[str, Any]:
        """``load_checkpoint`` for ``ModelParallelStrategy``, which loads the model and optimizers itself and never
        asks the plugin: the checkpoint goes into the live sharded model and optimizers in place (each rank reads
        its own pieces of every DTensor), and the rest of Lightning's checkpoint is returned."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        # The live tensors are the templates: their placements say which piece each rank reads.
        optim = [get_optimizer_state_dict(model, o) for o in optimizers]
        state = {MODEL_ENTRY: get_model_state_dict(model), LIGHTNING_ENTRY: {"optimizer_states": optim},
                 "rng": RNGState()}
        checkpoint = self._load(path, state)
        for o, restored in zip(optimizers, checkpoint["optimizer_states"], strict=True):
            set_optimizer_state_dict(model, o, restored)  # hyperparameters too, which no tensor copy carries
        return checkpoint

    def _load(self, path: Any, state: dict[str, Any]) -> dict[str, Any]:
        ref = str(path)
        if ref == RESUME:
            self.manager.resume(state)
            if self.manager.resumed_from is None:
                raise FileNotFoundError(f"nothing restorable to resume from in {self.run} (`vckpt list {self.run}` "
                                        "says why); pass ckpt_path=None to start afresh")
        else:
            info = self.manager.restore(state, checkpoint_id=ref) if not ref.isdigit() else \
                self.manager.restore(state, step=int(ref))
            self.manager.resumed_from = info.id
        self.resumed_from = self.manager.resumed_from
        return {**state[LIGHTNING_ENTRY], "state_dict": state[MODEL_ENTRY]}

    def remove_checkpoint(self, path: Any) -> None:
        """Retention is the manager's (``keep_last``): a checkpoint still needed for a rollback is never removed."""


def _unsupported(trainer: Trainer, pl_module: LightningModule) -> str | None:
    """Why the guard cannot run this trainer's steps (``None``: it can): it steps one optimizer automatically, on
    DDP, one device or FSDP2 (``ModelParallelStrategy``), without a loss scaler (whose skipped overflow steps it
    would see as NaN/Inf)."""
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    if not pl_module.automatic_optimization:
        return "manual optimization is not supported: the guard must run each optimizer step"
    if len(trainer.optimizers) != 1:
        return f"{len(trainer.optimizers)} optimizers; the guard steps exactly one"
    if not isinstance(trainer.strategy, (DDPStrategy, SingleDeviceStrategy, ModelParallelStrategy)):
        return (f"strategy {type(trainer.strategy).__name__} is not supported; use strategy='ddp', one device, or "
                "ModelParallelStrategy with fully_shard")
    if str(trainer.precision).startswith("16"):
        return (f"precision={trainer.precision!r} scales the loss and skips overflow steps, which the guard would see as "
                "NaN/Inf; use precision='bf16-mixed' or '32-true'")
    return None


def _loads_itself(strategy: Any) -> bool:
    """Whether ``strategy`` loads checkpoints without its ``CheckpointIO`` (``ModelParallelStrategy``)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy)


def _loss(out: Any) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, torch.Tensor):
        raise TypeError("SDCGuardCallback: training_step must return the loss (a tensor, or a dict with 'loss')")
    return loss


class SDCGuardCallback(Callback):
    """Runs every training step of the strategy's model (DDP, or FSDP2 under ``ModelParallelStrategy``) through an
    :class:`~verified_ckpt.SDCGuard`."""

    def __init__(self, config: GuardConfig | None = None) -> None:
        self.config = config or GuardConfig()
        self.guard: SDCGuard | None = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        strategy: Any = trainer.strategy
        io = strategy.checkpoint_io
        if isinstance(io, VerifiedCheckpointIO):
            # Lightning saves from rank 0 only; a verified save is collective, so every rank hands it over.
            strategy.save_checkpoint = lambda checkpoint, filepath, storage_options=None: io.save_checkpoint(
                checkpoint, filepath, storage_options)
            if _loads_itself(strategy):  # it would read a DCP folder at the path and never ask the plugin
                strategy.load_checkpoint = lambda path, weights_only=None: io.load_sharded(
                    path, strategy.model, [getattr(o, "_optimizer", o) for o in strategy.optimizers])
                if not getattr(strategy, "_save_distributed_checkpoint", True):
                    # Lightning would gather a full state dict on rank 0 and hand the other ranks nothing, and the
                    # restore reads into the live DTensors: the run keeps each rank's shards, as with the default.
                    strategy._save_distributed_checkpoint = True
                    log.info("VerifiedCheckpointIO: save_distributed_checkpoint=False ignored: the run stores "
                             "each rank's shards; `vckpt export` writes one full file")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        problem = _unsupported(trainer, pl_module)
        if problem:
            raise ValueError(f"SDCGuardCallback: {problem} (docs/INTEGRATIONS.md, 'Lightning')")
        strategy: Any = trainer.strategy
        model, opt = strategy.model, trainer.optimizers[0]
        accumulate = trainer.accumulate_grad_batches

        def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
            # What Lightning backpropagates: training_step's loss divided by accumulate_grad_batches.
            if m is pl_module:  # an audit's recompute, on the plain module
                return _loss(pl_module.training_step(batch, 0)) / accumulate
            # Through DDP (a warm-up after a resume), as Lightning itself runs training_step.
            return _loss(strategy._forward_redirection(m, pl_module, "training_step", batch, 0)) / accumulate

        self.guard = guard = guarded_steps(opt, lambda unguarded: SDCGuard(model, unguarded, loss_fn, self.config))
        io = strategy.checkpoint_io
        if isinstance(io, VerifiedCheckpointIO):
            io.attach(guard)
            if io.resumed_from is not None:
                guard.prepare_resume()  # a fresh process: rebuild DDP's bucket layout before the first step
        # Lightning's closure (run by the guarded step) runs training_step, zero_grad and this backward, then its
        # own hooks and clipping; the guard records the backward, and the update happens only if its checks pass.
        # A batch that only accumulates runs its closure directly, under DDP's no_sync: not the step's last.
        backward = strategy.backward

        def guarded_backward(closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            guard.backward_of(closure_loss, sync=not trainer.fit_loop._should_accumulate(),
                              backward=lambda loss: backward(loss, optimizer, *args, **kwargs))
            return closure_loss

        strategy.backward = guarded_backward

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.guard is not None:  # before Lightning's forward of this batch: audits replay it from here
            self.guard.begin(batch, step=trainer.global_step + 1)
