"""One read of each tensor of a batched product's check (``guard/abft/productstats.py``): the kernel (run here by
Triton's interpreter on CPU tensors, in a child process with ``TRITON_INTERPRET=1``: ``test_rowstats.py`` says
why) gives float64's results within float32 rounding on every layout attention hands the check (``q`` as a
transposed view, ``kᵀ``, rows of a wider buffer whose neighbours are NaN), sees a ×10 element of ``C`` in its row
only, and leaves products whose leading dimensions broadcast to the torch path.

Tolerance: a float32 sum of ``d`` products is within ``γ_d · Σ|a_i v_i|`` (``γ_d ≈ d·u``, u = 2⁻²⁴) of the exact
sum; the errors below are divided by ``2 d u Σ|a_i v_i|`` (the norms by ``2 d u ‖a‖``).
"""

from __future__ import annotations

import math

import helpers
import pytest
import torch

from verified_ckpt.guard.abft.productstats import (gemv_stats, product_stats, rowwise_stats, torch_product_stats,
                                                   triton_product_stats)
from verified_ckpt.guard.abft.sums import EPS32

pytestmark = pytest.mark.timeout(60)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (leading shape, n, d): ragged against the kernel's 16 x 128 tiles, one row, one exact tile
SHAPES = [((2, 3), 37, 200), ((4,), 1, 5), ((1, 2), 16, 128), ((3,), 17, 129)]
LAYOUTS = ("contiguous", "transposed", "columns", "padded")


def tensor(lead: tuple[int, ...], n: int, d: int, dtype: str, layout: str, seed: int) -> torch.Tensor:
    """``[*lead, n, d]`` laid out as attention hands it to the check: ``transposed``, a view of ``[b, n, h, d]``
    (``q``); ``columns``, the transpose of a ``[*lead, d, n]`` tensor (``kᵀ``: a row's elements lie apart);
    ``padded``, the rows of a wider buffer of NaN (a read past an edge would show)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, n, d, generator=g).to(DTYPES[dtype])
    if layout == "transposed" and len(lead) == 2:
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "columns":
        return x.mT.contiguous().mT
    if layout in ("padded", "transposed"):
        buf = torch.full((*lead, n + 2, d + 7), math.nan, dtype=x.dtype)
        buf[..., 1 : n + 1, 3 : d + 3] = x
        return buf[..., 1 : n + 1, 3 : d + 3]
    return x


def cases() -> list[tuple[tuple[int, ...], int, int, str, str, bool]]:
    """(lead, n, d, dtype, layout, one vector for every batch element or one each)."""
    return [(lead, n, d, list(DTYPES)[(i + j) % 3], layout, (i + j) % 2 == 0)
            for i, (lead, n, d) in enumerate(SHAPES) for j, layout in enumerate(LAYOUTS)]


def vector(lead: tuple[int, ...], d: int, shared: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(d, generator=g) if shared else torch.randn(*lead, d, generator=g)


def interpreted() -> dict[str, object]:
    """What the child process measures: the kernel against float64 over every case, the product's statistics
    against the torch path's, one fault and one NaN."""
    from verified_ckpt.guard.abft import tiles
    from verified_ckpt.guard.abft.productstats import batched_row_stats

    product_stats(*attention(), torch.ones(9))  # CPU tensors: the torch path, which never asks for Triton
    untouched = tiles.triton_module.cache_info().currsize == 0
    errors = []
    for k, (lead, n, d, dtype, layout, shared) in enumerate(cases()):
        a, v = tensor(lead, n, d, dtype, layout, k), vector(lead, d, shared, k)
        proj, norms = batched_row_stats(a, v)
        a64, v64 = a.double(), v.double() if shared else v.double().unsqueeze(-2)
        want = (a64 * v64).sum(-1)
        scale = (a64.abs() * v64.abs()).sum(-1) * 2 * d * EPS32 + 1e-30
        errors.append([[list(lead), n, d, dtype, layout, shared], ((proj.double() - want).abs() / scale).max().item(),
                       ((norms.double() - a64.norm(dim=-1)).abs() / (2 * d * EPS32 * a64.norm(dim=-1) + 1e-30)).max().item(),
                       list(proj.shape) == list(want.shape), bool(torch.isfinite(proj).all() and torch.isfinite(norms).all())])
    # The product's four statistics, kernel against the torch path: q kᵀ (q a transposed view, kᵀ a transposed
    # view) and P V in bf16
    q, kt, scores = attention()
    r = vector((), scores.shape[-1], True, 7)
    products = [relative(triton_product_stats(q, kt, scores, r), torch_product_stats(q, kt, scores, r))]
    p = torch.softmax(torch.randn(6, 17, 17, generator=torch.Generator().manual_seed(3)), -1).bfloat16()
    values = tensor((6,), 17, 129, "bfloat16", "padded", 4)
    out = p @ values
    r = vector((), 129, True, 8)
    products.append(relative(triton_product_stats(p, values, out, r), torch_product_stats(p, values, out, r)))
    # One ×10 element of C at its row's largest magnitude: the row's C r - A (B r) moves past the float32 rounding of
    # its statistics; no other row moves by a bit
    cr, abr, an, bn = triton_product_stats(q, kt, scores, vector((), 9, True, 9))
    row = (1, 2, 5)
    col = int(scores[row].abs().argmax())
    hit = scores.clone()
    hit[(*row, col)] *= 10
    cr2, abr2, _, _ = triton_product_stats(q, kt, hit, vector((), 9, True, 9))
    moved = ((cr2 - abr2) - (cr - abr)).abs()
    bound = 8 * 2 * 20 * EPS32 * an[row] * bn[row[:2]] * vector((), 9, True, 9).abs().max()
    nan = q.clone()
    nan[0, 1, 3, 4] = math.nan
    got = triton_product_stats(nan, kt, scores, vector((), 9, True, 9))
    return {"untouched": untouched, "errors": errors, "products": products, "fault": (moved[row] / bound).item(),
            "others": int((moved > 0).sum()) - 1,
            "nan": [int(torch.isnan(t).sum()) for t in got[1:3]], "nan_row": bool(torch.isnan(got[1][0, 1, 3]))}


def attention() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``, ``kᵀ`` and the scores of a 2-batch, 3-head attention of 9 tokens, as a model lays them out."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 9, 3, 20, generator=g).transpose(1, 2)  # [b, h, t, d], a view of [b, t, h, d]
    k = torch.randn(2, 9, 3, 20, generator=g).transpose(1, 2)
    return q, k.transpose(-2, -1), q @ k.transpose(-2, -1)


def relative(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> list[float]:
    """Each statistic's largest |kernel - torch| relative to the largest |torch| (both float32 sums of the same
    terms in different orders), and whether the shapes agree."""
    return [((a - b).abs().max() / b.abs().max()).item() if a.shape == b.shape else math.inf
            for a, b in zip(got, want, strict=True)]


@pytest.fixture(scope="module")
def kernel() -> dict:
    pytest.importorskip("triton")
    return helpers.interpreted("__import__('test_productstats').interpreted()")


def test_the_kernel_equals_float64_within_float32_rounding_on_every_layout_attention_hands_it(kernel):
    assert kernel["untouched"], "the CPU path asked for Triton"
    for case, proj, norms, shapes, finite in kernel["errors"]:
        assert shapes and finite, case  # finite: nothing past the edges (NaN there) was read
        assert proj <= 1 and norms <= 1, (case, proj, norms)


def test_the_products_statistics_by_kernel_equal_the_torch_paths(kernel):
    for errors in kernel["products"]:
        assert max(errors) < 1e-5, errors  # float32 sums of at most 129 terms, in two orders


def test_the_kernel_sees_a_single_element_of_c_times_ten_in_its_row_only_and_keeps_a_nan(kernel):
    assert kernel["fault"] > 1
    assert kernel["others"] == 0
    assert kernel["nan_row"] and kernel["nan"] == [1, 1]  # A (B r) and ‖A_i‖ of that row only


def test_products_whose_leading_dimensions_broadcast_take_the_torch_path_and_the_kernel_refuses_them():
    a, b = torch.randn(2, 3, 5, 4), torch.randn(1, 3, 4, 6)
    c, r = a @ b, torch.randn(6)
    got, want = product_stats(a, b, c, r), torch_product_stats(a, b, c, r)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="one leading shape"):
        triton_product_stats(a, b, c, r)


def test_the_cpu_forms_equal_float64_on_every_layout_and_keep_a_nan_in_its_row():
    """The CPU path (``rowwise_stats``: multiplies and sums over each tensor where it lies) and CUDA's fallback form
    (``gemv_stats``: batched products), each against float64, for ``A`` and ``B`` in every layout attention hands
    them over, broadcast leading dimensions included; a NaN in ``A`` reaches its own row only."""
    for k, (layout_a, layout_b) in enumerate((x, y) for x in LAYOUTS for y in LAYOUTS):
        a = tensor((2, 3), 11, 20, "float32", layout_a, k)
        b = tensor((1, 3) if k % 3 == 0 else (2, 3), 20, 13, "float32", layout_b, k + 50)
        c, r = a @ b, vector((), 13, True, k)
        a64, b64, r64 = a.double(), b.double(), r.double()
        want = (c.double() @ r64, a64 @ (b64 @ r64).unsqueeze(-1), a64.norm(dim=-1), b64.norm(dim=(-2, -1)))
        for form in (rowwise_stats, gemv_stats):
            for got, ref in zip(form(a, b, c, r), want, strict=True):
                torch.testing.assert_close(got.double(), ref.reshape(got.shape),
                                           rtol=1e-5, atol=1e-5, msg=f"{form.__name__} {layout_a} {layout_b}")
    a, b = tensor((2, 3), 11, 20, "float32", "transposed", 1), tensor((2, 3), 20, 13, "float32", "columns", 2)
    a[1, 2, 4, 7] = math.nan
    _, abr, an, _ = rowwise_stats(a, b, a @ b, torch.ones(13))
    assert torch.isnan(abr[1, 2, 4]) and torch.isnan(an[1, 2, 4])
    assert int(torch.isnan(abr).sum()) == 1 and int(torch.isnan(an).sum()) == 1
