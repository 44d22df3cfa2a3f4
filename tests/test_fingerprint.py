"""Fingerprints are exact: every single-bit change is caught, by construction, on every dtype."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verified_ckpt import Fingerprint, state_fingerprint, tensor_fingerprint
from verified_ckpt.lanes import lanes_of

M = 2**64

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]


def reference(data: bytes) -> tuple[int, int]:
    """The documented definition, in plain Python integers."""
    n8 = len(data) // 8
    words = [int.from_bytes(data[i * 8 : i * 8 + 8], "little") for i in range(n8)]
    rows = n8 // 1024
    sums = [sum(words[r * 1024 : (r + 1) * 1024]) % M for r in range(rows)]
    sums.append(sum(words[rows * 1024 :]) % M)
    if len(data) % 8:
        sums.append(int.from_bytes(data[n8 * 8 :], "little"))
    return sum(sums) % M, sum((2 * i + 1) * s for i, s in enumerate(sums)) % M


def raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def from_bytes(data: bytes, like: torch.Tensor) -> torch.Tensor:
    u = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return u.view(like.dtype).reshape(like.shape)


def sample(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (data[:n] & 1).bool()
    return data.view(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_single_bit_flip_changes_the_fingerprint(dtype):
    t = sample(dtype, 13)  # 13 elements: odd sizes leave a partial last word for 1- and 2-byte dtypes
    base = str(tensor_fingerprint(t))
    data = raw(t)
    for byte in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[byte] ^= 1 << bit
            fp = str(tensor_fingerprint(from_bytes(bytes(flipped), t)))
            assert fp != base, f"flip of byte {byte} bit {bit} not detected"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 7, 1023, 1024 + 5, 3 * 1024 * 2 + 17])
def test_matches_the_plain_integer_definition(dtype, n):
    t = sample(dtype, n, seed=n)
    assert tensor_fingerprint(t).lanes == reference(raw(t))


def test_bit_flips_in_a_multi_row_tensor_are_caught():
    t = torch.randn(5000, generator=torch.Generator().manual_seed(1))  # several 1024-word rows and a remainder
    base = tensor_fingerprint(t)
    data = raw(t)
    g = torch.Generator().manual_seed(2)
    positions = torch.randint(0, len(data) * 8, (2000,), generator=g).tolist()
    for pos in positions + [0, len(data) * 8 - 1]:
        flipped = bytearray(data)
        flipped[pos // 8] ^= 1 << (pos % 8)
        assert tensor_fingerprint(from_bytes(bytes(flipped), t)) != base


def test_wrapping_arithmetic_matches_modular_reference_with_extreme_words():
    # All-ones and max-magnitude words force every int64 sum and product to wrap.
    extremes = torch.tensor([-1, 2**63 - 1, -(2**63), 2**62] * 3000, dtype=torch.int64)
    assert tensor_fingerprint(extremes).lanes == reference(raw(extremes))


def test_non_contiguous_and_offset_views_fingerprint_their_logical_bytes():
    base = torch.randn(64, 33, generator=torch.Generator().manual_seed(3))
    for view in (base.t(), base[:, 1:], base[1:, ::2], base.view(torch.uint8)[1:-3]):
        assert tensor_fingerprint(view) == tensor_fingerprint(view.contiguous().clone())


def test_lanes_of_many_equals_one_by_one():
    ts = [sample(d, 9, seed=i) for i, d in enumerate(DTYPES)]
    assert lanes_of(ts) == [tensor_fingerprint(t) for t in ts]


def test_hex_form_round_trips():
    fp = tensor_fingerprint(torch.arange(10.0))
    assert len(str(fp)) == 32
    assert Fingerprint.from_hex(str(fp)) == fp


def test_state_fingerprint_sees_values_names_and_plain_data():
    a = {"w": torch.ones(4), "meta": {"lr": 0.1}}
    base = state_fingerprint(a)
    assert state_fingerprint({"w": torch.ones(4), "meta": {"lr": 0.1}}) == base
    assert state_fingerprint({"w2": torch.ones(4), "meta": {"lr": 0.1}}) != base
    assert state_fingerprint({"w": torch.ones(4), "meta": {"lr": 0.2}}) != base
    assert state_fingerprint({"w": torch.ones(2, 2), "meta": {"lr": 0.1}}) != base
    b = torch.ones(4)
    b.view(torch.int32)[2] ^= 1
    assert state_fingerprint({"w": b, "meta": {"lr": 0.1}}) != base


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=3000))
def test_any_byte_string_matches_reference(data):
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    assert tensor_fingerprint(t).lanes == reference(data)
