"""One read of each tensor a batched product's check needs (``products.py``): ``C r``; ``B r`` and ``‖B‖_F``;
``A (B r)`` and the rows' norms ``‖A_i‖``.

``products`` checks ``C = A @ B`` (attention's ``q kᵀ`` and ``P V``, of 3 or 4 dimensions) row by row, ``C_i r``
against ``A_i (B r)``, within a bound built on ``‖A_i‖ ‖B‖_F``. Of each tensor it needs:

* of ``C``, ``C r`` (``r`` over its columns, one vector for every batch element and head);
* of ``B``, ``B r`` and ``‖B‖_F`` per batch element and head (a row of ``B`` is what ``r`` weighs: for ``kᵀ``, a
  column of ``k``);
* of ``A``, ``A (B r)``, against each batch element and head's own vector, and its rows' norms.

On CUDA (:func:`triton_product_stats`) one kernel, :func:`batched_row_stats`, takes each in one read of the tensor
where it lies, in its own dtype: a program takes a block of one batch element and head's rows, upcasts them in
registers and sums the products and the squares in float32. ``kᵀ`` is read through its strides (a row's elements
lie ``d`` apart, neighbouring rows side by side), and ``q`` where it lies (a transposed view of ``[b, t, h, d]``),
with no copy. Elsewhere (:func:`torch_product_stats`) the torch ops. On a CPU (:func:`rowwise_stats`) ``B``
copied contiguous once (``v``) or ``Bᵀ`` (``kᵀ``, a transposed view of ``k``), unless it is already, and ``B r`` and
``‖B‖_F`` over that copy; ``A (B r)`` a multiply and a sum over ``A``'s rows where they lie (a temporary of ``A``'s
size) and their norms: seven passes where the kernel makes three reads. On CUDA without Triton
(:func:`gemv_stats`) ``A`` copied contiguous once and batched products with one column (no temporary). Products
whose leading dimensions broadcast take the torch path.

The kernel's rounding order differs from the torch path's: thresholds are calibrated on a device. Tested under
``TRITON_INTERPRET=1`` on CPU tensors (``tests/test_productstats.py``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from .tiles import BLOCK_D, BLOCK_N, needed, pow2, triton_module

__all__ = ["ProductRows", "batched_row_stats", "gemv_stats", "product_stats", "rowwise_stats", "torch_product_stats",
           "triton_product_stats"]

# ``C r``, ``A (B r)``, ``‖A_i‖`` (each in ``C``'s leading shape and rows) and ``‖B‖_F`` (in the leading shape), float32
ProductRows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def product_stats(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, r: torch.Tensor) -> ProductRows:
    """What the check of ``C = A @ B`` needs (module doc), for float32 ``r`` over ``C``'s columns: one read of each
    tensor on CUDA, the torch path elsewhere and where the leading dimensions broadcast."""
    if c.is_cuda and triton_module() is not None and _batched(a, b, c):
        return triton_product_stats(a, b, c, r)
    return torch_product_stats(a, b, c, r)


def torch_product_stats(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, r: torch.Tensor) -> ProductRows:
    """:func:`product_stats` in torch ops (module doc): on CUDA (where Triton is missing) as batched products, on a
    CPU as row by row multiplies and sums."""
    return (gemv_stats if c.is_cuda else rowwise_stats)(a.float(), b.float(), c.float(), r)


def gemv_stats(af: torch.Tensor, bf: torch.Tensor, cf: torch.Tensor, r: torch.Tensor) -> ProductRows:
    """The torch path as batched products: ``A`` copied contiguous once, ``A (B r)`` a batched product with one
    column; no temporary of ``A``'s size."""
    af = af.contiguous()
    br = torch.matmul(r, bf.mT) if bf.mT.is_contiguous() else torch.matmul(bf, r)
    return (torch.matmul(cf, r), torch.matmul(af, br.unsqueeze(-1)).squeeze(-1), torch.linalg.vector_norm(af, dim=-1),
            torch.linalg.vector_norm(bf, dim=(-2, -1)))


def rowwise_stats(af: torch.Tensor, bf: torch.Tensor, cf: torch.Tensor, r: torch.Tensor) -> ProductRows:
    """The torch path on a CPU. There a batched product with one column runs a small gemv per batch element and
    head, a matmul of a strided view copies it inside (slowly), and a norm over two strided dimensions is 8x
    one over a contiguous run. So ``B`` is copied contiguous once, in whichever orientation its rows or columns
    lie (``v``'s rows, ``kᵀ``'s columns: a view split from a fused projection), and ``B r`` and ``‖B‖_F`` read that
    copy; ``A (B r)`` is a multiply and a sum over ``A``'s rows where they lie. About 3x as fast as
    :func:`gemv_stats` on a d=256 GPT's ``q kᵀ`` and ``P V`` (``tools/bench/bench_products.py``), one op more where
    ``A`` is contiguous (``P``), where one batched product took ``A (B r)``."""
    if bf.stride(-1) == 1 or bf.mT.stride(-1) != 1:  # B's rows lie contiguous (v), or neither way does
        rows = bf.contiguous()
        br = torch.matmul(rows, r)
    else:  # Bᵀ's rows do: kᵀ, a transposed view of k
        rows = bf.mT.contiguous()
        br = torch.matmul(r, rows)
    return (torch.matmul(cf, r), torch.linalg.vecdot(af, br.unsqueeze(-2)), torch.linalg.vector_norm(af, dim=-1),
            torch.linalg.vector_norm(rows.flatten(-2), dim=-1))


def triton_product_stats(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, r: torch.Tensor) -> ProductRows:
    """:func:`product_stats` in three calls of :func:`batched_row_stats`, one read of ``C``, ``B`` and ``A`` each (on
    CUDA; on CPU tensors too under ``TRITON_INTERPRET=1``)."""
    if not _batched(a, b, c):
        raise ValueError(f"triton_product_stats takes tensors of 3 or 4 dimensions with one leading shape, got "
                         f"{tuple(a.shape)}, {tuple(b.shape)} and {tuple(c.shape)}: use torch_product_stats")
    cr, _ = batched_row_stats(c, r)
    br, bn = batched_row_stats(b, r)
    abr, an = batched_row_stats(a, br)
    return cr, abr, an, torch.linalg.vector_norm(bn, dim=-1)


def batched_row_stats(a: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a @ v, ‖a_i‖)``, float32 ``[..., n]``, of ``a`` (``[B, n, d]`` or ``[B, H, n, d]``, any strides and float
    dtype) and ``v``: one vector ``[d]`` for every batch element and head, or one each (``a``'s leading shape
    then ``d``). One kernel, one read of ``a`` (module doc)."""
    if a.dim() not in (3, 4) or v.shape[-1] != a.shape[-1] or v.dim() not in (1, a.dim() - 1):
        raise ValueError(f"batched_row_stats takes a tensor of 3 or 4 dimensions and a vector of its rows' width "
                         f"(or one per batch element), got {tuple(a.shape)} and {tuple(v.shape)}")
    a4 = a if a.dim() == 4 else a.unsqueeze(1)
    nb, heads, n, d = a4.shape
    v32 = v if v.dtype == torch.float32 else v.float()
    v3 = v32.expand(nb, heads, d) if v.dim() == 1 else (v32 if a.dim() == 4 else v32.unsqueeze(1)).expand(nb, heads, d)
    proj = torch.empty((nb, heads, n), dtype=torch.float32, device=a.device)
    norms = torch.empty((nb, heads, n), dtype=torch.float32, device=a.device)
    if proj.numel():
        # The batch on the grid's first axis (2³¹ programs); a block of rows on its second (65,535: 1M rows)
        grid = (nb * heads, -(-n // BLOCK_N))
        with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
            _kernel()[grid](a4, v3, proj, norms, heads, n, d, *a4.stride(), *v3.stride(), BLOCK_N=BLOCK_N,
                            BLOCK_D=min(BLOCK_D, pow2(d)))
    if a.dim() == 3:
        return proj[:, 0], norms[:, 0]
    return proj, norms


def _batched(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether the kernel takes the product: 3 or 4 dimensions each, one leading shape (no broadcast)."""
    return a.dim() == b.dim() == c.dim() and a.dim() in (3, 4) and a.shape[:-2] == b.shape[:-2] == c.shape[:-2]


@functools.cache
def _kernel() -> Any:
    """The kernel, defined on first use: ``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates."""
    triton = needed("batched_row_stats")
    import triton.language as tl

    @triton.jit
    def batched_row_stats_kernel(a_ptr, v_ptr, p_ptr, q_ptr, heads, n, d,  # type: ignore[no-untyped-def]
                                 s_b, s_h, s_n, s_d, v_b, v_h, v_d, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows = rows < n
        # 64-bit offsets: a batch of attention scores passes 2³¹ elements
        base = (pid // heads).to(tl.int64) * s_b + (pid % heads).to(tl.int64) * s_h
        vbase = (pid // heads).to(tl.int64) * v_b + (pid % heads).to(tl.int64) * v_h
        at = base + rows.to(tl.int64) * s_n
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in range(0, d, BLOCK_D):
            ks = k + tl.arange(0, BLOCK_D)
            in_cols = ks < d
            x = tl.load(a_ptr + at[:, None] + ks[None, :].to(tl.int64) * s_d,
                        mask=in_rows[:, None] & in_cols[None, :], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + vbase + ks.to(tl.int64) * v_d, mask=in_cols, other=0.0)
            sq += tl.sum(x * x, axis=1)
            acc += tl.sum(x * v[None, :], axis=1)
        out = pid.to(tl.int64) * n + rows
        tl.store(p_ptr + out, acc, mask=in_rows)
        tl.store(q_ptr + out, tl.sqrt(sq), mask=in_rows)  # a NaN stays NaN: it is what makes the ratio an alarm

    return batched_row_stats_kernel
