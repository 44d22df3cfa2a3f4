"""Small builders shared by tests: a deterministic model and training state, free ports, torchrun, op counts, and a
child process that runs Triton kernels under its interpreter."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from verified_ckpt import RNGState


class TinyLM(torch.nn.Module):
    """Embedding and output projection tied, like real language models."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.mid = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.out = torch.nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("counter", torch.zeros(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(torch.relu(self.mid(self.emb(x)))))


def trained_state(seed: int = 0, steps: int = 3) -> dict:
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        x = torch.randint(0, 32, (4, 5))
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 32), x.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        model.counter += 1
    return {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "data": {"position": 1234, "epoch": 2}}


def fresh_state(seed: int = 99) -> dict:
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return {"model": model, "optim": opt, "sched": sched, "rng": RNGState(), "data": None}


def flip_byte(fs, path: str, offset: int) -> None:
    """Flip every bit of one byte of a stored object, going through fsspec directly (not the code under test)."""
    data = bytearray(fs.cat_file(path))
    data[offset] ^= 0xFF
    fs.pipe_file(path, bytes(data))


def resealed(doc: dict) -> dict:
    """A manifest document a test edited, sealed again as its writer would seal it: the state fingerprint and (schema 2)
    the digest recomputed, so that the check the test is about, not the manifest's own, is what meets the edit."""
    from verified_ckpt.manifest import DIGEST_FIELD, TensorEntry, body_digest, state_fingerprint_of

    tensors = {n: TensorEntry(t["dtype"], t["shape"], t["shard"], t["fingerprint"]) for n, t in doc["tensors"].items()}
    doc = {**doc, "state_fingerprint": str(state_fingerprint_of(tensors, doc["state"]))}
    return doc if doc.get("schema_version") == 1 else {**doc, DIGEST_FIELD: body_digest(doc)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(script: str, nproc: int, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``script`` under ``torchrun`` with ``nproc`` ranks on loopback, one thread each; output captured."""
    from dist_harness import cores

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), script, *args]
    with cores(nproc):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})


def interpreted(expression: str, timeout: float = 50) -> dict:
    """The JSON that ``expression`` (Python, run from ``tests/``) gives in a child process with ``TRITON_INTERPRET=1``:
    ``triton.jit`` reads the variable when it defines a kernel, and a kernel this process defined first (on a GPU, by
    an earlier test) would stay compiled."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", f"import json; print(json.dumps({expression}))"], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=os.path.dirname(os.path.abspath(__file__)), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    return got


class Kernels(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: ``n`` those that are not views (views describe memory and launch
    no kernel), ``dispatched`` every one (each costs the host a dispatch), ``syncs`` the reads of a device value
    into Python (``.item()`` and its kin: on a GPU, each waits for the device)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = self.dispatched = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not func.is_view
        self.dispatched += 1
        self.syncs += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))
