"""``CheckpointManager``: verified saves, listing, verified restores, offline verification.

Public methods hold the invariants (never restore what is not restorable,
never commit before every shard is digested); ``_``-prefixed helpers do the
work. Subclasses must not override the public methods, or the invariants
would live in more than one place.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import socket
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import blake3
import torch

from . import decisions, history
from .errors import (
    CheckpointNotFound,
    CheckpointNotRestorable,
    CorruptCheckpoint,
    InvalidState,
    ManifestError,
    RunNotFound,
    StorageError,
    VerifiedCkptError,
)
from .fingerprint import Fingerprint, combine, dtype_name, lanes_of
from .guard import SDCGuard, describe_device
from .flatten import Flat, canonical_json, flatten, is_stateful, skeleton_problem, tensor_refs, unflatten
from .manifest import (
    CheckpointInfo,
    Incident,
    Manifest,
    Problem,
    ShardEntry,
    Status,
    TensorEntry,
    VerificationResult,
)
from .history import NO_RANK, Columns, Event
from .ledger import Ledger, read_ledger
from .signing import MIN_KEY_BYTES, Signature, Signer
from .shards import MAX_NDIM, parse_header, supported, tensors_from_buffer, write_shard
from .store import RunStore, utc_now

UNGUARDED = "saved without an SDCGuard: no cross-replica consensus or audit evidence"


def _checkpoint_id(step: int) -> str:
    return f"step-{step:010d}-{uuid.uuid4().hex[:8]}"


def _step_from_id(cid: str) -> int:
    try:
        return int(cid.split("-")[1])
    except (IndexError, ValueError):
        return -1


def _device_name(tensors: Mapping[str, torch.Tensor]) -> str:
    return describe_device(next((t.device for t in tensors.values() if t.device.type == "cuda"), torch.device("cpu")))


@dataclasses.dataclass
class _SaveJob:
    """What the synchronous part of a save decided, handed to the (maybe background) writer."""

    cid: str
    step: int
    flat: Flat
    status: Status
    reasons: list[str]
    evidence: dict[str, Any]
    topology: dict[str, Any]


class CheckpointManager:
    """Verified checkpoints of one training run at any fsspec URL.

    Args:
        url: where the run lives: a local path, ``file://``, ``memory://``, ``s3://bucket/prefix``.
        storage_options: fsspec options (endpoint, credentials, ...).
        keep_last: keep the N newest restorable checkpoints (and anything newer); ``None`` keeps all.
        shard_bytes: target size of one shard file.
        io_workers: shards written or read at the same time.
        guard: the job's :class:`SDCGuard`. Then every rank calls :meth:`save`; the
            consensus runs first, each rank writes about 1/W of the shards, rank 0
            commits the manifest with the verification evidence, and guard
            incidents are recorded under the run.
        signing_key: HMAC key for manifests and records; ``None`` reads ``VCKPT_SIGNING_KEY``
            or ``VCKPT_SIGNING_KEY_FILE`` (neither: records are written unsigned). See docs/SECURITY.md.

    Raises:
        InvalidRunURL: the URL cannot be opened.
        InvalidState: the signing key is unreadable or too short.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        shard_bytes: int = 64 << 20,
        io_workers: int = 8,
        guard: SDCGuard | None = None,
        report_timeout_s: float = 600.0,
        signing_key: bytes | None = None,
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
        if io_workers < 1:
            raise ValueError(f"io_workers must be >= 1, got {io_workers}")
        self._store = RunStore(url, storage_options)
        self._signer = Signer.from_env() if signing_key is None else Signer(bytes(signing_key))
        if self._signer.key is not None and len(self._signer.key) < MIN_KEY_BYTES:
            raise InvalidState(f"signing_key is shorter than {MIN_KEY_BYTES} bytes; use a random key of 32 bytes or more")
        self.url = url
        self.keep_last = keep_last
        self.shard_bytes = shard_bytes
        self.io_workers = io_workers
        self.guard = guard
        self.report_timeout_s = report_timeout_s
        self._pending: concurrent.futures.Future[CheckpointInfo] | None = None
        self._host_copies: dict[str, torch.Tensor] = {}  # reused by non-blocking saves
        self.rank = guard.rank if guard is not None else 0
        self.world = guard.world if guard is not None else 1
        self.resumed_from: str | None = None
        # Rank 0 keeps the run's ledger of check events (docs/LEDGER.md).
        self._ledger = Ledger(self._store) if guard is not None and self.rank == 0 else None
        if guard is not None:
            guard.add_incident_listener(self._record_incident)
            if self._ledger is not None:
                guard.add_event_listener(self._ledger.append)
            self._reset_evidence()
            warning = decisions.node_local_warning(self._store.is_local_disk, [t["host"] for t in guard.topology])
            if warning and self.rank == 0:
                warnings.warn(warning, stacklevel=2)

    # ------------------------------------------------------------------ save
    def save(
        self, step: int, state: Mapping[str, Any], *, blocking: bool = True
    ) -> CheckpointInfo | concurrent.futures.Future[CheckpointInfo]:
        """Save ``state`` at ``step`` and commit it with a manifest written last.

        With a guard, call it on every rank: the consensus runs first, each
        rank writes about 1/W of the shards, and rank 0 commits.

        Args:
            step: the training step (int >= 0).
            state: names to modules, optimizers, schedulers, tensors or plain data.
            blocking: ``False`` returns as soon as the state is copied to host
                memory; digests, uploads and the manifest complete on a background
                thread. At most one save is pending: the next save (or :meth:`wait`)
                waits for it and raises its failure. A failed save never commits.

        Returns:
            The committed :class:`CheckpointInfo` (status ``unverified`` without
            verification evidence), or, with ``blocking=False``, a future of it.

        Raises:
            InvalidState: the state holds something that cannot be stored.
            StorageError: the store could not be written; nothing is committed.
            SilentCorruptionDetected: the replicas disagree; nothing is written.
        """
        self.wait()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidState(f"step must be an int >= 0, got {step!r}")
        if step > MAX_STEP:
            raise InvalidState(f"step must be <= {MAX_STEP}, got {step}")
        flat = flatten(state)
        for name, t in flat.tensors.items():
            if not supported(t.dtype):
                raise InvalidState(f"{name}: dtype {t.dtype} cannot be stored in safetensors; convert it in state_dict()")
            if t.dim() > MAX_NDIM:
                raise InvalidState(f"{name}: {t.dim()} dimensions, more than the {MAX_NDIM} a checkpoint may hold")
        # The reader refuses skeletons it could not trust (too deep, ...): refuse them here, before writing.
        for key, entry in flat.skeleton.items():
            problem = skeleton_problem(entry["value"])
            if problem:
                raise InvalidState(f"state[{key!r}] cannot be saved: {problem}; flatten it into fewer levels")
        job = self._prepare(step, flat)
        # Before any manifest can claim this save's consensus, the ledger holds it.
        self._log([Event(step, "save", NO_RANK, "pass" if job.status is Status.RESTORABLE else "none")])
        if blocking:
            return self._finish(job, collective=True)
        # Training goes on mutating the live tensors: the background thread
        # works from host copies taken now (the only blocking cost).
        job.flat = Flat(self._snapshot(flat.tensors), flat.skeleton)
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vckpt-async-save")
        self._pending = pool.submit(self._finish, job, collective=False)
        pool.shutdown(wait=False)
        return self._pending

    def _snapshot(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` to host buffers kept from the previous non-blocking save.

        Reusing the buffers turns the blocking cost into a plain memcpy: fresh
        allocations page-fault on first touch, which measured 1-4x the copy
        itself. Safe because save() waits for the pending save first, so no
        background writer still reads them. Costs one host copy of the state
        between saves - the same bound as "at most one save pending".
        """
        old, out = self._host_copies, {}
        for n, t in tensors.items():
            buf = old.get(n)
            if buf is None or buf.dtype != t.dtype or buf.shape != t.shape:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
            out[n] = buf.copy_(t.detach(), non_blocking=t.device.type == "cuda")
        if any(t.device.type == "cuda" for t in tensors.values()):
            torch.cuda.synchronize()  # the copies must land before the live tensors change
        self._host_copies = out
        return out

    def wait(self) -> CheckpointInfo | None:
        """Wait for a pending non-blocking save; return its info or raise its failure."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def _prepare(self, step: int, flat: Flat) -> _SaveJob:
        """The synchronous part of a save: consensus, status and evidence, and one id for every rank."""
        g = self.guard
        if g is None:
            topology = {"world_size": 1, "ranks": [{"rank": 0, "host": socket.gethostname(),
                                                    "device": _device_name(flat.tensors)}]}
            return _SaveJob(_checkpoint_id(step), step, flat, Status.UNVERIFIED, [UNGUARDED], {}, topology)
        fingerprints = g.consensus(step)  # raises on disagreement: nothing is written
        now = g.counters()

        def delta(kind: str, field: str) -> int:
            return now.get(kind, {}).get(field, 0) - self._baseline.get(kind, {}).get(field, 0)

        audits = now.get("audit", {}).get("passed", 0) - self._audits_at_restorable
        status, reasons = decisions.save_status(g.world, {k: delta(k, "failed") for k in now}, g.audits_enabled, audits)
        evidence = {
            "consensus": {"step": step, "unanimous": bool(fingerprints), "replicas": len(fingerprints),
                          "fingerprints": {str(r): fp for r, fp in enumerate(fingerprints)}},
            "checks_since_previous": {k: {"passed": delta(k, "passed"), "failed": delta(k, "failed"),
                                          "last_pass": now[k]["last_pass"]} for k in sorted(now)},
            "audits_enabled": g.audits_enabled,
            "audits_since_restorable": audits,
        }
        topology = {"world_size": g.world, "ranks": [g.host_of(r) for r in range(g.world)]}
        cid = g.gather_bytes(_checkpoint_id(step).encode() if self.rank == 0 else b"")[0].decode()
        self._baseline = now
        if status is Status.RESTORABLE:
            self._audits_at_restorable = now.get("audit", {}).get("passed", 0)
        return _SaveJob(cid, step, flat, status, reasons, evidence, topology)

    def _finish(self, job: _SaveJob, *, collective: bool) -> CheckpointInfo:
        """Write this rank's shards and commit. Collectives only when ``collective`` (the caller's thread)."""
        plan = self._plan_shards(job.flat.tensors)
        try:
            entries, fps = self._write_shards(job.cid, plan, range(self.rank, len(plan), self.world))
        except BaseException as e:
            if self.guard is not None and not collective:
                with contextlib.suppress(Exception):  # tell rank 0 not to wait for us
                    self._store.write_aside(job.cid, f"rank-{self.rank:05d}.error", str(e).encode())
            raise
        mine = {"shards": [dataclasses.asdict(e) for e in entries], "fps": {n: str(fp) for n, fp in fps.items()}}
        if self.guard is None:
            reports = [mine]
        elif collective:
            reports = [json.loads(b) for b in self.guard.gather_bytes(json.dumps(mine).encode())]
        else:
            self._store.write_aside(job.cid, f"rank-{self.rank:05d}.json", json.dumps(mine).encode())
            reports = self._collect_reports(job.cid) if self.rank == 0 else []
        manifest_bytes = b""
        if self.rank == 0:
            all_entries = sorted((ShardEntry(**e) for r in reports for e in r["shards"]), key=lambda e: e.path)
            all_fps = {n: Fingerprint.from_hex(fp) for r in reports for n, fp in r["fps"].items()}
            manifest = self._manifest(self._run_id(), job.cid, job.step, job.flat, all_entries, all_fps, job.status,
                                      job.reasons, job.evidence, job.topology)
            manifest_bytes = canonical_json(self._signer.seal(manifest.to_dict()))
            self._store.commit_manifest(job.cid, manifest_bytes)
            if self.guard is not None and not collective:
                for r in range(self.world):
                    with contextlib.suppress(Exception):
                        self._store.delete_file(job.cid, f"rank-{r:05d}.json")
            if self.keep_last is not None:
                self._apply_retention()
        if self.guard is not None and collective:
            # Every rank returns only after the commit, with the same manifest in hand.
            manifest_bytes = self.guard.gather_bytes(manifest_bytes)[0]
            self.guard.barrier()
        elif self.rank != 0:
            manifest_bytes = self._await(lambda: self._store.read_optional(job.cid, "manifest.json"), job.cid, "manifest")
        raw = Manifest.decode_json(manifest_bytes, job.cid)
        info = self._info(Manifest.from_dict(raw, job.cid), [])
        return dataclasses.replace(info, signature=self._signer.check(raw).value)

    def _collect_reports(self, cid: str) -> list[dict[str, Any]]:
        reports = []
        for r in range(self.world):
            def look(r: int = r) -> bytes | None:
                err = self._store.read_optional(cid, f"rank-{r:05d}.error")
                if err is not None:
                    raise StorageError(f"rank {r} failed to write its shards of {cid}: "
                                       f"{err.decode(errors='replace')[:300]}; the checkpoint is not committed")
                return self._store.read_optional(cid, f"rank-{r:05d}.json")

            reports.append(json.loads(self._await(look, cid, f"rank {r}'s shard report")))
        return reports

    def _await(self, probe: Callable[[], bytes | None], cid: str, what: str) -> bytes:
        deadline = time.monotonic() + self.report_timeout_s
        delay = 0.02
        while True:
            got = probe()
            if got is not None:
                return got
            if time.monotonic() > deadline:
                raise StorageError(f"{what} for {cid} did not appear within {self.report_timeout_s:.0f}s; "
                                   "the checkpoint is not committed - check the other ranks' logs")
            time.sleep(delay)  # polling the store: no collective may run off the training thread
            delay = min(delay * 2, 0.5)

    def _reset_evidence(self) -> None:
        assert self.guard is not None
        self._baseline = self.guard.counters()
        self._audits_at_restorable = self._baseline.get("audit", {}).get("passed", 0)

    def _run_id(self) -> str:
        meta = self._store.run_meta()
        if meta and isinstance(meta.get("run_id"), str):
            return meta["run_id"]
        run_id = uuid.uuid4().hex
        self._store.write_run_meta({"run_id": run_id, "created_at": utc_now(), "schema_version": 1})
        return run_id

    def _plan_shards(self, flat_tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        shards: list[dict[str, torch.Tensor]] = [{}]
        filled = 0
        for name, t in flat_tensors.items():
            n = t.numel() * t.element_size()
            if shards[-1] and filled + n > self.shard_bytes:
                shards.append({})
                filled = 0
            shards[-1][name] = t
            filled += n
        return shards

    def _write_shards(
        self, cid: str, plan: list[dict[str, torch.Tensor]], indices: Any
    ) -> tuple[list[ShardEntry], dict[str, Fingerprint]]:
        indices = list(indices)
        names = [n for i in indices for n in plan[i]]
        fps = dict(zip(names, lanes_of([plan[i][n] for i in indices for n in plan[i]])))

        def one(i: int) -> ShardEntry:
            path = f"shard-{i:05d}.safetensors"
            nbytes = sum(t.numel() * t.element_size() for t in plan[i].values())
            with self._store.open_shard_for_write(cid, path, size_hint=nbytes) as f:
                size, digest = write_shard(f, plan[i])
            return ShardEntry(path, size, digest, sorted(plan[i]))

        with concurrent.futures.ThreadPoolExecutor(self.io_workers, thread_name_prefix="vckpt-io") as pool:
            return list(pool.map(one, indices)), fps

    def _manifest(
        self, run_id: str, cid: str, step: int, flat: Any, shard_entries: list[ShardEntry],
        fps: dict[str, Fingerprint], status: Status, reasons: list[str], evidence: dict, topology: dict,
    ) -> Manifest:
        tensors = {}
        for s in shard_entries:
            for n in s.tensors:
                t = flat.tensors[n]
                tensors[n] = TensorEntry(dtype_name(t.dtype), list(t.shape), s.path, str(fps[n]))
        state_fp = combine([(n, e.dtype, e.shape, fps[n]) for n, e in tensors.items()], flat.skeleton_json())
        return Manifest(
            run_id=run_id, checkpoint_id=cid, step=step, created_at=utc_now(), topology=topology,
            shards=shard_entries, tensors=tensors, state_fingerprint=str(state_fp), state=flat.skeleton,
            evidence=evidence, status=status, reasons=reasons, resumed_from=self.resumed_from,
        )

    def _apply_retention(self) -> None:
        infos = self.list()
        target = decisions.newest(infos, {Status.RESTORABLE})
        protect = {target.id} if target else set()
        for cid in decisions.to_delete(infos, self.keep_last, protect):  # type: ignore[arg-type]
            self._store.delete_checkpoint(cid)

    # ------------------------------------------------------------------ list
    def exists(self) -> bool:
        """Whether anything of a run is stored at the URL."""
        return self._store.exists()

    def list(self) -> list[CheckpointInfo]:
        """Every committed checkpoint, oldest first, with its derived status."""
        return self._view().infos

    def _view(self) -> _RunView:
        """One read of the run: checkpoints with derived status, incidents, trusted rollbacks.
        Operations that need several of these take one view, so each manifest is read once."""
        ids = self._store.committed_ids()
        verifications: dict[str, list[dict]] = {}
        for rec in self._records("verification"):
            if not Signature(rec["signature_state"]).trusted:  # an unverifiable "ok" must not count as one
                rec = {"checkpoint_id": rec.get("checkpoint_id"), "ok": False, "at": rec.get("at"), "problems": [
                    {"kind": "signature", "detail": self._signer.why(Signature(rec["signature_state"]), "a verification record")}]}
            verifications.setdefault(str(rec.get("checkpoint_id")), []).append(rec)
        incidents, rollbacks = self.incidents(), self._rollbacks()

        def load(cid: str) -> CheckpointInfo:
            try:
                raw = Manifest.decode_json(self._store.read_manifest(cid), cid)
                m = Manifest.from_dict(raw, cid)
            except CorruptCheckpoint as e:  # malformed, oversized, or behind a symlink out of the run
                return CheckpointInfo(cid, _step_from_id(cid), Status.CORRUPT, "", 0, [str(e)], None)
            sig = self._signer.check(raw)
            if not sig.trusted:
                return CheckpointInfo(cid, m.step, Status.CORRUPT, m.created_at, m.size_bytes,
                                      [self._signer.why(sig, f"the manifest of {cid}")], m, sig.value)
            if m.checkpoint_id != cid:
                return CheckpointInfo(cid, m.step, Status.CORRUPT, m.created_at, m.size_bytes,
                                      [f"manifest names checkpoint {m.checkpoint_id!r} but lives in folder {cid!r}"], m,
                                      sig.value)
            return dataclasses.replace(self._info(m, verifications.get(cid, []), incidents, rollbacks), signature=sig.value)

        with concurrent.futures.ThreadPoolExecutor(self.io_workers) as pool:
            infos = list(pool.map(load, ids))
        return _RunView(sorted(infos, key=lambda i: (i.created_at, i.step, i.id)), incidents, rollbacks)

    def _records(self, kind: str) -> list[dict[str, Any]]:
        """Records of ``kind``, each with ``signature_state`` (a :class:`Signature` value) added."""
        out = []
        for _, raw in self._store.records(kind):
            # ValueError: JSON errors, and integers too long to convert.
            with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError):
                rec = json.loads(raw)
                if isinstance(rec, dict):
                    rec["signature_state"] = self._signer.check(rec).value
                    out.append(rec)
        return out

    def _rollbacks(self) -> list[dict[str, Any]]:
        # A rollback record answers incidents and starts a lineage, which makes checkpoints
        # trusted again: one that fails its signature check answers nothing.
        return [r for r in self._records("rollback") if Signature(r["signature_state"]).trusted]

    def _append(self, kind: str, record: dict[str, Any]) -> dict[str, Any]:
        sealed = self._signer.seal(record)
        self._store.append_record(kind, sealed)
        return sealed

    # ------------------------------------------------------------- incidents
    def incidents(self) -> list[dict[str, Any]]:
        """Every incident recorded under the run (by the guard or by hand), oldest first."""
        out = []
        for rec in self._records("incident"):
            if not Signature(rec["signature_state"]).trusted:
                # Every field of an edited record may be the edit (a narrowed interval, a
                # back-dated time that an old rollback would answer), so none is believed:
                # it covers the whole run and no rollback answers it, until an operator
                # removes it (and re-flags what is real).
                rec = {**rec, "first_suspect_step": 0, "to_step": None, "at": UNANSWERABLE,
                       "id": str(rec.get("id", "unknown")),
                       "reason": self._signer.why(Signature(rec["signature_state"]), "this incident record")
                       + "; until it is removed every checkpoint is suspect"}
            if isinstance(rec.get("first_suspect_step"), int) and isinstance(rec.get("id"), str):
                out.append(rec)
        return sorted(out, key=lambda r: r.get("at", ""))

    def _record_incident(self, inc: Incident) -> None:
        if self.rank != 0:
            return
        rec = {**inc.to_dict(), "id": uuid.uuid4().hex[:12], "at": utc_now(), "source": "guard"}
        with contextlib.suppress(StorageError):  # the exception the guard raises next matters more
            self._append("incident", rec)
        if self._ledger is not None:
            self._ledger.append([Event(inc.detected_step, "incident", r, "fail") for r in inc.ranks or [NO_RANK]])
            with contextlib.suppress(StorageError):
                self._ledger.flush()

    def _log(self, events: list[Event]) -> None:
        """Append job-level events (saves, restores) and flush, so the ledger backs every manifest."""
        if self._ledger is not None:
            self._ledger.append(events)
            self._ledger.flush()

    def ledger(self) -> Columns | None:
        """The run's ledger of check events as columns (``None`` if the run has none)."""
        return read_ledger(self._store)

    def history_report(self) -> dict[str, Any]:
        """Everything ``vckpt report`` draws, as plain data (see ``history.report_data``)."""
        self.require_run()
        view = self._view()
        infos, incidents, rollbacks = view.infos, view.incidents, view.rollbacks
        target, _ = decisions.rollback_target(infos)
        return history.report_data(
            self.url, utc_now(), self.ledger(),
            [{"id": i.id, "step": i.step, "status": i.status.value} for i in infos],
            incidents, [decisions.answered_at(i, rollbacks) is not None for i in incidents],
            {"id": target.id, "step": target.step} if target is not None else None,
        )

    def flag(self, from_step: int, *, to_step: int | None = None, ranks: Sequence[int] = (), reason: str) -> dict[str, Any]:
        """Record an incident by hand: checkpoints in [from_step, to_step] become suspect.

        Raises:
            InvalidState: the interval or ranks are malformed.
        """
        if not isinstance(from_step, int) or from_step < 0:
            raise InvalidState(f"--from-step must be an int >= 0, got {from_step!r}")
        if to_step is not None and to_step < from_step:
            raise InvalidState(f"--to-step {to_step} is before --from-step {from_step}; give an interval in order")
        if not reason or not reason.strip():
            raise InvalidState("a reason is required: say why these steps are flagged (--reason TEXT)")
        self.require_run()
        infos = self.list()
        topo = next((i.manifest.topology for i in reversed(infos) if i.manifest), {"ranks": []})
        by_rank = {r.get("rank"): r for r in topo.get("ranks", []) if isinstance(r, dict)}
        hosts = [by_rank.get(r, {"rank": r, "host": "unknown", "device": "unknown"}) for r in ranks]
        rec = {"id": uuid.uuid4().hex[:12], "kind": "manual", "source": "manual", "at": utc_now(),
               "first_suspect_step": from_step, "to_step": to_step, "detected_step": from_step,
               "ranks": sorted(ranks), "hosts": hosts, "detail": reason.strip(), "reason": reason.strip()}
        return self._append("incident", rec)

    def rollback_target(self) -> tuple[CheckpointInfo | None, list[tuple[str, int, str]]]:
        """The newest restorable checkpoint predating every flagged interval on the current lineage,
        and why each newer checkpoint was skipped (newest first)."""
        return decisions.rollback_target(self.list())

    def record_rollback(self, *, dry_run: bool = False) -> tuple[CheckpointInfo, list[tuple[str, int, str]]]:
        """Choose the rollback target and record the rollback, answering every open incident.

        Checkpoints saved after this record form a new lineage. ``vckpt rollback``
        calls this; a training job then resumes with :meth:`rollback` or :meth:`restore`.

        Returns:
            (target, skipped newer checkpoints with reasons).

        Raises:
            CheckpointNotRestorable: nothing is restorable.
        """
        view = self._view()
        target, skipped = decisions.rollback_target(view.infos)
        if target is None:
            self.require_run()
            why = "; ".join(f"{cid} (step {st}) {w}" for cid, st, w in skipped[:3]) or "the run has no checkpoint"
            raise CheckpointNotRestorable(f"no restorable checkpoint to roll back to in {self.url}: {why}")
        if not dry_run:
            open_ids = [i["id"] for i in view.incidents if decisions.answered_at(i, view.rollbacks) is None]
            if open_ids:
                self._append("rollback", {"at": utc_now(), "to_checkpoint_id": target.id,
                                                       "to_step": target.step, "answers": open_ids})
        return target, skipped

    def rollback(self, state: Mapping[str, Any]) -> CheckpointInfo:
        """Roll back: restore the rollback target into ``state`` and start a new lineage.

        Call it on every rank of a guarded job (rank 0 chooses, everyone
        restores the same checkpoint). Incidents not yet answered are answered
        by a rollback record; checkpoints saved afterwards are valid even at
        step numbers already used, while the abandoned ones stay suspect.

        Raises:
            CheckpointNotRestorable: nothing is restorable.
        """
        chosen, target = "", None
        if self.rank == 0:
            with contextlib.suppress(VerifiedCkptError):  # re-raised below on every rank alike
                target = self.record_rollback()[0]
                chosen = target.id
        if self.guard is not None:
            chosen = self.guard.gather_bytes(chosen.encode() if self.rank == 0 else b"")[0].decode()
        if not chosen:
            self.record_rollback(dry_run=True)  # raises the explanation on every rank
        # Rank 0 already holds the target (a rollback record cannot change its status); the others look it up.
        info = self._restore(state, target) if target is not None else self.restore(state, checkpoint_id=chosen)
        if self.guard is not None:
            self.guard.barrier()
        return info

    def _info(self, m: Manifest, verifications: list[dict], incidents: Sequence[dict] = (),
              rollbacks: Sequence[dict] = ()) -> CheckpointInfo:
        """Derived status: the manifest's, worsened by verification records and flagged intervals."""
        status, reasons = decisions.derive_status(m.status, m.reasons, verifications)
        flagged = decisions.incident_reasons(m.step, m.created_at, incidents, rollbacks)
        if flagged:
            status, reasons = decisions.worst(status, Status.SUSPECT), reasons + flagged
        return CheckpointInfo(m.checkpoint_id, m.step, status, m.created_at, m.size_bytes, reasons, m)

    def get(self, ref: int | str) -> CheckpointInfo:
        """One checkpoint by step (the newest at that step) or by id.

        Raises:
            CheckpointNotFound: nothing matches.
        """
        infos = self.list()
        if isinstance(ref, str) and not ref.isdigit():
            for info in infos:
                if info.id == ref:
                    return info
        else:
            found = decisions.newest(infos, set(Status), step=int(ref))
            if found:
                return found
        self.require_run()
        have = sorted({i.step for i in infos})
        shown = ", ".join(map(str, have[-10:])) or "none"
        raise CheckpointNotFound(f"no checkpoint {ref!r} in {self.url}; steps present: {shown} (`vckpt list {self.url}`)")

    def require_run(self) -> None:
        """Raise :class:`RunNotFound` unless something of a run is stored at the URL."""
        if not self._store.exists():
            raise RunNotFound(f"no run at {self.url}: nothing is stored there; check the URL or save a checkpoint first")

    # --------------------------------------------------------------- restore
    def restore(
        self, state: Mapping[str, Any], *, step: int | None = None, checkpoint_id: str | None = None,
        allow_unverified: bool = False,
    ) -> CheckpointInfo:
        """Load a verified checkpoint into ``state`` in place.

        Every shard digest and tensor fingerprint is checked before anything
        in ``state`` is touched, and the fingerprints are checked again after loading.

        Args:
            state: the same kind of mapping given to :meth:`save`; stateful
                objects get ``load_state_dict``, tensors are copied into, plain
                values are replaced in the mapping.
            step: which step; ``None`` means the rollback target (the newest restorable
                checkpoint, which predates every flagged interval on the current lineage).
            checkpoint_id: a checkpoint by id instead of by step.
            allow_unverified: also accept an ``unverified`` checkpoint (never a
                ``suspect`` or ``corrupt`` one).

        Returns:
            The :class:`CheckpointInfo` that was restored.

        Raises:
            CheckpointNotFound: no such checkpoint.
            CheckpointNotRestorable: its status forbids it.
            CorruptCheckpoint: stored bytes do not match the manifest.
            InvalidState: ``state`` does not fit the checkpoint.
        """
        allowed = {Status.RESTORABLE} | ({Status.UNVERIFIED} if allow_unverified else set())
        info = self.get(checkpoint_id) if checkpoint_id is not None else self._select(step, allowed)
        if info.status not in allowed:
            raise CheckpointNotRestorable(self._refusal(info, allow_unverified))
        return self._restore(state, info)

    def _restore(self, state: Mapping[str, Any], info: CheckpointInfo) -> CheckpointInfo:
        """Restore a checkpoint whose status the caller has already checked."""
        m = info.manifest
        assert m is not None
        needed = self._check_fits(state, m)
        loaded, problems = self._read_checked(m, names=needed, scan_nonfinite=False, fail_fast=True)
        if problems:
            p = problems[0]
            raise CorruptCheckpoint(
                f"checkpoint {m.checkpoint_id} (step {m.step}) failed its {p.kind} check: {p.detail}; "
                f"run `vckpt verify {self.url} --step {m.step}` and restore an earlier checkpoint"
            )
        self._apply(state, m, loaded)
        self._check_after(state, m)
        self.resumed_from = m.checkpoint_id
        self._log([Event(m.step, "restore", NO_RANK, "none")])
        if self.guard is not None:
            self._reset_evidence()
            self.guard.prepare_resume()
        return info

    def _select(self, step: int | None, allowed: set[Status]) -> CheckpointInfo:
        infos = self.list()
        if step is None:
            found = decisions.newest(infos, allowed)
            if found is None:
                self.require_run()
                if not infos:
                    raise CheckpointNotFound(f"run {self.url} has no committed checkpoint; save one first")
                newest = infos[-1]
                raise CheckpointNotRestorable(self._refusal(newest, Status.UNVERIFIED in allowed, nothing_restorable=True))
            return found
        return self.get(step)

    def _refusal(self, info: CheckpointInfo, allow_unverified: bool, nothing_restorable: bool = False) -> str:
        why = info.reasons[-1] if info.reasons else "no reason recorded"
        head = "no checkpoint is restorable; the newest, " if nothing_restorable else ""
        if info.status is Status.UNVERIFIED and not allow_unverified:
            nxt = "pass allow_unverified=True (CLI: --allow-unverified) to accept it"
        else:
            nxt = f"restore an earlier restorable checkpoint (`vckpt list {self.url} --restorable`)"
        return f"{head}checkpoint {info.id} (step {info.step}) is {info.status.value}: {why}; {nxt}"

    def _check_fits(self, state: Mapping[str, Any], m: Manifest) -> set[str]:
        """Refuse before touching anything if ``state`` cannot take this checkpoint."""
        if not isinstance(state, Mapping):
            raise InvalidState(f"state must be a mapping of names to objects, got {type(state).__name__}")
        missing = [k for k in state if k not in m.state]
        if missing:
            raise InvalidState(
                f"checkpoint {m.checkpoint_id} has no entry {missing[0]!r}; it holds {sorted(m.state)} - pass matching keys"
            )
        current = flatten({k: state[k] for k in state}).tensors
        for name, t in current.items():
            e = m.tensors.get(name)
            if e is not None and list(t.shape) != e.shape:
                raise InvalidState(
                    f"{name}: checkpoint has shape {e.shape}, the object being restored has {list(t.shape)}; "
                    "build the model with the configuration it was saved with"
                )
        needed: set[str] = set()
        for k in state:
            needed |= tensor_refs(m.state[k]["value"])
        return needed

    def _apply(self, state: Any, m: Manifest, loaded: dict[str, torch.Tensor]) -> None:
        # Rebuild every entry before touching any: a failure leaves ``state`` as it was.
        values = {key: unflatten(m.state[key]["value"], loaded) for key in list(state)}
        for key, value in values.items():
            entry = m.state[key]
            target = state[key]
            if entry["stateful"] and is_stateful(target):
                # Modules copy into their parameters; other Stateful objects
                # (optimizers) may keep the tensors they are given, which would
                # pin whole shard buffers in memory, so they get their own copies.
                target.load_state_dict(value if isinstance(target, torch.nn.Module) else _own(value))
            elif isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
                with torch.no_grad():
                    target.copy_(value)
            else:
                state[key] = _load_into(target, value, {})

    def _check_after(self, state: Mapping[str, Any], m: Manifest) -> None:
        after = flatten(state).tensors
        names = [n for n, t in after.items() if n in m.tensors and dtype_name(t.dtype) == m.tensors[n].dtype]
        for n, fp in zip(names, lanes_of([after[n] for n in names])):
            if str(fp) != m.tensors[n].fingerprint:
                raise CorruptCheckpoint(
                    f"after loading, {n} does not match checkpoint {m.checkpoint_id}'s fingerprint; "
                    "the object altered the values while loading - restore into a freshly built object"
                )

    # ------------------------------------------------------------ read path
    def _read_checked(
        self, m: Manifest, *, names: set[str] | None, scan_nonfinite: bool, fail_fast: bool,
        progress: Callable[[int], None] | None = None,
        on_verified: Callable[[ShardEntry, torch.Tensor], None] | None = None, keep: bool = True,
    ) -> tuple[dict[str, torch.Tensor], list[Problem]]:
        """Read shards, checking size, digest, header and fingerprints; return tensors and problems."""
        shards = [s for s in m.shards if names is None or names & set(s.tensors)]
        missing = sorted((names or set()) - set(m.tensors))
        problems: list[Problem] = [Problem("missing", f"tensor {n} is referenced but not in the manifest") for n in missing]

        def one(s: ShardEntry) -> tuple[dict[str, torch.Tensor], list[Problem]]:
            where = f"{m.checkpoint_id}/{s.path}"
            try:
                actual = self._store.shard_size(m.checkpoint_id, s.path)
                if actual != s.size:
                    return {}, [Problem("size", f"{where} is {actual} bytes, the manifest says {s.size}")]
                hasher = blake3.blake3()

                def on_chunk(chunk: memoryview) -> None:
                    hasher.update(chunk)
                    if progress:
                        progress(len(chunk))

                buf = self._store.read_shard(m.checkpoint_id, s.path, s.size, on_chunk)
            except FileNotFoundError:
                return {}, [Problem("missing", f"{where} does not exist")]
            except (CorruptCheckpoint, StorageError) as e:
                return {}, [Problem("read", f"{where}: {e}")]
            if hasher.hexdigest() != s.digest:
                return {}, [Problem("digest", f"{where} blake3 digest does not match the manifest (bytes changed on storage)")]
            try:
                header = parse_header(memoryview(buf.numpy()), s.size, where)
            except CorruptCheckpoint as e:
                return {}, [Problem("header", str(e))]
            probs = []
            if sorted(header.entries) != sorted(s.tensors):
                probs.append(Problem("header", f"{where} holds tensors {sorted(header.entries)[:5]}..., the manifest lists others"))
                return {}, probs
            try:
                tensors = tensors_from_buffer(buf, header)
            except CorruptCheckpoint as e:
                return {}, [Problem("header", str(e))]
            for n, t in tensors.items():
                e = m.tensors.get(n)
                if e is None or e.dtype != dtype_name(t.dtype) or e.shape != list(t.shape):
                    probs.append(Problem("header", f"{where}: {n} has dtype/shape {t.dtype}/{list(t.shape)}, the manifest says otherwise"))
            if probs:
                return {}, probs
            order = list(tensors)
            for n, fp in zip(order, lanes_of([tensors[n] for n in order])):
                if str(fp) != m.tensors[n].fingerprint:
                    probs.append(Problem("fingerprint", f"{where}: {n} fingerprint {fp} != manifest {m.tensors[n].fingerprint}"))
            if scan_nonfinite:
                floats = [n for n in order if tensors[n].is_floating_point() and tensors[n].numel()]
                if floats:
                    ok = _finite_flags([tensors[n] for n in floats])
                    probs += [Problem("nonfinite", f"{where}: {n} holds NaN or Inf") for n, good in zip(floats, ok) if not good]
            if on_verified is not None and not probs:
                on_verified(s, buf)
            return (tensors if keep else {}), probs  # verify drops each shard once checked: bounded memory

        loaded: dict[str, torch.Tensor] = {}
        with concurrent.futures.ThreadPoolExecutor(self.io_workers, thread_name_prefix="vckpt-io") as pool:
            futures = [pool.submit(one, s) for s in shards]
            for fut in futures:
                tensors, probs = fut.result()
                problems += probs
                loaded.update(tensors)
                if fail_fast and problems:
                    for other in futures:
                        other.cancel()
                    break
        return loaded, problems

    def export(self, dest: str, *, step: int | None = None, allow_unverified: bool = False) -> CheckpointInfo:
        """Copy a verified checkpoint (safetensors shards and manifest) into the local folder ``dest``.

        The same refusals as :meth:`restore`; every shard is verified before
        it is written, and the manifest is written last.

        Raises:
            InvalidState: ``dest`` exists and is not an empty folder.
        """
        allowed = {Status.RESTORABLE} | ({Status.UNVERIFIED} if allow_unverified else set())
        info = self._select(step, allowed)
        if info.status not in allowed:
            raise CheckpointNotRestorable(self._refusal(info, allow_unverified))
        m = info.manifest
        assert m is not None
        if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
            raise InvalidState(f"{dest} exists and is not an empty folder; choose a new folder for --to")
        os.makedirs(dest, exist_ok=True)

        written: list[str] = []

        def write(entry: ShardEntry, buf: torch.Tensor) -> None:
            path = os.path.join(dest, entry.path)
            written.append(path)
            with open(path, "wb") as f:
                f.write(memoryview(buf.numpy()))

        _, problems = self._read_checked(m, names=None, scan_nonfinite=False, fail_fast=True, on_verified=write)
        if problems:
            for path in written:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            raise CorruptCheckpoint(f"checkpoint {m.checkpoint_id} failed its {problems[0].kind} check: "
                                    f"{problems[0].detail}; nothing usable was exported - pick another step")
        with open(os.path.join(dest, "manifest.json"), "wb") as f:
            f.write(m.to_json())
        return info

    def gc(self, *, grace_s: float = 3600.0, dry_run: bool = False) -> list[str]:
        """Remove orphans older than ``grace_s``: folders without a manifest (saves that never
        committed) and files a manifest does not reference. Never touches anything a manifest
        references, nor folders whose manifest is unreadable (evidence). Returns ``cid/file`` paths.
        """
        if grace_s < 0:
            raise InvalidState(f"--grace must be >= 0 seconds, got {grace_s}")
        self.require_run()
        now = time.time()
        removed = []
        for cid, files in sorted(self._store.checkpoint_files().items()):
            names = {n for n, _ in files}
            if "manifest.json" in names:
                try:
                    m = Manifest.from_json(self._store.read_manifest(cid), where=cid)
                except ManifestError:
                    continue
                keep = {s.path for s in m.shards} | {"manifest.json"}
            else:
                keep = set()
            doomed = [n for n, mtime in files if n not in keep and mtime is not None and now - mtime >= grace_s]
            removed += [f"{cid}/{n}" for n in doomed]
            if dry_run:
                continue
            if not keep and len(doomed) == len(files):
                self._store.delete_checkpoint(cid)  # a save that never committed: the whole folder
            else:
                for n in doomed:
                    self._store.delete_file(cid, n)
        return removed

    # ---------------------------------------------------------------- verify
    def verify(
        self, step: int | None = None, *, jobs: int = 1, progress: Callable[[int], None] | None = None
    ) -> list[VerificationResult]:
        """Re-read checkpoints offline and record the result (append-only).

        Re-reads every shard, recomputes digests and fingerprints, scans for
        NaN/Inf, compares everything with the manifest, and checks that the
        ledger backs the manifest's consensus claim. A mismatch makes the
        checkpoint ``corrupt`` from then on.

        Memory stays bounded by ``jobs * io_workers`` shards in flight: each
        shard is dropped once checked (local shards are mapped, remote ones
        staged in unlinked temporary files).

        Args:
            step: verify only the checkpoints at this step; ``None`` verifies all.
            jobs: checkpoints verified at the same time.
            progress: called with a byte count as data is read (from several threads).

        Returns:
            One :class:`VerificationResult` per checkpoint, oldest first.
        """
        if not isinstance(jobs, int) or jobs < 1:
            raise InvalidState(f"--jobs must be an int >= 1, got {jobs!r}")
        infos = self.list()
        if step is not None:
            infos = [i for i in infos if i.step == step]
            if not infos:
                self.get(step)  # raises a helpful CheckpointNotFound
        elif not infos:
            self.require_run()
        cols = self.ledger()
        consensus = history.passing_consensus(cols) if cols is not None else None

        def one(info: CheckpointInfo) -> VerificationResult:
            if info.manifest is None:
                problems = [Problem("manifest", info.reasons[0] if info.reasons else "manifest unreadable")]
            else:
                try:
                    _, problems = self._read_checked(info.manifest, names=None, scan_nonfinite=True, fail_fast=False,
                                                     progress=progress, keep=False)
                except VerifiedCkptError as e:
                    problems = [Problem("read", str(e))]
                problems += [Problem("ledger", p) for p in history.consensus_claim_problems(info.manifest.evidence, consensus)]
                if not Signature(info.signature).trusted:
                    problems.insert(0, Problem("signature", info.reasons[0]))
            result = VerificationResult(info.id, info.step, not problems, problems, utc_now())
            self._append("verification", result.to_record())
            return result

        with concurrent.futures.ThreadPoolExecutor(jobs, thread_name_prefix="vckpt-verify") as pool:
            return list(pool.map(one, infos))

    def total_bytes(self, step: int | None = None) -> int:
        """Bytes a :meth:`verify` with the same ``step`` would read (for progress bars)."""
        return sum(i.size_bytes for i in self.list() if step is None or i.step == step)


@dataclasses.dataclass(frozen=True)
class _RunView:
    infos: list[CheckpointInfo]
    incidents: list[dict[str, Any]]
    rollbacks: list[dict[str, Any]]


UNANSWERABLE = "9999-12-31T23:59:59+00:00"  # later than any rollback record
MAX_STEP = 2**63 - 1  # steps are int64 in the ledger


def _finite_flags(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each floating tensor holds only finite values, at about the speed of a sum.

    Any NaN or Inf element makes the sum NaN or Inf, so a finite sum proves the
    tensor finite; only a non-finite sum (a bad element, or finite values whose
    sum overflowed) pays for the exact elementwise check. ``isfinite().all()``
    on everything measured 30x slower than the sum on CPU. One host sync.
    """
    sums = torch.stack([t.sum().to(torch.float64) for t in tensors]).isfinite().tolist()
    return [True if fine else bool(torch.isfinite(t).all()) for t, fine in zip(tensors, sums)]


def _load_into(target: Any, value: Any, memo: dict[int, Any]) -> Any:
    """Copy restored tensors into the caller's existing tensors where they fit; own copies elsewhere."""
    if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor):
        if target.shape == value.shape and target.dtype == value.dtype and id(value) not in memo:
            with torch.no_grad():
                target.copy_(value)
            memo[id(value)] = target
            return target
        return _own(value, memo)
    if isinstance(target, dict) and isinstance(value, dict):
        for k in [k for k in target if k not in value]:
            del target[k]
        for k, v in value.items():
            target[k] = _load_into(target.get(k), v, memo)
        return target
    if isinstance(target, list) and isinstance(value, list) and len(target) == len(value):
        target[:] = [_load_into(t, v, memo) for t, v in zip(target, value)]
        return target
    return _own(value, memo)


def _own(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """Give restored data its own tensor memory, detached from the read buffer.

    Tensors that were one tensor when saved (aliases) stay one tensor.
    """
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            memo[id(value)] = value.clone()
        return memo[id(value)]
    if isinstance(value, list):
        return [_own(v, memo) for v in value]
    if isinstance(value, tuple):
        return tuple(_own(v, memo) for v in value)
    if isinstance(value, dict):
        return {k: _own(v, memo) for k, v in value.items()}
    return value
