"""A Hugging Face Trainer job with verified checkpoints: GPT-2 (a small config, default dropout) on random tokens.

    torchrun --nproc-per-node 3 examples/hf_train.py --run /tmp/hf-run            # train, saving every 4 steps
    torchrun --nproc-per-node 3 examples/hf_train.py --run /tmp/hf-run --resume   # continue from the run

``--inject SPEC`` injects a fault (``grad:1:8:elem=1000``: rank 1's gradient at step 8); the guard
raises, the incident is recorded, and the job exits 4. ``--story DIR`` runs what the test suite checks,
in one launch: an uninterrupted run, a run with a fault at an audit step, and its resume from the
rollback target, then writes ``DIR/story.json`` (rank 0) and the final weights of the uninterrupted run.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import story_cli
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

from verified_ckpt import CheckpointManager, GuardConfig, SilentCorruptionDetected, state_fingerprint
from verified_ckpt.integrations.transformers import VerifiedTrainer

SEQ, VOCAB = 16, 64


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Fixed random token sequences (the labels are the inputs: causal language modelling)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model() -> GPT2LMHeadModel:
    set_seed(0)  # the same initial weights on every rank and in every phase
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))


def trainer(run: str, out: str, steps: int, faults: list[str], audit_every: int) -> VerifiedTrainer:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=steps, save_strategy="steps",
                             save_steps=4, learning_rate=1e-3, seed=0, data_seed=0, use_cpu=True, report_to="none",
                             logging_steps=1000, disable_tqdm=True, dataloader_num_workers=0, ddp_find_unused_parameters=False,
                             ddp_backend="gloo" if world > 1 else None)
    cfg = GuardConfig(audit_every=audit_every, consensus_every=4, faults=tuple(faults))
    return VerifiedTrainer(model=model(), args=args, train_dataset=RandomTokens(2 * world * steps), run=run,
                           guard_config=cfg)


def story(root: str, steps: int) -> dict[str, Any]:
    """Uninterrupted, then a fault at audit step 8 and a resume: what the test suite checks."""
    clean = trainer(os.path.join(root, "clean"), os.path.join(root, "out-clean"), steps, [], 4)
    clean.train()
    out: dict[str, Any] = {"clean": str(state_fingerprint({"model": clean.model}))}
    if int(os.environ.get("RANK", "0")) == 0:
        from safetensors.torch import save_file

        save_file({k: v.contiguous().clone() for k, v in clean.model.state_dict().items()},
                  os.path.join(root, "clean-final.safetensors"))
    faulty = os.path.join(root, "faulty")
    try:
        trainer(faulty, os.path.join(root, "out-faulty"), steps, ["grad:1:8:elem=1000"], 4).train()
        out["caught"] = None
    except SilentCorruptionDetected as e:
        out["caught"] = {"kind": e.incident.kind, "ranks": list(e.incident.ranks), "step": e.incident.detected_step}
    resumed = trainer(faulty, os.path.join(root, "out-resumed"), steps, [], 4)
    resumed.train(resume_from_checkpoint=True)
    out["resumed"] = str(state_fingerprint({"model": resumed.model}))
    out["resumed_from"] = resumed.checkpoints.resumed_from if resumed.checkpoints else None
    out["checkpoints"] = [(c.step, c.status.value) for c in CheckpointManager(faulty).list()]
    return out


def main() -> int:
    torch.set_num_threads(1)
    ap = story_cli.parser(__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--audit-every", type=int, default=4)
    a = ap.parse_args()
    return story_cli.run(ap, a, lambda root: story(root, a.steps), lambda out: trainer(
        a.run, out, a.steps, a.inject, a.audit_every).train(resume_from_checkpoint=a.resume))


if __name__ == "__main__":
    sys.exit(main())
