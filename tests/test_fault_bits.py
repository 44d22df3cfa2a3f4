"""A fault flips only bits its target has: a spec whose bit lies beyond the element is refused in one line when it
fires, touching nothing (it used to "fire" and change nothing), and the campaign draws each trial's bits within its
target's element: 16 for a forward output that a bf16/fp16 group's autocast computes in 16 bits."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from verified_ckpt.faults import parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tools"), os.path.join(ROOT, "examples")]

from campaign_trials import FORWARD, plan  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("dtype", "mode"), [
    (torch.bfloat16, "bitflip=16"), (torch.float16, "bitflip=30"), (torch.bfloat16, "bits=3+20"),
    (torch.float16, "burst=17/32"), (torch.uint8, "bitflip=8"), (torch.float32, "bitflip=40"),
    (torch.float32, "bits=1+32")])
def test_a_bit_beyond_the_element_is_refused_in_one_line_and_changes_nothing(dtype, mode):
    t = (torch.arange(64) + 1).to(dtype)
    before = t.clone()
    width = 8 * t.element_size()
    with pytest.raises(ValueError, match=rf"outside a {str(dtype)[6:]} element \(bits 0\.\.{width - 1}\)") as e:
        parse(f"compute:0:3:{mode}@5").apply(t)
    assert "\n" not in str(e.value) and f"below {width}" in str(e.value)
    assert torch.equal(t, before)


@pytest.mark.parametrize(("dtype", "mode"), [(torch.bfloat16, "bitflip=15"), (torch.float16, "bits=0+14"),
                                             (torch.float64, "bitflip=63"), (torch.float32, "burst=31")])
def test_a_bit_within_the_element_still_flips(dtype, mode):
    t = (torch.arange(64) + 1).to(dtype)
    before = t.clone()
    parse(f"grad:0:3:{mode}@5").apply(t)
    assert not torch.equal(t, before)


def output_bits(fmt: str) -> dict[str, int]:
    """The bits of each campaign forward target's output, as the model computes it under the group's autocast."""
    from models import TinyGPT, lm_loss

    model = TinyGPT(vocab=256, d=128, layers=2, heads=4, context=32)
    seen: dict[str, int] = {}
    for name in FORWARD:
        model.get_submodule(name).register_forward_hook(
            lambda mod, args, out, name=name: seen.__setitem__(name, 8 * out.element_size()))
    with torch.no_grad(), torch.autocast("cpu", dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]):
        lm_loss(model, torch.randint(0, 256, (2, 33)))
    assert set(seen) == set(FORWARD)
    return seen


def bits_of(mode: str) -> list[int]:
    """The bits a campaign mode (``bitflip=B``, ``bits=B+B``, ``burst=B[/S]``, each ``@K``) flips; none for others."""
    name, _, value = mode.split("@", maxsplit=1)[0].partition("=")
    return [int(b) for b in value.split("/")[0].split("+")] if name in ("bitflip", "bits", "burst") else []


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_the_campaign_draws_each_bit_within_its_targets_element(fmt):
    widths = output_bits(fmt)
    assert min(widths.values()) == 16  # the case this pins: 2-byte outputs
    trials = [t for t in plan({f"fmt={fmt}": 60}, world=3, steps=30, seed=0) if t.get("mode")]
    flips = [t for t in trials if bits_of(t["mode"])]
    assert {t["kind"] for t in flips} == {"bitflip", "multibit", "burst"}
    forward = [t for t in flips if t["site"] == "forward"]
    assert any(widths[t["target"]] == 16 for t in forward)
    for t in flips:
        width = widths[t["target"]] if t["site"] == "forward" else 32  # parameters, so their state, are fp32
        assert max(bits_of(t["mode"])) < width, t
        target = torch.zeros(64, dtype={16: torch.bfloat16, 32: torch.float32}[width])
        parse(f"grad:0:1:{t['mode']}").apply(target)  # it fires: no refusal


def test_an_fp32_campaign_plans_the_same_trials_as_before():
    """Only 16-bit groups' draws change: every other plan, and so the results already recorded, stay valid."""
    p = plan({"default": 100, "overhead=0.01": 30, "abft=budget": 30, "accum=2": 30, "abft_forward=1": 30}, world=3,
             steps=30, seed=0, head_to_head=5)
    digest = hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest()
    assert (len(p), digest) == (1425, "d8fce5d83238d6e6cca92e19cbfb58833424ea9d224a8f81417e1157caa26fe0")


@pytest.mark.parametrize("bad_id", [[1, 2], {"a": 1}, 7])
def test_a_report_over_a_trial_whose_id_is_no_string_is_one_line_and_exit_2(tmp_path, bad_id):
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps({"id": "default/clean/0", "group": "default", "kind": "clean", "seed": 0}) + "\n"
                       + json.dumps({"id": bad_id, "group": "default", "kind": "clean"}) + "\n")
    got = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "campaign.py"), "--results", str(results),
                          "--report", "--group", "default:1", "--head-to-head", "0"], check=False, capture_output=True,
                         text=True, timeout=50)
    assert got.returncode == 2, got.stderr
    assert got.stderr.strip().count("\n") == 0 and "Traceback" not in got.stderr
    assert f"{results} line 2: a trial id must be a string" in got.stderr
