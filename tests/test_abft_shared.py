"""Layers that read one input (attention's q, k and v; an MLP's gate and up) have it read once a step for all of
them (``guard/abft/shared.py``): the groups are learnt at the first step, each member's rows equal its own read,
an input written between its readers is read again, and the checks still pass clean steps and name the layer a
fault is in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_abft import run
from verified_ckpt.guard.abft import shared
from verified_ckpt.guard.abft.layers import Layer
from verified_ckpt.guard.abft.rowstats import row_stats
from verified_ckpt.guard.abft.shared import SharedInputs
from verified_ckpt.guard.abft.sums import signed_weights

pytestmark = pytest.mark.timeout(60)


class Block(torch.nn.Module):
    """q, k and v of one normalised input (k and v narrower, as grouped-query attention's), gate and up of
    another, and layers that read inputs of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.norm1, self.norm2 = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)
        self.q, self.k, self.v = torch.nn.Linear(16, 16), torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
        self.o = torch.nn.Linear(32, 16)
        self.gate, self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        h = self.norm1(x)
        x = x + self.o(torch.cat([self.q(h), self.k(h), self.v(h)], -1))
        h = self.norm2(x)
        return self.head(x + self.down(F.silu(self.gate(h)) * self.up(h)))


def loss_fn(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def test_the_groups_are_learnt_at_the_first_step_and_each_input_is_read_once_after(monkeypatch):
    reads = []
    monkeypatch.setattr(shared, "row_stats", lambda a, v: reads.append(v.shape) or row_stats(a, v))
    torch.manual_seed(0)
    guard, incident = run(Block(), loss_fn, 3)
    assert incident is None and guard.checks["abft"].passed == 3
    # Two later steps (the replays that measure the hooks' cost in place come after the fifth: ``dispatch.SETTLED``)
    passes, rest = divmod(len(reads) - 8, 5)
    assert rest == 0 and passes == 2, len(reads)
    assert all(v[0] <= 2 for v in reads[:8])  # the first step: every covered Linear reads its own input
    groups = {tuple(la.name for la in g) for g in guard.abft._shared.groups.values()}
    assert groups == {("q", "k", "v"), ("gate", "up")}
    # Later steps: q, k and v in one read of 6 vectors (each its s and Wᵀ r), gate and up in one of 4
    each_step = [torch.Size([6, 16]), torch.Size([4, 16])] + [torch.Size([2, n]) for n in (32, 32, 16)]
    assert sorted(reads[8:]) == sorted(each_step * passes)


def members(n: int) -> list[Layer]:
    g = torch.Generator().manual_seed(1)
    out = []
    for k in range(n):
        la = Layer(f"l{k}", k, "Linear", torch.randn(8, 16, generator=g), None, (8, 16))
        la.r, la.s = signed_weights(8, g, la.weight.device), signed_weights(16, g, la.weight.device)
        out.append(la)
    return out


def vectors_of(la: Layer) -> torch.Tensor:
    assert la.s is not None
    return torch.stack([la.s, la.weight.T @ la.r]) if la.number % 2 else la.s[None]  # with and without the forward's


def own(la: Layer) -> torch.Tensor:
    v = vectors_of(la)
    return v[0] if v.shape[0] == 1 else v


def test_each_members_rows_equal_its_own_read_and_a_written_input_is_read_again():
    layers = members(3)
    s = SharedInputs(on=True)
    x = torch.randn(5, 7, 16)
    for la in layers:  # the first step
        s.rows(la, x, own(la), 0, True, vectors_of)
    for la in layers:  # a later step (the groups made at its first call): the first member's call reads for all
        got, norms = s.rows(la, x, own(la), 1, False, vectors_of)
        want, want_norms = row_stats(x.reshape(-1, 16), own(la))
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(norms, want_norms)
    assert {n: [m.number for m in g] for n, g in s.groups.items()} == {0: [0, 1, 2], 1: [0, 1, 2], 2: [0, 1, 2]}
    # The input written after the first member read it: the others read it again, not the stale rows
    s.rows(layers[0], x, own(layers[0]), 2, False, vectors_of)
    x.mul_(2)
    got, norms = s.rows(layers[1], x, own(layers[1]), 2, False, vectors_of)
    torch.testing.assert_close(got, row_stats(x.reshape(-1, 16), own(layers[1]))[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norms, row_stats(x.reshape(-1, 16), own(layers[1]))[1])


def test_layers_that_read_different_inputs_at_the_first_step_form_no_group():
    layers = members(3)
    s = SharedInputs(on=True)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    s.rows(layers[0], x, own(layers[0]), 0, True, vectors_of)
    s.rows(layers[1], x, own(layers[1]), 0, True, vectors_of)
    s.rows(layers[0], y, own(layers[0]), 0, True, vectors_of)  # read again, with other company
    s.rows(layers[2], y, own(layers[2]), 0, True, vectors_of)
    s.rows(layers[2], x, own(layers[2]), 1, False, vectors_of)
    assert s.groups == {}
    sharded = SharedInputs(on=False)  # weights that exist only in their forward: no group
    for la in layers:
        sharded.rows(la, x, own(la), 0, True, vectors_of)
    sharded.rows(layers[0], x, own(layers[0]), 1, False, vectors_of)
    assert sharded.groups == {}


@pytest.mark.parametrize("layer", ["k", "up"])
def test_a_wrong_output_of_a_group_member_is_caught_at_its_step_naming_it(layer):
    torch.manual_seed(0)
    model = Block()
    calls = [0]  # the layer's forwards: one a step

    def wrong(_mod: torch.nn.Module, _args: object, out: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 4:
            out = out.clone()
            out[1, 2, 3] = out[1, 2, 3] * 10 + 1
        return out

    getattr(model, layer).register_forward_hook(wrong)  # before the guard's: a fault inside the layer
    _, caught = run(model, loss_fn, 6)
    assert caught is not None and caught.detected_step == 4
    assert f"forward output of {layer} " in caught.detail, caught.detail


def test_the_same_memory_under_another_tensor_is_another_input():
    """Layers are grouped by the input object, not its memory alone: under autocast a float32 input can be freed
    once its reader has cast it, and the next layer's input then take its memory, with the same shape, strides,
    dtype and version (a false alarm in GPT-2's MLP under bf16 before this was held). ``x.detach()`` stands in:
    another tensor object over the same bytes and layout."""
    layers = members(2)
    s = SharedInputs(on=True)
    x = torch.randn(4, 16)
    s.rows(layers[0], x, own(layers[0]), 0, True, vectors_of)
    s.rows(layers[1], x.detach(), own(layers[1]), 0, True, vectors_of)
    s.rows(layers[0], x, own(layers[0]), 1, False, vectors_of)
    assert s.groups == {}
    # At a later step a member's rows come from its group's read only for that same input object
    s = SharedInputs(on=True)
    for step in (0, 1):
        for la in layers:
            got, _ = s.rows(la, x, own(la), step, step == 0, vectors_of)
    assert set(s.groups) == {0, 1}
    s.rows(layers[0], x, own(layers[0]), 2, False, vectors_of)
    other = x.detach().clone().mul_(3)  # another input, read after the group's read of x
    got, norms = s.rows(layers[1], other, own(layers[1]), 2, False, vectors_of)
    torch.testing.assert_close(got, row_stats(other, own(layers[1]))[0], rtol=1e-5, atol=1e-5)
