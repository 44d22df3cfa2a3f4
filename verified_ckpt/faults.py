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
element's bit pattern; ``bits=B+B+...`` flips several bits of one element (most
hardware bit-flip events are not single-bit); ``burst=B`` flips bit B in 32
consecutive elements and ``burst=B/S`` in 32 elements S apart (the warp-aligned
spacing corrupted addresses repeat with); ``stuck=V`` sets one element to V (with
``S-``, a lane stuck at V from step S on); ``elem=F`` multiplies one element by F
(with ``S-``, a persistent multiplier); ``scale=F`` multiplies the whole tensor
by F. "One element" is element 0 of the target, or element K with a ``@K``
suffix (``bitflip=22@1234``; taken modulo the target's size), so injections are
reproducible. A bit is 0..63 in a spec and must lie within the target's element
when the fault fires (0..15 in a 2-byte tensor): a bit beyond it is a ``ValueError``. RANK ``*`` fires on every rank
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
    mode: str  # nan | inf | bitflip | bits | burst | stuck | elem | scale
    arg: float = 0.0
    at: int = 0  # the element, modulo the target's size
    bits: tuple[int, ...] = ()  # ``bits``: the bits flipped in one element
    stride: int = 1  # ``burst``: the distance between its 32 elements

    @property
    def spec(self) -> str:
        steps = str(self.start) if self.once else f"{self.start}-{'' if self.end is None else self.end}"
        if self.mode in ("nan", "inf"):
            mode = self.mode
        elif self.mode == "bits":
            mode = "bits=" + "+".join(map(str, self.bits))
        elif self.mode == "burst":
            mode = f"burst={self.arg:g}" + (f"/{self.stride}" if self.stride != 1 else "")
        else:
            mode = f"{self.mode}={self.arg:g}"
        rank = "*" if self.rank == EVERY_RANK else str(self.rank)
        return f"{self.site}:{rank}:{steps}:{mode}" + (f"@{self.at}" if self.at else "")

    @property
    def flipped(self) -> tuple[int, ...]:
        """The bits this fault flips in an element (none for the modes that set or scale values)."""
        if self.mode == "bits":
            return self.bits
        return (int(self.arg),) if self.mode in ("bitflip", "burst") else ()

    def covers(self, step: int) -> bool:
        if self.once:
            return step == self.start
        return step >= self.start and (self.end is None or step <= self.end)

    def apply(self, t: torch.Tensor) -> None:
        """Corrupt ``t`` in place.

        Raises:
            ValueError: a bit this fault flips is outside ``t``'s element (``bitflip=20`` on a 2-byte tensor): the
                flip would change nothing while the fault counts as fired.
        """
        width = 8 * t.element_size()
        outside = [b for b in self.flipped if b >= width]
        if outside:
            raise ValueError(f"fault spec {self.spec!r}: bit {outside[0]} is outside a "
                             f"{str(t.dtype).removeprefix('torch.')} element (bits 0..{width - 1}); choose a bit "
                             f"below {width}")
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
            elif self.mode == "stuck":
                flat[k] = self.arg
            elif self.mode == "bitflip":
                _flip(flat[k : k + 1], (int(self.arg),))
            elif self.mode == "bits":
                _flip(flat[k : k + 1], self.bits)
            elif self.mode == "burst":
                lanes = torch.arange(BURST_LANES, device=t.device) * self.stride + k
                idx = lanes % flat.numel()  # a target smaller than the burst wraps round: fewer elements, each flipped once
                picked = flat[idx]
                _flip(picked, (int(self.arg),))
                flat[idx] = picked


BURST_LANES = 32  # a warp


def _flip(t: torch.Tensor, bits: tuple[int, ...]) -> None:
    """Flip ``bits`` of every element of ``t`` (contiguous) in place."""
    view = t.view(_INT_VIEW[t.element_size()])
    top = 8 * t.element_size() - 1
    mask = 0
    for b in set(bits):
        mask |= 1 << b
    if view.dtype != torch.uint8 and mask >> top & 1:  # the sign bit of a signed view: 1 << top does not fit it
        mask = mask - (1 << (top + 1))
    view ^= mask


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
    mode, arg, bits, stride = _mode(spec, m["mode"] or "nan")
    rank = EVERY_RANK if m["rank"] == "*" else int(m["rank"])
    return Fault(site, rank, start, end, once=m["dash"] is None, mode=mode, arg=arg, at=int(m["at"] or 0), bits=bits,
                 stride=stride)


def _mode(spec: str, mode_text: str) -> tuple[str, float, tuple[int, ...], int]:
    """A spec's MODE part: the mode, its number, the bits of ``bits=`` and the stride of ``burst=``."""
    arg: float = 0.0
    bits: tuple[int, ...] = ()
    stride = 1
    if mode_text in ("nan", "inf"):
        mode = mode_text
    else:
        mode, sep, value = mode_text.partition("=")
        if mode not in ("scale", "elem", "stuck", "bitflip", "bits", "burst") or not sep:
            raise ValueError(f"fault spec {spec!r}: mode must be nan, inf, scale=F, elem=F, stuck=V, bitflip=B, "
                             "bits=B+B, or burst=B[/S]")
        try:
            if mode in ("scale", "elem", "stuck"):
                arg = float(value)
            elif mode == "bits":
                bits = tuple(int(b) for b in value.split("+"))
            elif mode == "burst":
                bit, _, every = value.partition("/")
                arg, stride = int(bit), int(every or 1)
            else:
                arg = int(value)
        except ValueError:
            raise ValueError(f"fault spec {spec!r}: {mode} needs a number, got {value!r}") from None
        if any(not 0 <= b < 64 for b in (*bits, *([int(arg)] if mode in ("bitflip", "burst") else []))) or (
                mode == "bits" and not bits):
            raise ValueError(f"fault spec {spec!r}: a bit must be in 0..63")
        if stride < 1:
            raise ValueError(f"fault spec {spec!r}: a burst's stride must be at least 1")
    return mode, arg, bits, stride


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
