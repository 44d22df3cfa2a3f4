"""``VerifiedTrainer`` with FSDP2 on gloo ranks (run under torchrun by tests/test_hf_fsdp.py), at ``GuardConfig()``.

    hf_fsdp_story.py DIR train    # clean run (fsdp= arguments); extras run; then accelerate's environment, killed
    hf_fsdp_story.py DIR resume   # the killed run resumed through accelerate's environment

``train``: rank 0 writes ``DIR/train.json`` after the clean (30 steps, a save every 10), extras and fault phases, then
the last phase, requested only through ``ACCELERATE_USE_FSDP=true FSDP_VERSION=2`` and with
``gradient_checkpointing=True``, is killed with SIGKILL on rank 1 at step 14 (after the save at 10): the launch ends
there. ``resume``: the same run with ``resume_from_checkpoint=True``, to step 30; rank 0 writes ``DIR/resume.json``.
The model is hf_train's GPT-2 (Conv1D blocks), its blocks and root ``fully_shard``-ed by accelerate's FSDP2 plugin.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from typing import Any

import torch
from transformers import TrainerCallback

from verified_ckpt import CheckpointManager, GuardConfig, SilentCorruptionDetected
from verified_ckpt.integrations.transformers import VerifiedTrainer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))  # torchrun runs it bare
import hf_train
import story_cli

FSDP2 = {"fsdp": "full_shard", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}}
RANK = int(os.environ.get("RANK", "0"))
FAULTY = "transformer.h.0.mlp.c_fc"
STEPS, SAVE_EVERY, KILL_AT = 30, 10, 14
# The killed run: asked for through accelerate's environment only, with activation checkpointing (its recomputed
# forward gives the same bits on CPU, so it must end where the clean run ended).
KILLED = {"gradient_accumulation_steps": 1, "save_steps": SAVE_EVERY, "gradient_checkpointing": True}


class Kill(TrainerCallback):
    """SIGKILL on one rank as the step ``at`` begins: no handler, no flush, as a lost host."""

    def __init__(self, rank: int, at: int) -> None:
        self.rank, self.at = rank, at

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step + 1 == self.at and self.rank == RANK:
            os.kill(os.getpid(), signal.SIGKILL)


class WrongGradient(TrainerCallback):
    """One rank's gradient of ``FAULTY``'s unsharded weight with one element x10, at one step, once (its first
    microbatch's, never an audit's recomputation): hooked in the module's forward, where FSDP2 has gathered it."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step, self.now, self.fired = rank, step, 0, False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        model.get_submodule(FAULTY).register_forward_pre_hook(self.pre)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.now = state.global_step + 1

    def pre(self, module: torch.nn.Module, inputs: Any) -> None:
        if self.fired or self.now != self.step or self.rank != RANK or not torch.is_grad_enabled():
            return
        self.fired = True
        handle = module.weight.register_hook(lambda g: (handle.remove(), self.wrong(g))[1])

    @staticmethod
    def wrong(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g.view(-1)[5] *= 10
        return g


def digest(model: torch.nn.Module) -> str:
    """The full (unsharded) weights' digest, the same on every rank: a collective."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        h.update(name.encode() + full.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trainer(root: str, name: str, steps: int, **extra: Any) -> VerifiedTrainer:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    evaluation = {"eval_dataset": hf_train.RandomTokens(8, seed=1)} if extra.get("eval_strategy") else {}
    callbacks = extra.pop("callbacks", None)
    return VerifiedTrainer(model=hf_train.model(), args=hf_train.arguments(os.path.join(root, f"out-{name}"), steps, **extra),
                           train_dataset=hf_train.RandomTokens(4 * world * steps), run=os.path.join(root, name),
                           callbacks=callbacks, **evaluation)


def sharded(t: VerifiedTrainer) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    layout = type(t.guard.layout).__name__ if t.guard else None
    coverage = t.guard.coverage() if t.guard else None
    return {"fsdp": isinstance(t.model, FSDPModule), "layout": layout,
            "coverage": coverage.summary() if coverage else None,
            "checkpoints": [(c.step, c.status.value) for c in CheckpointManager(t.run_url).list()]}


def train(root: str) -> None:
    one = {"gradient_accumulation_steps": 1}
    out: dict[str, Any] = {}
    clean = trainer(root, "clean", STEPS, **FSDP2, **one, save_steps=SAVE_EVERY)
    clean.train()
    out["clean"] = {**sharded(clean), "digest": digest(clean.model)}
    # Gradient accumulation, activation checkpointing, retention and the best model, in one run.
    extras = trainer(root, "extras", 12, **FSDP2, gradient_checkpointing=True, eval_strategy="steps", eval_steps=4,
                     load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True,
                     save_total_limit=1)
    extras.train()
    best = extras.state.best_global_step
    out["extras"] = {**sharded(extras), "best": best, "digest": digest(extras.model)}
    # What the model ended with, against each kept checkpoint's weights restored into it.
    mgr = CheckpointManager(extras.run_url)
    for info in mgr.list():
        mgr.restore({"model": extras.model}, checkpoint_id=info.id)
        out["extras"][f"digest-{info.step}"] = digest(extras.model)
    # Faults as a faulty GPU would make them, each in a run of its own: a x10 element of rank 1's gradient of
    # c_fc's weight, as autograd computes it at step 3; a bit flipped in rank 1's weight shard after the update
    # of step 2 (verified_ckpt.faults), at rest until step 3 reads it.
    out["faults"] = {}
    # The weight flip again under gradient_checkpointing=True: the at-rest chain reads the state, not the forward.
    for name, fault, spec, more in (("grad", [WrongGradient(1, 3)], (), {}),
                                    ("weights", None, ("weights:1:2:bitflip=30",), {}),
                                    ("weights-gc", None, ("weights:1:2:bitflip=30",), {"gradient_checkpointing": True})):
        faulty = trainer(root, f"faulty-{name}", 4, **FSDP2, **one, **more, callbacks=fault)
        faulty.guard_config = GuardConfig(faults=spec)
        try:
            faulty.train()
            out["faults"][name] = None
        except SilentCorruptionDetected as e:
            inc = e.incident
            out["faults"][name] = {"kind": inc.kind, "ranks": list(inc.ranks), "step": inc.detected_step,
                                    "detail": inc.detail}
    if RANK == 0:
        with open(os.path.join(root, "train.json"), "w") as f:
            json.dump(out, f)
    os.environ.update({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})
    trainer(root, "killed", STEPS, **KILLED, callbacks=[Kill(1, KILL_AT)]).train()


def resume(root: str) -> None:
    os.environ.update({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})
    t = trainer(root, "killed", STEPS, **KILLED)
    t.train(resume_from_checkpoint=True)
    out = {**sharded(t), "digest": digest(t.model), "resumed_from": t.checkpoints.resumed_from if t.checkpoints else None,
           "checkpointing": bool(t.args.gradient_checkpointing), "incidents": len(t.guard.incidents) if t.guard else None}
    if RANK == 0:
        with open(os.path.join(root, "resume.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"train": train, "resume": resume}[sys.argv[2]](sys.argv[1])
    story_cli.leave(0)
