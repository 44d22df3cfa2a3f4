"""The public two-phase save: what every rank writes, what rank 0 commits, and how every rank learns of it.

A save of any shape (the manager's own, ``dcp.save`` through the verified writer) is the same sequence, as
DCP's ``StorageWriter`` documents its own:

============  ==========================================  ==========================================
who           call                                        what it does
============  ==========================================  ==========================================
every rank    ``CheckpointManager.begin_save(step)``      collective: consensus, status and evidence,
                                                          one checkpoint id (rank 0 leases its folder)
each rank     ``session.write(tensors, prefix)``          this rank's shards; returns its ``RankReport``
rank 0        ``session.commit(reports, ...)``            the manifest, written last: the commit
every rank    ``session.publish()``                       collective: every rank holds the same
                                                          committed ``CheckpointInfo``
============  ==========================================  ==========================================

Retention and the "saved while an incident is open" warning are not part of a save: they read the run, so
once the manifest is written they run as their own step on rank 0 (``CheckpointManager`` runs it in the
background and joins it at the next save or ``wait()``). A save reads only what it wrote.

Reports travel by collective when the caller's thread may run one, else through a :class:`Rendezvous` of
small objects beside the shards (a non-blocking save's background thread may not run collectives); the manager's
own save picks one of ``exchange``'s types for that. A session holds its ``SaveJob`` and reaches the writer only
through :class:`Writer`, so this module needs nothing of ``saving``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ..crc import is_hex
from ..errors import InvalidState, ManifestError, StorageError
from ..jsonx import JSONBudgetError, Limits, canonical_json, decode_object
from ..layout import LayoutEntry
from ..manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, SEGMENT, CheckpointInfo, ShardEntry
from ..signing import Signature, Signer
from ..status import Status
from .opening import as_raised, error_doc

if TYPE_CHECKING:
    import torch

    from ..comm import Communicator
    from ..flatten import Flat
    from ..hosts import Topology
    from ..store import RunStore
    from .lease import Lease

__all__ = ["RankReport", "Rendezvous", "SaveJob", "SaveSession", "Writer", "agreed_names", "agreement_problem",
           "reports_problem", "witness_problem"]

_LIMITS = Limits(max_bytes=MAX_MANIFEST_BYTES, max_depth=8)
_COMMIT_ERROR = "commit.error"  # beside the shards: rank 0's failed commit, for the ranks awaiting the manifest


@dataclasses.dataclass(frozen=True)
class RankReport:
    """What one rank wrote: its shards, the fingerprint of every tensor in them, and the dtype and shape of the
    tensors rank 0 does not hold itself (``specs``)."""

    shards: tuple[ShardEntry, ...] = ()
    fingerprints: Mapping[str, str] = dataclasses.field(default_factory=dict)
    specs: Mapping[str, tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=dict)

    def __add__(self, other: RankReport) -> RankReport:
        return RankReport((*self.shards, *other.shards), {**self.fingerprints, **other.fingerprints},
                          {**self.specs, **other.specs})

    def to_json(self) -> bytes:
        return json.dumps({"shards": [dataclasses.asdict(s) for s in self.shards], "fps": dict(self.fingerprints),
                           "specs": {n: [d, list(s)] for n, (d, s) in self.specs.items()}}).encode()

    @classmethod
    def from_json(cls, data: bytes, rank: int) -> RankReport:
        """Decode rank ``rank``'s report within bounds, checking every field's type.

        Raises:
            ManifestError: the report is not one this library writes.
        """
        try:
            d = decode_object(data, _LIMITS)
            shards = tuple(_shard(e) for e in d["shards"])
            fps = {str(n): _str(fp) for n, fp in d["fps"].items()}
            specs = {str(n): (_str(dt), tuple(_int(x) for x in shape)) for n, (dt, shape) in d["specs"].items()}
        except (JSONBudgetError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"rank {rank}'s shard report is malformed ({type(e).__name__}: {str(e)[:200]}); "
                                "the checkpoint is not committed - save again") from None
        return cls(shards, fps, specs)


def reports_problem(reports: Sequence[RankReport], known: Mapping[str, object] | None = None) -> str | None:
    """Why ``reports`` (rank order) cannot make one checkpoint, or ``None``: a shard path written by two ranks (or
    twice), a tensor in two shards, a tensor without its fingerprint or its dtype and shape. ``known``: the
    tensors whose dtype and shape the committing rank holds itself. Checked before a manifest is written."""
    paths: dict[str, int] = {}
    where: dict[str, str] = {}
    fps = {n for r in reports for n in r.fingerprints}
    specs = {n for r in reports for n in r.specs} | set(known or ())
    for rank, r in enumerate(reports):
        for s in r.shards:
            if s.path in paths:
                other = "twice by rank" if paths[s.path] == rank else f"by ranks {paths[s.path]} and"
                return (f"shard {s.path} was written {other} {rank}: give each rank, and each write, a prefix of its "
                        "own (session.write(tensors, prefix))")
            paths[s.path] = rank
            for n in s.tensors:
                if n in where:
                    return f"tensor {n} is in shards {where[n]} and {s.path}: write each tensor once, on one rank"
                where[n] = s.path
                if n not in fps or n not in specs:
                    return (f"rank {rank}'s report lists tensor {n} in shard {s.path} without its "
                            f"{'fingerprint' if n not in fps else 'dtype and shape'}: send the report write() returned")
    return None


def agreed_names(tensors: Mapping[str, torch.Tensor], agreed: Sequence[tuple[torch.Tensor, str]]) -> dict[str, str]:
    """The agreed fingerprint (``SDCGuard.agreed``) of each of ``tensors`` that is one of the consensus's state
    tensors (the same memory, shape, strides and dtype: a ``state_dict`` entry is a view of its parameter)."""
    def ident(t: torch.Tensor) -> tuple[object, ...]:
        return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device

    by_memory = {ident(t): fp for t, fp in agreed}
    return {n: by_memory[k] for n, t in tensors.items() if (k := ident(t)) in by_memory}


def agreement_problem(reports: Sequence[RankReport], agreed: Mapping[str, str]) -> str | None:
    """Why ``reports`` (rank order) do not hold what the replicas agreed on at the save's consensus, or ``None``:
    every fingerprint a rank reports for a tensor of ``agreed`` must be the agreed one. A shard changed between
    the consensus and its write (a fault in the copy), or in the store before the commit with its report rewritten
    to match, is refused here whatever the key."""
    for rank, r in enumerate(reports):
        for n, fp in r.fingerprints.items():
            if n in agreed and fp != agreed[n]:
                return (f"rank {rank} reports tensor {n} with fingerprint {fp[:12]}, but the replicas agreed on "
                        f"{agreed[n][:12]} at the save's consensus: what was written is not the agreed state")
    return None


def witness_problem(reports: Sequence[RankReport], witnessed: Mapping[str, str]) -> str | None:
    """Why ``reports`` (rank order) do not hold what the guard's at-rest chain vouched for at the save, or ``None``:
    every fingerprint a rank reports for a chunk of ``witnessed`` (state a rank alone holds, by stored name) must be
    the one its last checked update wrote. Single-owner state has no replica to agree with, so this is its only check
    between the chain and the store: a copy changed between the snapshot and its write (a flip in a non-blocking
    save's staging buffer), other bytes written, or a report changed, is refused here whatever the key."""
    for rank, r in enumerate(reports):
        for n, fp in r.fingerprints.items():
            if n in witnessed and fp != witnessed[n]:
                return (f"rank {rank} reports tensor {n} with fingerprint {fp[:12]}, but the at-rest chain vouched for "
                        f"{witnessed[n][:12]} at the save, the bytes its checked update wrote: what was written is not "
                        "the checked state")
    return None


def _str(x: Any) -> str:
    if not isinstance(x, str):
        raise TypeError(f"expected a string, got {type(x).__name__}")
    return x


def _int(x: Any) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise TypeError(f"expected an int >= 0, got {x!r}")
    return x


def _shard(e: Any) -> ShardEntry:
    if not isinstance(e, dict) or set(e) != {"path", "size", "digest", "tensors", "crc64nvme"}:
        raise TypeError("a shard entry has other fields than path, size, digest, tensors, crc64nvme")
    path = _str(e["path"])
    if not SEGMENT.match(path) or path in (".", ".."):
        raise ValueError(f"shard path {path[:80]!r} is not a plain file name")
    crc = e["crc64nvme"]
    if crc is not None and not is_hex(crc):
        raise ValueError("a shard's crc64nvme is not 16 lowercase hex digits")
    return ShardEntry(path, _int(e["size"]), _str(e["digest"]), [_str(t) for t in e["tensors"]], crc)


class Rendezvous:
    """Rank reports and the manifest, passed through small objects beside a save's shards (no collective).

    Every rank ``post``s its report (or ``post_error``s why it has none); rank 0 ``collect``s them within a
    bound and ``clear``s them after the commit; the other ranks ``await_manifest``. Every wait is bounded.
    Reports are sealed with ``seal`` (``signing``'s HMAC): a key the ranks share in memory only (the save's
    collective sent it), so a report someone else wrote into the store, signed run or not, is refused.
    """

    def __init__(self, store: RunStore, cid: str, world: int, timeout_s: float, seal: Signer) -> None:
        self.store, self.cid, self.world, self.timeout_s, self.seal = store, cid, world, timeout_s, seal

    def post(self, rank: int, report: RankReport) -> None:
        sealed = self.seal.seal(json.loads(report.to_json()))
        self.store.write_aside(self.cid, f"rank-{rank:05d}.json", canonical_json(sealed))

    def post_error(self, rank: int, message: str) -> None:
        """Tell rank 0 not to wait for this rank (best effort: the store may be what failed)."""
        with contextlib.suppress(Exception):
            self.store.write_aside(self.cid, f"rank-{rank:05d}.error", message.encode())

    def collect(self, timeout_s: float | None = None, mine: RankReport | None = None) -> list[RankReport]:
        """Every rank's report, in rank order, each within ``timeout_s`` (default: the rendezvous's own bound);
        ``mine``: rank 0's own, which is then never read back from the store.

        Raises:
            StorageError: a rank posted an error, or a report did not appear within the bound.
            ManifestError: a report is malformed, or not sealed by the rank that should have written it.
        """
        reports = []
        for r in range(self.world):
            if r == 0 and mine is not None:
                reports.append(mine)
                continue

            def look(r: int = r) -> bytes | None:
                err = self.store.read_optional(self.cid, f"rank-{r:05d}.error")
                if err is not None:
                    raise StorageError(f"rank {r} failed to write its shards of {self.cid}: "
                                       f"{err.decode(errors='replace')[:300]}; the checkpoint is not committed")
                return self.store.read_optional(self.cid, f"rank-{r:05d}.json")

            reports.append(self._unsealed(self._await(look, f"rank {r}'s shard report", timeout_s), r))
        return reports

    def _unsealed(self, data: bytes, rank: int) -> RankReport:
        try:
            doc = decode_object(data, _LIMITS)
        except JSONBudgetError:
            doc = {}
        if self.seal.check(doc) is not Signature.VALID:
            raise ManifestError(f"rank {rank}'s shard report of {self.cid} in the store is not the one rank {rank} "
                                "wrote (its seal, made with a key only the job holds, does not match): someone "
                                "else wrote it during the save; the checkpoint is not committed - check who can "
                                "write the store")
        return RankReport.from_json(canonical_json({k: v for k, v in doc.items() if k != "signature"}), rank)

    def post_failure(self, error: BaseException) -> None:
        """Rank 0's commit failed: the ranks awaiting the manifest raise it at once (best effort; sealed, so a
        failure someone else wrote is not believed)."""
        with contextlib.suppress(Exception):
            self.store.write_aside(self.cid, _COMMIT_ERROR, canonical_json(self.seal.seal(error_doc(error))))

    def await_manifest(self) -> bytes:
        """The committed manifest's bytes, or rank 0's commit failure raised here alike, within the bound."""
        def look() -> bytes | None:
            failed = self.store.read_optional(self.cid, _COMMIT_ERROR)
            if failed is not None:
                try:
                    doc = decode_object(failed, _LIMITS)
                except JSONBudgetError:
                    doc = {}
                error, message = doc.get("error"), doc.get("message")
                if self.seal.check(doc) is Signature.VALID and isinstance(error, str) and isinstance(message, str):
                    raise as_raised(error, message)
            return self.store.read_optional(self.cid, MANIFEST_NAME)

        return self._await(look, "manifest")

    def clear(self) -> None:
        for r in range(self.world):
            with contextlib.suppress(Exception):
                self.store.delete_file(self.cid, f"rank-{r:05d}.json")

    def _await(self, probe: Callable[[], bytes | None], what: str, timeout_s: float | None = None) -> bytes:
        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        delay = 0.02
        while True:
            got = probe()
            if got is not None:
                return got
            if time.monotonic() > deadline:
                raise StorageError(f"{what} for {self.cid} did not appear within {bound:.0f}s; "
                                   "the checkpoint is not committed - check the other ranks' logs")
            time.sleep(delay)  # polling the store: no collective may run off the training thread
            delay = min(delay * 2, 0.5)


@dataclasses.dataclass
class SaveJob:
    """What the synchronous part of a save decided, handed to the (maybe background) writer."""

    cid: str
    step: int
    flat: Flat
    status: Status
    reasons: list[str]
    evidence: dict[str, Any]
    topology: Topology
    resumed_from: str | None
    # Sharded tensors: the chunks this rank alone writes, and the global layout (the same on every rank).
    # ``flat.tensors`` then holds only the replicated tensors, which the ranks share out.
    mine: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    layout: dict[str, LayoutEntry] = dataclasses.field(default_factory=dict)
    started: float = dataclasses.field(default_factory=time.monotonic)  # when save() was called (the log says how long)
    lease: Lease | None = None  # rank 0's claim on the folder while the save runs
    # Reports that travel through the store are sealed with this key, which only the job's memory holds: rank 0
    # drew it and sent it by the save's collective; it is never written (``Rendezvous``).
    seal: Signer = dataclasses.field(default_factory=Signer, repr=False)
    # Rank 0: the fingerprint every replica agreed on at this save's consensus, by tensor name, for the tensors
    # other ranks write too (``agreement_problem``).
    agreed: dict[str, str] = dataclasses.field(default_factory=dict)
    # Rank 0: the fingerprint the guard's at-rest chain vouched for at this save, by stored name, for the chunks a
    # rank alone writes (``witness_problem``): single-owner state's counterpart of ``agreed``.
    witnessed: dict[str, str] = dataclasses.field(default_factory=dict)


class Writer(Protocol):
    """What a session needs of the writer behind it (``saving.Saver``): a narrow seam, so that this module, which
    the writer builds on, never imports it."""

    comm: Communicator

    def write(self, cid: str, tensors: dict[str, torch.Tensor], pattern: str) -> RankReport: ...

    def commit(self, job: SaveJob, reports: list[RankReport]) -> tuple[bytes, CheckpointInfo]: ...

    def committed(self, cid: str, manifest_bytes: bytes) -> CheckpointInfo: ...


class SaveSession:
    """One checkpoint being written (from ``CheckpointManager.begin_save``; the call table is in this module's
    docstring). ``id``, ``step`` and ``status`` are what ``begin_save`` decided, the same on every rank."""

    def __init__(self, saver: Writer, job: SaveJob, on_committed: Callable[[CheckpointInfo], None]) -> None:
        self._saver, self.job, self._on_committed = saver, job, on_committed  # ``job``: the saver's, not API
        self._manifest: bytes = b""
        self._committed: CheckpointInfo | None = None  # rank 0's, parsed once at commit; publish hands it back
        self._failure: BaseException | None = None  # rank 0's commit failed: publish raises it on every rank
        self._prefixes: set[str] = set()  # this rank's writes: a prefix used twice would overwrite a shard

    @property
    def id(self) -> str:
        return self.job.cid

    @property
    def step(self) -> int:
        return self.job.step

    @property
    def status(self) -> Status:
        return self.job.status

    def write(self, tensors: Mapping[str, torch.Tensor], prefix: str) -> RankReport:
        """Write ``tensors``, which only this rank writes, as shards ``<prefix>-<n>.safetensors``; the report to send
        to rank 0. ``prefix`` must differ between ranks and between one rank's writes (``dcp-r00003``, say).

        Raises:
            InvalidState: ``prefix`` was used already in this save, or is not a plain name.
        """
        if not isinstance(prefix, str) or not SEGMENT.match(f"{prefix}-00000.safetensors") or "{" in prefix:
            raise InvalidState(f"prefix={prefix!r} is not a plain file-name prefix; use letters, digits, '.', '_', '-'")
        if prefix in self._prefixes:
            raise InvalidState(f"prefix={prefix!r} was written already in save {self.job.cid}: its shards would be "
                               "overwritten; give each write a prefix of its own")
        self._prefixes.add(prefix)
        return self._saver.write(self.job.cid, dict(tensors), f"{prefix}-{{:05d}}")

    def commit(self, reports: Sequence[RankReport], *, layout: Mapping[str, LayoutEntry] | None = None,
               state: Mapping[str, Any] | None = None) -> CheckpointInfo:
        """Rank 0: write the manifest of every rank's ``reports``, last, and return the committed checkpoint.

        ``layout`` (sharded tensors' chunks) and ``state`` (the skeleton: entry name to ``{"stateful", "value"}``)
        replace what ``begin_save`` was given, for a writer that learns them only at the end (DCP).

        Raises:
            InvalidState: no state (``state=``, or ``begin_save``'s), or a manifest that would not read back (a
                state naming a tensor no report holds); nothing is committed.
            StorageError: a shard named in a report is not stored with its size; nothing is committed.
        """
        job = self.job
        if self._saver.comm.rank != 0:
            raise InvalidState(f"commit() runs on rank 0 only (this is rank {self._saver.comm.rank}); send it this "
                               "rank's report, and call publish() on every rank")
        try:
            if layout is not None:
                job.layout = dict(layout)
            if state is not None:
                job.flat = dataclasses.replace(job.flat, skeleton=dict(state))
            if not job.flat.skeleton:  # a checkpoint no restore could use, which verify would still pass
                raise InvalidState(f"checkpoint {job.cid} has no state to commit: pass state= (entry name -> "
                                   "{'stateful': bool, 'value': skeleton naming the written tensors}) to commit(); "
                                   "nothing is committed")
            self._manifest, self._committed = self._saver.commit(job, list(reports))
        except BaseException as e:
            self._failure = e
            raise
        self._on_committed(self._committed)
        return self._committed

    def publish(self) -> CheckpointInfo:
        """Every rank (collective): the committed checkpoint, from the manifest bytes rank 0 wrote.

        Call it on every rank even when ``commit`` raised on rank 0: every rank then raises that error alike,
        and none is left waiting.

        Raises:
            VerifiedCkptError: rank 0's commit failed (or was never called there): the same class and message.
        """
        comm = self._saver.comm
        if comm.rank == 0 and self._failure is None and self._committed is None:
            self._failure = InvalidState(f"publish() before rank 0 committed {self.job.cid}; call "
                                         "session.commit(reports) on rank 0 first")
        if comm.rank == 0 and self._failure is not None:
            sent = b"E" + json.dumps(error_doc(self._failure)).encode()
        else:
            sent = b"M" + self._manifest
        got = comm.broadcast_bytes(sent) if comm.active else sent
        if got[:1] == b"E":
            if comm.rank == 0 and self._failure is not None:
                raise self._failure
            doc = json.loads(got[1:])
            raise as_raised(doc["error"], doc["message"])
        comm.barrier()
        if self._committed is not None:  # rank 0 parsed these bytes when it committed them
            return self._committed
        return self._saver.committed(self.job.cid, got[1:])

    def abort(self) -> None:
        """Give up this save (nothing is committed; gc removes what was written once its lease is gone)."""
        if self.job.lease is not None:
            self.job.lease.release()
