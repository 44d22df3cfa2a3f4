"""``tools/gpu_check.py``'s ``guard_cost`` section: what the default guard costs a device-bound step, what the cost
model predicted for it, and how fast the one-read row statistics run against ``torch.sum``.

For each width (d=2048 and d=4096 on a GPU; tiny ones with ``--small``), one process:

* ``steps``: a TinyGPT (``examples/models.py``: written-out attention, dropout 0.1, tied head) in bf16 autocast,
  AdamW, a batch that keeps the device, not the host, busy (a plain step of about 50-100 ms on an H100).
  Plain steps against the default guard (``GuardConfig()``: forward checks, consensus and audits at the budget's
  schedule), the same without the forward checks, and without ABFT; each variant its own model from one seed,
  steps interleaved one by one, the figure the median of per-step ratios against the plain step beside it. The
  guard's own estimate (its budget's logged "expected overhead") is recorded beside the measurement.
* ``predicted``: the cost model (``tools/bench/abft_cost_model.py``) from one plain and one guarded step counted
  on the device (ops that are not views, their bytes, matmul FLOPs: the counts do not depend on the device), at
  the device's nominal bandwidth, at the bandwidth ``torch.sum`` measured below, and at an H200's (``on_h200``).
* ``kernel``: ``row_stats`` (``verified_ckpt/guard/abft/rowstats.py``: a Triton kernel on CUDA) with 2 vectors on a
  ``[tokens, d]`` bf16 activation and on a 1 GiB one, against ``torch.sum`` of the same tensor and the torch
  fallback, in GB/s of the tensor's bytes; and its largest difference from the torch fallback. Where the module
  does not import, the JSON says so and the rest runs. Beside it, the weights' kernel (``weights``) and an eager
  attention's product check (``products``: ``productstats.triton_product_stats`` on ``q kᵀ``), each against its
  torch path.

Budget on an H100: about 30-60 s a width (model builds on the device, 16 interleaved steps of 4 variants, 2
counted steps, the kernel's first compile). Each width stops its steps at ``cap_s`` / number of widths (at least
3 taken), and a width that runs out of device memory or raises (an incident on clean steps is a finding) is
recorded as such, not raised.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_guard import train_step  # tools/bench: on the path where gpu_check imports this module

from verified_ckpt import GuardConfig, SDCGuard

# (d, layers, batch, context, vocab): 219 M and 438 M parameters, 24,576 and 12,288 tokens a step, about 32 TFLOP
# each (6 x params x tokens), plus the written-out attention's passes over its [b, h, t, t] scores: a plain step of
# 50-100 ms on an H100 (its bf16 GEMMs ran at about 800 TFLOP/s on 8192-cubes, less on these), device-bound.
GPU_SHAPES = [(2048, 4, 48, 512, 8192), (4096, 2, 24, 512, 8192)]
SMALL_SHAPES = [(32, 1, 2, 16, 64), (64, 1, 2, 16, 64)]
# Nominal HBM bandwidth (bytes/s) by device name; the cost model's matmul rate stays its default (40 % of 990 TF/s).
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}
VARIANTS: dict[str, GuardConfig | None] = {"plain": None, "default": GuardConfig(),
                                           "no_forward": GuardConfig(abft_forward=False),
                                           "no_abft": GuardConfig(abft=False)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def guard_cost(device: torch.device, small: bool, cap_s: float) -> dict[str, Any]:
    """The section's JSON: one row per width (see the module docstring)."""
    shapes = SMALL_SHAPES if small else GPU_SHAPES
    rows = []
    for shape in shapes:
        deadline = time.monotonic() + cap_s / len(shapes)
        try:
            rows.append(one_width(device, shape, steps=4 if small else 16, deadline=deadline))
        except Exception as e:  # out of memory, or an incident on clean steps (a finding): recorded
            rows.append({"d": shape[0], "error": f"{type(e).__name__}: {str(e)[:300]}"})
        gc.collect()  # a guard and its model hold each other through hooks: free the width before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"widths": rows, "kernel_module": _row_stats_note()}


def one_width(device: torch.device, shape: tuple[int, int, int, int, int], steps: int,
              deadline: float) -> dict[str, Any]:
    from models import TinyGPT, lm_loss

    d, layers, batch, context, vocab = shape

    def loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return lm_loss(m, b)  # type: ignore[no-any-return]

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    runs: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer, SDCGuard | None]] = {}
    for name, cfg in VARIANTS.items():
        torch.manual_seed(0)
        with device:  # built where it trains: a CPU init of 400 M parameters would take longer than the steps
            m = TinyGPT(vocab=vocab, d=d, layers=layers, heads=max(d // 64, 1), context=context)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        runs[name] = (m, opt, SDCGuard(m, opt, loss, cfg) if cfg is not None else None)
    ids = torch.randint(0, vocab, (batch, context + 1), device=device)

    def one(s: int, m: torch.nn.Module, opt: torch.optim.Optimizer, guard: SDCGuard | None) -> None:
        train_step(m, opt, guard, ids, s, loss)

    times: dict[str, list[float]] = {name: [] for name in runs}
    capped = False
    for s in range(steps):  # interleaved, so drift in clocks and caches hits every variant alike
        if s >= 3 and time.monotonic() > deadline:
            capped = True
            break
        for name, run in runs.items():
            sync(device)
            t0 = time.perf_counter()
            one(s, *run)
            sync(device)
            times[name].append(time.perf_counter() - t0)
    warm = 1 if len(times["plain"]) < 4 else 2  # the first steps probe coverage and compile
    plain = times["plain"][warm:]
    over = {name: statistics.median(a / b for a, b in zip(t[warm:], plain, strict=True)) - 1
            for name, t in times.items() if name != "plain"}
    guard = runs["default"][2]
    rates = getattr(getattr(getattr(guard, "sched", None), "budget", None), "rates", None)
    row: dict[str, Any] = {
        "d": d, "layers": layers, "batch": batch, "context": context, "vocab": vocab, "tokens": batch * context,
        "params": sum(p.numel() for p in runs["plain"][0].parameters()), "timed_steps": len(plain), "capped": capped,
        "plain_s": statistics.median(plain), "overhead": over["default"], "overhead_no_forward": over["no_forward"],
        "overhead_no_abft": over["no_abft"],
        "guard_expected_overhead": rates.expected_overhead if rates is not None else None,
        "guard_schedule": rates.summary() if rates is not None else None,
        "abft_passed": guard.checks["abft"].passed if guard is not None else None,
    }
    row["kernel"] = _kept(lambda: kernel_bandwidth(device, batch * context, d, big=device.type == "cuda"))
    row["predicted"] = _kept(lambda: prediction(device, lambda: one(steps, *runs["plain"]),
                                                lambda: one(steps, *runs["default"]), row["kernel"].get("sum_gb_s")))
    if device.type == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def _kept(part: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``part()``, or its error: a kernel timing that runs out of memory must not lose the steps measured before it."""
    try:
        return part()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def prediction(device: torch.device, plain: Callable[[], None], guarded: Callable[[], None],
               sum_gb_s: float | None) -> dict[str, Any]:
    """The cost model's overhead for the steps just measured, from one of each counted on this device, as under DDP
    (``under_ddp``): the steps measured here run in one process, where the guard copies the gradients into one
    buffer and scales nothing; under DDP the copy is the reducer's in both steps and the guarded one scales each
    bucket instead, the same bytes added."""
    from abft_cost_model import counted, predict, under_ddp

    p, g = under_ddp(counted(plain)[0], counted(guarded)[0])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    nominal = next((bw for key, bw in NOMINAL_BANDWIDTH.items() if key in name), 4.8e12)
    out = {"plain": p, "guarded": g, "nominal_bandwidth": nominal,
           **_short(predict(p, g, bandwidth=nominal))}
    if sum_gb_s:
        out["at_measured_sum_bandwidth"] = _short(predict(p, g, bandwidth=sum_gb_s * 1e9))
    out["on_h200"] = _short(predict(p, g, bandwidth=NOMINAL_BANDWIDTH["H200"]))  # issue 51's target is an H200's
    return out


def _short(pred: dict[str, Any]) -> dict[str, Any]:
    keys = ("predicted_overhead", "predicted_overhead_if_device_bound", "bound_by", "predicted_plain",
            "predicted_guarded", "bandwidth")
    return {k: pred[k] for k in keys}


def kernel_bandwidth(device: torch.device, tokens: int, d: int, big: bool) -> dict[str, Any]:
    """``row_stats`` with 2 vectors against ``torch.sum`` on ``[tokens, d]`` bf16 (and a 1 GiB tensor if ``big``);
    ``torch.sum`` alone where ``row_stats`` does not import (the cost model still takes its bandwidth)."""
    rs = _row_stats()
    out: dict[str, Any] = {"vectors": 2} | ({} if rs is not None else {"skipped": _row_stats_note()})
    shapes = {"step": (tokens, d)} | ({"1GiB": ((1 << 29) // d, d)} if big else {})
    for label, (n, w) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, w, device=device, generator=g).to(torch.bfloat16)
        vecs = torch.randn(2, w, device=device, generator=g)
        t_sum = _loop_time(a.sum, device)
        out[label] = {"rows": n, "d": w, "bytes": a.nbytes, "sum_gb_s": a.nbytes / t_sum / 1e9,
                      **(_row_stats_timed(*rs, a, vecs, device, t_sum) if rs is not None else {})}
    out["sum_gb_s"] = out.get("1GiB", out["step"])["sum_gb_s"]  # the cost model's B: the larger tensor's
    out["weights"] = _weights_timed(device, d)
    out["products"] = _products_timed(device, tokens, d)
    return out


def _products_timed(device: torch.device, tokens: int, d: int) -> dict[str, Any]:
    """An eager attention's ``q kᵀ`` in bf16 (heads of 128, 512 tokens each, ``q`` and ``k`` transposed views of
    ``[b, t, h, 128]``): the check's statistics by the one-read kernels (``productstats.triton_product_stats``, CUDA
    only) against the torch path, in GB/s of the three tensors' bytes, and the largest relative difference."""
    try:
        from verified_ckpt.guard.abft.productstats import torch_product_stats, triton_product_stats
    except ImportError:
        return {"skipped": "no productstats on this head"}
    g = torch.Generator(device=device).manual_seed(2)
    b, h, t = max(tokens // 512, 1), max(d // 128, 1), 512
    q = torch.randn(b, t, h, 128, device=device, generator=g).to(torch.bfloat16).transpose(1, 2)
    kt = torch.randn(b, t, h, 128, device=device, generator=g).to(torch.bfloat16).transpose(1, 2).transpose(-2, -1)
    scores = q @ kt
    r = torch.randn(t, device=device, generator=g)
    nbytes = q.nbytes + kt.nbytes + scores.nbytes
    out: dict[str, Any] = {"q": list(q.shape), "bytes": nbytes,
                           "torch_gb_s": nbytes / _loop_time(lambda: torch_product_stats(q, kt, scores, r), device) / 1e9}
    if device.type != "cuda":
        return out | {"product_stats": "not run: a CPU tensor"}
    try:
        got = triton_product_stats(q, kt, scores, r)
    except Exception as e:  # a kernel that does not compile here: say so, keep the rest
        return out | {"error": f"triton_product_stats failed: {str(e)[:200]}"}
    diff = max(float(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item())
               for x, y in zip(got, torch_product_stats(q, kt, scores, r), strict=True))
    kernel_s = _loop_time(lambda: triton_product_stats(q, kt, scores, r), device)
    return out | {"product_stats_gb_s": nbytes / kernel_s / 1e9, "max_rel_diff_vs_torch": diff}


def _weights_timed(device: torch.device, d: int) -> dict[str, Any]:
    """A ``[4d, d]`` bf16 weight's per-step values (``W s``, ``Wᵀ r``, the column squares): the one-read kernel
    (``rowstats.triton_weight_stats``, CUDA only) against the torch path's three float32 passes, in GB/s of the
    weight's bytes, and the kernel's largest relative difference from the torch path."""
    try:
        from verified_ckpt.guard.abft.rowstats import torch_weight_stats, triton_weight_stats, weight_kernel_for
    except ImportError:
        return {"skipped": "no triton_weight_stats on this head"}
    g = torch.Generator(device=device).manual_seed(1)
    w = torch.randn(4 * d, d, device=device, generator=g).to(torch.bfloat16)
    s, r = torch.randn(d, device=device, generator=g), torch.randn(4 * d, device=device, generator=g)

    want_ws, want_wr = torch.empty(4 * d, device=device), torch.empty(d, device=device)

    def torch_path() -> torch.Tensor:
        return torch_weight_stats(w, s, r, want_ws, want_wr)

    out: dict[str, Any] = {"shape": list(w.shape), "bytes": w.nbytes,
                           "torch_gb_s": w.nbytes / _loop_time(torch_path, device) / 1e9}
    if not weight_kernel_for(w):
        return out | {"weight_stats": "not run: a CPU tensor, or Triton does not import"}
    ws, wr = torch.empty(4 * d, device=device), torch.empty(d, device=device)
    try:
        squares = triton_weight_stats(w, s, r, ws, wr)
    except Exception as e:  # a kernel that does not compile here: say so, keep the rest
        return out | {"error": f"triton_weight_stats failed: {str(e)[:200]}"}
    diff = max(float(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
               for a, b in zip((ws, wr, squares), (want_ws, want_wr, torch_path()), strict=True))
    kernel_s = _loop_time(lambda: triton_weight_stats(w, s, r, ws, wr), device)
    return out | {"weight_stats_gb_s": w.nbytes / kernel_s / 1e9, "max_rel_diff_vs_torch": diff}


def _row_stats_timed(row_stats: Callable[..., Any], torch_row_stats: Callable[..., Any], a: torch.Tensor,
                     vecs: torch.Tensor, device: torch.device, t_sum: float) -> dict[str, Any]:
    try:
        proj, norms = row_stats(a, vecs)
        ref_proj, _ = torch_row_stats(a, vecs)
    except Exception as e:  # an interface that moved, a kernel that does not compile: say so, time the rest
        return {"error": f"row_stats(a{list(a.shape)} bf16, vecs{list(vecs.shape)} float32) failed: {str(e)[:200]}"}
    scale = (norms.max() * vecs.norm(dim=1).max()).clamp_min(1e-30)
    sec = {"row_stats": _loop_time(lambda: row_stats(a, vecs), device),
           "torch_row_stats": _loop_time(lambda: torch_row_stats(a, vecs), device)}
    return {**{f"{k}_gb_s": a.nbytes / t / 1e9 for k, t in sec.items()}, "row_stats_over_sum": sec["row_stats"] / t_sum,
            "max_rel_diff_vs_torch": float(((proj - ref_proj).abs().max() / scale).item())}


def _loop_time(fn: Callable[[], Any], device: torch.device, calls: int = 20) -> float:
    """Seconds a call, over ``calls`` back to back behind one sync: a 64 MB read takes ~20 µs on an H100, about a
    launch and a sync, so each call timed alone would measure the host."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / calls


def _row_stats() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    try:
        from verified_ckpt.guard.abft.rowstats import row_stats, torch_row_stats
    except ImportError:
        return None
    return row_stats, torch_row_stats


def _row_stats_note() -> str:
    if _row_stats() is None:
        return "skipped: verified_ckpt.guard.abft.rowstats does not import on this head (no row_stats to time)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "row_stats present; triton does not import here, so CUDA runs its torch fallback"
    return "row_stats present; triton imports (its kernel runs on CUDA tensors, the torch path on CPU ones)"
