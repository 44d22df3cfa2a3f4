"""Hugging Face ``Trainer`` with verified checkpoints and the SDC guard: swap ``Trainer`` for ``VerifiedTrainer``.

What changes against a plain ``Trainer``, and why a subclass rather than a ``TrainerCallback``: a
callback can neither withhold an optimizer update nor change how a checkpoint is written and read.

- Every backward runs through :class:`~verified_ckpt.SDCGuard` (``training_step``), and the Trainer's
  ``optimizer.step()`` becomes ``guard.step()``: the checks run first, and the update is applied only if
  they pass. A failed check raises :class:`~verified_ckpt.SilentCorruptionDetected` out of ``train()``
  on every rank, with the incident already recorded under the run.
- Saves (``save_steps`` / ``save_strategy``) go through :class:`~verified_ckpt.CheckpointManager` at the
  run URL instead of ``output_dir/checkpoint-N``: the model, optimizer, scheduler, every rank's RNG,
  the Trainer's state and the model's ``config.json``. Step N is the state after N optimizer updates,
  as in HF's ``checkpoint-N``, so ``vckpt export --format hf`` gives what ``save_pretrained`` would.
- ``train(resume_from_checkpoint=True)`` continues through ``CheckpointManager.resume``: the rollback
  target after an incident (recording the rollback), otherwise the newest restorable checkpoint, a
  fresh start when there is none. Skipping the batches already seen and re-seeding the RNG follow
  HF's own resume, so a resumed run ends bit-identical to one that never stopped (on deterministic
  kernels).

What keeps it a drop-in: the loss and gradients are the Trainer's own (``compute_loss`` with
``num_items_in_batch``, the same scaling for gradient accumulation, ``accelerator.backward``), so a clean run
ends with the weights plain ``Trainer`` gives; ``save_total_limit`` is retention (``keep_last``), which never
deletes the best checkpoint or the rollback target; ``load_best_model_at_end`` restores the best *restorable*
checkpoint (never an unverified or suspect one); ``torch_compile`` compiles the DDP model as usual, and the
guard hooks what it wraps.

FSDP2 (``fsdp="full_shard"`` with ``fsdp_config={"version": 2}``, or accelerate's ``ACCELERATE_USE_FSDP=true
FSDP_VERSION=2``): accelerate ``fully_shard``-s the model, and the guard is built on that model, so it composes
the sharded layout (guard/fsdp.py); saves hold the DTensor shards. A resume chooses its checkpoint and restores the
Trainer's state before ``train()`` reads it, and the sharded rest of the same checkpoint once the model is sharded.

Refused at construction, with what to use instead (docs/INTEGRATIONS.md): DeepSpeed, FSDP1, an FSDP request
accelerate would drop (it would train without sharding), ``fp16`` (a ``GradScaler`` skips overflow steps, which
the guard would see as NaN/Inf: use ``bf16``), DataParallel (several GPUs in one process), LOMO optimizers (the
update happens inside the backward, where no check can withhold it), ``past_index`` (audits would overwrite the
Trainer's cached memories), ``push_to_hub`` (nothing is written to ``output_dir/checkpoint-N``: push a
``vckpt export --format hf`` folder) and ``save_only_model`` (a verified checkpoint is for resuming). It overrides
``Trainer`` methods that are not public API, so the supported ``transformers`` range is pinned in the
``transformers`` extra.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState

from .. import CheckpointManager, CheckpointNotRestorable, GuardConfig, RNGState, SDCGuard
from ..checkpoint.export import CONFIG_ENTRY, MODEL_ENTRY  # what `vckpt export --format hf` reads
from .stepping import guarded_steps

log = logging.getLogger("verified_ckpt")

__all__ = ["CONFIG_ENTRY", "MODEL_ENTRY", "VerifiedTrainer"]



class _TrainerState:
    """The Trainer's own state (global step, epoch, log history, callback states) as one JSON text."""

    def __init__(self, trainer: Trainer | None = None) -> None:
        self.trainer = trainer
        self.text = ""

    def state_dict(self) -> dict[str, Any]:
        if self.trainer is None:
            return {"json": self.text}
        t = self.trainer
        # As Trainer._save_checkpoint does: stateful callbacks (early stopping, ...) resume where they were.
        callbacks: list[Any] = [*t.callback_handler.callbacks, t.control]
        states: Any = t.state.stateful_callbacks  # a dict at run time (typed as a list upstream)
        for cb in [c for c in callbacks if isinstance(c, ExportableState)]:
            name = type(cb).__name__
            if isinstance(states.get(name), list):
                states[name].append(cb.state())
            else:
                states[name] = cb.state()
        return {"json": json.dumps(dataclasses.asdict(t.state), sort_keys=True)}  # what TrainerState.save_to_json writes

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.text = str(sd["json"])


@dataclasses.dataclass(frozen=True)
class _Resumed:
    checkpoint_id: str
    rng: dict[str, Any]  # the restored generators, applied again where HF applies its own
    folder: str  # holds trainer_state.json for HF's resume bookkeeping (steps, epoch, data skipping)


class VerifiedTrainer(Trainer):
    """A ``transformers.Trainer`` whose saves are verified checkpoints and whose steps are guarded.

    Args:
        run: the run URL (any fsspec URL) checkpoints are saved to and resumed from.
        storage_options: fsspec options for ``run``.
        guard_config: the guard's :class:`~verified_ckpt.GuardConfig` (default: the defaults).
        keep_last: retention, as for ``CheckpointManager``.
        *args, **kwargs: what ``Trainer`` takes.
    """

    def __init__(self, *args: Any, run: str, storage_options: dict[str, Any] | None = None,
                 guard_config: GuardConfig | None = None, keep_last: int | None = None, **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        problem = _unsupported(training_args) if training_args is not None else None
        if problem:  # before Trainer's own set-up (which may already reach the Hub, or build DeepSpeed)
            raise ValueError(f"VerifiedTrainer: {problem} (docs/INTEGRATIONS.md, 'Hugging Face Trainer')")
        super().__init__(*args, **kwargs)
        self._fsdp2 = self._require_fsdp2() if fsdp_request(self.args, os.environ) else False
        limit = self.args.save_total_limit
        if keep_last is not None and limit is not None and keep_last != limit:
            raise ValueError(f"VerifiedTrainer: keep_last={keep_last} and save_total_limit={limit} disagree; "
                             "give one of them (save_total_limit is the run's retention)")
        self.run_url, self.storage_options = run, storage_options
        self.keep_last = keep_last if keep_last is not None else limit
        self.guard_config = guard_config or GuardConfig()
        self.guard: SDCGuard | None = None
        self.checkpoints: CheckpointManager | None = None
        self._resumed: _Resumed | None = None
        self._best: str | None = None  # the checkpoint id of the best step, pinned against retention

    def _require_fsdp2(self) -> bool:
        """FSDP2 as asked for, or a refusal: never DDP in its place. Accelerate enables FSDP only on accelerators and
        drops the plugin without a word on CPU (gloo), where ``fully_shard`` runs all the same: there it is enabled
        here, as accelerate would on a GPU."""
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = self.accelerator.state
        if not self.is_fsdp_enabled and state.distributed_type is DistributedType.MULTI_CPU:
            plugin = self.args.fsdp_plugin_args if self.args.fsdp else None
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**(plugin or {}))
            state.distributed_type = DistributedType.FSDP
            self.is_fsdp_enabled = True
        version = getattr(getattr(state, "fsdp_plugin", None), "fsdp_version", None)
        if not self.is_fsdp_enabled or version != 2:
            raise ValueError(f"VerifiedTrainer: FSDP2 was asked for, but accelerate set up {state.distributed_type} "
                             f"(FSDP version {version}), which would train without FSDP2's sharding; launch with "
                             "torchrun or accelerate on one process per device (docs/INTEGRATIONS.md)")
        return True

    # ---------------------------------------------------------------- resume
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """``Trainer.train``; ``resume_from_checkpoint=True`` continues from the run (see the module doc)."""
        if resume_from_checkpoint not in (None, False, True):
            raise ValueError("VerifiedTrainer resumes from its run, not from a folder: pass resume_from_checkpoint=True "
                             "(`vckpt export --format hf` makes a folder HF tools load)")
        self._resumed = self._resume() if resume_from_checkpoint else None
        try:
            return super().train(resume_from_checkpoint=self._resumed.folder if self._resumed else None, **kwargs)
        finally:
            if self._resumed is not None:
                shutil.rmtree(self._resumed.folder, ignore_errors=True)

    def _resume(self) -> _Resumed | None:
        holder = _TrainerState()
        mgr = CheckpointManager(self.run_url, storage_options=self.storage_options)
        if self._fsdp2:
            # The sharded state fits only the model fully_shard makes inside train(): here resume() chooses (and
            # records any rollback) and restores the Trainer's state, which train() reads before it shards the
            # model; the rest of the same checkpoint is restored once it is sharded (_install_guard).
            mgr.resume({"trainer_state": holder})
        else:
            # resume() restores the whole state at once, so the optimizer and scheduler must exist before train()
            # would create them; the scheduler is marked as not the Trainer's, or train() would replace it.
            max_steps = self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]
            self.create_optimizer_and_scheduler(num_training_steps=max_steps)
            self._created_lr_scheduler = False
            mgr.resume(self._state(holder))
        if mgr.resumed_from is None:
            return None  # nothing to continue from: a fresh start (resume() logged it)
        folder = tempfile.mkdtemp(prefix="vckpt-hf-resume-")
        with open(os.path.join(folder, TRAINER_STATE_NAME), "w") as f:
            f.write(holder.text)
        return _Resumed(mgr.resumed_from, RNGState().state_dict(), folder)

    # What HF would read from checkpoint-N: already restored, verified, by resume().
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._resumed is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._resumed is None:
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._resumed is None:
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._resumed is None:
            super()._load_rng_state(checkpoint)
        else:  # where HF re-seeds, after skipping the batches already trained on
            RNGState().load_state_dict(self._resumed.rng)

    # ------------------------------------------------------------- training
    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        prepare: Any = super()._prepare_for_training  # not typed upstream
        model, train_dataloader = prepare(max_steps, train_dataloader, resume_from_checkpoint)
        self._install_guard(model)
        return model, train_dataloader

    def _install_guard(self, model: torch.nn.Module) -> None:
        # The Trainer's loop calls optimizer.step() after clipping: from now on that is guard.step(), which applies
        # the Trainer's own step (Accelerate's, and the scheduler's step counter) only if every check passed.
        self.guard = guard = guarded_steps(self.optimizer, lambda opt: SDCGuard(model, opt, self._loss_of,
                                                                                 self.guard_config))
        self.checkpoints = CheckpointManager(self.run_url, storage_options=self.storage_options,
                                             keep_last=self.keep_last, guard=guard)
        if self._resumed is not None and self._fsdp2:  # the sharded state of the checkpoint resume() chose
            self.checkpoints.restore(self._state(_TrainerState()), checkpoint_id=self._resumed.checkpoint_id)
            self._resumed = dataclasses.replace(self._resumed, rng=RNGState().state_dict())
        elif self._resumed is not None:
            self.checkpoints.resumed_from = self._resumed.checkpoint_id  # the lineage continues from it
            guard.prepare_resume()

    def _loss_of(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """The loss ``Trainer.training_step`` backpropagates, from what ``training_step`` recorded: the same call of
        ``compute_loss`` (with ``num_items_in_batch``) and the same scaling for gradient accumulation. Audits
        recompute it on other ranks from the owner's record, so it must depend on nothing else."""
        n = batch["num_items_in_batch"]
        with self.compute_loss_context_manager():
            # A copy: compute_loss may pop labels, and the guard keeps the batch for audits.
            loss: Any = self.compute_loss(model, dict(batch["inputs"]), num_items_in_batch=n)
        if self.args.n_gpu > 1:
            loss = loss.mean()
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and n is not None) or self.compute_loss_func is not None
        return torch.as_tensor(loss if scaled else loss / self.current_gradient_accumulation_steps)

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """``Trainer.training_step`` through the guard: the batch is recorded for audits before the forward, and the
        backward is the Accelerator's, inside the guard."""
        if self.guard is None:
            return super().training_step(model, inputs, num_items_in_batch)
        cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)
        with cp_context():
            model.train()
            train = getattr(self.optimizer, "train", None)
            if callable(train):  # schedule-free optimizers switch modes
                train()
            batch = {"inputs": self._prepare_inputs(inputs), "num_items_in_batch": num_items_in_batch}
            self.guard.begin(batch, step=self.state.global_step + 1)
            loss = self._loss_of(model, batch)
            every = self.args.torch_empty_cache_steps
            if every is not None and self.state.global_step % every == 0:
                from accelerate.utils.memory import clear_device_cache

                clear_device_cache()
            return self.guard.backward_of(loss, sync=self.accelerator.sync_gradients, backward=self.accelerator.backward)

    # ---------------------------------------------------------------- saving
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.checkpoints is None:
            super()._save_checkpoint(model, trial)
            return
        self.store_flos()
        self.checkpoints.save(self.state.global_step, self._state(_TrainerState(self)))
        best = self.state.best_global_step
        if best:  # what HF's best-model bookkeeping points at: the best step's checkpoint, kept by retention
            self.state.best_model_checkpoint = f"{self.run_url} (step {best})"
            info = next((c for c in reversed(self.checkpoints.list()) if c.step == best), None)
            if info is not None and info.id != self._best:
                self.checkpoints.pinned.discard(self._best or "")  # no longer the best: retention may take it
                self.checkpoints.pinned.add(info.id)
                self._best = info.id

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the model's weights from the best step's checkpoint, if it is restorable."""
        if self.checkpoints is None or not self.state.best_global_step:
            super()._load_best_model()
            return
        step = self.state.best_global_step
        try:
            self.checkpoints.restore({MODEL_ENTRY: self.model}, step=step)
        except CheckpointNotRestorable as e:
            log.warning("load_best_model_at_end: the best checkpoint (step %d) is not restorable (%s); the model "
                        "stays as trained to the end", step, e)

    def _state(self, trainer_state: _TrainerState) -> dict[str, Any]:
        config = getattr(self.model, "config", None)
        return {MODEL_ENTRY: self.model, "optim": self.optimizer, "sched": self.lr_scheduler, "rng": RNGState(),
                "trainer_state": trainer_state,
                CONFIG_ENTRY: config.to_json_string() if config is not None else None}


def _unsupported(a: Any, env: Mapping[str, str] | None = None) -> str | None:
    """Why the ``TrainingArguments`` ``a`` (and accelerate's launcher environment ``env``, default ``os.environ``)
    ask for something the guard or the verified checkpoints cannot honour (``None``: all fine); every option is
    either honoured or refused here, never silently ignored."""
    env = os.environ if env is None else env
    if a.deepspeed or _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        return f"DeepSpeed is not supported (the guard steps the optimizer itself); use FSDP2: {_FSDP2}"
    version = fsdp_request(a, env)
    if version is not None and version != 2:
        return f"FSDP{version} is not supported (the guard observes FSDP2's sharded layout); use FSDP2: {_FSDP2}"
    if a.fp16:
        return "fp16=True scales the loss and skips overflow steps, which the guard would see as NaN/Inf; use bf16=True"
    if a.n_gpu > 1:
        return f"DataParallel over {a.n_gpu} GPUs in one process is not supported; launch one process per GPU (torchrun)"
    if str(getattr(a.optim, "value", a.optim)) in ("lomo", "adalomo"):
        return f"optim={a.optim} updates the weights inside the backward, where no check can withhold the update"
    if getattr(a, "past_index", -1) >= 0:
        return "past_index keeps the model's memories on the Trainer, which an audit's recomputation would overwrite"
    if a.push_to_hub:
        return ("push_to_hub pushes output_dir/checkpoint-N folders, which verified saves do not write; push a "
                "`vckpt export RUN --format hf --to DIR` folder instead")
    if a.save_only_model:
        return "save_only_model=True: a verified checkpoint is for resuming; export weights with `vckpt export --format hf`"
    return None


_FSDP2 = "fsdp='full_shard' with fsdp_config={'version': 2}, or FSDP_VERSION=2 with accelerate's launcher"


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "false").strip().lower() in ("1", "true", "yes", "on")


def fsdp_request(a: Any, env: Mapping[str, str]) -> int | None:
    """The FSDP version the arguments ``a`` or accelerate's environment ask for (``None``: no FSDP). The arguments
    win, as in the Trainer; accelerate's own default version, without ``FSDP_VERSION``, is 1."""
    if a.fsdp:
        return int((a.fsdp_config or {}).get("version", 2))
    if _flag(env, "ACCELERATE_USE_FSDP"):
        return int(env.get("FSDP_VERSION", "1"))
    return None
