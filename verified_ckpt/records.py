"""Run records: typed facts learnt after a checkpoint was committed, and the one rule for untrusted ones.

Manifests are immutable; what is learnt later is an append-only record under
``<run>/records/<kind>/``: an :class:`Incident` (a failed check, or a flag set
by hand), a :class:`Rollback`, a :class:`VerificationResult`, a supervisor's decision (:class:`Supervision`), or the
evidence that clears a host an incident named (:class:`Clearance`). Each kind has
a strict ``from_record`` (types, ranges, lengths) and ``to_record`` (the
stored form, sealed by ``signing``).

:func:`parse` is the single place where a stored record becomes trusted data.
Its rule: a record that fails its signature check never makes anything more
trusted. An untrusted incident covers the whole run and no rollback answers it;
an untrusted verification counts as a failed one; an untrusted rollback answers
nothing, and an untrusted clearance clears no host. A record that cannot be read at all (oversized, not a regular file,
not JSON, wrongly typed) never counts as nothing either: with a signing key,
an unreadable incident or verification record (either may have been a
failure someone wants gone) is an untrusted incident covering the whole run;
without a key it is reported (:class:`Unreadable`) and changes no status.
Pure: bytes in, typed records out; the catalog does the I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .errors import InvalidState
from .hosts import Host, host_problem
from .jsonx import JSONBudgetError, Limits, canonical_json, decode_object, short_repr
from .manifest import SEGMENT
from .record_fields import ID, RecordError
from .record_fields import RecordFields as _Fields
from .signing import Signature, Signer

__all__ = [
    "CLEARANCE", "INCIDENT", "KINDS", "MAX_RECORD_BYTES", "MAX_TEXT", "ROLLBACK", "SUPERVISION", "UNANSWERABLE",
    "VERIFICATION", "Clearance", "Host", "Incident", "InvalidRecord", "Problem", "RecordError", "Rollback", "Supervision",
    "VerificationResult", "encoded", "parse",
]

INCIDENT, ROLLBACK, VERIFICATION, SUPERVISION = "incident", "rollback", "verification", "supervision"
CLEARANCE = "clearance"
KINDS = (INCIDENT, ROLLBACK, VERIFICATION, SUPERVISION, CLEARANCE)
MAX_RECORD_BYTES = 1 << 20
UNANSWERABLE = "9999-12-31T23:59:59+00:00"  # later than any rollback record
_LIMITS = Limits(max_bytes=MAX_RECORD_BYTES, max_depth=16)
MAX_TEXT = 64 << 10


class InvalidRecord(InvalidState, ValueError):
    """A record the reader would refuse was about to be written; nothing was stored (the message names the field)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint."""

    kind: str  # digest | size | header | fingerprint | missing | nonfinite | manifest | read | ledger | signature
    detail: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Incident:
    """A failed check, or steps flagged by hand: what failed, when, and which replicas are suspect.

    ``first_suspect_step`` is the step after the last step at which that
    check passed: state from that step on may carry the fault. ``to_step``
    closes the interval (``None``: open-ended). ``signature`` is how the record
    read back (a :class:`~verified_ckpt.signing.Signature` value); it is not stored.
    """

    kind: str  # nonfinite_local | nonfinite_averaged | checksum | audit | consensus | manual | ...
    detected_step: int
    first_suspect_step: int
    ranks: list[int]
    hosts: list[Host]
    detail: str
    id: str = ""
    reason: str = ""
    to_step: int | None = None
    at: str = ""
    source: str = "guard"
    software: bool = False  # software divergence: no host is to blame (``recovery.exits``: exit 6)
    signature: str = "unsigned"

    @property
    def exclude_hosts(self) -> list[str]:
        """Hosts a scheduler should keep this job off."""
        return sorted({h.host for h in self.hosts})

    @property
    def trusted(self) -> bool:
        return Signature(self.signature).trusted

    def summary(self) -> str:
        who = ", ".join(f"rank {h.rank} on {h.host} ({h.device})" for h in self.hosts) or (
            "no replica could be named (two replicas, or all of them, disagree: there is no majority; with 3 or more "
            "replicas a suspect is named) - exclude no host yet; if it recurs after the rollback, rerun the interval "
            "with one host swapped out")
        return (f"{self.kind} check failed at step {self.detected_step}: {self.detail}; suspect: {who}; "
                f"state from step {self.first_suspect_step} on may be corrupt - roll back with resume(state)")

    def to_dict(self) -> dict[str, Any]:
        """Every field (hosts as dicts), plus ``exclude_hosts``."""
        d = dataclasses.asdict(self)
        d["exclude_hosts"] = self.exclude_hosts
        return d

    def to_row(self) -> dict[str, Any]:
        """What a listing shows of it (``vckpt incidents``, ``vckpt status``): hosts as names, the reason or detail."""
        return {"id": self.id, "kind": self.kind, "ranks": self.ranks, "hosts": self.exclude_hosts,
                "first_suspect_step": self.first_suspect_step, "to_step": self.to_step,
                "detected_step": self.detected_step, "reason": self.reason or self.detail, "at": self.at,
                "signature": self.signature}

    def to_record(self) -> dict[str, Any]:
        """The stored form (without the read-back signature state)."""
        d = self.to_dict()
        del d["signature"]
        return d

    @classmethod
    def from_record(cls, d: dict[str, Any], signature: str = "unsigned") -> Incident:
        r = _Fields(d, INCIDENT)
        return cls(
            kind=r.ident("kind"), detected_step=r.step("detected_step"),
            first_suspect_step=r.step("first_suspect_step"), ranks=r.ranks("ranks"), hosts=r.hosts("hosts"),
            detail=r.text("detail", MAX_TEXT, default=""), id=r.ident("id"),
            reason=r.text("reason", MAX_TEXT, default=""), to_step=r.step("to_step", optional=True),
            at=r.text("at", 64), source=r.text("source", 32, default="guard"),
            software=r.flag("software") if "software" in d else False, signature=signature,
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rollback:
    """A recorded rollback: checkpoints saved after ``at`` form a new lineage; it answers ``answers``.

    ``to_checkpoint_id`` is ``None`` for a fresh start: nothing was restorable, and
    the job began again from its initial state.
    """

    at: str
    to_checkpoint_id: str | None
    to_step: int
    answers: list[str]
    signature: str = "unsigned"

    def to_record(self) -> dict[str, Any]:
        return {"at": self.at, "to_checkpoint_id": self.to_checkpoint_id, "to_step": self.to_step,
                "answers": list(self.answers)}

    @classmethod
    def from_record(cls, d: dict[str, Any], signature: str = "unsigned") -> Rollback:
        r = _Fields(d, ROLLBACK)
        target = None if d.get("to_checkpoint_id") is None else r.segment("to_checkpoint_id")
        return cls(at=r.text("at", 64), to_checkpoint_id=target, to_step=r.step("to_step"),
                   answers=r.idents("answers"), signature=signature)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Supervision:
    """A decision of ``vckpt supervise`` after one attempt of the job (``recovery/supervise``): what the attempt
    exited with, and whether the job was restarted (off ``exclude``), stopped with ``code`` or done. Believed only
    when trusted; it changes no status, it tells the recovery's story."""

    at: str
    attempt: int
    exit_code: int  # the launcher's status (negative: killed by that signal)
    action: str  # done | restart | stop
    code: int  # the supervisor's verdict, the exit-code table's
    exclude: list[str]
    reason: str
    signature: str = "unsigned"

    def to_record(self) -> dict[str, Any]:
        return {"at": self.at, "attempt": self.attempt, "exit_code": self.exit_code, "action": self.action,
                "code": self.code, "exclude": list(self.exclude), "reason": self.reason}

    @classmethod
    def from_record(cls, d: dict[str, Any], signature: str = "unsigned") -> Supervision:
        r = _Fields(d, SUPERVISION)
        action = r.text("action", 16)
        if action not in ("done", "restart", "stop"):
            raise RecordError(f"field 'action' must be done, restart or stop, got {short_repr(action)}")
        return cls(at=r.text("at", 64), attempt=r.step("attempt"), exit_code=r.small_int("exit_code"), action=action,
                   code=r.small_int("code"), exclude=r.host_names("exclude"), reason=r.text("reason", MAX_TEXT),
                   signature=signature)


CLEARED_BY = ("replay", "operator")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Clearance:
    """Evidence that clears ``host`` of the incidents in ``answers``: a replay on that host that computed the
    incident's step as a healthy rank did (``by="replay"``, ``vckpt replay``), or an operator's word, given with a
    reason (``by="operator"``, ``vckpt clear-host``). A rollback answers an incident for checkpoints, never for
    hosts: until a clearance names it, a host an incident named stays suspect (``recovery.health``). Believed only
    when trusted: an untrusted clearance clears nothing."""

    at: str
    host: str
    by: str  # replay | operator
    answers: list[str]  # the incidents it clears the host of
    reason: str
    signature: str = "unsigned"

    @property
    def trusted(self) -> bool:
        return Signature(self.signature).trusted

    def to_record(self) -> dict[str, Any]:
        return {"at": self.at, "host": self.host, "by": self.by, "answers": list(self.answers), "reason": self.reason}

    @classmethod
    def from_record(cls, d: dict[str, Any], signature: str = "unsigned") -> Clearance:
        r = _Fields(d, CLEARANCE)
        by, host, answers = r.text("by", 16), r.text("host", 253), r.idents("answers")
        if by not in CLEARED_BY:
            raise RecordError(f"field 'by' must be replay or operator, got {short_repr(by)}")
        if why := host_problem(host):
            raise RecordError(f"field 'host': {why}")
        if not answers:
            raise RecordError("field 'answers' must name at least one incident")
        return cls(at=r.text("at", 64), host=host, by=by, answers=answers, reason=r.text("reason", MAX_TEXT),
                   signature=signature)


# How deep a verification looked: every byte read and checked ("read"); the store's size and checksum of each shard,
# no byte read ("head", ``verification.head_all``); the store's checksum recomputed over the bytes at rest, by S3
# Batch Operations ("store", ``batchops``).
DEPTHS = ("read", "head", "store")


@dataclasses.dataclass(frozen=True)
class VerificationResult:
    """The outcome of re-reading one checkpoint, as returned and as recorded."""

    id: str
    step: int
    ok: bool
    problems: list[Problem]
    verified_at: str
    verifier: dict[str, str] | None = None  # who re-read it (host, version); None: the job or the CLI
    signature: str = "unsigned"
    # What was checked (``DEPTHS``): the bytes themselves ("read"), or the store's own record of each shard, its size
    # and full-object CRC-64/NVME, without reading a byte ("head"). Records older than issue 40 are reads.
    depth: str = "read"
    coverage: str | None = None  # a head check's: how many shards had their CRC compared, and how many their size only

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "step": self.step, "ok": self.ok,
            "problems": [f"{p.kind}: {p.detail}" for p in self.problems], "verified_at": self.verified_at,
        }

    def to_record(self) -> dict[str, Any]:
        rec = {
            "kind": VERIFICATION, "checkpoint_id": self.id, "step": self.step, "ok": self.ok,
            "problems": [dataclasses.asdict(p) for p in self.problems], "at": self.verified_at,
        }
        if self.verifier is not None:
            rec["verifier"] = dict(self.verifier)
        if self.depth != "read":  # a read's record is what it always was
            rec["depth"] = self.depth
        if self.coverage is not None:
            rec["coverage"] = self.coverage
        return rec

    @classmethod
    def from_record(cls, d: dict[str, Any], signature: str = "unsigned") -> VerificationResult:
        r = _Fields(d, VERIFICATION)
        ok = r.flag("ok")
        problems = [Problem(p["kind"], p["detail"]) for p in r.objects("problems", {"kind": 64, "detail": MAX_TEXT})]
        if ok and problems:
            raise RecordError("a verification record says ok but lists problems")
        verifier = d.get("verifier")
        if verifier is not None and not (isinstance(verifier, dict) and len(verifier) <= 16 and all(
                isinstance(k, str) and isinstance(v, str) and len(v) <= 256 for k, v in verifier.items())):
            raise RecordError("field 'verifier' must map names to short strings")
        depth = d.get("depth", "read")
        if depth not in DEPTHS:
            raise RecordError(f"field 'depth' must be one of {', '.join(DEPTHS)}")
        coverage = r.text("coverage", 200) if d.get("coverage") is not None else None
        return cls(r.segment("checkpoint_id"), r.step("step"), ok, problems, r.text("at", 64), verifier, signature, depth,
                   coverage)


@dataclasses.dataclass(frozen=True)
class Unreadable:
    """A stored record that could not be read, and why (reported to the operator)."""

    kind: str
    name: str
    why: str

    def __str__(self) -> str:
        return f"{self.kind} record {self.name} could not be read ({self.why})"


Record = Incident | Rollback | VerificationResult | Supervision | Clearance
_PARSERS: dict[str, Callable[..., Record]] = {
    INCIDENT: Incident.from_record, ROLLBACK: Rollback.from_record, VERIFICATION: VerificationResult.from_record,
    SUPERVISION: Supervision.from_record, CLEARANCE: Clearance.from_record,
}


def encoded(kind: str, record: dict[str, Any]) -> bytes:
    """The bytes ``record`` is stored as, if the reader would take it: the same decoder, limits and typed parser
    (``from_record``) as :func:`parse`. Writers are exactly as strict as readers: a value the reader would refuse
    (a rank of -1, a step past the largest, a float where an int belongs, a lone surrogate, a reason past its
    length, too deep, too large) is refused here, before anything is stored.

    Raises:
        InvalidRecord: naming the field and the value.
    """
    try:
        data = canonical_json(record)
    except (ValueError, TypeError, UnicodeEncodeError, RecursionError) as e:
        raise InvalidRecord(f"this {kind} record cannot be stored as JSON ({short_repr(str(e))[1:-1]}); nothing was "
                            "written") from None
    try:
        _PARSERS[kind](decode_object(data, _LIMITS))
    except (JSONBudgetError, RecordError) as e:
        raise InvalidRecord(f"this {kind} record would not read back ({e}); nothing was written") from None
    return data


def parse(kind: str, name: str, raw: bytes | None, problem: str | None, signer: Signer) -> Record | Unreadable | None:
    """A stored record as trusted data, under the one rule for untrusted records (module docstring).

    ``raw`` is the record's bytes, or ``None`` with ``problem`` saying why they
    were not read. Returns ``None`` only for an untrusted rollback (it answers nothing).
    """
    try:
        if raw is None:
            raise RecordError(problem or "not read")
        try:
            doc = decode_object(raw, _LIMITS)
        except JSONBudgetError as e:
            raise RecordError(str(e)) from None
        sig = signer.check(doc)
        if not sig.trusted:
            return _untrusted(kind, doc, signer.why(sig, f"this {kind} record"), sig.value)
        return _PARSERS[kind](doc, sig.value)
    except RecordError as e:
        unreadable = Unreadable(kind, name, short_repr(str(e))[1:-1])
        if signer.key is None or kind in (ROLLBACK, SUPERVISION, CLEARANCE):  # none can hide a failure
            return unreadable
        return _untrusted(INCIDENT, {"id": "unreadable", "kind": "unreadable-record"},
                          f"{unreadable}, although a signing key is configured: it may have been a failure someone "
                          "wanted gone", Signature.INVALID.value)


def _untrusted(kind: str, doc: dict[str, Any], why: str, signature: str) -> Record | None:
    if kind == INCIDENT:
        # Every field of an edited record may be the edit (a narrowed interval, a
        # back-dated time that an old rollback would answer), so none is believed:
        # it covers the whole run and no rollback answers it, until an operator
        # removes it (and re-flags what is real).
        # Its id and kind are shown (vckpt status, node-health), so only in the id grammar.
        rid, what = doc.get("id"), doc.get("kind")
        return Incident(kind=what if isinstance(what, str) and ID.match(what) else "unknown", detected_step=0,
                        first_suspect_step=0, ranks=[], hosts=[], detail=why,
                        id=rid if isinstance(rid, str) and ID.match(rid) else "unknown",
                        reason=why + "; until it is removed every checkpoint is suspect", to_step=None,
                        at=UNANSWERABLE, source="untrusted", signature=signature)
    if kind == VERIFICATION:
        cid = doc.get("checkpoint_id")
        return VerificationResult(cid if isinstance(cid, str) and SEGMENT.match(cid) else "", 0, False,
                                  [Problem("signature", why)], str(doc.get("at", ""))[:64], None, signature)
    return None
