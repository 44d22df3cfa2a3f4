"""ABFT's checks batched per step give what the per-layer, per-parameter arithmetic they replaced gave: the
weights' per-step values per group of like-shaped layers (``abft/weights.py``), a bucket's projections per group
of like-shaped gradients through one strided view or a stacked copy (``abft/measured.py``), and a step's forward
checks judged at once (``abft/forward.py``), which still name the layer and call a fault is in."""

from __future__ import annotations

import pytest
import torch

from verified_ckpt.guard.abft.forward import Forwards
from verified_ckpt.guard.abft.layers import Layer
from verified_ckpt.guard.abft.measured import _runs, projections
from verified_ckpt.guard.abft.sums import Covered, rgs, signed_weights
from verified_ckpt.guard.abft.weights import Weights, own_rows, prepare_one

pytestmark = pytest.mark.timeout(60)


def layers(kinds: list[tuple[str, int, int, bool]], seed: int = 0) -> list[Layer]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, (kind, o, i, bias) in enumerate(kinds):
        w = torch.randn((i, o) if kind == "Conv1D" else (o, i), generator=g)
        la = Layer(f"l{k}", k, kind, w, torch.randn(o, generator=g) if bias else None, (o, i))
        la.r, la.s = signed_weights(o, g, w.device), signed_weights(i, g, w.device)
        out.append(la)
    return out


def test_grouped_weight_values_equal_each_layers_own():
    kinds = [("Linear", 24, 16, True), ("Linear", 24, 16, True), ("Conv1D", 24, 16, False), ("Linear", 8, 16, True),
             ("Linear", 24, 16, True), ("Conv1D", 24, 16, False), ("Linear", 400, 200, True)]  # the last: past GROUP_MAX
    grouped, alone = layers(kinds), layers(kinds)
    w = Weights(grouped, forward=True, group=True)
    assert sorted(len(g.layers) for g in w.groups) == [1, 2, 3]  # by kind, shape and bias; the large one alone
    for la in grouped:
        w.prepare(la, tag=1)
    cols = [prepare_one(la, own_rows(la), la.weight, la.bias, forward=True) for la in alone]
    wsq, csq, at = w.squares()
    for a, b, c in zip(grouped, alone, cols, strict=True):
        assert a.tag == 1
        for name in ("ws", "wr", "br"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
        # ‖W‖_F² and the largest column's squared norm, reduced for every layer of the step at once
        torch.testing.assert_close(wsq[at[a.number]], c.sum(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(csq[at[a.number]], c.max(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(wsq[at[a.number]], b.weight.square().sum(), rtol=1e-5, atol=1e-6)
        rows = w.rows(a)  # the rows the hooks project on: [s, Wᵀ r] and [W s, r], views of the group's buffers
        assert torch.equal(rows.x[0], a.s) and torch.equal(rows.dy[1], a.r)
        torch.testing.assert_close(rows.x[1], b.wr)
        torch.testing.assert_close(rows.dy[0], b.ws)
    # A new step's weights are taken again, in place: the views follow, and the norms are the new step's
    grouped[0].weight.mul_(2)
    w.prepare(grouped[0], tag=2)
    torch.testing.assert_close(grouped[0].ws, 2 * alone[0].ws)
    wsq2, _, at2 = w.squares()
    torch.testing.assert_close(wsq2[at2[0]], 4 * cols[0].sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["bucket", "scattered"])
def test_a_buckets_grouped_projections_equal_each_gradients_own(layout):
    g = torch.Generator().manual_seed(1)
    shapes = [(16, 8), (8,), (4, 8), (8,)] * 3 + [(8,), (16, 8)]  # blocks alike, then one out of step
    if layout == "bucket":  # one flat buffer, like-shaped gradients evenly spaced: one strided view per run
        buf = torch.randn(sum(torch.Size(s).numel() for s in shapes), generator=g)
        grads = [t.view(s) for t, s in zip(buf.split([torch.Size(s).numel() for s in shapes]), shapes, strict=True)]
    else:  # tensors of their own: each alone
        grads = [torch.randn(s, generator=g) for s in shapes]
    covered = [Covered(f"p{k}", k, signed_weights(s[0], g, torch.device("cpu")),
                       signed_weights(s[1], g, torch.device("cpu")) if len(s) == 2 else None)
               for k, s in enumerate(shapes)]
    got = list(zip(covered, grads, strict=True))
    order, actual = projections(got)
    assert sorted(order) == list(range(len(shapes)))
    want = torch.stack([rgs(covered[k], grads[k]) for k in order]).double()
    torch.testing.assert_close(actual, want, rtol=1e-5, atol=1e-5)
    runs = _runs([0, 4, 8, 13], grads)  # the (16, 8) gradients, by offset
    assert runs == ([[0, 4, 8], [13]] if layout == "bucket" else [[0], [4], [8], [13]])


def test_a_steps_forward_checks_are_judged_at_once_naming_the_call_a_fault_is_in():
    ls = layers([("Linear", 24, 16, True), ("Linear", 8, 24, False)])
    w = Weights(ls, forward=True, group=True)
    g = torch.Generator().manual_seed(2)
    fw = Forwards(slack=8.0)
    calls = []
    for la in ls * 2:  # two forwards of each layer (two microbatches)
        w.prepare(la, tag=1)
        x = torch.randn(5, la.features[1], generator=g)
        y = torch.nn.functional.linear(x, la.weight, la.bias)
        xs, a = torch.mm(w.rows(la).x, x.T), torch.linalg.vector_norm(x, dim=1)
        calls.append(y)
        fw.add(la, y, xs[1], a, (2.0**-24, 2.0**-24))
    _, csq, at = w.squares()
    clean, numbers = fw.ratios(csq, at)
    assert numbers == (0, 1, 0, 1) and clean.dtype == torch.float64 and float(clean.max()) < 1
    calls[2][3, 7] *= 10  # the third call (layer 0's second forward), after it was recorded: the rows it read
    fw2 = Forwards(slack=8.0)
    for la, y, c in zip(ls * 2, calls, fw.calls, strict=True):
        fw2.add(la, y, c.xwr, c.a, c.eps)
    faulty, _ = fw2.ratios(csq, at)
    assert int(faulty.argmax()) == 2 and float(faulty[2]) > 1 and float(faulty[[0, 1, 3]].max()) < 1
