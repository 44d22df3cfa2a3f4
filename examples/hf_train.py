"""A Hugging Face Trainer job with verified checkpoints and the SDC guard at its defaults: GPT-2 (a small config,
default dropout; its blocks are HF's Conv1D layers) on random token sequences of random lengths (labels padded
with -100, so the Trainer's ``num_items_in_batch`` matters), two accumulated microbatches per step.

    torchrun --nproc-per-node 3 examples/hf_train.py --run-url /tmp/hf-run            # train, saving every 4 steps
    torchrun --nproc-per-node 3 examples/hf_train.py --run-url /tmp/hf-run --resume   # continue from the run

``--grad-fault RANK:STEP:FACTOR`` multiplies one rank's gradient of ``transformer.h.0.mlp.c_fc.weight`` at one
step, once (a hook on the parameter, as a faulty GPU would hand back a wrong result); the guard raises, the
incident is recorded, and the job exits 4. ``--story DIR`` runs what the test suite checks in one launch: plain
``Trainer`` and ``VerifiedTrainer`` side by side, a run with a fault at a step that is not an audit step and its
resume from the rollback target, ``load_best_model_at_end`` with ``save_total_limit=1``, and ``torch_compile``;
rank 0 writes ``DIR/story.json`` and the final weights of the uninterrupted run.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import story_cli
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

from verified_ckpt import CheckpointManager, SilentCorruptionDetected, state_fingerprint
from verified_ckpt.integrations.transformers import VerifiedTrainer

SEQ, VOCAB = 16, 64
FAULTY = "transformer.h.0.mlp.c_fc.weight"


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed random token sequences; each one's labels end with a random run of -100 (padding)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.labels = self.ids.clone()
        for row, keep in zip(self.labels, torch.randint(4, SEQ + 1, (n,), generator=g).tolist(), strict=True):
            row[keep:] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def model(layers: int = 2) -> GPT2LMHeadModel:
    set_seed(0)  # the same initial weights on every rank and in every phase
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=layers, n_head=2))


class GradientFault(TrainerCallback):
    """One rank's gradient of ``FAULTY`` multiplied at one step, once: its first microbatch's, never a recomputation."""

    def __init__(self, spec: str) -> None:
        rank, step, factor = spec.split(":")
        self.rank, self.step, self.factor = int(rank), int(step), float(factor)
        self.now, self.fired = 0, False

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        dict(model.named_parameters())[FAULTY].register_hook(self.wrong)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.now = state.global_step + 1

    def wrong(self, g: torch.Tensor) -> torch.Tensor:
        if self.fired or self.now != self.step or int(os.environ.get("RANK", "0")) != self.rank:
            return g
        self.fired = True
        return g * self.factor


def arguments(out: str, steps: int, **extra: Any) -> TrainingArguments:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    extra = {"gradient_accumulation_steps": 2, "save_steps": 4, **extra}
    return TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=steps,
                             save_strategy="steps", learning_rate=1e-3, seed=0, data_seed=0, use_cpu=True,
                             report_to="none", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
                             ddp_find_unused_parameters=False, ddp_backend="gloo" if world > 1 else None, **extra)


def trainer(run: str, out: str, steps: int, fault: str | None = None, layers: int = 2, **extra: Any) -> VerifiedTrainer:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = RandomTokens(4 * world * steps)
    evaluation = {"eval_dataset": RandomTokens(8, seed=1)} if extra.get("eval_strategy") else {}
    return VerifiedTrainer(model=model(layers), args=arguments(out, steps, **extra), train_dataset=data, run=run,
                           callbacks=[GradientFault(fault)] if fault else None, **evaluation)


def history(t: Trainer) -> list[tuple[Any, Any]]:
    return [(h["loss"], h["grad_norm"]) for h in t.state.log_history if "loss" in h]


def story(root: str, steps: int) -> dict[str, Any]:
    """What the test suite checks (see the module docstring). The fault and resume phases run without gradient
    accumulation: HF's own resume is not bit-identical with it (plain ``Trainer`` from ``checkpoint-4`` measured so)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    out: dict[str, Any] = {}
    plain = Trainer(model=model(), args=arguments(os.path.join(root, "out-plain"), steps),
                    train_dataset=RandomTokens(4 * world * steps))
    plain.train()
    out["plain"] = {"history": history(plain), "fingerprint": str(state_fingerprint({"model": plain.model}))}
    verified = trainer(os.path.join(root, "verified"), os.path.join(root, "out-verified"), steps)
    verified.train()
    out["verified"] = {"history": history(verified), "fingerprint": str(state_fingerprint({"model": verified.model}))}
    one = {"gradient_accumulation_steps": 1}
    clean = trainer(os.path.join(root, "clean"), os.path.join(root, "out-clean"), steps, **one)
    clean.train()
    out["clean"] = str(state_fingerprint({"model": clean.model}))
    if int(os.environ.get("RANK", "0")) == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous().clone() for k, v in clean.model.state_dict().items()},
                  os.path.join(root, "clean-final.safetensors"))
    faulty = os.path.join(root, "faulty")
    try:
        trainer(faulty, os.path.join(root, "out-faulty"), steps, fault="1:7:10", **one).train()
        out["caught"] = None
    except SilentCorruptionDetected as e:
        inc = e.incident
        out["caught"] = {"kind": inc.kind, "ranks": list(inc.ranks), "step": inc.detected_step, "detail": inc.detail}
    resumed = trainer(faulty, os.path.join(root, "out-resumed"), steps, **one)
    resumed.train(resume_from_checkpoint=True)
    out["resumed"] = str(state_fingerprint({"model": resumed.model}))
    out["resumed_from"] = resumed.checkpoints.resumed_from if resumed.checkpoints else None
    out["checkpoints"] = [(c.step, c.status.value) for c in CheckpointManager(faulty).list()]
    # The highest eval loss counts as best: the loss falls as it trains, so the best checkpoint is an early one, not
    # the newest, whatever the data - the case retention must get right (it keeps both).
    best = trainer(os.path.join(root, "best"), os.path.join(root, "out-best"), steps, eval_strategy="steps", eval_steps=4,
                   load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True, save_total_limit=1)
    best.train()
    out["best"] = {"step": best.state.best_global_step, "fingerprint": str(state_fingerprint({"model": best.model}))}
    # torch.compile as the Trainer applies it (the DDP model wrapped by dynamo); dynamo's eager backend skips
    # inductor's code generation (~40 s on this host's CPU) and AOT autograd's tracing (8 s more), and changes
    # nothing the guard sees: its hooks meet the same compiled wrapper. One block: dynamo's tracing of the eager
    # graph is most of this phase's time (8.3 CPU-s for two blocks, 5.7 for one).
    compiled = trainer(os.path.join(root, "compiled"), os.path.join(root, "out-compiled"), 4, layers=1, torch_compile=True,
                       torch_compile_backend=os.environ.get("VCKPT_COMPILE_BACKEND", "eager"))
    compiled.train()
    coverage = compiled.guard.coverage() if compiled.guard else None
    out["compiled"] = {"history": history(compiled), "coverage": coverage.summary() if coverage else None}
    return out


def main() -> int:
    torch.set_num_threads(1)
    ap = story_cli.parser(__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--grad-fault", metavar="RANK:STEP:FACTOR", help=f"one rank's wrong gradient of {FAULTY} at one step")
    a = ap.parse_args()
    if a.inject:
        ap.error("--inject is ddp_train.py's guard-side injection; this one takes --grad-fault RANK:STEP:FACTOR")
    return story_cli.run(ap, a, lambda root: story(root, a.steps), lambda out: trainer(
        a.run, out, a.steps, a.grad_fault).train(resume_from_checkpoint=a.resume))


if __name__ == "__main__":
    sys.exit(main())
