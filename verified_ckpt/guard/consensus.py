"""Check 4: state consensus. Every replica fingerprints its parameters, optimizer state and buffers; all must agree.

Run every ``consensus_every`` steps after the update and before every save.
Three verdicts come from one gather:

* ``nonfinite_state``: every replica checks that its parameters, optimizer
  state and floating buffers are finite. A NaN/Inf held by every replica alike
  passes any comparison (it spread through the all-reduce), so this is checked
  on its own; replicas that hold one are named, unless all do.
* ``consensus``: parameters and optimizer state, one fingerprint per replica.
  A strict majority (3 or more replicas) names the odd ones out; with two, a
  disagreement is reported and nobody is named.
* ``buffers``: each module buffer is compared while replicas are expected to
  hold it identically (``decisions.buffer_votes``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import decisions
from ..fingerprint import lanes_hex
from ..history import Event
from ..lanes import lanes_on
from .chain import tiebreak
from .stats import Verdict

__all__ = ["StateProbe", "judge", "state_lanes", "state_tensors"]


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
    return combined(lanes_on(tensors, device))  # a few kernels for the whole state, not a chain per tensor


def combined(lanes: torch.Tensor) -> torch.Tensor:
    """Per-tensor lanes (``int64[n, 2]``) folded, in order, into the state's ``int64[2]``."""
    w = torch.arange(lanes.shape[0], device=lanes.device, dtype=torch.int64) * 2 + 1
    return (lanes * w[:, None]).sum(0)


def nonfinite_count(floats: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """How many of ``floats`` hold a NaN or Inf, as an ``int64`` scalar on ``device`` (no host sync).

    The largest magnitude of a tensor is NaN or Inf exactly when an element is, and it cannot overflow
    (a sum could), so finite state is never flagged. One fused kernel for the lot (``_foreach_norm`` with
    ``ord=inf``) where the dtype has it; float8 tensors take the per-tensor path.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in floats:
        groups.setdefault((t.dtype, t.device), []).append(t)
    counts = []
    for (dtype, _), ts in groups.items():
        maxima = torch._foreach_norm(ts, float("inf")) if dtype in _FOREACH_DTYPES else [t.float().abs().amax() for t in ts]
        counts.append((~torch.stack(list(maxima)).isfinite()).sum().to(device))
    return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64, device=device)


_FOREACH_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16}


class StateProbe:
    """What one replica contributes to a consensus, as one int64 row: state lanes, buffer lanes, whether its state
    changed at rest (``moved``: the guard's at-rest chain, ``chain.py``), non-finite count."""

    def __init__(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                 buffers: Sequence[torch.Tensor], device: torch.device,
                 moved: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.params, self.optimizer, self.buffers, self.device = list(params), optimizer, list(buffers), device
        self.moved = moved
        self._last: tuple[list[torch.Tensor], torch.Tensor] = ([], torch.zeros(0, 2, dtype=torch.int64))

    def agreed(self) -> list[tuple[torch.Tensor, str]]:
        """Each state tensor of the last :meth:`row` with its own fingerprint: what the replicas agreed on, tensor
        by tensor, once that round's consensus passed (one transfer of the lanes, at a save)."""
        tensors, lanes = self._last
        return [(t, lanes_hex(ln)) for t, ln in zip(tensors, lanes.tolist(), strict=True)]

    def row(self) -> torch.Tensor:
        tensors = state_tensors(self.params, self.optimizer)
        floats = [t for t in tensors + [b.detach() for b in self.buffers] if t.is_floating_point() and t.numel()]
        bad = nonfinite_count(floats, self.device)
        buffers = lanes_on([b.detach() for b in self.buffers], self.device).reshape(-1)
        lanes = lanes_on(tensors, self.device) if tensors else torch.zeros(0, 2, dtype=torch.int64, device=self.device)
        self._last = (tensors, lanes)  # kept by reference: read back only by a save (``agreed``)
        moved = self.moved(lanes).amax().view(1) if tensors else torch.zeros(1, dtype=torch.int64, device=self.device)
        return torch.cat([combined(lanes), buffers, moved, bad.view(1)])

    def split(self, row: Sequence[int]) -> tuple[tuple[int, int], list[tuple[int, int]], bool, int]:
        """(state lanes, lanes per buffer, changed at rest, non-finite tensors) of one gathered row."""
        buffers = [(row[2 + 2 * i], row[3 + 2 * i]) for i in range(len(self.buffers))]
        return (row[0], row[1]), buffers, bool(row[-2]), row[-1]


def judge(step: int, rows: Sequence[Sequence[int]], probe: StateProbe, replicated: list[bool], names: Sequence[str],
          first_suspect: int) -> tuple[list[Verdict], list[str], list[bool]]:
    """The three verdicts over every replica's row, each replica's state fingerprint as hex, and the buffers
    still judged from now on."""
    parts = [probe.split(r) for r in rows]
    world = len(rows)
    bad = [r for r, p in enumerate(parts) if p[3]]
    nonfinite = Verdict("nonfinite_state", True) if not bad else Verdict(
        "nonfinite_state", False, bad if len(bad) < world else [],
        f"NaN/Inf in the parameters, optimizer state or buffers of rank(s) {bad}"
        + ("" if len(bad) < world else " - every replica holds it (it spread through the all-reduce), so none is named"),
        first_suspect)
    fps = [lanes_hex(p[0]) for p in parts]
    unanimous, _, suspects = decisions.vote(fps)
    rested = [] if unanimous or suspects else tiebreak([(r, p[0], p[2]) for r, p in enumerate(parts)])
    suspects = suspects or rested
    rows_of: Callable[[], list[Event]] = _ledger_rows(step, [p[0] for p in parts], suspects, unanimous)
    if unanimous:
        state = Verdict("consensus", True, rows=rows_of)
    else:
        detail = "replica fingerprints disagree: " + ", ".join(f"rank {r} {fp[:12]}" for r, fp in enumerate(fps))
        if rested:
            detail += (f"; rank(s) {rested} hold state that changed at rest, after their own optimizer update wrote it, "
                       "while the other replica's still matches what its update wrote (a memory fault, or code that "
                       "writes into the state on that rank only)")
        state = Verdict("consensus", False, suspects, detail, first_suspect, rows_of)
    still, disputed = decisions.buffer_votes([p[1] for p in parts], replicated)
    if disputed:
        named = sorted({r for ranks in disputed.values() for r in ranks})
        which = ", ".join(f"{names[b]} (ranks {ranks})" for b, ranks in sorted(disputed.items())[:5])
        buffers = Verdict("buffers", False, named, f"module buffers every replica held alike now disagree: {which}",
                          first_suspect)
    else:
        buffers = Verdict("buffers", True)
    return [nonfinite, state, buffers], fps, still


def _ledger_rows(step: int, lanes: list[tuple[int, int]], suspects: list[int], unanimous: bool) -> Callable[[], list[Event]]:
    def rows() -> list[Event]:
        bad = set(suspects) if suspects or unanimous else set(range(len(lanes)))
        # Every rank holds a whole replica: the vote compared len(lanes) of them (one: a single process, nothing).
        return [Event(step, "consensus", r, "fail" if r in bad else "pass", lane, loss=float(len(lanes)))
                for r, lane in enumerate(lanes)]

    return rows
