"""Fault injection: parse ``SITE:RANK:STEP[:MODE]`` specs and corrupt tensors on cue.

Sites (where a faulty GPU's wrong number enters):
    grad       one rank's local gradient bucket, before the all-reduce
    allreduce  one rank's averaged result, after the all-reduce
    weights    one rank's first parameter, after the optimizer update
    buffers    one rank's first floating-point module buffer, after the optimizer update
    optim      one rank's optimizer state (the first parameter's ``exp_avg_sq``, or its first
               floating-point state tensor), after the optimizer update
    compute    one rank's forward output (also during audit recomputation on that rank)

Steps: ``S`` fires during the first execution of step S only (a transient
fault: a step replayed after a rollback runs clean); ``S-`` every step from S
on; ``S-E`` every step from S to E inclusive (persistent faults).

Modes: ``nan`` and ``inf`` set one element; ``bitflip=B`` flips bit B of one
element's bit pattern; ``elem=F`` multiplies one element by F; ``scale=F``
multiplies the whole tensor by F. "One element" is element 0 of the target,
or element K with a ``@K`` suffix (``bitflip=22@1234``; taken modulo the
target's size), so injections are reproducible. RANK ``*`` fires on every rank
alike (the same wrong value everywhere, as a faulty reduction would deliver).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

SITES = ("grad", "allreduce", "weights", "buffers", "optim", "compute")

_SPEC = re.compile(r"^(?P<site>[a-z]+):(?P<rank>\d+|\*):(?P<start>\d+)(?P<dash>-(?P<end>\d+)?)?"
                   r"(?::(?P<mode>[^@]+)(?:@(?P<at>\d+))?)?$")
EVERY_RANK = -1
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclasses.dataclass(frozen=True)
class Fault:
    site: str
    rank: int
    start: int
    end: int | None  # None: open-ended (``S-``)
    once: bool  # ``S``: fires during the first execution of step S only
    mode: str  # nan | inf | bitflip | elem | scale
    arg: float = 0.0
    at: int = 0  # the element, modulo the target's size

    @property
    def spec(self) -> str:
        steps = str(self.start) if self.once else f"{self.start}-{'' if self.end is None else self.end}"
        mode = self.mode if self.mode in ("nan", "inf") else f"{self.mode}={self.arg:g}"
        rank = "*" if self.rank == EVERY_RANK else str(self.rank)
        return f"{self.site}:{rank}:{steps}:{mode}" + (f"@{self.at}" if self.at else "")

    def covers(self, step: int) -> bool:
        if self.once:
            return step == self.start
        return step >= self.start and (self.end is None or step <= self.end)

    def apply(self, t: torch.Tensor) -> None:
        """Corrupt ``t`` in place."""
        with torch.no_grad():
            flat = t.view(-1)
            if flat.numel() == 0:
                return
            k = self.at % flat.numel()
            if self.mode == "nan":
                flat[k] = float("nan")
            elif self.mode == "inf":
                flat[k] = float("inf")
            elif self.mode == "scale":
                t.mul_(self.arg)
            elif self.mode == "elem":
                flat[k] *= self.arg
            elif self.mode == "bitflip":
                bits = flat[k : k + 1].view(_INT_VIEW[t.element_size()])
                bit = int(self.arg)
                if bit == 8 * t.element_size() - 1:  # the sign bit: xor with the minimum value
                    bits ^= torch.iinfo(bits.dtype).min if bits.dtype != torch.uint8 else 0x80
                else:
                    bits ^= 1 << bit


def parse(spec: str) -> Fault:
    """Parse one ``SITE:RANK:STEP[:MODE]`` spec (MODE defaults to ``nan``).

    Raises:
        ValueError: with the offending part named.
    """
    m = _SPEC.match(spec.strip())
    if not m:
        raise ValueError(f"fault spec {spec!r} is not SITE:RANK:STEP[:MODE], e.g. grad:1:40:bitflip=30")
    site = m["site"]
    if site not in SITES:
        raise ValueError(f"fault spec {spec!r}: unknown site {site!r}; use one of {', '.join(SITES)}")
    start = int(m["start"])
    end = int(m["end"]) if m["end"] else None
    if end is not None and end < start:
        raise ValueError(f"fault spec {spec!r}: step range ends before it starts")
    mode_text = m["mode"] or "nan"
    arg = 0.0
    if mode_text in ("nan", "inf"):
        mode = mode_text
    else:
        mode, sep, value = mode_text.partition("=")
        if mode not in ("scale", "elem", "bitflip") or not sep:
            raise ValueError(f"fault spec {spec!r}: mode must be nan, inf, scale=F, elem=F or bitflip=B")
        try:
            arg = float(value) if mode in ("scale", "elem") else int(value)
        except ValueError:
            raise ValueError(f"fault spec {spec!r}: {mode} needs a number, got {value!r}") from None
        if mode == "bitflip" and not 0 <= arg < 64:
            raise ValueError(f"fault spec {spec!r}: bit must be in 0..63")
    rank = EVERY_RANK if m["rank"] == "*" else int(m["rank"])
    return Fault(site, rank, start, end, once=m["dash"] is None, mode=mode, arg=arg, at=int(m["at"] or 0))


class FaultPlan:
    """The faults of one process; asks "does anything fire here, now?"."""

    def __init__(self, specs: tuple[str, ...] | list[str] = ()) -> None:
        self.faults = [parse(s) for s in specs]
        self._spent: set[int] = set()  # indices of once-faults whose step has run

    def __bool__(self) -> bool:
        return bool(self.faults)

    def firing(self, site: str, rank: int, step: int | None) -> list[Fault]:
        if step is None:
            return []
        return [f for i, f in enumerate(self.faults)
                if f.site == site and f.rank in (rank, EVERY_RANK) and f.covers(step) and i not in self._spent]

    def apply(self, site: str, rank: int, step: int | None, t: torch.Tensor) -> bool:
        fired = self.firing(site, rank, step)
        for f in fired:
            f.apply(t)
        return bool(fired)

    def inject_state(self, rank: int, step: int, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor],
                     optimizer: torch.optim.Optimizer) -> None:
        """The state sites, after the optimizer update: the first parameter, the first floating buffer, and
        the first parameter's ``exp_avg_sq`` (or first floating state tensor); a DTensor's local shard."""
        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t  # a sharded (FSDP) tensor: this rank's piece

        if self.firing("weights", rank, step) and params:
            self.apply("weights", rank, step, local(params[0]).data)
        floats = [b for b in buffers if b.is_floating_point()]
        if self.firing("buffers", rank, step) and floats:
            self.apply("buffers", rank, step, floats[0].data)
        first = optimizer.state.get(params[0], {}) if params else {}
        target = first.get("exp_avg_sq", next((v for v in first.values() if torch.is_tensor(v) and v.is_floating_point()), None))
        if self.firing("optim", rank, step) and target is not None:
            self.apply("optim", rank, step, local(target))

    def step_done(self, step: int) -> None:
        """A step finished (or was abandoned): its once-faults never fire again."""
        for i, f in enumerate(self.faults):
            if f.once and f.start == step:
                self._spent.add(i)

    def has_site(self, site: str) -> bool:
        return any(f.site == site for f in self.faults)

    def hook_compute(self, module: torch.nn.Module, rank: int, step: Callable[[], int | None],
                     skip: Callable[[], bool] = lambda: False) -> None:
        """The ``compute`` site: ``module``'s forward output on ``rank``, also when it recomputes for an audit
        (not while ``skip()``: a warm-up pass). ``step()`` is the step in progress or, between steps (a save's
        audit), the last one: a persistent fault is still there then."""
        if not self.has_site("compute"):
            return

        def hook(mod: torch.nn.Module, args: Any, output: Any) -> Any:
            s = step()
            if skip() or not isinstance(output, torch.Tensor) or not self.firing("compute", rank, s):
                return None
            output = output.clone()
            self.apply("compute", rank, s, output)
            return output

        module.register_forward_hook(hook)
