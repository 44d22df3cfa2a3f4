"""The at-rest chain's cost per step, side by side with the training step it rides on.

One process, one thread: an MLP of ``--layers`` Linear(d, d) layers trained with AdamW on a ``--batch`` x d
batch. Measured, median of ``--steps`` steps after two warm-up steps:

* the step: forward, backward and ``optimizer.step()``;
* the chain: ``carry()`` before that update and ``after_update()`` after it, over every parameter and its optimizer
  state, as on every rank of two or more (``guard/chain.py``);
* for scale, one consensus fingerprint of the whole state (parameters, ``exp_avg``, ``exp_avg_sq``, ``step``).

It also counts the aten ops the chain dispatches per step (the proxy for GPU launches) and its host syncs
(none: it compares on the device and nothing is read until the step's row is gathered).

    .venv/bin/python tools/bench/bench_rest.py --layers 8 --d 1024 --batch 64 --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from verified_ckpt.guard.chain import StateChain
from verified_ckpt.guard.consensus import state_lanes, state_tensors


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.compute = self.syncs = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.compute += not func.is_view
        self.syncs += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.d, args.d) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    rest = StateChain(lambda: state_tensors(params, opt), torch.device("cpu"))
    x = torch.randn(args.batch, args.d)
    step_s, witness_s, consensus_s = [], [], []
    for i in range(args.steps + 2):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        t1 = time.perf_counter()
        rest.carry()
        rest.after_update()
        t2 = time.perf_counter()
        state_lanes(state_tensors(params, opt), torch.device("cpu"))
        t3 = time.perf_counter()
        if i >= 2:
            step_s.append(t1 - t0)
            witness_s.append(t2 - t1)
            consensus_s.append(t3 - t2)
    with Ops() as ops:
        rest.carry()
        rest.after_update()
    step, witness, consensus = (statistics.median(v) for v in (step_s, witness_s, consensus_s))
    n = sum(p.numel() for p in params)
    print(json.dumps({"params": n, "state_mib": round(sum(t.numel() * t.element_size()
                                                        for t in state_tensors(params, opt)) / 2**20, 1),
                      "step_ms": round(step * 1e3, 2), "witness_ms": round(witness * 1e3, 2),
                      "witness_of_step": round(witness / step, 4), "consensus_ms": round(consensus * 1e3, 2),
                      "witness_ops": ops.compute, "witness_syncs": ops.syncs}))


if __name__ == "__main__":
    main()
