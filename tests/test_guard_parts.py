"""Layouts are built from the guard's parts, never from the guard (issue 50): no layout imports the guard's module or
reads its private state, the guard package has no import circle, and a layout can be built and used from a
``GuardParts`` and a ``StepState`` alone."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import pathlib
import re

import pytest
import torch

from verified_ckpt import GuardConfig
from verified_ckpt.errors import GuardUsageError, SilentCorruptionDetected
from verified_ckpt.comm import Communicator
from verified_ckpt.faults import FaultPlan
from verified_ckpt.guard.judge import Judge
from verified_ckpt.guard.parts import GuardParts, StepState
from verified_ckpt.guard.replicated import ReplicatedLayout
from verified_ckpt.guard.schedule import Schedule
from verified_ckpt.guard.stats import Projector
from verified_ckpt.guard.steprow import StepRow

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUARD = ROOT / "verified_ckpt" / "guard"
PARTS = ("replicated", "fsdp", "pipeline", "capture", "protocol", "witnesses", "parts")


def imported(path: pathlib.Path) -> set[str]:
    """Every module name ``path`` imports from its own package, anywhere (``TYPE_CHECKING`` blocks included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out.add(node.module or "")
            out.update(a.name for a in node.names if node.module is None)
    return out


@pytest.mark.parametrize("name", PARTS)
def test_no_layout_or_part_imports_the_guard_module(name):
    assert "sdcguard" not in imported(GUARD / f"{name}.py"), f"guard/{name}.py imports sdcguard"


def test_no_module_of_the_guard_package_reads_the_guards_private_state():
    reads = [f"{p.name}: {m}" for p in sorted(GUARD.rglob("*.py"))
             for m in re.findall(r"\b(?:self\.)?g\._[a-z_]+", p.read_text())]
    assert not reads, reads


def test_the_guard_package_has_no_import_circle():
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "tools" / "import_cycles.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    found = tool.modules()
    facades = {m for m, p in found.items() if p.name == "__init__.py"}
    assert tool.circles(tool.graph(), "verified_ckpt.guard", facades) == []


def parts_of(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: GuardConfig) -> GuardParts:
    """What ``SDCGuard`` hands its layout, for one process, without a guard."""
    params = list(model.parameters())
    comm = Communicator(None, device=torch.device("cpu"), arrival_timeout_s=cfg.arrival_timeout_s)
    sched = Schedule(cfg)
    return GuardParts(model, model, params, list(model.buffers()), opt, lambda m, b: m(b).sum(), None, cfg, comm,
                      Judge(comm.world, comm.host_of, comm.rank), Projector(cfg.checksum_lanes, cfg.seed, comm.device),
                      sched, FaultPlan(cfg.faults), comm.device, False, lambda c: None, lambda kind: -1, lambda lanes: torch.zeros(lanes.shape[0], dtype=torch.bool))


def test_a_layout_is_built_and_used_from_parts_and_a_step_state_alone():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = GuardConfig()
    parts, state = parts_of(model, opt, cfg), StepState()
    layout = ReplicatedLayout(parts, state)
    assert not any(type(v).__name__ == "SDCGuard" for v in vars(layout).values())
    assert (layout.replicas, layout.ring, layout.records_batches) == (1, 1, False)
    assert layout.owned() == [False, False]
    # The step the layout's hooks read is the guard's record, whatever the guard has assigned since.
    state.step = 7
    assert state.now_or_kept() == 7
    state.step, state.kept = None, (6, [])
    assert state.now_or_kept() == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.cfg = cfg  # type: ignore[misc]
    state.batches, state.losses = [torch.ones(2, 4)], [torch.ones(())]
    state.clear()
    assert (state.batches, state.rng, state.losses) == ([], [], [])


def test_a_layout_judges_a_step_from_its_named_row_segments_without_the_guard():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    parts, state = parts_of(model, opt, GuardConfig()), StepState()
    layout = ReplicatedLayout(parts, state)
    with pytest.raises(GuardUsageError, match="no gradient bucket"):
        layout.row(1)
    state.step = 1
    model(torch.randn(5, 4)).sum().backward()
    layout.after_backward(True)  # one process: the step's one bucket, where DDP's hook would run
    row = StepRow([*layout.row(1), ("loss", torch.ones(1, dtype=torch.float64))])
    (mine,) = row.split(parts.comm.all_gather_rows(row.cat(torch.device("cpu"))))
    assert mine.value("loss") == 1.0
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
    assert mine.value("sumsq") == pytest.approx(float(grads @ grads))
    assert layout.judge(1, [mine]) == []  # one process: nothing to compare, nothing singled out
    # A NaN in this rank's gradients is named from the same row.
    state.step = 2
    layout.reset()
    opt.zero_grad()
    model(torch.full((5, 4), float("nan"))).sum().backward()
    layout.after_backward(True)
    row = StepRow([*layout.row(2), ("loss", torch.ones(1, dtype=torch.float64))])
    with pytest.raises(SilentCorruptionDetected, match="non-finite|NaN"):
        layout.judge(2, row.split(parts.comm.all_gather_rows(row.cat(torch.device("cpu")))))


def test_a_step_row_reads_back_every_segment_by_name_bit_for_bit():
    payload = torch.tensor([0x7FF8_0000_0000_1234], dtype=torch.int64).view(torch.float64)  # a NaN with a payload
    segments = [("a", torch.tensor([1.5, -2.0], dtype=torch.float64)), ("lanes", torch.tensor([-1, 2**62])),
                ("nan", payload), ("empty", torch.zeros(0, dtype=torch.float64))]
    row = StepRow(segments)
    two = torch.stack([row.cat(torch.device("cpu")), row.cat(torch.device("cpu"))])
    for got in row.split(two):
        assert got.floats("a") == [1.5, -2.0] and got["lanes"].tolist() == [-1, 2**62]
        assert got["nan"].view("int64").tolist() == [0x7FF8_0000_0000_1234] and got.floats("empty") == []
    with pytest.raises(ValueError, match="shape"):
        row.split(two[:, :-1])  # ranks that sent different segments are refused, not misread
    with pytest.raises(ValueError, match="distinct"):
        StepRow([("a", payload), ("a", payload)])
    with pytest.raises(ValueError, match="float64 or int64"):
        StepRow([("a", torch.ones(2))])
