"""The fault model's corruptions (``verified_ckpt.faults``): what each mode does to a tensor's bits, and its spec."""

from __future__ import annotations

import pytest
import torch

from verified_ckpt.faults import BURST_LANES, parse

pytestmark = pytest.mark.timeout(30)


def changed(spec: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    before = t.clone()
    parse(spec).apply(t)
    bits = {2: torch.int16, 4: torch.int32}[t.element_size()]
    return (t.view(bits) ^ before.view(bits)).nonzero().view(-1), (t.view(bits) ^ before.view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_several_bits_of_one_word_flip_together_sign_included(dtype):
    top = 8 * torch.tensor([], dtype=dtype).element_size() - 1
    where, diff = changed(f"grad:0:1:bits=1+3+{top}@5", torch.randn(64).to(dtype))
    assert where.tolist() == [5]
    assert (int(diff[5]) & ((1 << (top + 1)) - 1)) == (1 << 1) | (1 << 3) | (1 << top)


def test_a_burst_flips_one_bit_in_a_warp_of_lanes_consecutive_or_strided():
    where, diff = changed("grad:0:1:burst=20@3", torch.randn(4096))
    assert where.tolist() == list(range(3, 3 + BURST_LANES)) and set(diff[where].tolist()) == {1 << 20}
    where, _ = changed("grad:0:1:burst=20/32@3", torch.randn(4096))
    assert where.tolist() == list(range(3, 3 + 32 * BURST_LANES, 32))


def test_a_stuck_lane_holds_its_value_and_a_persistent_multiplier_scales_one_element():
    t = torch.randn(16)
    parse("compute:1:4-:stuck=0.5@2").apply(t)
    assert t[2] == 0.5
    u = torch.ones(16)
    f = parse("compute:1:4-:elem=1.01@9")
    assert f.covers(4) and f.covers(400) and not f.covers(3)
    f.apply(u)
    assert u[9] == pytest.approx(1.01) and int((u != 1).sum()) == 1


@pytest.mark.parametrize("spec", ["grad:0:1:bits=3+30@7", "grad:*:4-:burst=22/32@5", "compute:0:3-:stuck=0@7",
                                  "weights:2:9:elem=1.001"])
def test_specs_round_trip(spec):
    assert parse(parse(spec).spec) == parse(spec)


@pytest.mark.parametrize("bad", ["grad:0:1:bits=", "grad:0:1:bits=1+64", "grad:0:1:burst=70", "grad:0:1:burst=3/0",
                                 "grad:0:1:stuck=x", "grad:0:1:burst"])
def test_a_bad_mode_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match="fault spec") as e:
        parse(bad)
    assert "\n" not in str(e.value)


def test_a_byte_tensors_top_bit_flips_too():
    t = torch.tensor([1, 2, 3], dtype=torch.uint8)
    parse("buffers:0:1:bitflip=7@1").apply(t)
    assert t.tolist() == [1, 130, 3]
