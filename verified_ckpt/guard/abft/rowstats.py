"""One read of an activation for every row statistic ABFT takes of it: its projections on a few vectors and its
row norms.

The hooks need, of the layer input ``X``, ``X s`` (the weight check) and ``X (Wᵀ r)`` (the forward check); of the
output ``Y``, ``Y r``; of the output's gradient ``dY``, ``dY (W s)`` and ``dY r``; and of each, the row norms their
bounds are built on. :func:`row_stats` returns all of one tensor's in one pass over it:
``proj[j] = a.float() @ vecs[j]`` and ``norms = ‖a_n‖`` unfloored: the hooks record them and the step's batched
checks floor all of a step's at once after joining them (``sums.floored``: one op a step, not one a call).

* On CUDA, where Triton imports: one kernel (:func:`triton_row_stats`) reads ``a`` once, in tiles of rows by
  columns, in its own dtype (bf16/fp16 are upcast in registers: no float32 copy of ``a``), accumulating the
  ``c`` products and the sum of squares in float32; the ragged edges are masked (nothing past a row's end or the
  last row is read). The products are elementwise multiplies summed per row, not ``tl.dot``: ``c`` is at most 8,
  under a tensor core's smallest tile, and the interpreter's bf16 ``tl.dot`` is wrong.
* Elsewhere: one float32 copy where ``a`` is not float32, then ``mm(vecs, a32ᵀ)`` and the row norms (one vector:
  ``mv``). Measured on this project's 2-core CPU (torch 2.13, 2 threads, float32 ``a``, best of 9, µs for
  c = 1 / 2 / 3; the row norms alone for comparison):

      n x d          mm(vecs[c,d], aᵀ)   c x mv             mm(a, cols[d,c])    row norms
      512 x 256      7 / 6 / 7           6 / 13 / 19        6 / 21 / 19         10
      4096 x 256     58 / 58 / 60        56 / 95 / 172      49 / 152 / 147      62
      4096 x 1024    328 / 329 / 335     335 / 663 / 1019   322 / 648 / 650     345
      16384 x 512    634 / 631 / 648     634 / 1279 / 1900  610 / 1340 / 1307   640

  so the vectors are rows (``[c, d]``, contiguous) and the product is taken as ``vecs @ aᵀ``: one pass over ``a``
  whatever ``c``, for the cost of one ``mv`` (the other orientation, ``a @ cols``, is the skinny GEMM the
  ``Projector`` doc in ``guard/stats.py`` measured slower than separate ``mv``). ``proj`` comes back as ``[c, n]``:
  each projection a contiguous vector. The norm stays a pass of its own (2 on a CPU, against 3 to 4 before).

Triton is imported on the first CUDA call, never at ``import verified_ckpt`` (where it is installed, torch's own
``torch.utils.flop_counter``, which ``flops`` imports, loads it with the guard: about 0.1 s, not this module's).
Under ``TRITON_INTERPRET=1`` (set before that first call: the kernel is defined then) :func:`triton_row_stats`
also runs on CPU tensors; that is how the tests run it. Rounding order differs from the torch path's, so
thresholds are calibrated on a device.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from .sums import scalar_on
from .tiles import BLOCK_D, BLOCK_N, needed, pow2, triton_module

__all__ = ["MAX_VECTORS", "NormRows", "norm_stats", "project", "row_norms", "row_stats", "rows_of", "torch_norm_stats",
           "torch_row_stats", "torch_weight_stats", "triton_norm_stats", "triton_row_stats", "triton_weight_stats",
           "weight_kernel_for", "weight_stats"]

# The most projections one read returns (the kernel keeps one float32 column per vector): a layer's two, or
# those of up to four layers that read one input (``shared.py``: attention's q, k and v)
MAX_VECTORS = 8
_W_BLOCK_N = 32  # a weight's rows per program (``triton_weight_stats``): its partial sums are 1/16 of W's float32 bytes


def row_stats(a: torch.Tensor, vecs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(proj float32[c, n], norms float32[n])`` of a 2-D ``a`` (``n`` rows of ``d``, any float dtype, rows may
    be strided) and float32 ``vecs[c, d]`` (c in 1..8, rows may be strided): ``proj[j] = a.float() @ vecs[j]``,
    ``norms`` the rows' norms, not floored (``sums.floored`` after the step's are joined); one vector ``vecs[d]``
    gives ``proj[n]``. One read of ``a``: a Triton kernel on
    CUDA, the torch ops elsewhere."""
    if a.is_cuda and triton_module() is not None:
        return triton_row_stats(a, vecs)
    return torch_row_stats(a, vecs)


def project(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``a.float() @ v`` (float32 ``[n]``) of a 2-D ``a`` and a float32 ``v[d]``, where no row norm is wanted (the
    input-gradient check's ``dX s``): on CUDA the kernel's one read of ``a`` in its own dtype (its norms, taken in
    registers, are dropped: a bf16 ``dX`` is not copied to float32 first), elsewhere ``mv`` alone."""
    if a.is_cuda and triton_module() is not None:
        return triton_row_stats(a, v)[0]
    return torch.mv(a if a.dtype == torch.float32 else a.float(), v)


def row_norms(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 ``‖a_n‖`` of a 2-D ``a`` (``v``: any float32 vector of its width), where no projection is wanted
    (attention's ``q`` and ``k``): on CUDA the kernel's one read in ``a``'s own dtype (its projection on ``v``,
    taken in registers, is dropped), elsewhere the norm alone."""
    if a.is_cuda and triton_module() is not None:
        return triton_row_stats(a, v)[1]
    norms: torch.Tensor = torch.linalg.vector_norm(a if a.dtype == torch.float32 else a.float(), dim=1)
    return norms


def rows_of(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``t``'s rows (over its last dimension) as a 2-D tensor, and what puts a per-row result ``[n]`` back in
    ``t``'s leading shape (a view). The rows are a view, not a copy, wherever the leading dimensions, taken in
    the order of their strides, lie evenly in memory: attention's ``[b, h, t, d]`` tensors are mostly transposed
    views of ``[b, t, h, d]``, which flattening in their logical order copies (a float32 copy of a bf16 output
    and then a second one, 18 bytes moved an element, where the rows' one read is 2)."""
    strides = t.stride()
    lead = sorted(range(t.dim() - 1), key=lambda i: -strides[i])
    laid = t.permute(*lead, t.dim() - 1)
    try:
        rows = laid.view(-1, t.shape[-1])
    except RuntimeError:  # not evenly laid out: one copy
        rows = laid.reshape(-1, t.shape[-1])
    inverse = sorted(range(len(lead)), key=lambda i: lead[i])
    shape = laid.shape[:-1]
    return rows, lambda per_row: per_row.view(shape).permute(*inverse)


# A normalisation layer's rows (``norm_stats``): dY·v_β, ‖dY‖, (dY ⊙ X̂)·v_γ, ‖dY ⊙ X̂‖ (None: no such parameter)
NormRows = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def norm_stats(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor | None,
               vg: torch.Tensor | None, vb: torch.Tensor | None, eps: float = 0.0) -> NormRows:
    """A normalisation layer's per-row statistics (``norms.record``) from its output's gradient ``dy`` (2-D, any
    float dtype) and its input rows ``x`` (float32, as the forward hook kept them), ``X̂_n = (x_n - mean_n) ·
    rstd_n`` (``mean`` None: an RMSNorm; both ``[n]`` or ``[n, 1]``): ``dY_n · vb`` (its shift's rows, None without
    ``vb``), ``‖dY_n‖``, ``(dY_n ⊙ X̂_n) · vg`` and ``‖dY_n ⊙ X̂_n‖`` (its scale's, None without ``vg``); norms
    unfloored. ``rstd`` None (an RMSNorm's, ``mean`` None too): ``(‖x_n‖² / d + eps)^-½``, taken here from the
    read of ``x`` the scale's rows make anyway, so that the forward need not read ``x`` for it. On CUDA one kernel
    reads ``dy`` and ``x`` once each and forms ``X̂`` and the product in registers; the torch path reads ``dy``
    twice and writes the product."""
    if rstd is None and mean is not None:
        raise ValueError("norm_stats takes a LayerNorm's rows with their rstd: only an RMSNorm's is taken here")
    if dy.is_cuda and triton_module() is not None:
        return triton_norm_stats(dy, x, mean, rstd, vg, vb, eps)
    return torch_norm_stats(dy, x, mean, rstd, vg, vb, eps)


def torch_norm_stats(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor | None,
                     vg: torch.Tensor | None, vb: torch.Tensor | None, eps: float = 0.0) -> NormRows:
    """:func:`norm_stats` in torch ops."""
    d = dy if dy.dtype == torch.float32 else dy.float()
    y = None
    if vb is not None:
        y, b = torch_row_stats(d, vb)
    else:
        b = torch.linalg.vector_norm(d, dim=1)
    if vg is None:
        return y, b, None, None
    if rstd is None:  # the mean square from the rows' norms: one read, where squaring first wrote the rows again
        norm = torch.linalg.vector_norm(x, dim=1)
        rstd = torch.addcmul(scalar_on(eps, norm.device), norm, norm, value=1 / x.shape[1]).rsqrt_()
    r = rstd.reshape(-1, 1)
    if mean is None:
        # RMSNorm: X̂_n = rstd_n X_n, so the row's product and norm are rstd_n times dY_n ⊙ X_n's (X̂ is never
        # written and read again: two passes of the rows fewer)
        got, pn = torch_row_stats(d * x, vg)
        return y, b, got.mul_(r[:, 0]), pn.mul_(r[:, 0])
    got, pn = torch_row_stats(d * ((x - mean.reshape(-1, 1)) * r), vg)
    return y, b, got, pn


def triton_norm_stats(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor | None, rstd: torch.Tensor | None,
                      vg: torch.Tensor | None, vb: torch.Tensor | None, eps: float = 0.0) -> NormRows:
    """:func:`norm_stats` by one Triton kernel (on CUDA; on CPU tensors too under ``TRITON_INTERPRET=1``)."""
    n, d = dy.shape
    if x.shape != dy.shape:
        raise ValueError(f"norm_stats takes a layer's gradient and input rows of one shape, got {tuple(dy.shape)} "
                         f"and {tuple(x.shape)}")
    out = torch.empty((4, n), dtype=torch.float32, device=dy.device)
    if n:
        zero = out[0, :1]  # a vector's stand-in where there is none (never read: the flags compile its use out)
        r = zero if rstd is None else rstd.reshape(-1).float().contiguous()  # not read without: taken from x
        m = r if mean is None else mean.reshape(-1).float().contiguous()  # not read without a mean
        with torch.cuda.device(dy.device) if dy.is_cuda else contextlib.nullcontext():
            _norm_kernel()[(-(-n // BLOCK_N),)](
                dy, x, m, r, zero if vg is None else vg.float().contiguous(), zero if vb is None else vb.float().contiguous(),
                out, n, d, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), float(eps), HAS_MEAN=mean is not None,
                HAS_RSTD=rstd is not None, HAS_G=vg is not None, HAS_B=vb is not None, BLOCK_N=BLOCK_N,
                BLOCK_D=min(BLOCK_D, pow2(d)))
    return (out[0] if vb is not None else None, out[1], out[2] if vg is not None else None,
            out[3] if vg is not None else None)


def torch_row_stats(a: torch.Tensor, vecs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_stats` in torch ops (the CPU path, and CUDA's where Triton is missing)."""
    if torch.is_autocast_enabled(a.device.type):  # a backward run inside autocast would take the product in bf16
        with torch.autocast(a.device.type, enabled=False):
            return torch_row_stats(a, vecs)
    a32 = a if a.dtype == torch.float32 else a.float()
    # One vector: mv, no view dispatched (the hooks' host cost counts every dispatch)
    return (torch.mv(a32, vecs) if vecs.dim() == 1 else torch.mm(vecs, a32.T),
            torch.linalg.vector_norm(a32, dim=1))


def triton_row_stats(a: torch.Tensor, vecs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_stats` by one Triton kernel (on CUDA; on CPU tensors too under ``TRITON_INTERPRET=1``)."""
    n, d = a.shape
    c = 1 if vecs.dim() == 1 else vecs.shape[0]
    if not 1 <= c <= MAX_VECTORS or vecs.shape[-1] != d or vecs.dim() > 2:
        raise ValueError(f"row_stats takes 1 to {MAX_VECTORS} vectors of the rows' width {d}, got a {tuple(vecs.shape)}"
                         " tensor: pass the vectors as rows of one float32 tensor")
    vecs = vecs if vecs.dtype == torch.float32 and vecs.stride(-1) == 1 else vecs.float().contiguous()
    proj = torch.empty((n,) if vecs.dim() == 1 else (c, n), dtype=torch.float32, device=a.device)
    norms = torch.empty(n, dtype=torch.float32, device=a.device)
    if n == 0:
        return proj, norms
    kernel = _kernel()
    grid = (-(-n // BLOCK_N),)
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        kernel[grid](a, vecs, proj, norms, n, d, a.stride(0), a.stride(1), vecs.stride(0) if vecs.dim() == 2 else d,
                     C=c, BLOCK_C=1 << (c - 1).bit_length(), BLOCK_N=BLOCK_N, BLOCK_D=min(BLOCK_D, pow2(d)))
    return proj, norms


def weight_stats(wo: torch.Tensor, s: torch.Tensor, r: torch.Tensor, ws: torch.Tensor,
                 wr: torch.Tensor | None) -> torch.Tensor:
    """A weight's per-step values (``weights.prepare_one``) from ``wo`` (``[out, in]``, as its forward uses it):
    ``W s`` into ``ws``, ``Wᵀ r`` into ``wr`` (``None``: not wanted), float32; returns its columns' squared norms
    (float32 ``[in]``). On CUDA one kernel's read of ``W`` in its own dtype (:func:`triton_weight_stats`),
    elsewhere three float32 passes (:func:`torch_weight_stats`)."""
    if weight_kernel_for(wo):
        return triton_weight_stats(wo, s, r, ws, wr)
    return torch_weight_stats(wo, s, r, ws, wr)


def torch_weight_stats(wo: torch.Tensor, s: torch.Tensor, r: torch.Tensor, ws: torch.Tensor,
                       wr: torch.Tensor | None) -> torch.Tensor:
    """:func:`weight_stats` in torch ops: a float32 copy of a low-precision ``wo``, then ``W s``, ``Wᵀ r`` and the
    column squares (:func:`column_squares`), a pass each."""
    w32 = wo.float()
    torch.mv(w32, s, out=ws)
    if wr is not None:
        torch.mv(w32.T, r, out=wr)
    return column_squares(w32)


def column_squares(wo: torch.Tensor) -> torch.Tensor:
    """``float32[in]``: the squared norms of ``wo``'s columns. On a GPU the column norms in one read of ``W``; on a
    CPU ``W²`` summed over rows, which writes ``W²`` and reads it again, because a CPU's norm over dimension 0 is
    a strided kernel, 4x to 40x slower."""
    if wo.is_cuda:
        norms: torch.Tensor = torch.linalg.vector_norm(wo, dim=0)
        return norms.square_()
    return wo.square().sum(0)


def weight_kernel_for(w: torch.Tensor) -> bool:
    """Whether :func:`triton_weight_stats` takes ``w``'s per-step values: a plain CUDA matrix, where Triton imports."""
    return w.is_cuda and w.dim() == 2 and type(w) in (torch.Tensor, torch.nn.Parameter) and triton_module() is not None


def triton_weight_stats(wo: torch.Tensor, s: torch.Tensor, r: torch.Tensor, ws: torch.Tensor,
                        wr: torch.Tensor | None) -> torch.Tensor:
    """:func:`weight_stats` by one Triton kernel (on CUDA; on CPU tensors too under ``TRITON_INTERPRET=1``), in one
    read of ``wo`` (any layout and float dtype, upcast in registers; ``ws`` contiguous: the kernel writes it row by
    row; ``Wᵀ r`` is taken in the same read, wanted or not). Each program takes a block of rows whole: its ``W s``
    rows are finished there, its shares of ``Wᵀ r`` and of the squares are summed over the programs after
    (deterministic, no atomics: a fixed order), a few percent of ``W``'s bytes. Where the torch path takes three
    reads of ``W``."""
    if ws.stride(0) != 1:
        raise ValueError(f"triton_weight_stats writes W s row by row: ws must be contiguous, got strides {ws.stride()}")
    n, d = wo.shape
    programs = -(-n // _W_BLOCK_N)
    part = torch.empty((programs, 2, d), dtype=torch.float32, device=wo.device)
    if n and d:
        with torch.cuda.device(wo.device) if wo.is_cuda else contextlib.nullcontext():
            _weight_kernel()[(programs,)](wo, s.float().contiguous(), r.float().contiguous(), ws, part, n, d,
                                          wo.stride(0), wo.stride(1), BLOCK_N=_W_BLOCK_N,
                                          BLOCK_D=min(BLOCK_D, pow2(d)))
    sums = part.sum(0)
    if wr is not None:
        wr.copy_(sums[0])
    return sums[1]


@functools.cache
def _kernel() -> Any:
    """The kernel, defined on first use: ``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates."""
    triton = needed("row_stats")
    import triton.language as tl

    @triton.jit
    def row_stats_kernel(a_ptr, v_ptr, p_ptr, q_ptr, n, d, stride_n, stride_d, stride_v,  # type: ignore[no-untyped-def]
                         C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < n
        at = rows.to(tl.int64) * stride_n  # a tensor over 2³¹ elements is addressed in 64 bits
        cs = tl.arange(0, BLOCK_C)
        acc = tl.zeros((BLOCK_N, BLOCK_C), dtype=tl.float32)
        sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in range(0, d, BLOCK_D):
            ks = k + tl.arange(0, BLOCK_D)
            in_cols = ks < d
            x = tl.load(a_ptr + at[:, None] + ks[None, :].to(tl.int64) * stride_d,
                        mask=in_rows[:, None] & in_cols[None, :], other=0.0).to(tl.float32)
            sq += tl.sum(x * x, axis=1)
            for j in tl.static_range(C):
                v = tl.load(v_ptr + j * stride_v + ks, mask=in_cols, other=0.0)
                acc += tl.where(cs[None, :] == j, tl.sum(x * v[None, :], axis=1)[:, None], 0.0)
        tl.store(q_ptr + rows, tl.sqrt(sq), mask=in_rows)  # a NaN stays NaN: it is what makes the ratio an alarm
        tl.store(p_ptr + cs[None, :].to(tl.int64) * n + rows[:, None], acc, mask=in_rows[:, None] & (cs[None, :] < C))

    return row_stats_kernel


@functools.cache
def _norm_kernel() -> Any:
    """:func:`triton_norm_stats`' kernel, defined on first use (as :func:`_kernel`)."""
    triton = needed("norm_stats")
    import triton.language as tl

    @triton.jit
    def norm_stats_kernel(dy_ptr, x_ptr, mean_ptr, rstd_ptr, vg_ptr, vb_ptr, out_ptr,  # type: ignore[no-untyped-def]
                          n, d, s_dy, s_dyd, s_x, s_xd, eps, HAS_MEAN: tl.constexpr, HAS_RSTD: tl.constexpr,
                          HAS_G: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < n
        wide = rows.to(tl.int64)  # a tensor over 2³¹ elements is addressed in 64 bits
        rs = tl.full((BLOCK_N,), 1.0, tl.float32)  # without a given rstd (an RMSNorm's): applied after the loop
        if HAS_RSTD:
            rs = tl.load(rstd_ptr + rows, mask=in_rows, other=0.0)
        mu = rs * 0.0  # an RMSNorm's rows are not centred
        if HAS_MEAN:
            mu = tl.load(mean_ptr + rows, mask=in_rows, other=0.0)
        acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
        sq_dy = tl.zeros((BLOCK_N,), dtype=tl.float32)
        sq_p = tl.zeros((BLOCK_N,), dtype=tl.float32)
        sq_x = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in range(0, d, BLOCK_D):
            ks = k + tl.arange(0, BLOCK_D)
            in_cols = ks < d
            tile = in_rows[:, None] & in_cols[None, :]
            g = tl.load(dy_ptr + wide[:, None] * s_dy + ks[None, :].to(tl.int64) * s_dyd, mask=tile,
                        other=0.0).to(tl.float32)
            sq_dy += tl.sum(g * g, axis=1)
            if HAS_B:
                acc_b += tl.sum(g * tl.load(vb_ptr + ks, mask=in_cols, other=0.0)[None, :], axis=1)
            if HAS_G:
                xv = tl.load(x_ptr + wide[:, None] * s_x + ks[None, :].to(tl.int64) * s_xd, mask=tile,
                             other=0.0).to(tl.float32)
                if not HAS_RSTD:
                    sq_x += tl.sum(xv * xv, axis=1)
                p = g * ((xv - mu[:, None]) * rs[:, None])
                acc_g += tl.sum(p * tl.load(vg_ptr + ks, mask=in_cols, other=0.0)[None, :], axis=1)
                sq_p += tl.sum(p * p, axis=1)
        sq_p = tl.sqrt(sq_p)
        if not HAS_RSTD:  # X̂_n = rstd_n X_n: the row's product and norm are rstd_n times dY_n ⊙ X_n's
            rs = 1.0 / tl.sqrt(sq_x / d + eps)
            acc_g = acc_g * rs
            sq_p = sq_p * rs
        tl.store(out_ptr + rows, acc_b, mask=in_rows)
        tl.store(out_ptr + n + rows, tl.sqrt(sq_dy), mask=in_rows)  # a NaN stays NaN: an alarm
        tl.store(out_ptr + 2 * n + rows, acc_g, mask=in_rows)
        tl.store(out_ptr + 3 * n + rows, sq_p, mask=in_rows)

    return norm_stats_kernel


@functools.cache
def _weight_kernel() -> Any:
    """:func:`triton_weight_stats`' kernel, defined on first use (as :func:`_kernel`)."""
    triton = needed("weight_stats")
    import triton.language as tl

    @triton.jit
    def weight_stats_kernel(w_ptr, s_ptr, r_ptr, ws_ptr, part_ptr, n, d, stride_n,  # type: ignore[no-untyped-def]
                            stride_d, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < n
        at = rows.to(tl.int64) * stride_n  # a weight over 2³¹ elements is addressed in 64 bits
        rv = tl.load(r_ptr + rows, mask=in_rows, other=0.0)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        base = part_ptr + pid.to(tl.int64) * 2 * d
        for k in range(0, d, BLOCK_D):
            ks = k + tl.arange(0, BLOCK_D)
            in_cols = ks < d
            w = tl.load(w_ptr + at[:, None] + ks[None, :].to(tl.int64) * stride_d,
                        mask=in_rows[:, None] & in_cols[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * tl.load(s_ptr + ks, mask=in_cols, other=0.0)[None, :], axis=1)
            tl.store(base + ks, tl.sum(w * rv[:, None], axis=0), mask=in_cols)  # this block's share of Wᵀ r
            tl.store(base + d + ks, tl.sum(w * w, axis=0), mask=in_cols)  # and of the columns' squares
        tl.store(ws_ptr + rows, acc, mask=in_rows)

    return weight_stats_kernel
