"""Check 4: weight consensus. Every replica fingerprints its parameters and optimizer state; all must agree.

Run every ``consensus_every`` steps after the update and before every save.
A strict majority (with 3 or more replicas) names the odd ones out; with two,
a disagreement is reported and nobody is named.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import decisions
from ..fingerprint import lanes_hex
from ..history import Event
from ..lanes import tensor_lanes
from .stats import Verdict

__all__ = ["judge", "state_lanes", "state_tensors"]


def state_tensors(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What replicas must hold identically, in a fixed order: parameters, then each one's optimizer state."""
    tensors = [p.detach() for p in params]
    for p in params:
        st = optimizer.state.get(p, {})
        tensors += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
    return tensors


def state_lanes(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Exact fingerprint lanes of a replica's state as one ``int64[2]`` on ``device`` (no host sync)."""
    if not tensors:
        return torch.zeros(2, dtype=torch.int64, device=device)
    lanes = torch.stack([tensor_lanes(t).to(device) for t in tensors])
    w = torch.arange(len(tensors), device=device, dtype=torch.int64) * 2 + 1
    return (lanes * w[:, None]).sum(0)


def judge(step: int, rows: Sequence[Sequence[int]], first_suspect: int) -> tuple[Verdict, list[str]]:
    """The verdict over every rank's lanes, and each rank's fingerprint as hex."""
    fps = [lanes_hex(row) for row in rows]
    unanimous, _, suspects = decisions.vote(fps)

    def ledger_rows() -> list[Event]:
        bad = set(suspects) if suspects or unanimous else set(range(len(rows)))
        return [Event(step, "consensus", r, "fail" if r in bad else "pass", (row[0], row[1])) for r, row in enumerate(rows)]

    if unanimous:
        return Verdict("consensus", True, rows=ledger_rows), fps
    detail = "replica fingerprints disagree: " + ", ".join(f"rank {r} {fp[:12]}" for r, fp in enumerate(fps))
    return Verdict("consensus", False, suspects, detail, first_suspect, ledger_rows), fps
