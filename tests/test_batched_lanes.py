"""Fingerprints of a whole state in a few kernels: bitwise the per-tensor format, pinned values, bounded op counts."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import Kernels

from verified_ckpt import lanes, state_fingerprint, tensor_fingerprint
from verified_ckpt.guard.consensus import nonfinite_count, state_lanes
from verified_ckpt.lanes import batched_lanes, tensor_lanes

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.complex64, torch.complex128]


def awkward_tensors(seed: int, n: int = 200) -> list[torch.Tensor]:
    """Every dtype; sizes at and around row, granule and word boundaries; misaligned and non-contiguous views;
    0-d tensors."""
    rnd, out = random.Random(seed), []
    for _ in range(n):
        dt = rnd.choice(DTYPES)
        size = rnd.choice([0, 1, 3, 7, 8, 9, 64, 96, 1023, 1024, 1025, 8191, 8192, 8193, 40_000, 300_001])
        width = torch.empty((), dtype=dt).element_size()
        g = torch.Generator().manual_seed(rnd.randrange(1 << 30))
        raw = torch.randint(0, 256, (size * width + 3,), dtype=torch.uint8, generator=g)
        t = (raw[:size] & 1).bool() if dt == torch.bool else raw[: size * width].view(dt)
        if size > 2 and rnd.random() < 0.2:
            t = t[1:]  # a view whose bytes are not 8-byte aligned
        if size > 4 and rnd.random() < 0.2:
            t = t[::2]  # not contiguous
        if t.numel() == 40_000 and rnd.random() < 0.5:
            t = t.reshape(200, 200)
        if t.numel() and rnd.random() < 0.1:
            t = t.reshape(-1)[-1]  # 0-d, as an optimizer's step is
        out.append(t)
    return out


@pytest.mark.parametrize("direct_bytes", [0, 8192, 1 << 20, 1 << 40], ids=["all-direct", "8k", "1m", "all-staged"])
@pytest.mark.parametrize("chunk", [8192, 100_000, 256 << 20], ids=["row-chunks", "small-chunks", "default"])
def test_batched_lanes_are_bitwise_the_per_tensor_lanes(monkeypatch, direct_bytes, chunk):
    monkeypatch.setattr(lanes, "_CHUNK_BYTES", chunk)
    tensors = awkward_tensors(direct_bytes ^ chunk)
    expected = torch.stack([tensor_lanes(t) for t in tensors])
    assert torch.equal(batched_lanes(tensors, direct_bytes), expected)


@pytest.mark.parametrize("direct_bytes", [0, 8192, 1 << 40], ids=["all-direct", "8k", "all-staged"])
def test_a_recurring_list_is_summed_by_its_plan_bitwise_and_a_changed_layout_gets_its_own(monkeypatch, direct_bytes):
    """Lists of whole-word tensors (and 0-d ones of any width) take a plan kept per signature: the same lanes as
    one tensor at a time, on the first call and on the next, with other values; a list of the same dtypes and sizes
    whose tensors lie otherwise (not contiguous, not aligned) is not summed by the first list's plan."""
    monkeypatch.setattr(lanes, "_CHUNK_BYTES", 100_000)
    monkeypatch.setattr(lanes, "_PLANS", type(lanes._PLANS)())
    tensors = [t for t in awkward_tensors(direct_bytes + 5, 300) if t.dim() == 0 or t.nbytes % 8 == 0]
    assert lanes._signature(tensors, direct_bytes) is not None and len(tensors) > 100
    for round_ in range(3):
        if round_:
            for t in tensors:
                if t.dtype in (torch.float32, torch.float64, torch.int64, torch.int32, torch.int16):
                    t.add_(1)  # new values, the same layout: the kept plan sums them
        expected = torch.stack([tensor_lanes(t) for t in tensors])
        assert torch.equal(batched_lanes(tensors, direct_bytes), expected)
        assert len(lanes._PLANS) == 1
    base = torch.arange(4 * 4096, dtype=torch.float32)
    moved = [base[: 2 * 4096], base[1: 2 * 4096 + 1].clone()[::1], base.view(4096, 4)[:, :2]]
    for t in moved:  # one contiguous, one contiguous copy, one strided view with the same dtype and size
        assert torch.equal(batched_lanes([t], direct_bytes), tensor_lanes(t)[None])


def test_pinned_fingerprints_do_not_change():
    # Values written by the format as stored in manifests and ledgers: a change here breaks every old checkpoint.
    pinned = {
        "42500001024000004250000102400000": torch.arange(10, dtype=torch.float32),
        "523d2812fe937b74a18a735c48836554": (torch.arange(8203) % 251).to(torch.uint8),
        "b2e5fda5fddbfda4b2e67da67d927d12": torch.linspace(-2, 2, 15).to(torch.bfloat16).reshape(3, 5),
        "00010001010001010001000301000301": torch.arange(13) % 3 == 0,
        "0000008040701a000002acacc0d81a00": torch.arange(1025 * 1024 + 7, dtype=torch.int64)[7:],
        "00000000000000000000000000000000": torch.zeros(0, dtype=torch.float16),
    }
    for want, t in pinned.items():
        assert str(tensor_fingerprint(t)) == want
    assert [str(lanes.fingerprint_from_lanes(x)) for x in batched_lanes(list(pinned.values())).tolist()] == list(pinned)
    state = {"a": torch.arange(10, dtype=torch.float32), "b": {"c": (torch.arange(8203) % 251).to(torch.uint8), "n": 3}}
    assert str(state_fingerprint(state)) == "cbfefea2ae1c3a39838f2e1d9cd9f163"


def transformer_state(layers: int = 12, d: int = 16, vocab: int = 64) -> list[torch.Tensor]:
    """The 12-layer transformer's 592 state tensors (parameters, AdamW step and moments), at a small width."""
    shapes = [(vocab, d), (32, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    params = [torch.randn(s) for s in [*shapes, (d,), (d,)]]
    return params + [x for p in params for x in (torch.tensor(3.0), torch.randn(p.shape), torch.rand(p.shape))]


@pytest.mark.parametrize("direct_bytes", [lanes.DIRECT_BYTES[1], 4 * 1024 * 64], ids=["all-staged", "embedding-direct"])
def test_a_whole_state_fingerprint_dispatches_a_bounded_number_of_ops(direct_bytes):
    # The CPU proxy for GPU launches and host dispatch: every aten op counts, views included. With the CUDA policy
    # the 1.79 GiB state stages all but its three 32 MiB embedding tensors, as "embedding-direct" does here.
    tensors = transformer_state(d=64, vocab=1024)
    assert len(tensors) == 592
    cpu = torch.device("cpu")
    for fn in (lambda: batched_lanes(tensors, direct_bytes), lambda: state_lanes(tensors, cpu),
               lambda: nonfinite_count([t for t in tensors if t.is_floating_point()], cpu)):
        with Kernels() as ops:
            fn()
        assert ops.dispatched <= 100, ops.dispatched  # was 12,803 (22 ops per tensor; 6,291 not views)


def test_nonfinite_count_flags_nan_and_inf_in_any_float_dtype_and_never_large_finite_state():
    ok = [torch.full((5,), 65504.0, dtype=torch.float16), torch.full((3,), 3e38), torch.ones(4, dtype=torch.bfloat16)]
    assert int(nonfinite_count(ok, torch.device("cpu"))) == 0  # a sum of these would overflow; the check must not
    bad = [torch.tensor([1.0, float("nan")]), torch.tensor([float("-inf")], dtype=torch.bfloat16),
           torch.tensor([float("nan")]).to(torch.float8_e4m3fn)]
    assert int(nonfinite_count(ok + bad, torch.device("cpu"))) == 3
