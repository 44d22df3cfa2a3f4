"""One read of a tensor for its ABFT row statistics (``guard/abft/rowstats.py``): the torch path gives what the
separate ops it replaced gave, and the Triton kernels (run here by Triton's interpreter on CPU tensors) give the
torch path's results within float32 rounding, see a ×10 element, and read nothing past the tensors' edges: the
row statistics of one tensor, and a normalisation layer's of its output's gradient and its input together.

The kernel runs in one child process with ``TRITON_INTERPRET=1``: ``triton.jit`` reads the variable when it
defines the kernel, and a kernel this process defined first (on a GPU, by an earlier test) would stay compiled.

Tolerance: both paths sum ``d`` float32 products, in different orders; each is within ``γ_d · Σ|a_i v_i|``
(``γ_d ≈ d·u``, u = 2⁻²⁴) of the exact sum, so they differ by at most ``2 d u Σ|a_i v_i|`` (bf16 and fp16 become
float32 exactly). The norms likewise, by at most ``2 d u ‖a‖``. Errors below are divided by those bounds.
"""

from __future__ import annotations

import math

import helpers
import pytest
import torch

from verified_ckpt.guard.abft.rowstats import norm_stats, row_stats, torch_norm_stats, torch_row_stats
from verified_ckpt.guard.abft.sums import EPS32

pytestmark = pytest.mark.timeout(60)

SLACK = 8.0  # GuardConfig's default abft slack
# (n, d): ragged against the kernel's 16 x 128 tiles, one row, one exact tile multiple
SHAPES = [(37, 200), (1, 5), (256, 256), (100, 129)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cases() -> list[tuple[int, int, int, str, str]]:
    """(n, d, c, dtype, layout): c = 0 stands for one vector given as 1-D."""
    out = []
    for i, (n, d) in enumerate(SHAPES):
        for c in (0, 1, 2, 3, 6):  # 6: three layers that read one input (shared.py)
            dtype = list(DTYPES)[(i + c) % 3]
            layout = ("contiguous", "row-strided", "column-strided")[(i + c) % 3]
            out.append((n, d, c, dtype, layout))
    return out


def inputs(n: int, d: int, c: int, dtype: str, layout: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` as a view whose neighbours in memory are NaN (a read past its edge would show), and the vectors."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d, generator=g).to(DTYPES[dtype])
    vecs = (torch.rand(max(c, 1), d, generator=g) + 1) * (torch.randint(0, 2, (max(c, 1), d), generator=g) * 2 - 1)
    if layout == "row-strided":  # rows of a wider buffer, and rows past the last
        buf = torch.full((n + 3, d + 19), math.nan, dtype=a.dtype)
        buf[:n, :d] = a
        a = buf[:n, :d]
    elif layout == "column-strided":  # every other column of a buffer twice as wide
        buf = torch.full((n, 2 * d + 1), math.nan, dtype=a.dtype)
        buf[:, 1 : 2 * d + 1 : 2] = a
        a = buf[:, 1 : 2 * d + 1 : 2]
    return a, vecs[0] if c == 0 else vecs


def scaled_errors(a: torch.Tensor, vecs: torch.Tensor, got: tuple[torch.Tensor, torch.Tensor],
                  want: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """The largest |got - want| of the projections and of the norms, each over its rounding bound (module doc)."""
    a32 = a.float()
    d = a.shape[1]
    v = vecs.reshape(-1, d)
    scale = (a32.abs() @ v.abs().T).T.reshape(got[0].shape) * 2 * d * EPS32 + 1e-30
    proj = ((got[0] - want[0]).abs() / scale).max().item()
    norms = ((got[1] - want[1]).abs() / (2 * d * EPS32 * want[1])).max().item()
    return proj, norms


def interpreted() -> dict[str, object]:
    """What the child process measures: the kernel against the torch path over every case, and one fault."""
    from verified_ckpt.guard.abft import tiles
    from verified_ckpt.guard.abft.rowstats import triton_row_stats

    row_stats(*inputs(3, 4, 2, "float32", "contiguous"))
    untouched = tiles.triton_module.cache_info().currsize == 0  # the CPU path never asks for Triton
    errors = []
    for case in cases():
        a, vecs = inputs(*case)
        got = triton_row_stats(a, vecs)
        want = torch_row_stats(a, vecs)
        shapes = [list(t.shape) for t in got] == [list(t.shape) for t in want]
        errors.append([list(case), *scaled_errors(a, vecs, got, want), shapes, bool(torch.isfinite(got[0]).all())])
    # Vectors as rows of a wider buffer (``weights.py`` keeps every like-shaped layer's in one: each layer's are
    # a strided view), read in place by the kernel
    a, vecs = inputs(37, 200, 2, "float32", "contiguous", seed=2)
    wide = torch.full((2, 3, 200), math.nan)
    wide[:, 1] = vecs
    strided = scaled_errors(a, vecs, triton_row_stats(a, wide[:, 1]), torch_row_stats(a, vecs))
    # One ×10 element, at its row's largest magnitude (a ×10 of a near-zero element is within any rounding bound)
    a, vecs = inputs(37, 200, 2, "bfloat16", "row-strided", seed=1)
    before, norms = triton_row_stats(a, vecs)
    row = 11
    col = int(a[row].float().abs().argmax())
    a[row, col] *= 10
    after, _ = triton_row_stats(a, vecs)
    moved = (after - before).abs()
    # forward.py's bound on the input side, with the vectors' largest entry for its column weights: the rounding
    # of a bf16 GEMM's row and of float32 projections of that width
    bound = SLACK * (2 * 2.0**-8 + EPS32 * math.sqrt(200)) * norms[row] * vecs.abs().max()
    a[row + 1, col] = math.nan  # a NaN stays NaN: what makes the hooks' ratio an alarm
    nan_proj, nan_norms = triton_row_stats(a, vecs)
    return {"untouched": untouched, "errors": errors, "strided": strided, "fault": (moved[:, row] / bound).min().item(),
            "others": moved[:, torch.arange(37) != row].max().item(),
            "nan": bool(nan_proj[:, row + 1].isnan().all() and nan_norms[row + 1].isnan()),
            "nan_alone": int(nan_norms.isnan().sum()) + int(nan_proj.isnan().sum())}


def norm_inputs(n: int, d: int, dtype: str, layout: str, layer: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A normalisation layer's gradient rows (``inputs``' layouts: NaN beyond their edges), its float32 input rows,
    per-row mean (LayerNorm; an RMSNorm has none) and reciprocal spread, and its scale's and shift's vectors."""
    dy, vecs = inputs(n, d, 2, dtype, layout, seed)
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(n, d, generator=g) * 3 + 0.5
    mean = x.mean(1, keepdim=True) if layer else None
    centred = x - mean if mean is not None else x
    rstd = torch.rsqrt(centred.square().mean(1, keepdim=True) + 1e-5)
    return dy, x, mean, rstd, vecs[0], vecs[1]


def norm_errors(case: tuple[int, int, str, str, bool], got: tuple, want: tuple) -> list[float]:
    """Each of the four outputs' largest |got - want| over its rounding bound: ``2 d u`` of a float32 sum of ``d``
    terms (the shift's), plus a few roundings more where ``X̂`` and the product are formed (the scale's)."""
    dy, x, mean, rstd, vg, vb = norm_inputs(*case)
    d = dy.shape[1]
    g = dy.double()
    xhat = ((x.double() - (mean.double() if mean is not None else 0)) * rstd.double())
    p = g * xhat
    k = 2 * (d + 4) * EPS32
    bounds = [(g.abs() @ vb.double().abs()) * k, g.norm(dim=1) * k, (p.abs() @ vg.double().abs()) * k, p.norm(dim=1) * k]
    return [((a.double() - b.double()).abs() / (bound + 1e-30)).max().item() for a, b, bound in zip(got, want, bounds, strict=True)]


NORM_CASES = [(n, d, list(DTYPES)[i % 3], ("contiguous", "row-strided", "column-strided")[i % 3], i % 2 == 0)
              for i, (n, d) in enumerate(SHAPES)]


def interpreted_norms() -> dict[str, object]:
    """The norm kernel against the torch path over every case (LayerNorm and RMSNorm, each output), with one
    parameter alone, and one fault."""
    from verified_ckpt.guard.abft.rowstats import triton_norm_stats

    errors = []
    for case in NORM_CASES:
        args = norm_inputs(*case)
        got, want = triton_norm_stats(*args), torch_norm_stats(*args)
        errors.append([list(case), *norm_errors(case, got, want), all(bool(torch.isfinite(t).all()) for t in got)])
    dy, x, mean, rstd, vg, vb = norm_inputs(37, 200, "float32", "contiguous", True, seed=3)
    alone = [t is None for t in triton_norm_stats(dy, x, mean, rstd, vg, None)] + \
        [t is None for t in triton_norm_stats(dy, x, mean, rstd, None, vb)]
    # One ×10 element of the gradient at its row's largest product: the scale's row moves past its float32 rounding
    before = triton_norm_stats(dy, x, None, rstd, vg, vb)
    row = 7
    col = int((dy[row] * x[row]).abs().argmax())
    dy[row, col] *= 10
    after = triton_norm_stats(dy, x, None, rstd, vg, vb)
    moved = (after[2] - before[2]).abs()
    bound = SLACK * 2 * 200 * EPS32 * before[3][row] * vg.abs().max()
    # An RMSNorm's rstd taken in the same read of x (none given) against the torch path given it
    taken = [[list(case), *norm_errors(case, triton_norm_stats(dy, x, None, None, vg, vb, 1e-5),
                                       torch_norm_stats(dy, x, None, r, vg, vb))]
             for case in NORM_CASES if not case[4] for dy, x, _, r, vg, vb in [norm_inputs(*case)]]
    return {"errors": errors, "alone": alone, "fault": (moved[row] / bound).item(),
            "others": moved[torch.arange(37) != row].max().item(), "taken": taken}


def interpreted_weights() -> dict[str, object]:
    """The weights' kernel (``triton_weight_stats``: ``W s``, ``Wᵀ r`` and the columns' squares in one read) against
    float64 over every case's layout (NaN beyond the weight's edges: a read past them would show), and one fault."""
    from verified_ckpt.guard.abft.rowstats import triton_weight_stats

    errors = []
    for n, d, c, dtype, layout in cases():
        w, vecs = inputs(n, d, 1, dtype, layout)
        s, r = vecs[0], torch.randn(n, generator=torch.Generator().manual_seed(n))
        ws, wr = torch.empty(n), torch.empty(d)
        squares = triton_weight_stats(w, s, r, ws, wr)
        w64 = w.double()
        k = 2 * (max(n, d) + 2) * EPS32  # a float32 sum's rounding, a few roundings more
        pairs = [(ws, w64 @ s.double(), (w64.abs() @ s.double().abs()) * k),
                 (wr, w64.T @ r.double(), (w64.abs().T @ r.double().abs()) * k),
                 (squares, (w64 * w64).sum(0), (w64 * w64).sum(0) * k)]
        errors.append([[n, d, dtype, layout], *[((a.double() - b).abs() / (bound + 1e-30)).max().item()
                                                  for a, b, bound in pairs]])
    # One x10 element: W s moves in its row only, Wᵀ r and the squares in its column only
    w, vecs = inputs(37, 200, 1, "float32", "contiguous", seed=5)
    s, r = vecs[0], torch.ones(37)
    before = [torch.empty(37), torch.empty(200)]
    sq0 = triton_weight_stats(w, s, r, *before)
    w[7, 50] *= 10
    after = [torch.empty(37), torch.empty(200)]
    sq1 = triton_weight_stats(w, s, r, *after)
    moved = [(a - b).abs() > 0 for a, b in ((after[0], before[0]), (after[1], before[1]), (sq1, sq0))]
    return {"errors": errors, "moved": [m.nonzero().flatten().tolist() for m in moved]}


@pytest.fixture(scope="module")
def kernel() -> dict:
    pytest.importorskip("triton")
    t = "__import__('test_rowstats')"
    return helpers.interpreted(f"{{**{t}.interpreted(), 'norms': {t}.interpreted_norms(), "
                               f"'weights': {t}.interpreted_weights()}}")


def test_the_kernel_equals_the_torch_path_within_float32_rounding(kernel):
    assert kernel["untouched"]
    for case, proj, norms, shapes, finite in kernel["errors"]:
        assert shapes, case
        assert proj <= 1 and norms <= 1, (case, proj, norms)
        assert finite, case  # nothing past a ragged edge (NaN there) was read


def test_the_kernel_reads_vectors_that_are_strided_rows_of_a_wider_buffer(kernel):
    assert max(kernel["strided"]) <= 1, kernel["strided"]  # NaN beside them: a read outside the rows would show


def test_the_kernel_sees_a_single_element_times_ten_and_only_in_its_row(kernel):
    assert kernel["fault"] > 1, kernel["fault"]
    assert kernel["others"] == 0  # rows are summed apart: one row's fault moves no other row's products
    assert kernel["nan"] and kernel["nan_alone"] == 3, kernel


def test_the_norm_kernel_equals_the_torch_path_within_float32_rounding(kernel):
    """A LayerNorm's and an RMSNorm's rows from one read of their gradient and input, every output within its
    rounding of the torch path's; nothing read past a ragged edge (NaN there)."""
    for case, *errors, finite in kernel["norms"]["errors"]:
        assert max(errors) <= 1, (case, errors)
        assert finite, case
    # A layer with only a scale, or only a shift: the other's outputs are None
    assert kernel["norms"]["alone"] == [True, False, False, False, False, False, True, True]


def test_an_rmsnorms_rstd_is_taken_in_the_same_read_of_its_rows_as_the_forward_took_it(kernel):
    """The forward no longer reads an RMSNorm's input for its mean square: the kernel takes it from the read of
    ``x`` the scale's rows make, the torch path from the rows' norms, both within rounding of the given rstd."""
    assert kernel["norms"]["taken"], kernel["norms"]
    for case, *errors in kernel["norms"]["taken"]:
        assert max(errors) <= 1, (case, errors)
    for case in [c for c in NORM_CASES if not c[4]]:
        dy, x, _, rstd, vg, vb = norm_inputs(*case)
        errors = norm_errors(case, torch_norm_stats(dy, x, None, None, vg, vb, 1e-5),
                             torch_norm_stats(dy, x, None, rstd, vg, vb))
        assert max(errors) <= 1, (case, errors)
    with pytest.raises(ValueError, match="only an RMSNorm's"):
        norm_stats(*norm_inputs(8, 16, "float32", "contiguous", True)[:2], torch.zeros(8), None, None, None)


def test_the_weights_kernel_takes_w_s_wt_r_and_the_column_squares_in_one_read_within_rounding(kernel):
    """``weights.prepare_one``'s values on CUDA, one read of ``W`` in its own dtype (ragged, strided and transposed
    layouts, bf16 and fp16 among them), each within a float32 sum's rounding of float64; a x10 element moves its
    row's ``W s`` and its column's ``Wᵀ r`` and squares, nothing else."""
    assert kernel["weights"]["errors"]
    for case, *errors in kernel["weights"]["errors"]:
        assert max(errors) <= 1, (case, errors)
    assert kernel["weights"]["moved"] == [[7], [50], [50]]


def test_the_weights_torch_path_is_what_the_kernel_replaces_and_a_strided_ws_is_refused():
    """``weight_stats`` off CUDA: ``W s``, ``Wᵀ r`` (or none) and the column squares of a bf16 weight as float32
    passes; the kernel refuses an output it cannot write row by row before it runs."""
    from verified_ckpt.guard.abft.rowstats import torch_weight_stats, triton_weight_stats, weight_stats

    w, vecs = inputs(37, 200, 1, "bfloat16", "column-strided")
    s, r = vecs[0], torch.randn(37)
    ws, wr = torch.empty(37), torch.full((200,), -1.0)
    squares = weight_stats(w, s, r, ws, None)
    w32 = w.float()
    assert torch.equal(ws, torch.mv(w32, s)) and torch.equal(squares, w32.square().sum(0))
    assert (wr == -1).all()  # not wanted: not written
    torch_weight_stats(w, s, r, ws, wr)
    assert torch.equal(wr, torch.mv(w32.T, r))
    with pytest.raises(ValueError, match="ws must be contiguous"):
        triton_weight_stats(w, s, r, torch.empty(74)[::2], wr)


def test_the_norm_kernel_sees_a_single_gradient_element_times_ten_in_its_row_only(kernel):
    assert kernel["norms"]["fault"] > 1, kernel["norms"]
    assert kernel["norms"]["others"] == 0


@pytest.mark.parametrize("case", cases()[:8], ids=str)
def test_the_torch_path_equals_the_separate_ops_it_replaced(case):
    """What the hooks computed before, one op per vector (``mv`` over a float32 copy) and the row norms."""
    a, vecs = inputs(*case)
    proj, norms = row_stats(a, vecs)
    a32 = a.float()
    assert torch.equal(norms, torch.linalg.vector_norm(a32, dim=1))  # unfloored: the batch floors them
    if vecs.dim() == 1:
        assert torch.equal(proj, torch.mv(a32, vecs))
        return
    old = torch.stack([torch.mv(a32, v) for v in vecs])
    assert scaled_errors(a, vecs, (proj, norms), (old, norms))[0] <= 1
