"""State fingerprints at GPU-state scale: aten ops dispatched and CPU time, against one flat fingerprint.

The state has the shape of the issue-18 transformer (12 layers, d=1024, AdamW): every parameter, its
``exp_avg`` and ``exp_avg_sq``, and AdamW's ``step`` scalars (--vocab sets the embedding; 8192 gives 160M
parameters, 1.9 GB in fp32). Measures, side by side:

* aten ops dispatched (a ``TorchDispatchMode`` counting every op, and the ops that are not views: views only
  describe memory and launch no kernel) for ``batched_lanes`` over every tensor, for the guard's consensus
  lanes (``state_lanes``), for ``batched_lanes`` with the CUDA policy (which tensors are summed in place
  rather than staged; the proxy for GPU launches) and for the per-tensor path that was there before;
* CPU time of the state fingerprint against ``tensor_lanes`` of one flat tensor of the same bytes, median of
  repeats (target: <= 2x), and the old per-tensor path.

    .venv/bin/python tools/bench/bench_state_fingerprint.py --layers 12 --d 1024 --vocab 8192
    .venv/bin/python tools/bench/bench_state_fingerprint.py --staging   # where the CUDA policy's time goes here

``--staging`` times what the CUDA policy does with the tensors it stages (those below its 32 MiB), on this CPU: one
``_chunk_cat`` into a staging chunk and one sum of it, with chunks of several sizes, each freshly allocated (as
``batched_lanes`` does) or one buffer reused, against summing each of those tensors where it lies.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from verified_ckpt.guard.consensus import state_lanes
from verified_ckpt.lanes import DIRECT_BYTES, batched_lanes, tensor_lanes


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.all = self.compute = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.all += 1
        self.compute += not func.is_view
        return func(*args, **(kwargs or {}))


def count(fn: Callable[[], Any]) -> tuple[int, int]:
    with OpCount() as c:
        fn()
    return c.all, c.compute


def state(layers: int, d: int, vocab: int, seq: int = 1024) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = [(vocab, d), (seq, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes += [(d,), (d,)]
    params = [torch.randn(s, generator=g) for s in shapes]
    # AdamW's state per parameter: a step scalar and two moments (what state_tensors lists after the params).
    return params + [x for p in params for x in (torch.tensor(10.0), torch.randn(p.shape, generator=g),
                                                  torch.rand(p.shape, generator=g))]


def timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--staging", action="store_true", help="time the staging copy by chunk size (see above)")
    args = ap.parse_args()
    tensors = state(args.layers, args.d, args.vocab)
    if args.staging:
        staging(tensors, args.repeats)
        return
    nbytes = sum(t.nbytes for t in tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    print(f"{len(tensors)} tensors, {nbytes / 2**30:.2f} GiB, torch {torch.__version__}, {torch.get_num_threads()} threads")
    per_tensor = lambda: torch.stack([tensor_lanes(t) for t in tensors])  # noqa: E731 - the path before
    cuda_policy = DIRECT_BYTES[1]
    for name, fn in [("lanes of every tensor (batched_lanes, CPU policy)", lambda: batched_lanes(tensors)),
                     ("consensus lanes (state_lanes, CPU policy)", lambda: state_lanes(tensors, torch.device("cpu"))),
                     (f"batched_lanes with the CUDA policy (whole rows >= {cuda_policy >> 20} MiB summed in place)",
                      lambda: batched_lanes(tensors, cuda_policy)),
                     ("before: tensor_lanes per tensor", per_tensor)]:
        n_all, n_compute = count(fn)
        print(f"aten ops, {name}: {n_all} dispatched, {n_compute} not views (target <= 100)")
    one = timed(lambda: tensor_lanes(flat), args.repeats)
    staged = timed(lambda: batched_lanes(tensors, cuda_policy), args.repeats)
    print(f"CPU time, the CUDA policy: {staged * 1e3:.1f} ms = {staged / one:.2f}x one flat fingerprint (target <= 2.5x)")
    batched = timed(lambda: batched_lanes(tensors), args.repeats)
    before = timed(per_tensor, args.repeats)
    print(f"CPU time: one flat fingerprint {one * 1e3:.1f} ms ({nbytes / one / 1e9:.1f} GB/s); state fingerprint "
          f"{batched * 1e3:.1f} ms = {batched / one:.2f}x (target <= 2x); before {before * 1e3:.1f} ms = {before / one:.2f}x")


def staging(tensors: list[torch.Tensor], repeats: int) -> None:
    """The CUDA policy's staged tensors: copied into chunks of each size (fresh or one reused buffer) and summed."""
    staged = [t for t in tensors if t.dim() and t.nbytes < DIRECT_BYTES[1]]
    nbytes = sum(t.nbytes for t in staged)

    def chunks(limit: int) -> list[list[torch.Tensor]]:
        out: list[list[torch.Tensor]] = [[]]
        held = 0
        for t in staged:
            if out[-1] and held + t.nbytes > limit:
                out.append([])
                held = 0
            out[-1].append(t)
            held += t.nbytes
        return out

    def run(limit: int, reuse: bool) -> Callable[[], None]:
        cut = chunks(limit)
        buf = torch.empty(max(sum(t.numel() for t in c) for c in cut)) if reuse else None

        def go() -> None:
            for c in cut:
                n = sum(t.numel() for t in c)
                out = torch._chunk_cat(c, 0, 1, out=buf[:n].view(1, n)) if buf is not None else torch._chunk_cat(c, 0, 1)
                out.view(torch.int64).view(-1, 64).sum(dim=1)
        return go

    print(f"{len(staged)} staged tensors (below {DIRECT_BYTES[1] >> 20} MiB), {nbytes / 2**30:.2f} GiB")
    for limit in (256 << 20, 16 << 20, 1 << 20):
        for reuse in (False, True):
            t = timed(run(limit, reuse), repeats)
            print(f"  chunks of {limit >> 10:>6} KiB ({len(chunks(limit))}), {'one buffer reused' if reuse else 'fresh':17}: "
                  f"{t * 1e3:7.1f} ms, {nbytes / t / 1e9:5.1f} GB/s")
    t = timed(lambda: [t.reshape(-1).view(torch.int64).view(-1, 64).sum(dim=1) for t in staged], repeats)
    print(f"  each summed where it lies: {t * 1e3:7.1f} ms, {nbytes / t / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
