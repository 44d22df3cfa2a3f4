"""The witnesses of the optimizer update, composed once: the at-rest chain (every holder's state, ``chain``), the
update oracle and the gradient scaler, around each update and at each save.

``SDCGuard`` runs the same sequence on every layout: ``before_update``, ``update``, ``after_update``, then the
state faults and a consensus when one is due; at the next step ``carry`` travels in the step's gathered row and
``judge_carried`` judges every rank's; at a save ``settle`` judges them now. A part that does not run (one process,
an optimizer the oracle cannot recompute, no scaler) is a null part with the same methods, so the loop has no
``if x is not None``. Every verdict goes through the guard's ``judge`` (counted, raised on failure). The chain
has a second role, in the consensus: which of this rank's pieces changed at rest (``chain.moved``), for the
two-holder tiebreak.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import SilentCorruptionDetected
from ..evidence import NO_ORACLE, NOT_WITNESSED
from .chain import StateChain
from .oracle import CARRY, UpdateOracle, elementwise_optimizer
from .replicas import ReplicaOracle
from .scaling import Scaling
from .stats import Verdict

if TYPE_CHECKING:
    from ..comm import Communicator
    from .protocol import Layout
    from .steprow import RankRow

__all__ = ["NOT_REPLAYED", "NullScaling", "Witnesses"]

# Incidents the witnesses raise before an update that a replay cannot reproduce (it recomputes gradients): a wrong
# update, a change at rest, and the consensus the chain runs when several ranks' state changed at once.
NOT_REPLAYED = ("oracle", "chain", "consensus", "nonfinite_state", "buffers")


class NullScaling:
    """No gradient scaler: backward and the update as the loop would run them."""

    on = False

    def scale_now(self, device: torch.device) -> torch.Tensor | None:
        return None

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to unscale."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def settle(self) -> None:
        """Nothing to end."""


class _NullOracle:
    """No update oracle (one process, or an optimizer whose update it cannot recompute): zeros in the row."""

    diverged = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def carry(self) -> torch.Tensor:
        return torch.zeros(CARRY, dtype=torch.float64, device=self.device)

    def before_update(self) -> None:
        """Nothing to copy."""

    def after_update(self, step: int) -> None:
        """Nothing to ship."""

    def agree(self, carried: Sequence[Sequence[float]]) -> Verdict | None:
        return None

    def settle(self) -> Verdict | None:
        return None

    def reset(self) -> None:
        """Nothing held."""


class Witnesses:
    """This rank's witnesses of the update (module doc).

    Args:
        params: the guard's parameters, in its order.
        optimizer: the optimizer whose update they witness.
        layout: who holds which pieces (``owned``) and this rank's state in its consensus's order (``local_state``).
        comm: the guard's communicator (a save's ``settle`` gathers).
        slices: ``GuardConfig.oracle_slices`` (0: no oracle).
        scaler: the job's gradient scaler, or :class:`NullScaling`.
        judge: the guard's ``judge(step, verdict)``: counts, and raises a failed verdict.
        consensus: the layout's ``consensus(step)`` (collective; judges and raises), which decides per piece when
            several ranks' state changed at rest at once (:meth:`_judge_chain`).
    """

    def __init__(self, params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, layout: Layout,
                 comm: Communicator, *, slices: int, scaler: Scaling | NullScaling,
                 judge: Callable[[int, Verdict], None], consensus: Callable[[int], object]) -> None:
        device, world = comm.device, comm.world
        self.optimizer, self.comm, self.device, self.scaler, self._judge = optimizer, comm, device, scaler, judge
        self._consensus = consensus
        # Every holder chains all its state, replicated or not: a flip in a replicated piece reaches every rank
        # through the computation before any consensus compares the copies, so only its holder can name itself.
        # A judge needs a second rank (one rank's change alone is software).
        self.chain = StateChain(layout.local_state, device, on=world >= 2)
        # The single-owner evidence (``oracle``, ``chain``): a peer recomputes a slice of every rank's update.
        sliced = elementwise_optimizer(optimizer) if world >= 2 and slices else None
        self.owned = [p for p, alone in zip(params, layout.owned(), strict=True) if alone]
        # Where every rank holds the whole state (DDP), the replicas' own updates of a slice are its recomputation.
        oracle: type[ReplicaOracle] | type[UpdateOracle] = UpdateOracle
        if not self.owned and layout.replicas == world:
            oracle = ReplicaOracle
        self.oracle: UpdateOracle | ReplicaOracle | _NullOracle = (
            oracle(sliced, comm, slices, device) if sliced else _NullOracle(device))
        self._chain_checked: int | None = None  # the step of the last save whose chain held, until the next update
        # The step of the last update, and of the last one whose recomputation the oracle passed (at the next step's
        # carry or at a save's settle, whichever judged it): facts about the state, so that a save's evidence does
        # not depend on which call judged them first (``guard.consensus(step)`` before ``save(step)``).
        self._updated: int | None = None
        self._oracle_ok: int | None = None

    # ------------------------------------------------------------ around the update
    def before_update(self) -> None:
        self.scaler.unscale(self.optimizer)  # the oracle ships the gradients the update will use
        self.oracle.before_update()

    def update(self) -> None:
        """The optimizer's update (through the scaler, which skips it when the gradients overflowed)."""
        self.scaler.step(self.optimizer)

    def after_update(self, step: int) -> None:
        self.chain.after_update()
        self.oracle.after_update(step)
        self._updated, self._chain_checked = step, None  # a save's check spoke for the state before this update

    @property
    def diverged(self) -> bool:
        """The oracle found the replicas' inputs already apart: a consensus decides who."""
        return self.oracle.diverged

    # ------------------------------------------------------------ at the next step
    def carry(self) -> list[tuple[str, torch.Tensor]]:
        """The step row's segments the chain and the oracle carry (zeros for the ones not running)."""
        return [("chain", self.chain.carry()), ("oracle", self.oracle.carry())]

    def judge_carried(self, s: int, rows: Sequence[RankRow]) -> None:
        """The chain's and the oracle's verdicts from every rank's carry (the same on every rank), before the
        layout's own checks: a change at rest or a wrong update is the cause of what those would see next."""
        self._judge_chain(s, [r.floats("chain") for r in rows])
        v = self.oracle.agree([r.floats("oracle") for r in rows])
        if v is not None:
            self._judge(s, v)
            self._oracle_ok = self._updated  # passed (a failure raised): the oracle's verdict on the last update

    def _judge_chain(self, step: int, carried: list[list[float]]) -> Verdict | None:
        """Judge the chain over every rank's carry (the same on every rank); the verdict, ``None`` without a
        baseline. One rank's change is that rank's. When several ranks' state changed at once (every rank's
        included), more often code than one fault each, the consensus runs first (collective: every rank reaches
        the same verdict) and decides per piece with the chain's flags, as it does right after an update: holders
        of one piece whose copies all changed are software divergence, a minority of three or more holders is
        outvoted. What it cannot compare, or finds alike (pieces held once, the same write on every copy), stays
        the chain's verdict: the ranks named, or software when every rank's state changed."""
        v = StateChain.judge(step, carried, step)
        if v is not None and not v.ok and sum(1 for c in carried if c[0]) >= 2:
            self._consensus(step)
        if v is not None:
            self._judge(step, v)
        return v

    def forget(self) -> None:
        """A check failed, or state was restored: what the chain and the oracle hold is about a state the job rolls
        back, repairs or has replaced."""
        self.chain.reset()
        self.oracle.reset()
        self._chain_checked = self._oracle_ok = None

    # ------------------------------------------------------------ at a save
    def settle(self, step: int) -> None:
        """Collective, at a save: the chain checked now (the state is still what the last update wrote) and the
        oracle's last recomputations judged, rather than at the next step; the save's evidence says whether
        they ran (:meth:`single_owner_evidence`).

        Raises:
            SilentCorruptionDetected: a rank's state changed at rest, or a recomputed update differs.
        """
        try:
            if self.chain.on:
                v = self._judge_chain(step, self.comm.all_gather_rows(self.chain.carry()).tolist())
                self._chain_checked = step if v is not None else None
            if (v := self.oracle.settle()) is not None:
                self._judge(step, v)
                self._oracle_ok = self._updated
        except SilentCorruptionDetected:
            self.forget()
            raise

    def single_owner_evidence(self, step: int) -> bool:
        """Whether state without a replica carries its own evidence at a save of ``step``: this rank holds such
        state, the chain held at this save (:meth:`settle`) and the oracle passed the update that wrote it."""
        return bool(self.owned) and self.comm.world >= 2 and self.owner_problem(step) is None

    def owner_problem(self, step: int) -> str | None:
        """Why this rank's state without a replica has no evidence of its own at a save of ``step``, in the words a
        manifest records (``None``: it has, or this rank holds none). The same after any number of :meth:`settle`
        calls at that step: each judges what the previous left, and the facts are kept."""
        if not self.owned or self.comm.world < 2:
            return None  # nothing held alone, or one process: "a single replica" is then the cause
        if isinstance(self.oracle, _NullOracle):
            return NO_ORACLE
        if self._chain_checked != step or self._updated is None or self._oracle_ok != self._updated:
            return NOT_WITNESSED
        return None

    def vouched(self, step: int) -> list[tuple[torch.Tensor, str]] | None:
        """After :meth:`settle` at a save of ``step``: each tensor of this rank's state with the fingerprint its last
        update wrote, which the chain has just found it still holds: what the save must write. ``None`` where the
        chain did not hold at this save (the same on every rank: the verdict is the job's)."""
        return self.chain.written() if self._chain_checked == step else None


def scaling(scaler: Any) -> Scaling | NullScaling:
    """The job's gradient scaler as the guard drives it (refused at once when it is not one)."""
    return Scaling(scaler) if scaler is not None else NullScaling()
