"""What the per-step checks cost, counted: aten ops dispatched and bytes read per step, against the bytes they check.

Machine-independent (issue 51): no clock is read, only what a ``TorchDispatchMode`` sees. One gloo rank (world 1):
DDP still buckets the gradients and the guard's communication hook runs. Even with one rank a bucket's all-reduce
has not always completed when the hook attaches its callback, which then runs on gloo's thread, out of a
thread-local mode's sight (the after-all-reduce projection came and went from run to run): the counter follows
every ``Future.then`` callback started inside it onto whatever thread runs it. The per-step checks run the same
code on every rank; what a larger world adds (the gather's size, the peers' oracle slices) is not counted here.

For each configuration the same model is built afresh (the same seed and batch), trained ``--warmup`` steps
(coverage probe, optimizer state, DDP's rebuilt buckets), then ``--steps`` steps under the counter; figures are
per step, the guarded run's minus the plain run's:

* **ops**: every aten op dispatched, split into *views* (``is_view``, in-place view ops, ``_unsafe_view``:
  metadata, no kernel) and *compute* ops (the rest: each a kernel launch on a GPU, allocations included);
* **bytes read**: for each compute op, the sum of ``nbytes`` of its tensor inputs (in lists too; not ``out=``),
  except ``copy_`` (its source only), ``fill_``/``zero_`` and the ``*_like``/``new_*`` factories (nothing: they
  read shapes). Views read nothing. ``nbytes`` is the logical size, so an expanded (stride 0) input counts every
  element, and an op that reads its input twice internally counts it once, as does a tensor passed twice
  (``dot(x, x)``; counted twice before 2026-12-06's fifth turn of issue 51);
* **checked bytes**: what the checks check, measured on a separate plain copy with this tool's own hooks (sizes
  only, so the counted plain run carries no hooks), defined here and not by the guard under test, so before and
  after divide by the same figure: every parameter's gradient (once per parameter, tied ones once); and, when
  ABFT is on, for every call of a Linear-like layer (``nn.Linear``, Hugging Face's ``Conv1D``), ``nn.Embedding``
  (its indices as X) and normalisation layer (``nn.LayerNorm``, ``nn.RMSNorm``, classes named ``*RMSNorm``) its
  input X and its output's gradient dY, plus its output Y for Linear-like layers under ``abft_forward``; and for
  attention's products inside the forward (``matmul``/``bmm`` of 3-d or larger tensors: A, B and C;
  ``scaled_dot_product_attention``: q, k, v and the output). The guard's own coverage line is printed beside it.
  The last column divides by these plus each Linear-like layer's share of its input's gradient (``dX``, X's
  shape), which the input-gradient check reads too (it predates issue 51; the definition above left it out).

``--one-read`` counts each row statistic the way the Triton kernels take it on CUDA (``abft_cost_model.one_read``:
one op reading each of its tensors once, in place of the CPU path's product and norm): the GPU path's bytes by
design, on this CPU.

Not counted: ops on threads other than this one and the callbacks' (C++ ``then`` callbacks: plain DDP's own
reducer), Python work between ops and Python-level calls that dispatch no aten op (a ``TorchFunctionMode``'s
interceptions: the host-bound cost of small models, of which ops are only a proxy), the scheduled checks
(consensus rounds and audits are set off by default: the budget schedules them from measured times, which is not
machine-independent; ``--scheduled`` keeps ``GuardConfig``'s own schedule, and then whatever it runs in the
counted steps is counted), and the step's gather between ranks beyond what one rank dispatches.

Each figure names the commit of the ``verified_ckpt`` it imported (``+dirty``: that tree had uncommitted changes
under ``verified_ckpt/``).

    .venv/bin/python tools/bench/count_checks.py
    .venv/bin/python tools/bench/count_checks.py --models gpt --steps 5 --json out.json
    .venv/bin/python tools/bench/count_checks.py --one-read                     # the Triton path's design
    PYTHONPATH=/tmp/wt_count .venv/bin/python tools/bench/count_checks.py   # another commit's guard (a worktree)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from abft_cost_model import one_read
from bench_guard import build, loss_fn, train_step
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import verified_ckpt
from verified_ckpt import GuardConfig, SDCGuard

aten = torch.ops.aten
_METADATA = {aten._unsafe_view, aten._reshape_alias}  # views in all but their schema's alias annotation
_READS_NOTHING = {aten.fill_, aten.zero_, aten.empty_like, aten.zeros_like, aten.ones_like, aten.full_like,
                  aten.rand_like, aten.randn_like, aten.new_empty, aten.new_empty_strided, aten.new_zeros,
                  aten.new_ones, aten.new_full, aten.set_, aten.resize_}
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}


def is_view(func: Any) -> bool:
    return bool(func.is_view) or torch.Tag.inplace_view in func.tags or func.overloadpacket in _METADATA


def bytes_read(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """What one compute op reads: its tensor inputs' bytes (the module doc's rule)."""
    packet = func.overloadpacket
    if packet in _READS_NOTHING:
        return 0
    if packet is aten.copy_:
        args = args[1:]  # ``self`` is written, not read
    inputs = tree_leaves((args, {k: v for k, v in kwargs.items() if k != "out"}))
    # One tensor passed twice (``dot(x, x)``) is read once; distinct views of one storage are distinct bytes
    seen = {(t.data_ptr(), t.nbytes, t.stride()): t.nbytes for t in inputs if isinstance(t, torch.Tensor)}
    return sum(seen.values())


class Counted(TorchDispatchMode):
    """Counts the aten ops dispatched inside it and the bytes they read, in total and by op, on this thread and in
    the ``Future.then`` callbacks started inside it wherever they run.

    A dispatch mode is thread-local, and even with one gloo rank a bucket's all-reduce has not always completed
    when the guard's hook attaches its callback, which then runs on gloo's thread: counted on the calling thread
    alone, the after-all-reduce projection came and went from run to run."""

    def __init__(self, follow: bool = True) -> None:
        super().__init__()
        self.views = self.compute = self.bytes = self.syncs = 0
        self.ops: collections.Counter[str] = collections.Counter()
        self.op_bytes: collections.Counter[str] = collections.Counter()
        self.callbacks_elsewhere = 0  # callbacks that ran on another thread (counted there)
        self._lock = threading.Lock()
        self._follow, self._thread, self._then = follow, 0, torch._C.Future.then

    def __enter__(self) -> Counted:
        self._thread = threading.get_ident()
        if self._follow:
            then, wrap = self._then, self._wrap
            # The C class: ``torch.futures.Future.then`` (and c10d's futures, which are the C class) call it.
            torch._C.Future.then = lambda fut, callback: then(fut, wrap(callback))  # type: ignore[method-assign]
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        if self._follow:
            torch._C.Future.then = self._then  # type: ignore[method-assign]
        super().__exit__(*exc)

    def _wrap(self, callback: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def run(fut: Any) -> Any:
            if threading.get_ident() == self._thread:  # inline: this thread's mode sees it already
                return callback(fut)
            with Counted(follow=False) as there:
                out = callback(fut)
            self._add(there.views, there.compute, there.bytes, there.syncs, there.ops, there.op_bytes)
            with self._lock:
                self.callbacks_elsewhere += 1
            return out
        return run

    def _add(self, views: int, compute: int, nbytes: int, syncs: int, ops: collections.Counter[str],
             op_bytes: collections.Counter[str]) -> None:
        with self._lock:
            self.views += views
            self.compute += compute
            self.bytes += nbytes
            self.syncs += syncs
            self.ops.update(ops)
            self.op_bytes.update(op_bytes)

    def kernel(self, label: str, read: Any, _written: Any) -> None:
        """One call of a Triton kernel that ``--one-read`` stands in for (``abft_cost_model.one_read``): one op that
        reads each of its tensors once."""
        n = sum(t.nbytes for t in read if isinstance(t, torch.Tensor))
        self._add(0, 1, n, 0, collections.Counter({label: 1}), collections.Counter({label: n}))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if is_view(func):
            self._add(1, 0, 0, 0, collections.Counter(), collections.Counter())
        else:
            n, name = bytes_read(func, args, kwargs), func.overloadpacket.__name__
            self._add(0, 1, n, int(func is aten._local_scalar_dense.default), collections.Counter({name: 1}),
                      collections.Counter({name: n}))
        return func(*args, **kwargs)


def _nbytes(t: Any) -> int:
    return t.nbytes if isinstance(t, torch.Tensor) else 0


def _kind(mod: torch.nn.Module) -> str | None:
    """Which part of the checked bytes a module's calls add to (this tool's own list, the module doc's)."""
    t = type(mod)
    if isinstance(mod, torch.nn.Linear) and t.forward is torch.nn.Linear.forward:
        return "gemm"
    if t.__name__ == "Conv1D" and t.__module__ == "transformers.pytorch_utils":
        return "gemm"
    if isinstance(mod, torch.nn.Embedding):
        return "embedding"
    if isinstance(mod, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or t.__name__.endswith("RMSNorm"):
        return "norm"
    return None


class Products(TorchFunctionMode):
    """Bytes of attention's products in a forward: inputs and output of each batched matmul and fused SDPA."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if not torch.is_grad_enabled():
            return out
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if func in _MATMULS and len(tensors) >= 2 and tensors[0].dim() >= 3 and tensors[1].dim() >= 3:
            self.bytes += tensors[0].nbytes + tensors[1].nbytes + _nbytes(out)
            self.count += 1
        elif func is F.scaled_dot_product_attention:
            self.bytes += sum(t.nbytes for t in tensors[:3]) + _nbytes(out)
            self.count += 1
        return out


def checked_bytes(model: torch.nn.Module, batch: Any) -> dict[str, int]:
    """One step's checked bytes, by part, measured with hooks on ``model`` (a plain copy, never the counted one)."""
    sizes: collections.Counter[str] = collections.Counter()
    sizes["grads"] = sum(p.nbytes for p in model.parameters() if p.requires_grad)

    def hook(kind: str) -> Callable[..., None]:
        def forward(_mod: torch.nn.Module, args: tuple[Any, ...], out: Any) -> None:
            sizes[f"{kind}_x"] += _nbytes(args[0]) if args else 0
            if kind == "gemm" and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                sizes["gemm_dx"] += args[0].nbytes  # this layer's own share of its input's gradient, X's shape
            if isinstance(out, torch.Tensor):
                sizes[f"{kind}_y"] += out.nbytes
                sizes[f"{kind}_calls"] += 1
                if out.requires_grad:
                    out.register_hook(lambda g: sizes.update({f"{kind}_dy": g.nbytes}) or None)
        return forward

    handles = [m.register_forward_hook(hook(k)) for m in model.modules() if (k := _kind(m)) is not None]
    products = Products()
    with products:
        loss = loss_fn(model, batch)
    loss.backward()
    for h in handles:
        h.remove()
    sizes["products"], sizes["product_calls"] = products.bytes, products.count
    return dict(sizes)


def denominator(sizes: dict[str, int], cfg: GuardConfig | None, inputs: bool = False) -> int:
    """The checked bytes of one step under ``cfg`` (the module doc's definition); ``inputs``: with the Linear-like
    layers' input-gradient shares too (``dX``, which the input-gradient check reads; the definition kept for
    comparison with earlier figures leaves them out)."""
    if cfg is None or not cfg.abft:
        return sizes["grads"]
    parts = [f"{k}_{p}" for k in ("gemm", "embedding", "norm") for p in ("x", "dy")]
    if cfg.abft_forward:
        parts.append("gemm_y")
    if inputs:
        parts.append("gemm_dx")
    return sizes["grads"] + sizes["products"] + sum(sizes.get(p, 0) for p in parts)


@dataclasses.dataclass
class Count:
    """One configuration's counted steps, per step."""

    views: float
    compute: float
    bytes: float
    syncs: float
    ops: dict[str, float]
    op_bytes: dict[str, float]
    elsewhere: float  # the guard's callbacks that ran on gloo's thread (counted there)


def count(args: argparse.Namespace, batch: Any, cfg: GuardConfig | None) -> tuple[Count, str | None]:
    """Per-step counts of ``args.steps`` steps after ``args.warmup``, and the guard's coverage line."""
    model = DDP(build(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    guard = SDCGuard(model, opt, loss_fn, cfg) if cfg is not None else None
    for step in range(1, args.warmup + 1):
        train_step(model, opt, guard, batch, step)
    with Counted() as c, one_read(c.kernel) if args.one_read else contextlib.nullcontext():
        for step in range(args.warmup + 1, args.warmup + args.steps + 1):
            train_step(model, opt, guard, batch, step)
    n = args.steps
    abft = getattr(guard, "abft", None)
    coverage = abft.coverage().summary() if abft is not None else None
    return Count(c.views / n, c.compute / n, c.bytes / n, c.syncs / n, {k: v / n for k, v in c.ops.items()},
                 {k: v / n for k, v in c.op_bytes.items()}, c.callbacks_elsewhere / n), coverage


def provenance() -> str:
    """The commit of the ``verified_ckpt`` imported, ``+dirty`` if its tree had uncommitted changes there."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(verified_ckpt.__file__)))

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", root, *a], capture_output=True, text=True, check=False).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--", "verified_ckpt") else "") + f" ({root})"


def configs(scheduled: bool) -> dict[str, GuardConfig | None]:
    off: dict[str, Any] = {} if scheduled else {"consensus_every": 10**9, "audit_every": None}
    return {"plain DDP": None, "GuardConfig()": GuardConfig(**off),
            "abft_forward=True": GuardConfig(abft_forward=True, **off), "abft=False": GuardConfig(abft=False, **off)}


def run_model(args: argparse.Namespace) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    tag = torch.ones(()) if args.model.startswith("hf-") else torch.zeros(())  # bench_guard's loss tag
    batch = (torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=g), tag)
    torch.manual_seed(0)
    sizes = checked_bytes(build(args), batch)
    rows: dict[str, Any] = {}
    plain: Count | None = None
    for name, cfg in configs(args.scheduled).items():
        torch.manual_seed(0)
        got, coverage = count(args, batch, cfg)
        if plain is None:
            plain = got
        ops = collections.Counter(got.ops)
        ops.subtract(plain.ops)
        by_bytes = collections.Counter(got.op_bytes)
        by_bytes.subtract(plain.op_bytes)
        added_bytes, checked, with_dx = got.bytes - plain.bytes, denominator(sizes, cfg), denominator(sizes, cfg, True)
        rows[name] = {"abft": cfg.abft if cfg else None, "abft_forward": cfg.abft_forward if cfg else None,
                      "views": got.views, "compute": got.compute, "bytes_read": got.bytes, "syncs": got.syncs,
                      "callbacks_on_gloo_thread": got.elsewhere,
                      "added_views": got.views - plain.views, "added_compute": got.compute - plain.compute,
                      "added_bytes_read": added_bytes, "checked_bytes": checked,
                      "ratio": added_bytes / checked if cfg is not None else None,
                      "checked_bytes_with_dx": with_dx, "ratio_with_dx": added_bytes / with_dx if cfg is not None else None,
                      "coverage": coverage,
                      "added_ops": {k: v for k, v in ops.most_common() if v},
                      "added_bytes": {k: v for k, v in by_bytes.most_common() if v}}
    return {"model": args.model, "d_model": args.d_model, "depth": args.depth, "batch": args.batch,
            "context": args.context, "vocab": args.vocab, "params": sum(p.numel() for p in build(args).parameters()),
            "checked_sizes": sizes, "configs": rows}


def show(res: dict[str, Any], top: int) -> None:
    mb = 1e6
    s = res["checked_sizes"]
    print(f"{res['model']} d={res['d_model']} x{res['depth']}, batch {res['batch']} x {res['context']} tokens, "
          f"{res['params'] / 1e6:.2f} M params; checked bytes: grads {s['grads'] / mb:.2f} MB, layers' X+dY "
          f"{sum(s.get(f'{k}_{p}', 0) for k in ('gemm', 'embedding', 'norm') for p in ('x', 'dy')) / mb:.2f} MB, "
          f"Linear-like Y {s.get('gemm_y', 0) / mb:.2f} MB, attention products {s['products'] / mb:.2f} MB "
          f"({s['product_calls']} calls); Linear-like dX {s.get('gemm_dx', 0) / mb:.2f} MB (in the last column)")
    print(f"  {'config':<20} {'ops/step':>9} {'views':>7} {'+compute':>9} {'+views':>7} {'+MB read':>9} "
          f"{'checked MB':>10} {'ratio':>6} {'with dX':>7}")
    for name, r in res["configs"].items():
        ratio = "" if r["ratio"] is None else f"{r['ratio']:6.2f} {r['ratio_with_dx']:7.2f}"
        added = ("" if r["ratio"] is None else
                 f"{r['added_compute']:9.1f} {r['added_views']:7.1f} {r['added_bytes_read'] / mb:9.2f} "
                 f"{r['checked_bytes'] / mb:10.2f} {ratio}")
        print(f"  {name:<20} {r['compute']:9.1f} {r['views']:7.1f} {added}")
    if top:
        for name, r in res["configs"].items():
            if r["ratio"] is not None:
                most = list(r["added_bytes"].items())[:top]
                print(f"    {name}: most added bytes read " + ", ".join(f"{k} {v / mb:+.1f} MB" for k, v in most))
                print(f"      coverage: {r['coverage']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,hf-llama", help="comma-separated: gpt (TinyGPT), hf-llama, hf-gpt2")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--scheduled", action="store_true", help="keep GuardConfig's scheduled consensus and audits")
    ap.add_argument("--one-read", action="store_true",
                    help="count the row statistics as the Triton kernels take them on CUDA (the path's design)")
    ap.add_argument("--top", type=int, default=6, help="the ops each configuration adds most, in the table's notes")
    ap.add_argument("--json", dest="json_out", default=None, help="write the figures to this file")
    args = ap.parse_args()
    args.width = 0  # bench_guard.build's MLP width: unused by the language models
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            results = []
            for model in args.models.split(","):
                results.append(run_model(argparse.Namespace(**{**vars(args), "model": model})))
        finally:
            dist.destroy_process_group()
    out = {"verified_ckpt": provenance(), "torch": torch.__version__, "world": 1, "warmup": args.warmup,
           "steps": args.steps, "scheduled": args.scheduled, "one_read": args.one_read, "results": results,
           "wall_s": round(time.perf_counter() - t0, 1)}
    print(f"verified_ckpt {out['verified_ckpt']}, torch {out['torch']}, 1 gloo rank, per step over {args.steps} "
          f"steps after {args.warmup}; '+': guarded minus plain; ratio: +bytes read / checked bytes"
          + ("; row statistics counted as the Triton kernels' one read (--one-read)" if args.one_read else ""))
    for res in results:
        show(res, args.top)
    print(f"({out['wall_s']} s)", file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
