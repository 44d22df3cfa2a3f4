"""``CheckpointManager``: verified saves, listing, verified restores, offline verification.

Public methods hold the invariants (never restore what is not restorable,
never commit before every shard is digested); ``_``-prefixed helpers do the
work. Subclasses must not override the public methods, or the invariants
would live in more than one place.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import blake3
import torch

from . import decisions
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
from .fingerprint import combine, dtype_name, lanes_of
from .flatten import flatten, is_stateful, tensor_refs, unflatten
from .manifest import (
    CheckpointInfo,
    Manifest,
    Problem,
    ShardEntry,
    Status,
    TensorEntry,
    VerificationResult,
)
from .shards import parse_header, supported, tensors_from_buffer, write_shard
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
    for t in tensors.values():
        if t.device.type == "cuda":
            props = torch.cuda.get_device_properties(t.device)
            return f"{props.name} {getattr(props, 'uuid', '')}".strip()
    return "cpu"


class CheckpointManager:
    """Verified checkpoints of one training run at any fsspec URL.

    Args:
        url: where the run lives: a local path, ``file://``, ``memory://``, ``s3://bucket/prefix``.
        storage_options: fsspec options (endpoint, credentials, ...).
        keep_last: keep the N newest restorable checkpoints (and anything newer); ``None`` keeps all.
        shard_bytes: target size of one shard file.
        io_workers: shards written or read at the same time.

    Raises:
        InvalidRunURL: the URL cannot be opened.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: dict[str, Any] | None = None,
        keep_last: int | None = None,
        shard_bytes: int = 256 << 20,
        io_workers: int = 4,
    ) -> None:
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")
        if io_workers < 1:
            raise ValueError(f"io_workers must be >= 1, got {io_workers}")
        self._store = RunStore(url, storage_options)
        self.url = url
        self.keep_last = keep_last
        self.shard_bytes = shard_bytes
        self.io_workers = io_workers

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Mapping[str, Any]) -> CheckpointInfo:
        """Save ``state`` at ``step`` and commit it with a manifest written last.

        Args:
            step: the training step (int >= 0).
            state: names to modules, optimizers, schedulers, tensors or plain data.

        Returns:
            The committed :class:`CheckpointInfo`. Without verification
            evidence its status is ``unverified``.

        Raises:
            InvalidState: the state holds something that cannot be stored.
            StorageError: the store could not be written; nothing is committed.
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise InvalidState(f"step must be an int >= 0, got {step!r}")
        flat = flatten(state)
        for name, t in flat.tensors.items():
            if not supported(t.dtype):
                raise InvalidState(f"{name}: dtype {t.dtype} cannot be stored in safetensors; convert it in state_dict()")
        run_id = self._run_id()
        cid = _checkpoint_id(step)
        manifest = self._write(run_id, cid, step, flat, status=Status.UNVERIFIED, reasons=[UNGUARDED], evidence={})
        self._store.commit_manifest(cid, manifest.to_json())
        info = self._info(manifest, [])
        if self.keep_last is not None:
            self._apply_retention()
        return info

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

    def _write(
        self, run_id: str, cid: str, step: int, flat: Any, *, status: Status, reasons: list[str], evidence: dict
    ) -> Manifest:
        names = list(flat.tensors)
        fps = dict(zip(names, lanes_of([flat.tensors[n] for n in names])))
        plan = self._plan_shards(flat.tensors)

        def one(i: int) -> ShardEntry:
            path = f"shard-{i:05d}.safetensors"
            with self._store.open_shard_for_write(cid, path) as f:
                size, digest = write_shard(f, plan[i])
            return ShardEntry(path, size, digest, sorted(plan[i]))

        with concurrent.futures.ThreadPoolExecutor(self.io_workers, thread_name_prefix="vckpt-io") as pool:
            shard_entries = list(pool.map(one, range(len(plan))))
        tensors = {}
        for s in shard_entries:
            for n in s.tensors:
                t = flat.tensors[n]
                tensors[n] = TensorEntry(dtype_name(t.dtype), list(t.shape), s.path, str(fps[n]))
        state_fp = combine([(n, e.dtype, e.shape, fps[n]) for n, e in tensors.items()], flat.skeleton_json())
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        topology = {"world_size": world, "ranks": [{"rank": 0, "host": socket.gethostname(), "device": _device_name(flat.tensors)}]}
        return Manifest(
            run_id=run_id, checkpoint_id=cid, step=step, created_at=utc_now(), topology=topology,
            shards=shard_entries, tensors=tensors, state_fingerprint=str(state_fp), state=flat.skeleton,
            evidence=evidence, status=status, reasons=reasons,
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
        ids = self._store.committed_ids()
        verifications: dict[str, list[dict]] = {}
        for _, raw in self._store.records("verification"):
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                rec = json.loads(raw)
                verifications.setdefault(str(rec.get("checkpoint_id")), []).append(rec)

        def load(cid: str) -> CheckpointInfo:
            try:
                m = Manifest.from_json(self._store.read_manifest(cid), where=f"{cid}")
            except ManifestError as e:
                return CheckpointInfo(cid, _step_from_id(cid), Status.CORRUPT, "", 0, [str(e)], None)
            if m.checkpoint_id != cid:
                return CheckpointInfo(cid, m.step, Status.CORRUPT, m.created_at, m.size_bytes,
                                      [f"manifest names checkpoint {m.checkpoint_id!r} but lives in folder {cid!r}"], m)
            return self._info(m, verifications.get(cid, []))

        with concurrent.futures.ThreadPoolExecutor(self.io_workers) as pool:
            infos = list(pool.map(load, ids))
        return sorted(infos, key=lambda i: (i.created_at, i.step, i.id))

    def _info(self, m: Manifest, verifications: list[dict]) -> CheckpointInfo:
        status, reasons = decisions.derive_status(m.status, m.reasons, verifications)
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
        self._require_run()
        have = sorted({i.step for i in infos})
        shown = ", ".join(map(str, have[-10:])) or "none"
        raise CheckpointNotFound(f"no checkpoint {ref!r} in {self.url}; steps present: {shown} (`vckpt list {self.url}`)")

    def _require_run(self) -> None:
        if not self._store.exists():
            raise RunNotFound(f"no run at {self.url}: nothing is stored there; check the URL or save a checkpoint first")

    # --------------------------------------------------------------- restore
    def restore(self, state: Mapping[str, Any], *, step: int | None = None, allow_unverified: bool = False) -> CheckpointInfo:
        """Load a verified checkpoint into ``state`` in place.

        Every shard digest and tensor fingerprint is checked before anything
        in ``state`` is touched, and the fingerprints are checked again after loading.

        Args:
            state: the same kind of mapping given to :meth:`save`; stateful
                objects get ``load_state_dict``, tensors are copied into, plain
                values are replaced in the mapping.
            step: which step; ``None`` means the newest restorable checkpoint.
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
        info = self._select(step, allowed)
        if info.status not in allowed:
            raise CheckpointNotRestorable(self._refusal(info, allow_unverified))
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
        return info

    def _select(self, step: int | None, allowed: set[Status]) -> CheckpointInfo:
        infos = self.list()
        if step is None:
            found = decisions.newest(infos, allowed)
            if found is None:
                self._require_run()
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
        for key in list(state):
            entry = m.state[key]
            value = unflatten(entry["value"], loaded)
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
            tensors = tensors_from_buffer(buf, header)
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
                    ok = torch.stack([torch.isfinite(tensors[n]).all() for n in floats]).tolist()
                    probs += [Problem("nonfinite", f"{where}: {n} holds NaN or Inf") for n, good in zip(floats, ok) if not good]
            return tensors, probs

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

    # ---------------------------------------------------------------- verify
    def verify(self, step: int | None = None, *, progress: Callable[[int], None] | None = None) -> list[VerificationResult]:
        """Re-read checkpoints offline and record the result (append-only).

        Re-reads every shard, recomputes digests and fingerprints, scans for
        NaN/Inf and compares everything with the manifest. A mismatch makes
        the checkpoint ``corrupt`` from then on.

        Args:
            step: verify only the checkpoints at this step; ``None`` verifies all.
            progress: called with a byte count as data is read.

        Returns:
            One :class:`VerificationResult` per checkpoint, oldest first.
        """
        infos = self.list()
        if step is not None:
            infos = [i for i in infos if i.step == step]
            if not infos:
                self.get(step)  # raises a helpful CheckpointNotFound
        elif not infos:
            self._require_run()
        results = []
        for info in infos:
            if info.manifest is None:
                problems = [Problem("manifest", info.reasons[0] if info.reasons else "manifest unreadable")]
            else:
                try:
                    _, problems = self._read_checked(info.manifest, names=None, scan_nonfinite=True, fail_fast=False, progress=progress)
                except VerifiedCkptError as e:
                    problems = [Problem("read", str(e))]
            result = VerificationResult(info.id, info.step, not problems, problems, utc_now())
            self._store.append_record("verification", result.to_record())
            results.append(result)
        return results

    def total_bytes(self, step: int | None = None) -> int:
        """Bytes a :meth:`verify` with the same ``step`` would read (for progress bars)."""
        return sum(i.size_bytes for i in self.list() if step is None or i.step == step)


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
