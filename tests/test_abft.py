"""Per-step verification of gradient computation (ABFT): clean configurations pass, wrong gradients are caught
at the step, naming the rank and the layer; one injection per fault class on 3 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import bit_campaign
from dist_harness import run_ranks
from models import TinyGPT, lm_loss
from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

pytestmark = pytest.mark.timeout(180)


class Checkpointed(torch.nn.Module):
    """TinyGPT with activation checkpointing on every block."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        g = self.gpt
        x = g.drop(g.tok(ids) + g.pos(torch.arange(ids.shape[1])))
        for block in g.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return g.head(g.ln(x))


def bf16_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return lm_loss(model, batch).float()


def run(model: torch.nn.Module, loss_fn, steps: int, *, accum: int = 1, clip: float = 0.0, faults: tuple = (),
        mode: str = "exact") -> tuple[SDCGuard, SilentCorruptionDetected | None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(model, opt, loss_fn, GuardConfig(faults=faults, mode=mode))
    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        for _ in range(accum):
            guard.backward(torch.randint(0, 64, (4, 17), generator=g), step=step)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        try:
            guard.step()
        except SilentCorruptionDetected as e:
            return guard, e
        opt.zero_grad()
    return guard, None


@pytest.mark.parametrize("case", ["plain", "accumulation + clipping", "bf16 autocast", "activation checkpointing"])
def test_clean_configurations_pass_abft_with_tied_weights(case):
    torch.manual_seed(0)
    model = Checkpointed() if case == "activation checkpointing" else TinyGPT()
    loss = bf16_loss if case == "bf16 autocast" else lm_loss
    guard, incident = run(model, loss, 12, accum=2 if "accumulation" in case else 1,
                          clip=1.0 if "clipping" in case else 0.0, mode="tolerance" if "bf16" in case else "exact")
    assert incident is None, incident
    assert guard.checks["abft"].passed == 12
    # Weight and input gradients of every Linear: all of their backward FLOPs; attention's matmuls are not covered
    # (and with activation checkpointing, the backward also runs the forward again).
    cov = guard.coverage()
    low = 0.5 if case == "activation checkpointing" else 0.8
    assert cov.param_fraction > 0.95 and low < cov.flop_fraction < 1.0 and cov.linear_flop_fraction == 1.0


def test_under_autocast_each_layers_input_gradient_is_read_in_the_gemms_dtype(monkeypatch):
    """A float32 input is cast by the layer's pre-hook, as autocast would cast it: the tap then sees the GEMM's own
    bf16 input gradient (half the bytes of the float32 cast of it that reaches the input), and the checks pass."""
    from verified_ckpt.guard.abft import checks, rowstats

    seen: list[torch.dtype] = []
    monkeypatch.setattr(checks, "project", lambda a, v: seen.append(a.dtype) or rowstats.project(a, v))
    torch.manual_seed(0)
    guard, incident = run(TinyGPT(), bf16_loss, 4, mode="tolerance")
    assert incident is None and guard.checks["abft"].passed == 4
    assert seen and set(seen) == {torch.bfloat16}, seen


@pytest.mark.parametrize("spec", ["grad:0:5:elem=10@100", "grad:0:5:bitflip=22@2000", "grad:0:5:bitflip=30@5000"])
def test_a_wrong_gradient_is_caught_at_its_step_naming_the_layer(spec):
    torch.manual_seed(0)
    guard, incident = run(TinyGPT(), lm_loss, 8, faults=(spec,))
    assert incident is not None and (incident.kind, incident.detected_step, incident.ranks) == ("abft", 5, [0])
    assert "does not match its ABFT checksum" in incident.detail and ".weight" in incident.detail or ".bias" in incident.detail


def test_checks_switch_off_one_by_one():
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = SDCGuard(model, opt, lm_loss, GuardConfig(audit_every=None, abft=False, check_nonfinite=False,
                                                       check_checksum=False, faults=("grad:0:2:nan",)))
    for step in (1, 2):
        guard.backward(torch.randint(0, 64, (2, 9)), step=step)
        guard.step()  # nothing checks the NaN now
    assert set(guard.checks) == set() and guard.abft is None


CLASSES = [
    ("grad", "sign", "grad:1:7:bitflip=31@321"),
    ("grad", "high exponent", "grad:2:7:bitflip=28@1500"),
    ("grad", "high mantissa", "grad:0:7:bitflip=22@700"),
    ("x10", "x10", "grad:1:7:elem=10@2222"),
    ("allreduce*", "sign", "allreduce:*:7:bitflip=31@321"),
    ("allreduce*", "high exponent", "allreduce:*:7:bitflip=28@1500"),
    ("allreduce*", "high mantissa", "allreduce:*:7:bitflip=22@4000"),
]


@pytest.mark.parametrize("site,bits,spec", CLASSES, ids=[f"{c[0]}-{c[1]}" for c in CLASSES])
def test_one_injection_per_class_is_caught_at_its_step_on_three_ranks(site, bits, spec):
    got = run_ranks(bit_campaign.trial, 3, spec, 10, {})
    kinds = {(r["kind"], tuple(r["ranks"]), r["step"]) for r in got}
    rank = spec.split(":")[1]
    expected = ("checksum", (), 7) if rank == "*" else ("abft", (int(rank),), 7)
    assert kinds == {expected}, kinds


def test_the_clean_twin_raises_nothing():
    got = run_ranks(bit_campaign.trial, 3, None, 12, {})
    assert all(r["kind"] is None for r in got) and len({r["fingerprint"] for r in got}) == 1


def clean_schedule(rank: int, world: int) -> dict:
    import ddp_train

    args = ddp_train.parse(["--steps", "40", "--lr-schedule", "warmup-cosine", "--audit-every", "5"])
    return ddp_train.train(rank, world, args)


def test_a_clean_warmup_cosine_run_raises_nothing():
    got = run_ranks(clean_schedule, 3)
    assert all(r["incidents"] == [] for r in got) and got[0]["checks"]["abft"]["passed"] == 40


def test_long_gradient_accumulation_folds_its_rows_and_still_catches_a_wrong_gradient():
    # Each microbatch leaves per-row vectors on the device until the check; past a few they are summed, so
    # memory does not grow with the number of microbatches, and the sums are the same.
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(model, opt, lm_loss, GuardConfig())
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        guard.backward(torch.randint(0, 64, (4, 17), generator=g), step=1)
        assert max(len(c.entries) for c in guard.abft.covered.values()) <= 8
    guard.step()
    assert guard.checks["abft"].passed == 1
    torch.manual_seed(0)
    guard, incident = run(TinyGPT(), lm_loss, 3, accum=12, faults=("grad:0:2:elem=10@100",))
    assert incident is not None and (incident.kind, incident.detected_step, incident.ranks) == ("abft", 2, [0])


@pytest.mark.parametrize("spec", [None, "grad:0:3:elem=10@100"], ids=["clean", "fault"])
def test_gradients_left_from_the_step_before_are_where_the_check_starts(spec):
    # Without zero_grad the step reduces the old gradient plus the new one: the check starts from the old one.
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = SDCGuard(model, opt, lm_loss, GuardConfig(faults=(spec,) if spec else ()))
    g = torch.Generator().manual_seed(0)
    incident = None
    for step in range(1, 5):
        for _ in range(2):
            guard.backward(torch.randint(0, 64, (4, 17), generator=g), step=step)
        try:
            guard.step()
        except SilentCorruptionDetected as e:
            incident = e.incident
            break
    if spec is None:
        assert incident is None and guard.checks["abft"].passed == 4
    else:
        assert incident is not None and (incident.kind, incident.detected_step) == ("abft", 3)


@pytest.mark.parametrize("tiny", [1e-23, 3e-24])
def test_rows_of_tiny_gradients_raise_no_false_alarm(tiny):
    # Half the rows' output gradients are so small that their float32 squared norms underflow to 0 while their
    # products do not (a GPT's logits gradient at positions the loss barely sees): their bound must not be 0.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 16))
    scale = torch.ones(32, 1)
    scale[::2] = tiny

    def loss_fn(m, batch):
        x, y = batch
        return ((m(x) - y) * scale).sum()

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = SDCGuard(model, opt, loss_fn, GuardConfig())
    for step in range(1, 11):
        g = torch.Generator().manual_seed(step)
        guard.backward((torch.randn(32, 32, generator=g), torch.randn(32, 16, generator=g)), step=step)
        guard.step()
        opt.zero_grad()
    assert guard.checks["abft"].passed == 10 and guard.checks["abft"].failed == 0
