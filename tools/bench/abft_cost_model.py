"""The per-step checks' cost on a GPU, predicted from what they do, counted on this CPU.

One plain training step and one guarded step (the default per-step checks: NaN/Inf, ABFT with attention's products;
consensus and audits off) of TinyGPT run under a ``TorchDispatchMode`` that counts every aten op that is not a view
(each is at least one kernel launch on a GPU), the bytes each reads and writes (its tensor arguments and results:
what it moves through memory at most once each), and the matmul FLOPs (``FlopCounterMode``; the CPU's fused attention
by torch's formulas for the CUDA kernels, causal masks not discounted, as torch does not). The counts do not
depend on the device. The prediction for a device of bandwidth ``B``, matmul throughput ``F`` and host time per
op ``h`` (the launch and the Python around it) is the slower of the host and the device:

    T = max(ops_training · h + ops_checks · h_checks, bytes / B + flops / F)

for the plain step and the guarded one; the overhead is their ratio. ``h`` defaults to what the H200 runs measured
(``docs/gpu/h200-2026-12-04-c.json``: the plain d=1024 step's 26.7 ms over its counted ops; a check's op costs the
host 2.78 times a training op, from the guarded step there), ``B`` to 4.8 TB/s and
``F`` to 40 % of the H200's 990 dense bf16 TFLOP/s (fp32 matmuls run as TF32 at half that: pass ``--flops``).

``--one-read`` counts each ``row_stats``, ``project``, ``row_norms``, ``norm_stats`` and ``product_stats`` call as what the
Triton kernels do on CUDA (``guard/abft/rowstats.py``, ``guard/abft/productstats.py``):
one op that reads its tensor once in its own dtype and writes its projections and norms, where this CPU's torch
path takes a product and a norm (two reads, and a float32 copy of a bf16 tensor); and a weight's per-step values
as the GPU takes them (``rowstats.triton_weight_stats``: ``W s``, ``Wᵀ r`` and the column norms in one read of
``W``, where the CPU takes three float32 passes and writes ``W²``).
``--bf16`` runs the steps under
bf16 autocast, as a GPU run would train. The one-process guard copies the gradients into one buffer, which under
DDP is the reducer's bucket, filled in a plain step too: that copy is counted in both steps (``as_ddp``); the
guarded step's in-place scaling of each bucket before its all-reduce, which a plain DDP step fuses into that copy,
is counted in the guarded step (``under_ddp``; one process has none to count).

    .venv/bin/python tools/bench/abft_cost_model.py --d 1024 --layers 12 --batch 8 --context 64 --vocab 8192
    .venv/bin/python tools/bench/abft_cost_model.py --no-products   # as the H200 run c measured it
    .venv/bin/python tools/bench/abft_cost_model.py --d 4096 --layers 1 --batch 4 --context 512 --one-read
    .venv/bin/python tools/bench/abft_cost_model.py --model llama --d 4096 --layers 1 --batch 4 --context 512 --one-read --bf16

``--model llama`` counts Hugging Face's Llama (fused attention, separate projections: the shape trained at d=4096)
where the default TinyGPT computes attention eagerly, so that its scores and probabilities, ``t`` values a head per
token, are read again by the product checks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

import torch
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))

from verified_ckpt import GuardConfig, SDCGuard

VIEWS = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "slice", "select", "unsqueeze",
         "squeeze", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "_reshape_alias",
         "unfold", "diagonal", "view_as_real", "view_as_complex", "lift_fresh"}


class Counts(TorchDispatchMode):
    """Ops that are not views, and the bytes of their tensor arguments and results."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0
        self.bucket = 0  # the gradients' copy into one buffer, which DDP's buckets make in a plain step too (``as_ddp``)
        self.by_op: dict[str, list[int]] = {}  # op -> [count, bytes]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] not in VIEWS:
            self.ops += 1
            seen: set[int] = set()
            moved = 0
            for t in [*_tensors(args), *_tensors(kwargs or {}), *_tensors(out)]:
                key = t.untyped_storage().data_ptr() if t.numel() else id(t)
                if key not in seen:
                    seen.add(key)
                    moved += t.numel() * t.element_size()
            self.bytes += moved
            row = self.by_op.setdefault(func.__name__, [0, 0])
            row[0] += 1
            row[1] += moved
        return out

    def record(self, label: str, read: Any, written: Any) -> None:
        """One op that :func:`one_read` stands in for: the bytes of what it reads and writes."""
        moved = sum(t.numel() * t.element_size() for t in (*read, *written) if isinstance(t, torch.Tensor))
        self.ops += 1
        self.bytes += moved
        row = self.by_op.setdefault(label, [0, 0])
        row[0] += 1
        row[1] += moved


@contextlib.contextmanager
def one_read(record: Any) -> Any:
    """Inside: each ``row_stats``, ``project`` and ``norm_stats`` call counted as one op reading each of its tensors
    once (the Triton kernels'), computed outside the count by the torch path; a weight's column norms as the GPU
    takes them. ``record(label, read, written)`` counts one such op, with the tensors it reads and those it writes
    (:meth:`Counts.record` adds both; ``count_checks.py`` counts what is read)."""
    from unittest import mock

    from torch.utils._python_dispatch import _disable_current_modes

    from verified_ckpt.guard.abft import checks, forward, norms, products, productstats, rowstats, shared, weights

    def kernel(a: torch.Tensor, vecs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with _disable_current_modes():
            proj, norm = rowstats.torch_row_stats(a, vecs)
        record("row_stats (one read)", (a, vecs), (proj, norm))
        return proj, norm

    def norm_kernel(dy: torch.Tensor, x: torch.Tensor, *rest: Any) -> Any:
        with _disable_current_modes():
            got = rowstats.torch_norm_stats(dy, x, *rest)
        record("norm_stats (one read)", (dy, x, *rest), got)  # one read of dY and of X
        return got

    def projected(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel(a, v)[0]  # the same kernel, its norms dropped (``rowstats.project``)

    def normed(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return kernel(a, v)[1]  # the same kernel, its projection dropped (``rowstats.row_norms``)

    def weight_kernel(wo: torch.Tensor, s: torch.Tensor, r: torch.Tensor, ws: torch.Tensor,
                      wr: torch.Tensor | None) -> torch.Tensor:  # ``rowstats.triton_weight_stats``: one read of W
        with _disable_current_modes():
            squares = rowstats.torch_weight_stats(wo, s, r, ws, wr)
        record("weight_stats (one read)", (wo, s, r), (ws, wr, squares))
        return squares

    def product_kernel(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, r: torch.Tensor) -> Any:
        # ``productstats.triton_product_stats``: one read each of C, B and A (B r, a vector, is the third one's)
        with _disable_current_modes():
            cr, abr, an, bn = got = productstats.torch_product_stats(a, b, c, r)
        record("product_stats (one read)", (c, r), (cr,))
        record("product_stats (one read)", (b, r), (bn,))
        record("product_stats (one read)", (a,), (abr, an))
        return got

    # Each name where the module that calls it looks it up
    patches: list[tuple[Any, str, Any]] = [(m, "row_stats", kernel) for m in (checks, forward, norms, shared)]
    patches += [(checks, "project", projected), (norms, "norm_stats", norm_kernel),
                (weights, "weight_stats", weight_kernel),
                (products, "project", projected), (products, "row_norms", normed),
                (products, "product_stats", product_kernel)]
    with contextlib.ExitStack() as stack:
        for module, name, fn in patches:
            stack.enter_context(mock.patch.object(module, name, fn))
        yield


@contextlib.contextmanager
def as_ddp(counts: Counts) -> Any:
    """Inside: the one-process guard's copy of the gradients into one buffer (``GradientTap._flat_of``) taken
    outside the count and its bytes (a read and a write of every gradient) kept apart in ``counts.bucket``: under
    DDP the reducer's bucket is that buffer, a copy the plain step makes too (``main`` adds it to both)."""
    from unittest import mock

    from torch.utils._python_dispatch import _disable_current_modes

    from verified_ckpt.guard.tap import GradientTap

    flat_of = GradientTap._flat_of

    def counted_apart(tap: GradientTap, grads: list[torch.Tensor]) -> torch.Tensor:
        with _disable_current_modes():
            flat = flat_of(tap, grads)
        counts.bucket += 2 * flat.numel() * flat.element_size()
        return flat

    with mock.patch.object(GradientTap, "_flat_of", counted_apart):
        yield


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    if isinstance(x, dict):
        return [t for y in x.values() for t in _tensors(y)]
    return []


# The CPU's fused attention, which torch's FLOP counter does not know (it counts the CUDA kernels' calls): counted
# by the same formulas, so that attention's FLOPs, and the product check's second call, weigh in the prediction
_CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: flop_counter.sdpa_flop.__wrapped__,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_counter.sdpa_backward_flop.__wrapped__,
}


def counted(run: Any, single_read: bool = False) -> tuple[dict[str, float], dict[str, list[int]]]:
    with FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION) as flops, Counts() as c, as_ddp(c), \
            one_read(c.record) if single_read else contextlib.nullcontext():
        run()
    attention = sum(n for op, n in flops.get_flop_counts().get("Global", {}).items() if op in _CPU_ATTENTION)
    # attention's share apart: it grows with the context and the width, the GEMMs' with the width squared
    return {"ops": c.ops, "bytes": c.bytes, "flops": flops.get_total_flops(), "attention_flops": attention,
            "bucket_bytes": c.bucket}, c.by_op


def under_ddp(p: dict[str, float], g: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """The plain and guarded counts as under DDP: the gradients' copy into buckets (``as_ddp``), the guarded step's,
    is the plain step's as much; and the guarded step scales each bucket in place before its all-reduce (a read
    and a write of it: ``tap.py``'s ``mul_``), where DDP without a communication hook fuses the scaling into that
    copy, so the guarded step moves the buckets' bytes once more."""
    return ({**p, "bytes": p["bytes"] + g["bucket_bytes"], "bucket_bytes": g["bucket_bytes"]},
            {**g, "bytes": g["bytes"] + 2 * g["bucket_bytes"]})


def predict(p: dict[str, float], g: dict[str, float], bandwidth: float = 4.8e12, flops: float = 0.4 * 990e12,
            host_per_op: float | None = None) -> dict[str, Any]:
    """The plain step's and the guarded step's predicted times from their :func:`counted` figures, and the overhead
    (``tools/gpu_check.py`` calls it beside its measurement, with the counts it takes on the device)."""
    # Host time per op, from the H200 run c (docs/gpu/h200-2026-12-04-c.json, d=1024, 12 layers, batch 8 x 64): the
    # plain step's 26.7 ms over its 2,252 counted ops, and the guarded step's 41.9 ms more over the 1,271 ops the
    # checks added then (this tool with --no-products: attention's products came after that run). A check's op
    # costs the host 2.78 times a training op: its hooks' Python, and small ops each launched alone.
    h_plain = host_per_op if host_per_op is not None else 26.7e-3 / 2252
    h_added = 2.78 * h_plain if host_per_op is None else host_per_op

    def time_of(c: dict[str, float]) -> dict[str, float]:
        host = p["ops"] * h_plain + (c["ops"] - p["ops"]) * h_added
        device = c["bytes"] / bandwidth + c["flops"] / flops
        return {"host_s": host, "device_s": device, "step_s": max(host, device)}

    tp, tg = time_of(p), time_of(g)
    return {"host_per_op_s": {"training": h_plain, "checks": h_added}, "bandwidth": bandwidth, "flops_per_s": flops,
            "predicted_plain": tp, "predicted_guarded": tg, "predicted_overhead": tg["step_s"] / tp["step_s"] - 1,
            "predicted_overhead_if_device_bound": tg["device_s"] / tp["device_s"] - 1,
            "bound_by": "host (launches)" if tp["host_s"] > tp["device_s"] else "device"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s")
    ap.add_argument("--flops", type=float, default=0.4 * 990e12, help="matmul FLOP/s achieved")
    ap.add_argument("--host-per-op", type=float, default=None, help="seconds of host time per op, training's and the "
                    "checks' alike (default: the H200 runs', training 11.9 us, the checks' 2.78 times that)")
    ap.add_argument("--no-products", action="store_true", help="without attention's product checks (as the H200 "
                    "runs measured)")
    ap.add_argument("--one-read", action="store_true", help="count row_stats as the Triton kernel's one read")
    ap.add_argument("--bf16", action="store_true", help="the steps under bf16 autocast")
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt",
                    help="TinyGPT (eager attention: its scores and probabilities materialised and checked as products) "
                         "or Hugging Face's Llama at its defaults (fused attention, grouped-query heads of 128, "
                         "separate q/k/v and gate/up projections, intermediate 3.5 d: Llama 3's shape at d=4096)")
    args = ap.parse_args()
    import models

    torch.manual_seed(0)

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        if args.model == "llama":
            import transformers as tf

            heads = max(args.d // 128, 1)
            llama: torch.nn.Module = tf.LlamaForCausalLM(tf.LlamaConfig(
                vocab_size=args.vocab, hidden_size=args.d, intermediate_size=7 * args.d // 2,
                num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 1),
                max_position_embeddings=args.context + 1))
            return llama
        return models.TinyGPT(vocab=args.vocab, d=args.d, layers=args.layers, heads=max(args.d // 64, 1),
                              context=args.context)

    def loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            if args.model == "llama":
                got: torch.Tensor = model(input_ids=ids, labels=ids).loss.float()
                return got
            return models.lm_loss(model, ids).float()

    plain, guarded = build(), build()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in (plain, guarded)]
    guard = SDCGuard(guarded, opts[1], loss, GuardConfig(audit_every=None, consensus_every=10**9,
                                                         mode="tolerance" if args.bf16 else "exact"))
    if args.no_products:
        guard.abft.products.on = lambda: False
    batch = torch.randint(0, args.vocab, (args.batch, args.context + 1))

    def plain_step() -> None:
        loss(plain, batch).backward()
        opts[0].step()
        opts[0].zero_grad()

    def guarded_step(s: int) -> None:
        guard.backward(batch, step=s)
        guard.step()
        opts[1].zero_grad()

    plain_step()
    guarded_step(0)  # the first step probes coverage: count a steady one
    (p, p_ops), (g, g_ops) = counted(plain_step), counted(lambda: guarded_step(1), args.one_read)
    p, g = under_ddp(p, g)
    added_by_op = {k: [n - p_ops.get(k, [0, 0])[0], b - p_ops.get(k, [0, 0])[1]] for k, (n, b) in g_ops.items()}
    top = sorted(added_by_op.items(), key=lambda kv: -kv[1][1])[:12]
    pred = predict(p, g, args.bandwidth, args.flops, args.host_per_op)
    print(json.dumps({
        "model": {"kind": args.model, "d": args.d, "layers": args.layers, "batch": args.batch, "context": args.context,
                  "vocab": args.vocab, "params": sum(x.numel() for x in plain.parameters()), "bf16": args.bf16,
                  "row_stats": "one read (the Triton kernel's)" if args.one_read else "this CPU's torch path"},
        "plain": p, "guarded": g, "added": {k: g[k] - p[k] for k in p}, **pred,
        "added_by_op (count, bytes)": dict(top)}, indent=1))


if __name__ == "__main__":
    main()
