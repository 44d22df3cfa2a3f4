"""The update oracle: every step, a peer recomputes a rotating slice of each rank's optimizer update.

A shard only one rank holds (pure FSDP, a tensor-parallel slice, a pipeline stage) has no replica to compare
with, and a wrong update of it reaches every rank through the next all-gather, where no later check can tell
it from a right one. The oracle gives each update an independent witness. Before the update, each rank copies
one slice of every tensor it updates (the parameter, its gradient, its optimizer state); after it, the rank
sends the slice's inputs, the group's hyperparameters and the fingerprint lanes of what its update wrote to
the next rank of a ring (point to point: each rank moves only its own slice). That rank recomputes the slice
with the same optimizer class and settings on its own device and compares lanes. The optimizers it knows
(``ELEMENTWISE``) update each element from that element's inputs alone, so a slice computes exactly what the
same elements computed inside the whole tensor (bitwise: ``tests/test_oracle.py`` checks each).

The mismatch travels in the next step's gathered row, so the oracle adds no host sync; the next update is
withheld when it fails. A third rank then recomputes the same slice: it agrees with the first witness (the
owner's update was wrong: the owner is named) or with the owner (the first witness computed wrongly: it is
named). With two ranks there is no third and nobody is named.

Which slice: the elements of every tensor it updates, laid end to end, are cut into ``slices`` equal windows
and turn ``t`` checks window ``t mod slices`` (``recompute.turn_pieces``: a few whole tensors and parts of two),
so a persistent fault in one element's update is caught within ``slices`` steps, and a one-off fault in one
element at its step with probability ``1/slices``. A window of whole tensors, rather than a piece of every
tensor, keeps the per-tensor work (Python, kernel launches) to a few tensors a step.

A state bit flip at rest is not this module's: the owner ships the flipped value and the recompute agrees
with it; the at-rest chain (``chain``) sees it. An optimizer it does not know (per-tensor norms, factored or
quantised state: LAMB, Adafactor, 8-bit Adam) cannot be sliced: the oracle does not run, and the coverage says so.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..comm import Communicator
from ..dtensors import held
from ..history import NO_RANK, Event
from .recompute import Part, item_lanes, piece, recompute, turn_pieces
from .stats import Verdict, host_row

__all__ = ["CARRY", "ELEMENTWISE", "UpdateOracle", "elementwise_optimizer", "elementwise_state", "piece"]

# Optimizers whose update of an element reads that element's parameter, gradient and state alone (and scalars).
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Rprop, torch.optim.ASGD)
CARRY = 10  # the values each rank's gathered row carries for the oracle (``UpdateOracle.carry``, ``replicas``)


def elementwise_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer the oracle can slice, under the wrappers frameworks put around it (Accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``): ``None`` when it is not one it knows. An exact
    class match: a subclass may change the update."""
    for _ in range(4):
        if type(optimizer) in ELEMENTWISE:
            return optimizer  # type: ignore[no-any-return]
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _described(t: torch.Tensor) -> list[Any]:
    return [str(t.dtype), list(t.shape)]


class UpdateOracle:
    """One rank's side of the oracle: it ships its own slice and recomputes the previous rank's (module doc).

    Call :meth:`carry` before the step's gather, :meth:`agree` with every rank's carried values, then
    :meth:`before_update` and :meth:`after_update` around ``optimizer.step()``; :meth:`settle` at a save."""

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Communicator, slices: int, device: torch.device) -> None:
        self.optimizer, self.comm, self.slices, self.device = optimizer, comm, slices, device
        self.turn = 0
        # This turn's payload, allocated whole before the update, and how many of its bytes (the slices as the
        # update reads them) are filled: the rest is written after it, so the slices are copied once.
        self._inputs: tuple[torch.Tensor, int] | None = None
        self._size = 0  # this turn's payload bytes
        # Each parameter's item of the structure, kept while its state stays the same (``_plan``).
        self._described: dict[int, tuple[tuple[Any, tuple[Any, ...]], list[Any]]] = {}
        self._digested: tuple[Any, int] = (None, 0)  # the structure's digest, and what it was taken of
        self._items: list[tuple[int, torch.Tensor, tuple[int, int]]] = []  # this turn's (group, parameter, window)
        self._picked: list[list[Any]] = []  # their items of the structure
        self._hyper: list[float] = []  # the groups' numeric hyperparameters at this update
        self._structure: dict[str, Any] = {}  # what the receiver needs to rebuild this rank's slice
        self._sent: _Sent | None = None  # the last slice shipped (kept for a tiebreak)
        self._flag: torch.Tensor | None = None  # float64[2]: elements checked, mismatches (of the rank before)
        self._theirs: dict[int, dict[str, Any]] = {}  # each rank's structure, as last exchanged
        self._digests: list[int] = []
        self._sizes: list[int] = []  # each rank's payload bytes at this step's update
        self.diverged = False  # never: its recompute starts from the owner's own inputs (``replicas`` can be)
        self._incoming: tuple[Callable[[], torch.Tensor], _Sent] | None = None  # the transfer under way
        # Whether the optimizer's own step ran: a wrapper may skip it (a gradient scaler that found an Inf), and a
        # slice of an update that never happened must not be recomputed as one.
        self._ran = False
        optimizer.register_step_post_hook(self._stepped)

    # ------------------------------------------------------------ the owner
    def _plan(self) -> None:
        """This turn's items (every parameter with a gradient and local elements) and the structure describing
        their slices, computed on the host from shapes and dtypes alone (and kept per parameter while its state
        is the same dict with the same keys: describing every parameter every step was most of this call)."""
        items: list[tuple[int, torch.Tensor]] = []
        described: list[Any] = []
        kept: dict[int, tuple[tuple[Any, tuple[Any, ...]], list[Any]]] = {}
        for gi, group in enumerate(self.optimizer.param_groups):
            fused = bool(group.get("fused"))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.optimizer.state.get(p)
                # The state dict itself is in the key, compared by identity (held, so its id cannot be reused by
                # another while cached; its values are tensors, which have no truth value).
                key = (gi, fused, p.grad.dtype, len(state) if state is not None else -1)
                cached = self._described.get(id(p))
                hit = cached is not None and cached[0][0] is state and cached[0][1] == key
                entry = cached[1] if cached is not None and hit else self._describe(gi, p, state or {}, fused)
                if entry is None:
                    continue
                if entry[5] == "{}" and state is not None:  # non-tensor state can change every step: not kept
                    kept[id(p)] = ((state, key), entry)
                items.append((gi, p))
                described.append(entry)
        self._described = kept
        pieces = turn_pieces(tuple(d[1] for d in described), self.slices, self.turn)
        self._items = [(items[i][0], items[i][1], (lo, hi)) for i, lo, hi in pieces]
        self._picked = [described[i] for i, _, _ in pieces]
        groups = []
        hyper: list[float] = []
        for group in self.optimizer.param_groups:
            shape: dict[str, Any] = {}
            for k, v in sorted(group.items()):
                if k == "params":
                    continue
                if isinstance(v, bool) or v is None or isinstance(v, str):
                    shape[k] = ["j", v]
                elif isinstance(v, (int, float)):
                    shape[k] = ["i" if isinstance(v, int) else "f", len(hyper)]
                    hyper.append(float(v))
                elif isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                          for x in v):
                    shape[k] = ["t", len(hyper), ["i" if isinstance(x, int) else "f" for x in v]]
                    hyper += [float(x) for x in v]
                else:
                    shape[k] = ["r", repr(v)]  # a tensor learning rate, an object: the receiver cannot rebuild it
            groups.append(shape)
        self._hyper = hyper
        self._structure = {"items": described, "groups": groups, "hyper": len(hyper)}

    @staticmethod
    def _describe(gi: int, p: torch.Tensor, state: dict[str, Any], fused: bool) -> list[Any] | None:
        """One parameter's item of the structure (``None``: no local elements to update)."""
        lp = held(p)
        if lp.numel() == 0:
            return None
        # A scalar may live on the host beside a GPU parameter (Adam's step count): rebuilt where it was.
        entries = [[k, "e" if elementwise_state(v, lp) else "h" if held(v).device.type == "cpu" else "w",
                    *_described(held(v))] for k, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
        others = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
        try:
            kept = json.dumps(others, sort_keys=True)
        except (TypeError, ValueError):
            kept = None  # state the receiver cannot rebuild: this item is shipped, not checked
        # A fused kernel is not bitwise under slicing (on a CPU its vector body and scalar tail round
        # differently): its outputs are shipped and compared within a rounding bound instead of bitwise.
        return [gi, lp.numel(), str(lp.dtype), str(held(p.grad).dtype), entries, kept, fused]

    def carry(self) -> torch.Tensor:
        """``float64[6]`` for this step's gathered row: the verdict on the previous rank's last update (elements
        checked, mismatches), this rank's structure digest and the bytes it will ship after this update."""
        self._finish()
        self._plan()
        same = (tuple(map(id, self._structure["items"])), self._structure["groups"])
        if same != self._digested[0]:
            self._digested = (same, zlib.crc32(json.dumps(self._structure, sort_keys=True).encode()))
        digest = self._digested[1]
        self._size = _payload_bytes(self._structure, self.slices, self.turn)
        return torch.cat([self._pending(), host_row([float(digest), float(self._size)] + [0.0] * 6, self.device)])

    def _pending(self) -> torch.Tensor:
        flag = self._flag if self._flag is not None else torch.zeros(2, dtype=torch.float64, device=self.device)
        self._flag = None
        return flag

    def agree(self, carried: Sequence[Sequence[float]]) -> Verdict | None:
        """Every rank's carried values: the verdict on the last update's recomputations (``None`` when none ran),
        then the structures exchanged where one changed (collective: the same decision on every rank)."""
        verdict = self._judge([c[:2] for c in carried])
        digests = [int(c[2]) for c in carried]
        self._sizes = [int(c[3]) for c in carried]
        if digests != self._digests:
            got = self.comm.gather_bytes(json.dumps(self._structure, sort_keys=True).encode())
            self._theirs = {r: json.loads(b) for r, b in enumerate(got)}
            self._digests = digests
        return verdict

    def settle(self) -> Verdict | None:
        """Collective, at a save: the verdict on the last update's recomputations now, not at the next step."""
        self._finish()
        return self._judge(self.comm.all_gather_rows(self._pending()).tolist())

    def _finish(self) -> None:
        """The previous rank's slice, sent after the last update while this rank went on (its forward and
        backward hide the transfer): received now, and recomputed."""
        if self._incoming is not None:
            wait, sent = self._incoming
            self._incoming = None
            owner = (self.comm.rank - 1) % self.comm.world
            structure = sent.structures.get(owner)
            got = wait()
            self._flag = torch.zeros(2, dtype=torch.float64, device=self.device) if structure is None else \
                recompute(self.optimizer, structure, got.to(self.device), self.slices, sent.turn)

    def _stepped(self, *_: Any) -> None:
        self._ran = True

    def before_update(self) -> None:
        """Copy this turn's slice of every updated tensor as the update will read it: one ``cat`` of their bytes
        (a copy per tensor was a kernel launch and a Python call each)."""
        self._ran = False
        views: list[torch.Tensor] = []
        for (_, p, (lo, hi)), described in zip(self._items, self._picked, strict=True):
            state = self.optimizer.state.get(p, {})
            views += [held(p).detach().reshape(-1)[lo:hi], held(p.grad).reshape(-1)[lo:hi]]
            # The plan's kinds (``_plan``): whether each state tensor is sliced with the parameter, found once.
            views += [held(state[k]).detach().reshape(-1)[lo:hi] if kind == "e" else held(state[k]).detach()
                      for k, kind, *_ in described[4]]
        buf = torch.empty(self._size, dtype=torch.uint8, device=self.device)
        n = _bytes_into(views, buf, 0)
        self._inputs = (buf, n)

    def after_update(self, step: int) -> None:
        """Ship the slice (inputs, hyperparameters, lanes of what the update wrote) to the next rank, and
        recompute the previous rank's: the mismatch is carried in the next step's row."""
        afters, raw = [], []
        for (_, p, (lo, hi)), described in zip(self._items, self._picked, strict=True):
            lp = held(p)
            state = self.optimizer.state.get(p, {})
            after = [lp.detach().reshape(-1)[lo:hi]]
            # Every state tensor after the update, by the plan's kinds where the update kept its keys (the first
            # update creates them: the plan, made before, has none).
            kinds = described[4]
            if len(kinds) == len(state) and all(k in state for k, *_ in kinds):
                after += [held(state[k]).reshape(-1)[lo:hi] if kind == "e" else held(state[k]) for k, kind, *_ in kinds]
            else:
                after += [held(v).reshape(-1)[lo:hi] if elementwise_state(v, lp) else held(v)
                          for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)]
            afters.append(after)
            if described[6]:  # fused: what was written, for a comparison within rounding (the entries shipped in)
                raw += [after[0]] + [held(state[k]).reshape(-1)[lo:hi] if kind == "e" else held(state[k])
                                     for k, kind, *_ in described[4]]
        outs = list(item_lanes(afters, self.device))
        payload, n = self._inputs if self._inputs is not None else (
            torch.empty(self._size, dtype=torch.uint8, device=self.device), 0)
        n = _bytes_into([*[t.detach() for t in raw], host_row([*self._hyper, float(self._ran)], self.device), *outs],
                        payload, n)
        if n != payload.numel():  # the plan's size and what was packed disagree: a bug, never a verdict on a rank
            raise RuntimeError(f"update oracle: packed {n} bytes where the plan said {payload.numel()}")
        self._sent = _Sent(payload, step, self.turn, list(self._sizes), dict(self._theirs))
        self._inputs = None
        owner = (self.comm.rank - 1) % self.comm.world
        self._incoming = (self.comm.shift_start(payload, self._sizes[owner], by=1), self._sent)
        self.turn += 1

    def _witness(self, sent: _Sent, back: int) -> torch.Tensor:
        """Recompute the slice of the rank ``back`` places before this one, from what it shipped at ``sent``'s
        update (collective); ``float64[2]``: elements checked and whether what it reported differs."""
        owner = (self.comm.rank - back) % self.comm.world
        got = self.comm.shift(sent.payload, sent.sizes[owner], by=back)
        structure = sent.structures.get(owner)
        if structure is None:
            return torch.zeros(2, dtype=torch.float64, device=self.device)
        return recompute(self.optimizer, structure, got.to(self.device), self.slices, sent.turn)

    def _judge(self, flags: Sequence[Sequence[float]]) -> Verdict | None:
        sent, world = self._sent, len(flags)
        if sent is None or not any(f[0] or f[1] for f in flags):
            return None  # nothing was recomputed (the first step, or after a restore)
        differ = [(r - 1) % world for r, f in enumerate(flags) if f[1]]  # the owner each mismatch is about

        def rows(failed: Sequence[int]) -> Any:  # one job-wide pass row, or a fail row per rank in question
            return lambda: [Event(sent.step, "oracle", r, "fail") for r in failed] or [
                Event(sent.step, "oracle", NO_RANK, "pass")]

        if not differ:
            return Verdict("oracle", True, rows=rows([]))
        named: set[int] = set()
        if world >= 3:
            second = self.comm.all_gather_rows(self._witness(sent, 2)).tolist()
            for o in differ:
                if second[(o + 2) % world][1]:
                    named.add(o)  # two other ranks agree that the owner's update is not what its inputs give
                else:
                    named.add((o + 1) % world)  # a third rank reproduces the owner: its first witness was wrong
        detail = (f"recomputing a slice of rank(s) {differ}'s optimizer update of step {sent.step} on another rank "
                  "gave other values" + (f"; a third rank names rank(s) {sorted(named)}" if named else
                                         "; with two ranks there is no third to tell which is wrong"))
        # A persistent fault in one element's update would have been caught when its piece was last checked,
        # ``slices`` turns ago: the state is suspect from the update after that.
        first_suspect = max(0, sent.step - self.slices + 1)
        return Verdict("oracle", False, sorted(named), detail, first_suspect, rows(differ))

    def reset(self) -> None:
        """State was restored: nothing shipped before is evidence (a transfer under way is waited for and dropped:
        every rank started it, and the next must not meet it)."""
        if self._incoming is not None:
            self._incoming[0]()
        self._flag = self._sent = self._incoming = None


@dataclasses.dataclass(frozen=True)
class _Sent:
    """What a rank shipped after one update, kept until its recomputations are judged (a tiebreak needs it)."""

    payload: torch.Tensor
    step: int
    turn: int
    sizes: list[int]  # every rank's payload bytes at that update
    structures: dict[int, dict[str, Any]]  # every rank's structure at that update


def elementwise_state(v: torch.Tensor, lp: torch.Tensor) -> bool:
    """Whether a state tensor holds one value per parameter element (sliced with it) rather than a scalar."""
    return tuple(held(v).shape) == tuple(lp.shape) and v.dim() > 0


def _payload_bytes(structure: dict[str, Any], slices: int, turn: int) -> int:
    """The bytes a rank ships for ``structure`` at ``turn`` (inputs, hyperparameters, 16 per item's lanes)."""
    n, described = 0, structure["items"]
    pieces = turn_pieces(tuple(d[1] for d in described), slices, turn)
    for (_, _, pdtype, gdtype, entries, _, fused), (_, lo, hi) in zip([described[i] for i, _, _ in pieces], pieces,
                                                                     strict=True):
        state = sum(Part(dt, (hi - lo,) if kind == "e" else tuple(shape)).nbytes for _, kind, dt, shape in entries)
        n += Part(pdtype, (hi - lo,)).nbytes + Part(gdtype, (hi - lo,)).nbytes + state
        if fused:  # its outputs too (``after_update``)
            n += Part(pdtype, (hi - lo,)).nbytes + state
    return n + 8 * (int(structure["hyper"]) + 1) + 16 * len(pieces)  # the last number: whether it ran


def _bytes_into(tensors: Sequence[torch.Tensor], out: torch.Tensor, at: int) -> int:
    """Copy the tensors' bytes, one after another, into ``out`` (``uint8``) from byte ``at`` on, in one ``cat``;
    where the copy ends."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    parts = [t if t.device == out.device else t.to(out.device) for t in parts]
    n = sum(t.numel() for t in parts)
    if n:
        torch.cat(parts, out=out[at:at + n])
    return at + n
