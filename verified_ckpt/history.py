"""A run's check history as events, and the pure summaries built from it.

The guard emits an :class:`Event` for every check it runs; rank 0's
checkpoint manager appends them to the ledger (``ledger.py``). Everything
here is pure: columns in, summaries out, so ``vckpt ledger``, ``vckpt
report`` and ``vckpt verify`` share one reading of the history and the
tests can drive it without a store.

Rows of one check are appended together, so a *check* is a maximal run of
consecutive rows with the same (step, kind): a step repeated after a
rollback is a new check, not a merge with the old one.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .evidence import consensus_claim
from .fingerprint import lanes_hex
from .records import Incident

# numpy is imported by the functions that build or scan columns: the checkpoint manager imports this module
# for ``Event``, and commands that only list a run should not pay for numpy.
if TYPE_CHECKING:
    import numpy as np

# Codes are positions in these lists; the ledger stores both lists in its attributes.
KINDS = ["step", "audit", "consensus", "save", "incident", "restore", "verify", "nonfinite", "checksum", "abft",
         "coverage", "budget", "oracle", "chain", "overflow"]  # append only
VERDICTS = ["pass", "fail", "none"]
NO_RANK = -1  # a job-wide row (a save, a restore, or a per-step summary of a large job)
STEP_CHECKS = ("step", "nonfinite", "checksum", "abft", "audit", "consensus")  # what a step's checks write
# The checks that compare ranks' values (a vote over weights, a recomputation on another rank, the all-reduce
# against the local gradients): only they can say that replicas agree. NaN/Inf and ABFT look at one rank alone.
COMPARING = ("checksum", "audit", "consensus")


@dataclasses.dataclass(frozen=True)
class Event:
    """One row of the ledger.

    ``lanes`` are exact fingerprint lanes: the rank's local gradients for
    ``step``, the recomputed gradients for ``audit`` (``rank`` = the audited
    rank), the replica's weights and optimizer state for ``consensus``.
    ``loss`` and ``grad_norm`` are NaN where they do not apply; a ``consensus`` row's ``loss`` is the replicas
    its vote compared (:func:`compares`).
    """

    step: int
    kind: str
    rank: int
    verdict: str
    lanes: tuple[int, int] = (0, 0)
    loss: float = math.nan
    grad_norm: float = math.nan
    time: float = dataclasses.field(default_factory=time.time)


@dataclasses.dataclass(frozen=True)
class Columns:
    """The ledger as numpy columns of equal length (what ``Ledger.read`` returns)."""

    step: np.ndarray  # int64
    kind: np.ndarray  # uint8, index into KINDS
    rank: np.ndarray  # int32
    verdict: np.ndarray  # uint8, index into VERDICTS
    lanes: np.ndarray  # uint64 (n, 2)
    loss: np.ndarray  # float64
    grad_norm: np.ndarray  # float64
    time: np.ndarray  # float64, seconds since the epoch

    def __len__(self) -> int:
        return int(self.step.shape[0])

    @staticmethod
    def of(events: Sequence[Event]) -> Columns:
        import numpy as np

        return Columns(
            step=np.array([e.step for e in events], dtype=np.int64),
            kind=np.array([KINDS.index(e.kind) for e in events], dtype=np.uint8),
            rank=np.array([e.rank for e in events], dtype=np.int32),
            verdict=np.array([VERDICTS.index(e.verdict) for e in events], dtype=np.uint8),
            lanes=np.array([[v & (2**64 - 1) for v in e.lanes] for e in events], dtype=np.uint64).reshape(-1, 2),
            loss=np.array([e.loss for e in events], dtype=np.float64),
            grad_norm=np.array([e.grad_norm for e in events], dtype=np.float64),
            time=np.array([e.time for e in events], dtype=np.float64),
        )


@dataclasses.dataclass(frozen=True)
class Check:
    """One check in the ledger: consecutive rows with the same (step, kind)."""

    step: int
    kind: str
    rows: tuple[int, int]  # [lo, hi) in ledger order
    failed: bool
    ranks: list[int]
    failed_ranks: list[int]


def checks(cols: Columns) -> list[Check]:
    """Group rows into checks: consecutive rows with the same (step, kind), in ledger order."""
    import numpy as np

    n = len(cols)
    if n == 0:
        return []
    key_change = np.ones(n, dtype=bool)
    key_change[1:] = (cols.step[1:] != cols.step[:-1]) | (cols.kind[1:] != cols.kind[:-1])
    starts = [*np.flatnonzero(key_change).tolist(), n]
    out = []
    fail = VERDICTS.index("fail")
    for lo, hi in itertools.pairwise(starts):
        verdicts = cols.verdict[lo:hi]
        out.append(Check(int(cols.step[lo]), KINDS[int(cols.kind[lo])], (lo, hi), bool((verdicts == fail).any()),
                         cols.rank[lo:hi].tolist(),
                         sorted({int(r) for r, v in zip(cols.rank[lo:hi], verdicts, strict=True)
                                 if v == fail and r != NO_RANK})))
    return out


def compares(cols: Columns, g: Check) -> bool:
    """Whether check ``g`` compared what it claims to: any check but a consensus does; a consensus only where it
    compared replicas of the state. Its rows record how many (``loss``: the fewest holders of any piece; 1 on pure
    FSDP, whose every piece one rank holds); in a ledger written before they did (NaN), where two ranks held the
    same fingerprint. A failed vote compared copies that disagreed."""
    if g.kind != "consensus" or g.failed:
        return True
    import numpy as np

    lo, hi = g.rows
    replicas = cols.loss[lo:hi]
    replicas = replicas[np.isfinite(replicas)]
    if replicas.size:
        return bool(replicas.min() >= 2)
    return len({(int(a), int(b)) for a, b in cols.lanes[lo:hi].tolist()}) < hi - lo


def summarize(cols: Columns) -> dict[str, Any]:
    """What ``vckpt ledger`` reports: counts per kind, the last unanimous consensus,
    the divergence points (every failed check), and the audits. A consensus that compared no replica
    (:func:`compares`) is not counted: nothing was voted on."""
    groups = [g for g in checks(cols) if compares(cols, g)]
    counts: dict[str, dict[str, int]] = {}
    for g in groups:
        c = counts.setdefault(g.kind, {"checks": 0, "failed": 0})
        c["checks"] += 1
        c["failed"] += int(g.failed)
    unanimous = [g.step for g in groups if g.kind == "consensus" and not g.failed]
    covered = [i for i in range(len(cols)) if KINDS[int(cols.kind[i])] == "coverage"] if "coverage" in counts else []
    planned = [i for i in range(len(cols)) if KINDS[int(cols.kind[i])] == "budget"] if "budget" in counts else []
    return {
        "rows": len(cols),
        "steps": [int(cols.step.min()), int(cols.step.max())] if len(cols) else None,
        "counts": counts,
        "last_unanimous_consensus": unanimous[-1] if unanimous else None,
        "divergence": [{"step": g.step, "kind": g.kind, "ranks": g.failed_ranks}
                       for g in groups if g.failed and g.kind != "incident"],
        "audits": [{"step": g.step, "audited_ranks": sorted(set(g.ranks)), "failed": g.failed,
                    "disputed_ranks": g.failed_ranks} for g in groups if g.kind == "audit"],
        # What ABFT checked, as measured at each (re)start's first step: shares of parameters and of backward FLOPs.
        "coverage": [{"step": int(cols.step[i]), "params": float(cols.loss[i]), "flops": float(cols.grad_norm[i])}
                     for i in covered],
        # The schedule the budget chose, each time it moved: intervals in steps, ABFT's share of steps, and the
        # overhead it expects from the costs it measured.
        "schedule": [{"step": int(cols.step[i]), "consensus_every": int(cols.lanes[i][0]),
                      "audit_every": int(cols.lanes[i][1]), "abft_share": float(cols.loss[i]),
                      "overhead": float(cols.grad_norm[i])} for i in planned],
    }


def passing_consensus(cols: Columns) -> dict[int, list[dict[int, str]]]:
    """Every consensus check in which all ranks passed, by step: each as {rank: fingerprint hex}.

    Built once per verification run, so checking N manifests does not regroup the ledger N times.
    """
    out: dict[int, list[dict[int, str]]] = {}
    for g in checks(cols):
        if g.kind == "consensus" and not g.failed:
            lo, hi = g.rows
            out.setdefault(g.step, []).append(
                {int(cols.rank[i]): lanes_hex(cols.lanes[i].tolist()) for i in range(lo, hi)})
    return out


def consensus_claim_problems(evidence: dict[str, Any], consensus: dict[int, list[dict[int, str]]] | None) -> list[str]:
    """Why the ledger does not back a manifest's consensus claim (empty when it does).

    A manifest that records a unanimous consensus at step s must find, in the
    ledger (``consensus`` from :func:`passing_consensus`, ``None`` without a
    ledger), a consensus check at step s in which every claimed rank passed
    with exactly the claimed fingerprint. Manifests without a claim need nothing.
    """
    claim = consensus_claim(evidence)
    if claim is None:
        return []
    if consensus is None:
        return [f"the manifest claims a unanimous consensus at step {claim.step}, but the run has no ledger"]
    for seen in consensus.get(claim.step, []):
        if all(seen.get(r) == fp for r, fp in claim.fingerprints.items()):
            return []
    return [f"the manifest claims a unanimous consensus at step {claim.step} over {len(claim.fingerprints)} replicas, "
            "but the ledger records no such consensus"]


def step_series(cols: Columns) -> dict[str, list[Any]]:
    """Per step: the mean loss of its latest per-step check, and what its checks found.

    ``agree`` is ``False`` where any check at that step ever failed, ``True`` where a check comparing ranks
    (``COMPARING``) ran and none failed, and ``None`` where only checks of one rank's own values ran: nothing
    was compared, so nothing says the replicas agree (a single replica's run, or steps between consensus rounds
    of a run whose ledger predates the ``checksum`` rows). A step replayed after a rollback keeps its red mark:
    the report must still show when the replicas stopped agreeing.
    """
    import numpy as np

    loss: dict[int, float | None] = {}
    failed: dict[int, bool] = {}
    compared: set[int] = set()
    for g in checks(cols):
        if g.kind not in STEP_CHECKS:
            continue
        failed[g.step] = failed.get(g.step, False) or g.failed
        if g.kind in COMPARING and compares(cols, g):
            compared.add(g.step)
        if g.kind == "step":
            lo, hi = g.rows
            vals = cols.loss[lo:hi]
            vals = vals[np.isfinite(vals)]
            loss[g.step] = float(vals.mean()) if vals.size else None
    steps = sorted(st for st in failed if st in loss)
    return {"step": steps, "loss": [loss[s] for s in steps],
            "agree": [False if failed[s] else True if s in compared else None for s in steps]}


def checked(cols: Columns | None, series: dict[str, list[Any]]) -> dict[str, Any] | None:
    """What the ledger says was checked, for a reader to see before any verdict (``None``: the run has no ledger).

    ``steps``: steps with per-step checks; ``compared``: those at which a check compared ranks; ``consensus``
    (votes that compared replicas, :func:`compares`) and ``audits``: checks of each kind; ``ranks``: the most ranks
    one step's per-step check covered (1: a single replica, where no consensus is possible; ``None`` where a large
    job's ledger summarised them in one row).
    ``series``: :func:`step_series` of ``cols``.
    """
    if cols is None:
        return None
    groups = [g for g in checks(cols) if compares(cols, g)]
    widths = [len(set(g.ranks)) for g in groups if g.kind == "step"]
    summarised = any(NO_RANK in g.ranks for g in groups if g.kind == "step")
    return {"steps": len(series["step"]), "compared": sum(a is not None for a in series["agree"]),
            "consensus": sum(g.kind == "consensus" for g in groups), "audits": sum(g.kind == "audit" for g in groups),
            "ranks": None if summarised else max(widths, default=0)}


def consensus_votes(cols: Columns) -> list[dict[str, Any]]:
    return [{"step": g.step, "unanimous": not g.failed, "suspects": g.failed_ranks}
            for g in checks(cols) if g.kind == "consensus" and compares(cols, g)]


def redact_url(url: str) -> str:
    """A run URL fit for a report: any ``user:password@`` part is dropped."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def report_data(run: str, generated_at: str, cols: Columns | None, checkpoints: Sequence[dict[str, Any]],
                incidents: Sequence[Incident], answered: Sequence[bool], target: dict[str, Any] | None,
                exclude_hosts: Sequence[str] = (), recovery: tuple[int, int] | None = None,
                supervision: Sequence[dict[str, Any]] = (), health: str | None = None,
                hosts_unknown: bool = False) -> dict[str, Any]:
    """The input of ``report.render_html``: the ledger's per-step series and votes, checkpoints
    with their derived status, incidents' flagged intervals, the rollback target, the hosts the open
    incidents name, the recovery (detected step, rolled back to) once every incident is answered, and
    ``vckpt supervise``'s decisions (attempt, exit code, action, verdict, hosts excluded, why), and what the
    ledger says was checked (``checked``)."""
    ledger, cols = cols, cols if cols is not None else Columns.of([])
    series = step_series(cols)
    return {
        "run": redact_url(run),
        "generated_at": generated_at,
        "steps": series,
        "consensus": consensus_votes(cols),
        "checkpoints": [{"id": c["id"], "step": c["step"], "status": c["status"]} for c in checkpoints],
        # An answered open-ended interval ends where it was detected: the rollback
        # abandoned that stretch, and later steps belong to the new lineage.
        "incidents": [{
            "kind": i.kind, "from_step": i.first_suspect_step,
            "to_step": i.to_step if i.to_step is not None or not a else i.detected_step,
            "detected_step": i.detected_step, "ranks": list(i.ranks), "hosts": i.exclude_hosts,
            "detail": i.reason or i.detail, "answered": bool(a),
        } for i, a in zip(incidents, answered, strict=True)],
        "rollback_target": target,
        "exclude_hosts": list(exclude_hosts),
        "exclude_hosts_unknown": hosts_unknown,  # an open incident cannot be trusted: it could have named any host
        "recovery": {"detected_step": recovery[0], "rolled_back_to": recovery[1]} if recovery else None,
        "supervision": [{k: d[k] for k in ("at", "attempt", "exit_code", "action", "code", "exclude", "reason")}
                        for d in supervision],
        "health": health,  # ``RunView.health().state``: the word ``vckpt status`` and the service say
        "checked": checked(ledger, series),
    }
