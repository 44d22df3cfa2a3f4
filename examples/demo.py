"""The `make demo` story on the embedded default store (a local directory).

1. Train a small model, saving a checkpoint every few steps with CheckpointManager.
2. `vckpt list` and `vckpt verify` the run from a shell.
3. Flip one byte of the newest shard on disk: `vckpt verify` catches it and marks it corrupt.
4. Restore the newest checkpoint that is still intact and show that training
   resumed from it matches an uninterrupted run bit for bit.

Without an SDCGuard (single process) saves are `unverified`, so the restore
passes allow_unverified=True; the DDP demo makes them `restorable`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import torch

from verified_ckpt import CheckpointManager, CheckpointNotRestorable, RNGState, state_fingerprint

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = os.environ.get("VCKPT_DEMO_RUN") or os.path.join(tempfile.gettempdir(), "vckpt-demo-run")


def build(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)
    return {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "data": {"step": 0}}


def train_step(s: dict) -> float:
    x = torch.randn(32, 16)
    y = x[:, :4].sum(dim=1, keepdim=True).repeat(1, 4)
    loss = torch.nn.functional.mse_loss(s["model"](x), y)
    loss.backward()
    s["optim"].step()
    s["optim"].zero_grad()
    s["sched"].step()
    s["data"]["step"] += 1
    return loss.item()


def vckpt(*args: str) -> int:
    exe = os.path.join(os.path.dirname(sys.executable), "vckpt")
    print(f"\n$ vckpt {' '.join(args)}", flush=True)
    return subprocess.run([exe, *args]).returncode


def main() -> None:
    shutil.rmtree(RUN, ignore_errors=True)
    mgr = CheckpointManager(RUN)
    state = build()
    for step in range(1, 31):
        loss = train_step(state)
        if step % 10 == 0:
            info = mgr.save(step, state)
            print(f"step {step:3d}  loss {loss:.4f}  saved {info.id} ({info.status})")
    reference = build()
    for _ in range(40):
        train_step(reference)
    vckpt("list", RUN)
    vckpt("verify", RUN)

    newest = mgr.list()[-1]
    shard = os.path.join(RUN, "checkpoints", newest.id, newest.manifest.shards[0].path)
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x04]))
    print(f"\nflipped one bit in {shard}")
    code = vckpt("verify", RUN, "--step", str(newest.step))
    print(f"(exit code {code}: a check failed)")
    try:
        mgr.restore(build(1), step=newest.step, allow_unverified=True)
    except CheckpointNotRestorable as e:
        print(f"\nrestore of step {newest.step} refused: {e}")

    resumed = build(seed=123)
    info = mgr.restore(resumed, allow_unverified=True)
    print(f"\nrestored {info.id} (step {info.step}); continuing to step 40")
    while resumed["data"]["step"] < 40:
        train_step(resumed)
    a = state_fingerprint({"model": resumed["model"], "optim": resumed["optim"]})
    b = state_fingerprint({"model": reference["model"], "optim": reference["optim"]})
    print(f"final fingerprint, resumed run:        {a}")
    print(f"final fingerprint, uninterrupted run:  {b}")
    print("bitwise identical" if a == b else "MISMATCH")
    sys.exit(0 if a == b else 1)


if __name__ == "__main__":
    main()
