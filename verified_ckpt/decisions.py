"""Pure decisions over plain data: no torch.distributed, no storage.

Everything that decides what a user may trust lives here, so it is tested in
milliseconds and the process-group and storage code only calls it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .records import Incident, Rollback, VerificationResult
from .status import Status

if TYPE_CHECKING:
    from .manifest import CheckpointInfo

# Higher is worse; a derived status never improves on what the manifest said.
_SEVERITY = {Status.RESTORABLE: 0, Status.UNVERIFIED: 1, Status.SUSPECT: 2, Status.CORRUPT: 3}

# Problem kinds that mean the stored bytes are not what was committed.
_CORRUPTING = {"digest", "size", "header", "fingerprint", "missing", "manifest", "read", "checksum"}
# Problem kinds a later passing full read answers: what a head check cannot vouch for (a shard kept without the
# CRC-64/NVME its upload sent: replaced, or only copied), which reading every byte settles either way.
_UNTIL_READ = {"checksum-missing"}


def worst(a: Status, b: Status) -> Status:
    return a if _SEVERITY[a] >= _SEVERITY[b] else b


def derive_status(
    committed: Status, reasons: Sequence[str], verifications: Iterable[VerificationResult]
) -> tuple[Status, list[str]]:
    """The status a user sees: the manifest's status, worsened by later verification records.

    Args:
        committed: the status written in the manifest.
        reasons: the manifest's reasons for that status.
        verifications: verification records of this checkpoint.

    Returns:
        (status, reasons); a failed verification is permanent, but for one that only found what a later passing full
        read answers (``_UNTIL_READ``).
    """
    status, why = committed, list(reasons)
    recs = list(verifications)
    for rec in recs:
        found = found_status(rec)
        if found is None or _answered(rec, recs):
            continue
        status = worst(status, found)
        details = "; ".join(f"{p.kind}: {p.detail}" for p in rec.problems)
        why.append(f"verification at {rec.verified_at} failed: {details or 'no detail'}")
    return status, why


def _answered(rec: VerificationResult, recs: Sequence[VerificationResult]) -> bool:
    """Whether failed ``rec`` found only what a full read settles (``_UNTIL_READ``), and a later full read passed."""
    return bool(rec.problems) and all(p.kind in _UNTIL_READ for p in rec.problems) and any(
        r.ok and r.depth == "read" and r.verified_at > rec.verified_at for r in recs)


def found_status(rec: VerificationResult) -> Status | None:
    """What one verification record makes its checkpoint: ``None`` if it passed, ``corrupt`` if the stored bytes
    are not what was committed (or it names no problem), else ``suspect``."""
    if rec.ok:
        return None
    kinds = {p.kind for p in rec.problems}
    return Status.CORRUPT if kinds & _CORRUPTING or not kinds else Status.SUSPECT


def verifications_to_keep(recs: Sequence[tuple[str, VerificationResult]]) -> set[str]:
    """Of one stored checkpoint's verification records (stored name, record), the names compaction keeps: every
    record that decides what the checkpoint is. The newest (the latest word), the first failure (when it went
    wrong), the worst failure no later read answers (a failure is permanent and the status is the worst of them,
    :func:`derive_status`: a digest failure outranks a non-finite one, whatever their order), and the newest
    passing full read (what answers a head check's ``_UNTIL_READ`` findings before it, whatever came after)."""
    if not recs:
        return set()
    ordered = sorted(recs, key=lambda nr: (nr[1].verified_at, nr[0]))
    keep = {ordered[-1][0]}
    keep.update([name for name, rec in ordered if rec.ok and rec.depth == "read"][-1:])
    every = [rec for _, rec in ordered]
    failed = [(name, found, rec) for name, rec in ordered if (found := found_status(rec)) is not None]
    if failed:
        keep.add(failed[0][0])
        standing = [nf for nf in failed if not _answered(nf[2], every)]
        if standing:
            keep.add(max(standing, key=lambda nf: _SEVERITY[nf[1]])[0])  # max keeps the first of equals
    return keep


def newest(infos: Sequence[CheckpointInfo], allowed: set[Status], step: int | None = None) -> CheckpointInfo | None:
    """The newest checkpoint whose status is in ``allowed`` (and at ``step``, if given)."""
    for info in reversed(infos):
        if info.status in allowed and (step is None or info.step == step):
            return info
    return None


def to_delete(infos: Sequence[CheckpointInfo], keep_last: int, protect: Iterable[str] = ()) -> list[str]:
    """Retention: ids older than the ``keep_last``-th newest restorable checkpoint.

    Newer checkpoints of any status stay (a suspect one is evidence), the
    newest restorable one always stays, and so does anything in ``protect``
    (the rollback target). With fewer than ``keep_last`` restorable
    checkpoints nothing is deleted.

    Args:
        infos: all checkpoints, oldest first.
        keep_last: how many restorable checkpoints to keep (>= 1).
        protect: ids never to delete.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    restorable = [i for i, info in enumerate(infos) if info.status is Status.RESTORABLE]
    if len(restorable) <= keep_last:
        return []
    cutoff = restorable[-keep_last]
    keep = set(protect)
    return [info.id for info in infos[:cutoff] if info.id not in keep]


# The one depth that reads every byte back: each shard's digest, header and the fingerprints of its tensors
# (``records.DEPTHS``). A head check sees sizes and the store's CRCs, a store-side record the store's checksum of the
# object: a shard that rotted in place keeps its size, and a store that keeps no CRC then sees nothing wrong.
FULL_READ = "read"


def read_back_in_full(verifications: Iterable[VerificationResult]) -> bool:
    """Whether a passing full read of a checkpoint is recorded; a head or store-side record never counts."""
    return any(rec.ok and rec.depth == FULL_READ for rec in verifications)


@dataclasses.dataclass(frozen=True)
class Retention:
    """What retention may do to a run: ``doomed`` goes only once ``relies_on`` (the newest restorable checkpoint,
    which stays) is known to read back in full; ``read_back``: no passing full read of it is recorded yet, so one
    must run first, and if it fails nothing goes."""

    doomed: list[str]
    relies_on: CheckpointInfo | None
    read_back: bool


def retention(infos: Sequence[CheckpointInfo], keep_last: int,
              verifications: Mapping[str, Sequence[VerificationResult]], protect: Iterable[str] = ()) -> Retention:
    """Retention's choice (:func:`to_delete`), and whether it still needs the read-back that makes it safe.

    The run is never left without a restorable checkpoint read back in full: the one retention relies on is the
    newest restorable one (its derived status, so a later failure or incident already rules it out), and it is
    kept. An older one read back in full is deleted only after this one has been too.

    Args:
        infos: all checkpoints, oldest first, with their derived status.
        keep_last: how many restorable checkpoints to keep (>= 1).
        verifications: each checkpoint's verification records, by id.
        protect: ids never to delete (pinned).
    """
    target = newest(infos, {Status.RESTORABLE})
    doomed = to_delete(infos, keep_last, {*protect, *([target.id] if target else [])})
    if target is None or not doomed:  # with nothing restorable, to_delete keeps everything
        return Retention([], target, False)
    return Retention(doomed, target, not read_back_in_full(verifications.get(target.id, ())))


# ---------------------------------------------------------------- guard decisions


def vote(values: Sequence[Any]) -> tuple[bool, Any, list[int]]:
    """Majority vote over one value per rank.

    Returns:
        (unanimous, majority value or None, suspect ranks). Suspects are named
        only under a strict majority (more than half) with at least 3 voters;
        otherwise a disagreement names nobody.
    """
    counts = Counter(values)
    if len(counts) <= 1:
        return True, values[0] if values else None, []
    value, n = counts.most_common(1)[0]
    if len(values) >= 3 and n * 2 > len(values):
        return False, value, [r for r, v in enumerate(values) if v != value]
    return False, None, []


def checksum_suspects(local: Sequence[Sequence[float]], averaged: Sequence[Sequence[float]], bound: Sequence[float]) -> list[int]:
    """Ranks whose all-reduced bucket does not project to the mean of the local projections.

    Projections are linear, so ``P(mean_i g_i) = mean_i P(g_i)`` up to rounding;
    ``bound`` (one per lane) is derived from the data by the caller.
    """
    w = len(local)
    expected = [sum(local[r][k] for r in range(w)) / w for k in range(len(bound))]
    bad = []
    for r in range(w):
        for k, b in enumerate(bound):
            d = averaged[r][k] - expected[k]
            if not math.isfinite(d) or abs(d) > b:
                bad.append(r)
                break
    return bad


def outliers(norms: Sequence[float], factor: float) -> list[int]:
    """Ranks whose local gradient norm is ``factor`` times above or below the median of the others.

    Needs at least 3 ranks: with two, neither can be called the odd one out.
    """
    if len(norms) < 3:
        return []
    out = []
    for r, n in enumerate(norms):
        others = sorted(x for i, x in enumerate(norms) if i != r)
        mid = len(others) // 2
        med = others[mid] if len(others) % 2 else (others[mid - 1] + others[mid]) / 2
        if med > 0 and (n > factor * med or n * factor < med):
            out.append(r)
    return out


def diverged_pair(norms: Sequence[float], factor: float) -> bool:
    """Two replicas whose local gradient norms differ by more than ``factor``: audit both.

    With two, neither can be called the odd one out (see :func:`outliers`), but
    a recompute of each by the other still tells whether either computed wrongly.
    """
    if len(norms) != 2:
        return False
    lo, hi = sorted(norms)
    return hi > 0 and (lo * factor < hi or not math.isfinite(hi))


def buffer_votes(rows: Sequence[Sequence[Any]], replicated: Sequence[bool]) -> tuple[list[bool], dict[int, list[int]]]:
    """Judge module buffers across replicas, one column per buffer.

    A buffer is *replicated* while every replica holds it identically: DDP
    starts every replica from rank 0's buffers, and buffers that forward()
    does not change (masks, frozen statistics, counters that advance alike)
    stay so. A replicated buffer that now disagrees with a strict majority
    against some replicas names those replicas. One whose values all differ
    (statistics of each replica's own data, such as BatchNorm's running mean
    in training) was never going to agree: it stops being judged. With two
    replicas no majority exists, so a disagreement retires the buffer too.

    Returns:
        (still replicated per buffer, {buffer index: suspect ranks}).
    """
    out, suspects = list(replicated), {}
    for b, rep in enumerate(replicated):
        if not rep:
            continue
        unanimous, _, named = vote([tuple(row[b]) for row in rows])
        if unanimous:
            continue
        if named:
            suspects[b] = named
        else:
            out[b] = False
    return out, suspects


def audit_verdict(owner: Any, auditor: Any, tiebreaker: Any | None) -> tuple[str, list[str]]:
    """Who is wrong when an owner's record and an auditor's recomputation disagree.

    Returns:
        (verdict, roles): ``("agree", [])``; ``("owner", ["owner"])`` when the
        tiebreaker sides with the auditor; ``("auditor", ["auditor"])`` when it
        sides with the owner; ``("undetermined", [...])`` with no tiebreaker or
        three different answers.
    """
    if owner == auditor:
        return "agree", []
    if tiebreaker is None:
        return "undetermined", []
    if tiebreaker == auditor:
        return "owner", ["owner"]
    if tiebreaker == owner:
        return "auditor", ["auditor"]
    return "undetermined", ["owner", "auditor"]


def nodes_from(group_ranks: Sequence[int | None], hosts: Sequence[str]) -> list[int]:
    """Node id per rank: the launcher's node rank where every rank has one, else hostnames in order of appearance."""
    if all(g is not None for g in group_ranks):
        return [int(g) for g in group_ranks]  # type: ignore[arg-type]
    order: dict[str, int] = {}
    return [order.setdefault(h, len(order)) for h in hosts]


def audit_targets(node_of: Sequence[int]) -> list[int | None]:
    """For each auditor rank, the rank whose microbatch it recomputes.

    A rank on the next node (cyclically), at the same local position, so a
    fault confined to one node is always judged by another node; on one
    node, the next rank. ``None`` when there is nobody else.
    """
    w = len(node_of)
    if w < 2:
        return [None] * w
    nodes = sorted(set(node_of))
    if len(nodes) < 2:
        return [(r + 1) % w for r in range(w)]
    members = {n: [r for r in range(w) if node_of[r] == n] for n in nodes}
    out: list[int | None] = []
    for r in range(w):
        n = node_of[r]
        nxt = members[nodes[(nodes.index(n) + 1) % len(nodes)]]
        out.append(nxt[members[n].index(r) % len(nxt)])
    return out


def tiebreaker(owner: int, auditor: int, node_of: Sequence[int]) -> int | None:
    """A third rank to recompute a disputed microbatch, preferably on a node of neither party."""
    w = len(node_of)
    others = [(owner + i) % w for i in range(1, w) if (owner + i) % w not in (owner, auditor)]
    if not others:
        return None
    far = [r for r in others if node_of[r] not in (node_of[owner], node_of[auditor])]
    return (far or others)[0]


# ------------------------------------------------------- saves, incidents, rollback
def answered_at(incident: Incident, rollbacks: Sequence[Rollback]) -> str | None:
    """When the first rollback after ``incident`` happened (ISO time), or None while unanswered."""
    times = sorted(r.at for r in rollbacks if r.at > incident.at)
    return times[0] if times else None


def exclude_hosts(incidents: Sequence[Incident], rollbacks: Sequence[Rollback]) -> list[str]:
    """The hosts to keep jobs off: those the incidents no rollback has answered yet name. One answer for
    ``vckpt status``, ``vckpt incidents``, the report and the service."""
    return sorted({h for i in incidents if answered_at(i, rollbacks) is None for h in i.exclude_hosts})


def recovery(incidents: Sequence[Incident], rollbacks: Sequence[Rollback]) -> tuple[int, int] | None:
    """``(detected step, rolled back to step)`` of the latest recovery once every incident is answered, else None."""
    if not incidents or any(answered_at(i, rollbacks) is None for i in incidents):
        return None
    last = max(rollbacks, key=lambda r: r.at)
    answered = [i.detected_step for i in incidents if answered_at(i, rollbacks) == last.at]
    if not answered:  # the latest rollback answered nothing (a rollback by hand, later): the one before it did
        answered = [max(incidents, key=lambda i: i.at).detected_step]
        last = next(r for r in sorted(rollbacks, key=lambda r: r.at) if r.at > max(i.at for i in incidents))
    return max(answered), last.to_step


def incident_reasons(step: int, created_at: str, incidents: Sequence[Incident],
                     rollbacks: Sequence[Rollback]) -> list[str]:
    """Why a checkpoint is suspect: its step lies in a flagged interval and it was written
    before the rollback that answered that incident (later checkpoints are a new lineage)."""
    out = []
    for inc in incidents:
        lo, hi = inc.first_suspect_step, inc.to_step
        if step < lo or (hi is not None and step > hi):
            continue
        answered = answered_at(inc, rollbacks)
        if answered is not None and created_at > answered:
            continue
        span = f"{lo}..{hi}" if hi is not None else f"{lo}.."
        out.append(f"step {step} lies in flagged interval {span} of incident {inc.id or '?'} "
                   f"({inc.kind}: {inc.reason or inc.detail})".rstrip())
    return out


def rollback_target(infos: Sequence[CheckpointInfo]) -> tuple[CheckpointInfo | None, list[tuple[str, int, str]]]:
    """The newest restorable checkpoint, and why each newer one was skipped.

    Statuses already carry the flagged intervals (``incident_reasons``), so the
    newest restorable checkpoint predates every interval on the current lineage.

    Returns:
        (target or None, [(id, step, why skipped)] newest first).
    """
    skipped: list[tuple[str, int, str]] = []
    for info in reversed(infos):
        if info.status is Status.RESTORABLE:
            return info, skipped
        why = info.reasons[-1] if info.reasons else info.status.value
        skipped.append((info.id, info.step, f"{info.status.value}: {why}"))
    return None, skipped


def node_local_warning(store_is_local_disk: bool, hosts: Sequence[str]) -> str | None:
    """The warning for a multi-host job that keeps its checkpoints on one node's disk, or None."""
    distinct = sorted(set(hosts))
    if not store_is_local_disk or len(distinct) < 2:
        return None
    return (f"this job spans {len(distinct)} hosts but its checkpoints go to a node-local folder: they die with "
            "that node (a replaced node's disks are wiped) - use shared or object storage such as s3://")
