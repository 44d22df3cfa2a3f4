"""The verification evidence a manifest records, and the tracker that produces it for each save.

A checkpoint is ``restorable`` only with evidence: a unanimous consensus of
every replica's fingerprint taken for this save, no failed check since the
previous checkpoint, and (when audits are scheduled) at least one passed
recompute audit since the previous checkpoint, so that every kind of check covered the checkpoint's step (a save
runs the audit itself when none ran: ``audit_before_save``). The schema lives
here once: :class:`Evidence` writes it, :func:`evidence_problem` validates it
when a manifest is read, and :func:`consensus_claim` reads the claim back for
the ledger cross-check. Each manifest also says, per fault class, what was checked since the previous checkpoint
and how (:func:`checked_by_class`), so that ``restorable`` is read for what it is: no check that ran saw a fault,
not "no fault".
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .status import MAX_STEP, Status

__all__ = [
    "FAULT_CLASSES", "NOT_WITNESSED", "NO_AUDIT", "NO_ORACLE", "SINGLE_REPLICA", "CheckCounts", "ConsensusClaim",
    "Evidence", "EvidenceTracker", "checked_by_class", "consensus_claim", "evidence_basis", "evidence_problem",
    "remedies", "save_status",
]

SINGLE_REPLICA = "a single replica: no cross-replica consensus or audit is possible"
NO_AUDIT = "no recompute audit has passed since the previous checkpoint"
FAILED = "checks failed since the previous checkpoint: "
# Why state without a replica carries no evidence of its own at a save (``Witnesses.owner_problem``): the cause,
# where "a single replica" would name the mesh, which is not what is missing.
NO_ORACLE = ("state without a replica has no witness of its updates: the update oracle does not run (an optimizer it "
             "cannot recompute element-wise, or oracle_slices=0)")
NOT_WITNESSED = ("state without a replica has no checked update yet: the at-rest chain and the update oracle vouch "
                 "for what an update they checked wrote, and none has run since the job started or was restored")
# What to change, for each reason a save is not restorable (logged with it; the manifest keeps the reason).
_REMEDIES = {
    FAILED: "roll back: resume(state) on the restart, or `vckpt rollback RUN`",
    SINGLE_REPLICA: "on 2 or more ranks, state without a replica stands on the update oracle and the at-rest chain: use "
                    "an element-wise torch optimizer (AdamW, Adam, SGD...) and oracle_slices >= 1 (docs/GUARD.md, 'The "
                    "update oracle'); or train with 2 or more data-parallel replicas (3 or more to have suspects named)",
    NO_AUDIT: "keep GuardConfig(audit_before_save=True) (the default), which audits before such a save, or set "
              "audit_every to at most the save interval; a save before the first training step has nothing to audit",
    NO_ORACLE: "use an element-wise torch optimizer (AdamW, Adam, SGD...) and oracle_slices >= 1 (docs/GUARD.md, 'The "
               "update oracle')",
    NOT_WITNESSED: "save after a training step (guard.step()): the next save stands on the chain and the oracle",
    "saved without an SDCGuard": "pass guard=SDCGuard(...) to CheckpointManager (the Lightning and Hugging Face "
                                 "integrations do when their guard is installed)",
}


def remedies(reasons: Sequence[str]) -> list[str]:
    """The next step for each reason a save is not restorable (those this module knows)."""
    return [fix for r in reasons for prefix, fix in _REMEDIES.items() if r.startswith(prefix)]

_RANK = re.compile(r"(0|[1-9][0-9]{0,8})\Z")


@dataclasses.dataclass
class CheckCounts:
    """Per check kind: passes, failures, and the last step it passed."""

    passed: int = 0
    failed: int = 0
    last_pass: int | None = None
    coverage: float | None = None  # the share of backward FLOPs the check verifies each step (ABFT), once measured

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"passed": self.passed, "failed": self.failed, "last_pass": self.last_pass}
        if self.coverage is not None:
            d["coverage"] = self.coverage
        return d


@dataclasses.dataclass(frozen=True)
class ConsensusClaim:
    """A manifest's claim that every replica held these fingerprints at ``step``."""

    step: int
    unanimous: bool
    fingerprints: dict[int, str]  # rank -> 32 hex digits


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What the guard had established when a save committed."""

    consensus_step: int
    fingerprints: list[str]  # one per replica, in rank order; empty with one replica
    checks_since_previous: dict[str, CheckCounts]
    audits_enabled: bool
    audits_since_restorable: int
    single_owner: bool = False  # state without a replica stood on the update oracle and the at-rest chain
    checked: dict[str, str] = dataclasses.field(default_factory=dict)  # per fault class: what ran, and how

    def to_dict(self) -> dict[str, Any]:
        owner = {"single_owner": {"chain_step": self.consensus_step,
                                  "oracle_passed": self.checks_since_previous.get("oracle", CheckCounts()).passed}}
        return {**(owner if self.single_owner else {}),
            "consensus": {"step": self.consensus_step, "unanimous": bool(self.fingerprints),
                          "replicas": len(self.fingerprints),
                          "fingerprints": {str(r): fp for r, fp in enumerate(self.fingerprints)}},
            "checks_since_previous": {k: c.to_dict() for k, c in sorted(self.checks_since_previous.items())},
            "audits_enabled": self.audits_enabled,
            "audits_since_restorable": self.audits_since_restorable,
            **({"checked_by_class": dict(self.checked)} if self.checked else {}),
        }


@dataclasses.dataclass(frozen=True)
class GuardAccount:
    """What the guard answers a save of one step (``SDCGuard.save_evidence``), after the collective checks a save
    runs: the consensus's fingerprints, its check counters, and its witnesses' account of state without a replica.

    ``agreed``: each whole state tensor this rank holds with the fingerprint every replica agreed on (a save checks
    what other ranks wrote against it); ``vouched``: each tensor of this rank's state without a replica with the
    fingerprint the at-rest chain found it still holds (``None`` where the chain did not hold)."""

    step: int
    fingerprints: list[str]
    counters: Mapping[str, CheckCounts]
    replicas: int
    audits_enabled: bool
    single_owner: bool
    owner_problem: str | None
    oracle_slices: int
    forward: bool
    agreed: list[tuple[Any, str]]
    vouched: list[tuple[Any, str]] | None


class EvidenceTracker:
    """Turns the guard's running check counters into each save's evidence and status.

    It keeps the counters as of the previous checkpoint (failures since then
    make a save suspect) and the audits passed as of the previous restorable
    one (a save needs a newer audit to be restorable).
    """

    def __init__(self, counters: Mapping[str, CheckCounts]) -> None:
        self.reset(counters)

    def reset(self, counters: Mapping[str, CheckCounts]) -> None:
        """Start afresh from ``counters`` (at construction, and after a restore)."""
        self._baseline = {k: dataclasses.replace(c) for k, c in counters.items()}
        self._audits_at_restorable = self._baseline.get("audit", CheckCounts()).passed

    @staticmethod
    def needs_audit(counters: Mapping[str, CheckCounts], audits_enabled: bool, step: int) -> bool:
        """Whether a save of ``step`` must audit first: no recompute audit passed at that step. Every kind of check
        then covers each checkpoint's step, so a later incident's suspect interval, which starts after the newest
        step where every kind passed (``guard.judge``), starts after the previous save, never before it."""
        last = counters.get("audit", CheckCounts()).last_pass
        return audits_enabled and (last is None or last < step)

    def for_account(self, a: GuardAccount) -> tuple[Evidence, Status, list[str]]:
        """:meth:`for_save` of what the guard answered a save."""
        return self.for_save(a.step, a.fingerprints, a.counters, world=a.replicas, audits_enabled=a.audits_enabled,
                             single_owner=a.single_owner, oracle_slices=a.oracle_slices, forward=a.forward,
                             owner_problem=a.owner_problem)

    def for_save(self, step: int, fingerprints: Sequence[str], counters: Mapping[str, CheckCounts], *, world: int,
                 audits_enabled: bool, single_owner: bool = False, oracle_slices: int = 0,
                 forward: bool = False, owner_problem: str | None = None) -> tuple[Evidence, Status, list[str]]:
        """The evidence, status and reasons of a save whose consensus gave ``fingerprints``; advances the baselines.
        ``oracle_slices`` and ``forward`` are the guard's configuration (``GuardConfig``), which the per-class
        account of what was checked states."""
        since = {k: CheckCounts(c.passed - self._baseline.get(k, CheckCounts()).passed,
                                c.failed - self._baseline.get(k, CheckCounts()).failed, c.last_pass, c.coverage)
                 for k, c in counters.items()}
        audits = counters.get("audit", CheckCounts()).passed - self._audits_at_restorable
        # ``single_owner`` is the guard's own account (``Witnesses.single_owner_evidence``): the chain held at this save
        # and the oracle passed the update that wrote the state, whichever call judged it first. A count of oracle
        # passes since this tracker's baseline made the status depend on the order of the calls: a
        # ``guard.consensus(step)`` that judged the last update before the baseline left the save none.
        owned = single_owner
        status, reasons = save_status(world, {k: c.failed for k, c in since.items()}, audits_enabled,
                                      since.get("audit", CheckCounts()).passed, single_owner=owned,
                                      owner_problem=owner_problem)
        checked = checked_by_class(since, replicas=world, audits_enabled=audits_enabled,
                                   oracle_slices=oracle_slices, forward=forward)
        evidence = Evidence(step, list(fingerprints), since, audits_enabled, audits, owned, checked)
        self._baseline = {k: dataclasses.replace(c) for k, c in counters.items()}
        if status is Status.RESTORABLE:
            self._audits_at_restorable = counters.get("audit", CheckCounts()).passed
        return evidence, status, reasons


def save_status(
    world: int, failed_since_previous: Mapping[str, int], audits_enabled: bool, audits_since_previous: int, *,
    single_owner: bool = False, owner_problem: str | None = None,
) -> tuple[Status, list[str]]:
    """The status a guarded save commits with (the consensus already agreed, or the save raised).

    Args:
        world: replicas that took part in the consensus.
        failed_since_previous: failures per check kind since the previous checkpoint.
        audits_enabled: whether recompute audits are scheduled.
        audits_since_previous: audits passed since the previous checkpoint (of any status).
        single_owner: state without a replica carries its own evidence instead of a consensus: the at-rest
            chain held at this save and the update oracle passed the update that wrote the state.
        owner_problem: why such state has no evidence of its own (``NO_ORACLE``, ``NOT_WITNESSED``): the reason an
            unverified save records instead of ``SINGLE_REPLICA``, which would blame the mesh.
    """
    failed = {k: n for k, n in failed_since_previous.items() if n}
    if failed:
        return Status.SUSPECT, [FAILED + ", ".join(f"{k} x{n}" for k, n in sorted(failed.items()))]
    if world < 2 and not single_owner:
        return Status.UNVERIFIED, [owner_problem or SINGLE_REPLICA]
    if audits_enabled and audits_since_previous < 1:
        return Status.UNVERIFIED, [NO_AUDIT]
    return Status.RESTORABLE, []


FAULT_CLASSES = ("gradients", "forward outputs", "all-reduce", "state at rest", "updates")


def checked_by_class(since: Mapping[str, CheckCounts], *, replicas: int, audits_enabled: bool, oracle_slices: int,
                     forward: bool) -> dict[str, str]:
    """Per fault class (:data:`FAULT_CLASSES`), what the checks that ran since the previous checkpoint (``since``)
    looked at, and how: the words ``vckpt show`` prints, so that a sampled check reads as sampled."""
    def n(kind: str) -> int:
        return since.get(kind, CheckCounts()).passed

    audits = (f"{n('audit')} recompute audit(s), each of a slice of one microbatch per rank" if audits_enabled
              else "no recompute audit (audits off, or no second replica to recompute)")
    cov = since.get("abft", CheckCounts()).coverage
    abft = (f"ABFT on {n('abft')} step(s)" + (f", {cov:.0%} of the backward FLOPs" if cov is not None else "")
            if n("abft") else "ABFT did not run")
    rest = [f"consensus of {replicas} replicas x{n('consensus')}" if replicas >= 2 and n("consensus")
            else "no replica compared by a consensus"]
    if n("chain"):
        rest.append(f"at-rest chain on {n('chain')} step(s)")
    if n("oracle"):
        updates = (f"update oracle on {n('oracle')} step(s): 1/{max(oracle_slices, 1)} of each rank's updated elements "
                   "recomputed per step; the other elements only through a consensus of replicas")
    else:
        updates = "replicas' updates compared by the consensus" if replicas >= 2 else "not checked"
    return {
        "gradients": f"{abft}; {audits}",
        "forward outputs": f"{'ABFT forward checks with ABFT' if forward and n('abft') else 'no per-step check'}; "
                           f"{audits}",
        "all-reduce": f"NaN/Inf before and after the reduction on {n('nonfinite_local')} step(s); checksum on "
                      f"{n('checksum')} step(s)",
        "state at rest": "; ".join(rest),
        "updates": updates,
    }


def evidence_problem(evidence: Mapping[str, Any]) -> str | None:
    """Why a manifest's ``evidence`` object is not one this library could have written (``None`` if it is)."""
    checked = evidence.get("checked_by_class")
    if checked is not None and not (isinstance(checked, dict) and len(checked) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 1000 for k, v in checked.items())):
        return "evidence checked_by_class must map at most 16 fault classes to short texts"
    claim = evidence.get("consensus")
    if claim is None:
        return None
    if not isinstance(claim, dict):
        return "evidence consensus must be an object"
    if not isinstance(claim.get("unanimous", False), bool):
        return "evidence consensus unanimous must be a bool"
    for k in ("step", "replicas"):
        if k in claim and (type(claim[k]) is not int or not 0 <= claim[k] <= MAX_STEP):
            return f"evidence consensus {k} must be an int >= 0"
    fps = claim.get("fingerprints")
    if fps is not None and not (isinstance(fps, dict) and all(
            _RANK.match(r) and isinstance(fp, str) for r, fp in fps.items())):
        return "evidence consensus fingerprints must map rank numbers to strings"
    return None


def evidence_basis(evidence: Mapping[str, Any] | None) -> str:
    """What a validated ``evidence`` object rests on, in words (``vckpt show``)."""
    ev = evidence or {}
    claim = ev.get("consensus") or {}
    owner = ev.get("single_owner")
    parts = []
    if claim.get("unanimous"):
        parts.append(f"replica consensus at step {claim.get('step')} ({claim.get('replicas')} replicas agreed)")
    if isinstance(owner, dict):
        parts.append(f"single-owner state: at-rest chain held at step {owner.get('chain_step')}, update oracle "
                     f"passed {owner.get('oracle_passed')} time(s) since the previous checkpoint")
    audits = ev.get("audits_since_restorable")
    if ev.get("audits_enabled") and isinstance(audits, int):
        parts.append(f"{audits} recompute audit(s) passed")
    return "; ".join(parts) or "none"


def consensus_claim(evidence: Mapping[str, Any] | None) -> ConsensusClaim | None:
    """The unanimous-consensus claim of a validated ``evidence`` object, or ``None`` if it makes none."""
    claim = (evidence or {}).get("consensus") or {}
    if not claim.get("unanimous"):
        return None
    return ConsensusClaim(int(claim.get("step", 0)), True,
                          {int(r): fp for r, fp in (claim.get("fingerprints") or {}).items()})
