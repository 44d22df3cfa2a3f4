"""The write path: every rank writes its share of the shards, rank 0 commits the manifest last.

:meth:`Saver.prepare` is the synchronous, collective start of a save (``CheckpointManager.begin_save``): the
guard's consensus (when there is a guard), the evidence and status, one checkpoint id for every rank.
:meth:`Saver.finish` is the manager's own use of the resulting ``SaveSession`` (``session``): this rank's
shards (about 1/W of them), every rank's report, rank 0's commit, every rank's publish. A blocking save gathers
the reports with collectives; a non-blocking one runs ``finish`` on a background thread where no collective may
run, so reports and the manifest pass through a ``Rendezvous`` in the store, within a bound. What reads the
run (retention, the open-incident warning) is :meth:`Saver.housekeep`, run after the commit, off the save.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..comm import Communicator, describe_device
from ..errors import CorruptCheckpoint, InvalidState, ManifestError
from ..evidence import EvidenceTracker, remedies
from ..fingerprint import Fingerprint
from ..flatten import Flat, bookkeeping, flatten, is_per_rank
from ..guard import SDCGuard
from ..hosts import Topology
from ..jsonx import canonical_json
from ..lanes import lanes_of
from ..manifest import CheckpointInfo, Manifest, ShardEntry, TensorEntry, state_fingerprint_of
from ..sharding import split
from ..shards import supported, write_shard
from ..signing import Signer
from ..skeleton import skeleton_problem, tensor_refs
from ..status import MAX_STEP, Status
from ..store import RunStore, utc_now
from ..tensorspec import MAX_NDIM, dtype_name
from . import housekeeping
from .catalog import Catalog, info
from .exchange import exchange_for
from .lease import Lease
from .session import RankReport, SaveJob, SaveSession, agreed_names, agreement_problem, reports_problem, witness_problem
from .stages import merge

__all__ = ["UNGUARDED", "SaveJob", "Saver", "checked_flat"]

log = logging.getLogger("verified_ckpt")

UNGUARDED = "saved without an SDCGuard: no cross-replica consensus or audit evidence"


def training_tensors(state: Mapping[str, Any], guard: SDCGuard | None) -> list[torch.Tensor]:
    """The live tensors training updates: parameters and buffers of the modules, and optimizer state, found in
    ``state`` and held by ``guard``. What a save tells apart from bookkeeping (``flatten.bookkeeping``)."""
    objects = [*state.values(), *((guard.module, guard.optimizer) if guard is not None else ())]
    out: list[torch.Tensor] = []
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            out += [*obj.parameters(), *obj.buffers()]
        elif isinstance(getattr(obj, "state", None), Mapping) and hasattr(obj, "param_groups"):  # an optimizer
            out += [v for per in obj.state.values() if isinstance(per, Mapping) for v in per.values()
                    if isinstance(v, torch.Tensor)]
    return out


def checked_flat(step: int, state: Mapping[str, Any], rank: int = 0, live: Sequence[torch.Tensor] = ()) -> Flat:
    """Flatten ``state`` for saving, refusing (before anything is written) what the reader would refuse.

    Per-rank entries (``is_per_rank``) get tensor names of their own on every rank (``key@r<rank>/...``).
    ``live``: the training state (``training_tensors``); the other floating tensors are recorded as bookkeeping.

    Raises:
        InvalidState: naming the offending entry and what to do.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InvalidState(f"step must be an int >= 0, got {step!r}")
    if step > MAX_STEP:
        raise InvalidState(f"step must be <= {MAX_STEP}, got {step}")
    own = tuple(k for k, v in state.items() if is_per_rank(v)) if isinstance(state, Mapping) else ()
    flat = flatten({f"{k}@r{rank}" if k in own else k: v for k, v in state.items()} if own else state)
    if own:  # the tensors keep their rank's names; the skeleton goes back to the state's own keys
        original = {f"{k}@r{rank}": k for k in own}
        flat = Flat(flat.tensors, {original.get(k, k): v for k, v in flat.skeleton.items()}, own)
    for name, t in flat.tensors.items():
        if not supported(t.dtype):
            raise InvalidState(f"{name}: dtype {t.dtype} cannot be stored in safetensors; convert it in state_dict()")
        if t.dim() > MAX_NDIM:
            raise InvalidState(f"{name}: {t.dim()} dimensions, more than the {MAX_NDIM} a checkpoint may hold")
    for key, entry in flat.skeleton.items():
        problem = skeleton_problem(entry["value"])
        if problem:
            raise InvalidState(f"state[{key!r}] cannot be saved: {problem}; flatten it into fewer levels")
    return dataclasses.replace(flat, bookkeeping=bookkeeping(flat.tensors, live))


class Saver:
    """Writes checkpoints of one run for one rank of ``comm``."""

    def __init__(self, store: RunStore, signer: Signer, comm: Communicator, guard: SDCGuard | None,
                 tracker: EvidenceTracker, catalog: Catalog, *, keep_last: int | None, shard_bytes: int, io_workers: int,
                 report_timeout_s: float, pinned: set[str] | None = None) -> None:
        self.store, self.signer, self.comm, self.guard, self.tracker = store, signer, comm, guard, tracker
        self.catalog, self.keep_last, self.pinned = catalog, keep_last, pinned if pinned is not None else set()
        self._warned_open = self._warned_unverified = False
        self.shard_bytes, self.io_workers, self.report_timeout_s = shard_bytes, io_workers, report_timeout_s
        self._host_copies: dict[str, torch.Tensor] = {}  # reused by non-blocking saves

    def prepare(self, step: int, flat: Flat, resumed_from: str | None) -> SaveJob:
        """The synchronous part of a save: consensus, status and evidence, and one id for every rank."""
        started = time.monotonic()
        self.comm.arrive("save")  # fails fast, naming who is missing, when only some ranks save
        flat, own = self._per_rank(flat)
        flat, held = merge(flat, self.comm)  # ranks holding different parts of the state (pipeline stages)
        parts = split(flat.tensors, self.comm)
        g = self.guard
        agreed: dict[str, str] = {}
        witnessed: dict[str, str] = {}
        if g is None:
            status, reasons, evidence = Status.UNVERIFIED, [UNGUARDED], {}
        else:
            account = g.save_evidence(step)  # raises on a failed audit or disagreement: nothing is written
            ev, status, reasons = self.tracker.for_account(account)
            evidence = ev.to_dict()
            if account.fingerprints and self.comm.rank == 0:
                agreed = agreed_names(parts.replicated, account.agreed)
            witnessed = self._witnessed(account.vouched, parts.mine | own | held, bool(parts.layout))
        hosts = list(self.comm.topology())
        if self.comm.world == 1:  # name the device the state lives on, which a single process may not have told comm
            device = next((t.device for t in flat.tensors.values() if t.device.type == "cuda"), torch.device("cpu"))
            hosts[0] = dataclasses.replace(hosts[0], device=describe_device(device))
        proposed = f"step-{step:010d}-{uuid.uuid4().hex[:8]}"
        # Rank 0 leases the folder before any rank writes into it: gc leaves a running save alone (``lease``).
        lease = Lease(self.store, proposed) if self.comm.rank == 0 else None
        try:
            got = self.comm.broadcast_bytes(proposed.encode() + b"\0" + os.urandom(32))
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        cid, key = got[:got.index(b"\0")].decode(), got[got.index(b"\0") + 1:]
        topology = Topology(self.comm.world, tuple(hosts))
        return SaveJob(cid, step, dataclasses.replace(flat, tensors=parts.replicated), status, reasons, evidence,
                       topology, resumed_from, parts.mine | own | held, parts.layout, started, lease, Signer(key), agreed,
                       witnessed)

    def _witnessed(self, vouched: list[tuple[torch.Tensor, str]] | None, mine: dict[str, torch.Tensor],
                   sharded: bool) -> dict[str, str]:
        """Rank 0: every rank's fingerprint, by stored name, of the chunks it alone writes (``mine``) that are
        tensors the guard's chain vouched for (``Witnesses.vouched``, matched by memory as ``agreed_names``): the
        bytes its checked update wrote, without a pass of their own. One small gather, where the chain held at this
        save and the state has sharded tensors (both the same on every rank)."""
        if vouched is None or not sharded:
            return {}
        got = self.comm.gather_bytes(json.dumps(agreed_names(mine, vouched)).encode())
        return {n: fp for b in got for n, fp in json.loads(b).items()} if self.comm.rank == 0 else {}

    def _per_rank(self, flat: Flat) -> tuple[Flat, dict[str, torch.Tensor]]:
        """Every rank's value of the per-rank entries in the skeleton (one small all-gather); this rank's tensors
        of them, which it writes itself."""
        if not flat.per_rank:
            return flat, {}
        mine = {k: flat.skeleton[k] for k in flat.per_rank}
        everyone = [json.loads(b) for b in self.comm.gather_bytes(canonical_json(mine))]
        skeleton = dict(flat.skeleton)
        for k in flat.per_rank:
            skeleton[k] = {"stateful": mine[k]["stateful"], "per_rank": True,
                           "value": {str(r): theirs[k]["value"] for r, theirs in enumerate(everyone)}}
        names = set().union(*(tensor_refs(mine[k]["value"]) for k in flat.per_rank))
        own = {n: t for n, t in flat.tensors.items() if n in names}
        return dataclasses.replace(flat, tensors={n: t for n, t in flat.tensors.items() if n not in names},
                                   skeleton=skeleton), own

    def snapshot(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` to host buffers kept from the previous non-blocking save.

        Reusing the buffers turns the blocking cost into a plain memcpy: fresh
        allocations page-fault on first touch, which measured 1-4x the copy
        itself. Safe because a save waits for the pending one first, so no
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

    def start(self, session: SaveSession) -> concurrent.futures.Future[CheckpointInfo]:
        """Finish ``session`` on a background thread, from host copies taken now (the only blocking cost)."""
        job = session.job
        copies = self.snapshot(job.flat.tensors | job.mine)
        job.flat = dataclasses.replace(job.flat, tensors={n: copies[n] for n in job.flat.tensors})
        job.mine = {n: copies[n] for n in job.mine}
        from . import background

        return background.submit(lambda: self.finish(session, collective=False), "vckpt-async-save")

    def finish(self, session: SaveSession, *, collective: bool) -> CheckpointInfo:
        """Write this rank's shards and commit; every rank returns the committed checkpoint.

        Collectives only when ``collective`` (the caller's thread); otherwise reports and the manifest pass
        through a ``Rendezvous`` in the store (``exchange``).
        """
        job, rank, world = session.job, self.comm.rank, self.comm.world
        exchange = exchange_for(session, self.comm, self.store, collective=collective, timeout_s=self.report_timeout_s,
                                committed=self.committed)
        # Alone, this rank's own tensors go with the rest: a single process writes the files it always did.
        alone = not self.comm.active
        plan = self._plan(job.flat.tensors | job.mine if alone else job.flat.tensors)
        try:
            report = self._write(job.cid, plan, range(rank, len(plan), world), "shard-{:05d}")
            report += self.write(job.cid, {} if alone else job.mine, f"chunks-r{rank:05d}-{{:05d}}")
        except BaseException as e:
            exchange.fail(e)  # the others learn of it instead of waiting for this rank's report
            raise
        exchange.send(report)
        return exchange.announce(lambda: session.commit(exchange.collect()))

    def committed(self, cid: str, manifest_bytes: bytes) -> CheckpointInfo:
        """The committed checkpoint ``cid`` from its manifest's bytes, with its signature checked."""
        doc = Manifest.decode_json(manifest_bytes, cid)
        return dataclasses.replace(info(Manifest.from_dict(doc, cid), []), signature=self.signer.check(doc).value)

    def commit(self, job: SaveJob, reports: list[RankReport]) -> tuple[bytes, CheckpointInfo]:
        """Rank 0: write the manifest of ``job`` from every rank's shard report, last; return its bytes, and the
        checkpoint as the reader parses them (parsed before they are written: a commit is as strict as a read)."""
        try:
            problem = reports_problem(reports, job.flat.tensors | job.mine)
            if problem is not None:  # before anything is written: nothing is committed
                raise InvalidState(f"checkpoint {job.cid} cannot be committed: {problem}; nothing is committed")
            # Replicated state against the consensus, single-owner state against its chain: whatever the key, bytes
            # other than the checked ones (a flipped staging copy, another write, a changed report) never commit.
            problem = agreement_problem(reports, job.agreed) or witness_problem(reports, job.witnessed)
            if problem is not None:
                raise CorruptCheckpoint(f"checkpoint {job.cid} cannot be committed: {problem}; nothing is committed "
                                        "- save again, and check that rank's host and who can write the store")
            manifest = self._manifest(self.catalog.run_id(), job, reports)
            manifest_bytes = canonical_json(self.signer.seal(manifest.to_dict()))
            try:
                parsed = self.committed(job.cid, manifest_bytes)
            except ManifestError as e:  # what no reader would take is never committed (a state= naming no tensor)
                raise InvalidState(f"checkpoint {job.cid} cannot be committed: its manifest would not read back "
                                   f"({e}); nothing is committed") from None
            # The commit re-checks what it promises: every shard it names is stored, with its recorded size.
            self.store.check_shards(job.cid, {s.path: s.size for s in manifest.shards})
            self.store.commit_manifest(job.cid, manifest_bytes)
        finally:
            if job.lease is not None:
                job.lease.release()
        took, mib = time.monotonic() - job.started, manifest.size_bytes / 2**20
        if manifest.status is Status.RESTORABLE:
            log.info("saved %s (step %d, restorable, %.1f MiB, %.2f s)", job.cid, job.step, mib, took)
        else:  # committed, but a restore will refuse it: say why, and what to change, where people look
            fixes = remedies(manifest.reasons)
            log.warning("saved %s (step %d, %s, %.1f MiB, %.2f s): %s%s", job.cid, job.step, manifest.status.value, mib,
                        took, "; ".join(manifest.reasons) or "no reason recorded",
                        f" - to make saves restorable: {'; '.join(fixes)}" if fixes else "")
        return manifest_bytes, parsed

    def housekeep(self, committed: CheckpointInfo) -> None:
        """Rank 0, after a commit, off the save's path (it reads the run): warn once if the new checkpoint is suspect
        by an open incident, then apply retention."""
        assert committed.manifest is not None
        self._warn_if_flagged(committed.manifest)
        if self.keep_last is not None and committed.status is Status.UNVERIFIED and not self._warned_unverified:
            self._warned_unverified = True  # retention keeps the newest *restorable*: with none, it deletes nothing
            log.warning("keep_last=%d deletes nothing while saves are unverified (%s): retention keeps the newest "
                        "restorable checkpoints and never leaves a run without one", self.keep_last,
                        "; ".join(committed.reasons) or "no reason recorded")
        if self.keep_last is not None:
            housekeeping.apply_retention(self.catalog, self.keep_last, self.pinned, self._read_back)

    def _read_back(self, info: CheckpointInfo) -> bool:
        """Read ``info`` back and verify it (recorded), before retention deletes older checkpoints."""
        from .reading import Reader
        from .verification import verify_all

        [result] = verify_all(self.catalog, Reader(self.store, self.io_workers), [info], jobs=1, progress=None)
        return result.ok

    def write(self, cid: str, tensors: dict[str, torch.Tensor], pattern: str) -> RankReport:
        """Write ``tensors``, which only this rank writes, into shards named by ``pattern``; return its report."""
        plan = self._plan(tensors)
        report = self._write(cid, plan, range(len(plan)), pattern) if tensors else RankReport()
        return dataclasses.replace(report, specs={n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()})

    def _warn_if_flagged(self, m: Manifest) -> None:
        """A save while an incident is open is suspect: say so once, with the way out."""
        if self._warned_open:
            return
        flagged = self.catalog.flagged(m.step, m.created_at)
        if flagged:
            self._warned_open = True
            warnings.warn(f"checkpoint {m.checkpoint_id} is suspect: {flagged[0]}; it stays suspect (and so will later "
                          "saves) until a rollback answers the incident - call resume(state) or `vckpt rollback`",
                          stacklevel=2)

    def _plan(self, flat_tensors: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
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

    def _write(self, cid: str, plan: list[dict[str, torch.Tensor]], indices: range, pattern: str) -> RankReport:
        names = [n for i in indices for n in plan[i]]
        fps = dict(zip(names, lanes_of([plan[i][n] for i in indices for n in plan[i]]), strict=True))

        def one(i: int) -> ShardEntry:
            path = pattern.format(i) + ".safetensors"
            nbytes = sum(t.numel() * t.element_size() for t in plan[i].values())
            with self.store.open_shard_for_write(cid, path, size_hint=nbytes) as f:
                w = write_shard(f, plan[i])
            return ShardEntry(path, w.size, w.digest, sorted(plan[i]), w.crc64nvme)

        with concurrent.futures.ThreadPoolExecutor(self.io_workers, thread_name_prefix="vckpt-io") as pool:
            return RankReport(tuple(pool.map(one, indices)), {n: str(fp) for n, fp in fps.items()})

    def _manifest(self, run_id: str, job: SaveJob, reports: list[RankReport]) -> Manifest:
        shards = sorted((e for r in reports for e in r.shards), key=lambda e: e.path)
        fps = {n: Fingerprint.from_hex(fp) for r in reports for n, fp in r.fingerprints.items()}
        specs = {n: (dtype_name(t.dtype), list(t.shape)) for n, t in (job.flat.tensors | job.mine).items()}
        specs |= {n: (d, list(shape)) for r in reports for n, (d, shape) in r.specs.items()}
        tensors = {}
        for s in shards:
            for n in s.tensors:
                dtype, shape = specs[n]
                tensors[n] = TensorEntry(dtype, shape, s.path, str(fps[n]))
        # The function every parse recomputes it with: what is written is what a reader checks.
        state_fp = state_fingerprint_of(tensors, job.flat.skeleton)
        return Manifest(
            run_id=run_id, checkpoint_id=job.cid, step=job.step, created_at=utc_now(), topology=job.topology,
            shards=shards, tensors=tensors, state_fingerprint=str(state_fp), state=job.flat.skeleton,
            evidence=job.evidence, status=job.status, reasons=job.reasons, resumed_from=job.resumed_from,
            layout=job.layout, bookkeeping=sorted(n for n in job.flat.bookkeeping if n in tensors),
        )
