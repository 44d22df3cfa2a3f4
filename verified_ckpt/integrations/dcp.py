"""``torch.distributed.checkpoint`` storage that writes and reads verified checkpoints.

A team already on DCP changes one argument::

    dcp.save(state, storage_writer=VerifiedStorageWriter(manager, step))
    dcp.load(state, storage_reader=VerifiedStorageReader(manager))

DCP wraps every failure in its own ``CheckpointException``; :func:`save` and :func:`load` are the same calls
with the failure raised as the library's own error (``CorruptCheckpoint``, ``CheckpointNotRestorable``, ...), the
same on every rank.

DCP keeps doing what it does well: planning who writes which chunk (replicas
deduplicated) and the resharding arithmetic of a load. The storage is
verified-ckpt's: every rank writes safetensors shards through the run's store,
rank 0 commits a manifest last, with the guard's consensus when the manager
has a guard, and the checkpoint is listed, verified, flagged and rolled back
like any other. DCP's own ``.metadata`` (a pickle) is never written or read:
the reader rebuilds DCP's metadata from the manifest's JSON layout.

Values that are not tensors (DCP pickles them) are stored through the same
codec as the rest of a checkpoint and set directly on load, so nothing is
unpickled: JSON-like data in the manifest, byte strings (``bytes``,
``bytearray``, ``io.BytesIO``) as raw bytes in a uint8 tensor of the writing
rank's shards, read back through the checked path like every chunk; any other
value is refused at save. Loading them needs the default load planner (or one
with its ``state_dict`` bookkeeping).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from .. import RankReport
from ..errors import InvalidState, StorageError, VerifiedCkptError
from ..flatten import flatten_value, unflatten
from ..layout import Chunk, LayoutEntry, chunk_name
from ..manifest import CheckpointInfo, Manifest
from ..sharding import region
from ..skeleton import TENSOR, skeleton_problem, tensor_refs
from ..tensorspec import dtype_name

if TYPE_CHECKING:
    from .. import CheckpointManager, OpenCheckpoint, SaveSession

__all__ = ["VerifiedStorageReader", "VerifiedStorageWriter"]

_ENTRY = "dcp"  # the one state entry of a checkpoint written through DCP: its flattened state dict


class VerifiedStorageWriter(StorageWriter):
    """Commit ``dcp.save`` as checkpoint ``step`` of ``manager``'s run (call it on every rank).

    Args:
        manager: the run, and its guard (consensus before the save) if it has one.
        step: the training step this checkpoint holds.
    """

    def __init__(self, manager: CheckpointManager, step: int) -> None:
        self.manager, self.step = manager, step
        self.session: SaveSession | None = None
        self.info: CheckpointInfo | None = None  # the committed checkpoint (on the coordinator)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.session = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # the checkpoint is chosen by the manager's run and the step, not by a path

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # Collective, on every rank, before any data moves: consensus, status and one checkpoint id.
        self.session = self.manager.begin_save(self.step)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.session is not None, "set_up_storage_writer runs first"
        tensors: dict[str, torch.Tensor] = {}
        values: dict[str, Any] = {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                values[item.index.fqn], new = _plain_value(item.index.fqn, getattr(planner, "state_dict", {}))
            else:
                data = planner.resolve_data(item)
                assert isinstance(data, torch.Tensor)
                new = {chunk_name(item.index.fqn, tuple(item.index.offset or ())): data.detach()}
            clash = sorted(tensors.keys() & new.keys())
            if clash:  # a byte string named like another value's chunk: one would overwrite the other
                self.session.abort()
                raise InvalidState(f"{clash[0]}: two values of the state dict would be stored under this one name; "
                                   "rename one of their keys")
            tensors |= new
        rank = self.manager.comm.rank
        report = self.session.write(tensors, f"dcp-r{rank:05d}")
        # DCP hands every rank's results to the coordinator: the first one carries this rank's report, as the
        # bytes the coordinator decodes within bounds.
        results = [WriteResult(index=item.index, size_in_bytes=0,
                               storage_data={"rank": rank, "report": report.to_json(), "values": values} if i == 0 else None)
                   for i, item in enumerate(plan.items)]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.session is not None
        firsts = [r[0].storage_data for r in results if r and r[0].storage_data]
        reports = [RankReport.from_json(f["report"], f["rank"]) for f in firsts]
        values = {k: v for f in firsts for k, v in f["values"].items()}
        layout, skeleton = {}, {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                chunks = [Chunk([int(o) for o in c.offsets], chunk_name(fqn, tuple(c.offsets))) for c in md.chunks]
                layout[fqn] = LayoutEntry(dtype_name(md.properties.dtype), list(md.size), chunks)
                skeleton[fqn] = {TENSOR: fqn}
            else:
                skeleton[fqn] = values[fqn]
        clash = sorted(layout.keys() & {n for r in reports for n in r.fingerprints})
        if clash:  # refused before the commit: a manifest may not hold a tensor named like a sharded one
            self.session.abort()
            raise InvalidState(f"{clash[0]}: a byte string of the state dict would be stored under the name of a "
                               "tensor of it; rename one of their keys")
        self.info = self.session.commit(reports, layout=layout, state={_ENTRY: {"stateful": False, "value": skeleton}})

    def storage_meta(self) -> None:
        return None


def _plain_value(fqn: str, state_dict: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """The skeleton of the non-tensor value ``fqn`` (the planner pickles it; we never unpickle), and the uint8
    tensors of its byte strings, named from ``fqn`` as ``flatten`` names them (``fqn``, ``fqn/0``, ...)."""
    if fqn not in state_dict:
        raise InvalidState(f"{fqn}: a non-tensor value the planner does not expose; use DefaultSavePlanner")
    value, tensors = flatten_value(state_dict[fqn], fqn)
    blobs: set[str] = set()
    skeleton_problem(value, blobs=blobs)
    if tensors.keys() - blobs:
        raise InvalidState(f"{fqn}: a non-tensor value that holds tensors cannot be stored")
    return value, tensors


class VerifiedStorageReader(StorageReader):
    """Serve ``dcp.load`` from a verified checkpoint of ``manager``'s run.

    Every stored chunk a rank needs is read through the checked path (size,
    digest, header, fingerprint) before any value reaches the planner, and
    the ranks agree that every read passed before any of them loads: a
    flipped byte anywhere fails the load with nothing touched.

    Args:
        manager: the run.
        step: which step; ``None`` is the rollback target (the newest restorable checkpoint).
        checkpoint_id: a checkpoint by id instead.
        allow_unverified: also accept an ``unverified`` checkpoint (never ``suspect`` or ``corrupt``).
    """

    def __init__(self, manager: CheckpointManager, *, step: int | None = None, checkpoint_id: str | None = None,
                 allow_unverified: bool = False) -> None:
        self.manager = manager
        self.step, self.checkpoint_id, self.allow_unverified = step, checkpoint_id, allow_unverified
        self.opened: OpenCheckpoint | None = None
        self.error: VerifiedCkptError | None = None

    @property
    def info(self) -> CheckpointInfo | None:
        """The checkpoint being loaded (every rank holds the same one once ``read_metadata`` ran)."""
        return self.opened.info if self.opened is not None else None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.opened = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP calls this on every rank: one decision (rank 0's) for all of them, from the same manifest bytes.
        try:
            self.opened = self.manager.open(step=self.step, checkpoint_id=self.checkpoint_id,
                                            allow_unverified=self.allow_unverified)
        except VerifiedCkptError as refused:
            self.error = refused  # DCP catches this one and fails with "metadata is None": ``load`` raises it instead
            raise
        m = self.manager_manifest()
        sd_md: dict[str, Any] = {}
        storage: dict[MetadataIndex, str] = {}
        for fqn, e in m.layout.items():
            chunks = []
            for c in e.chunks:
                chunks.append(ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(m.tensors[c.tensor].shape)))
                storage[MetadataIndex(fqn, torch.Size(c.offsets))] = c.tensor
            sd_md[fqn] = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, e.dtype)), torch.Size(e.shape),
                                               chunks)
        for fqn in self._values(m):
            sd_md[fqn] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=sd_md, storage_data=storage)

    def manager_manifest(self) -> Manifest:
        assert self.info is not None and self.info.manifest is not None, "read_metadata runs first"
        m = self.info.manifest
        if set(m.state) != {_ENTRY}:
            raise InvalidState(f"checkpoint {m.checkpoint_id} was not written through DCP; restore it with "
                               "CheckpointManager.restore()")
        return m

    def _values(self, m: Manifest) -> dict[str, Any]:
        skeleton = m.state[_ENTRY]["value"]
        return {k: v for k, v in skeleton.items() if k not in m.layout}

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.info is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        m = self.manager_manifest()
        by_chunk: dict[str, list[Any]] = defaultdict(list)
        for item in plan.items:
            if item.type == LoadItemType.TENSOR:
                by_chunk[chunk_name(item.storage_index.fqn, tuple(item.storage_index.offset or ()))].append(item)
        assert self.opened is not None
        values = self._values(m)
        wanted = [values[item.storage_index.fqn] for item in plan.items if item.type == LoadItemType.BYTE_IO]
        blobs = set().union(*map(tensor_refs, wanted))  # the byte strings' tensors, read and checked with the chunks
        loaded = self.opened.read(set(by_chunk) | blobs)  # every rank raises alike, before any copies a value
        rebuilt = {item.dest_index.fqn: unflatten(values[item.storage_index.fqn], loaded)  # all before any is set
                   for item in plan.items if item.type == LoadItemType.BYTE_IO}
        for fqn, value in rebuilt.items():
            _set_value(planner, fqn, value)
        for name, items in by_chunk.items():
            for item in items:
                dest = planner.resolve_tensor(item).detach()
                dest.copy_(region(loaded[name], item.storage_offsets, item.lengths))
                planner.commit_tensor(item, dest)
        self.opened.applied()  # the lineage, the ledger and the guard learn of the restore
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _set_value(planner: LoadPlanner, fqn: str, value: Any) -> None:
    """What ``DefaultLoadPlanner.load_bytes`` does after unpickling, without the unpickling."""
    from torch.distributed.checkpoint._traverse import set_element

    mappings = getattr(planner, "mappings", None)
    if getattr(planner, "flatten_state_dict", False) and mappings is not None:
        set_element(planner.original_state_dict, mappings[fqn], value)  # type: ignore[attr-defined]
    elif isinstance(getattr(planner, "state_dict", None), dict):
        planner.state_dict[fqn] = value  # type: ignore[attr-defined]
    else:
        raise InvalidState(f"{fqn}: this load planner cannot take a non-tensor value without unpickling it; "
                           "use DefaultLoadPlanner")


def save(state_dict: dict[str, Any], writer: VerifiedStorageWriter, **kwargs: Any) -> None:
    """``dcp.save(state_dict, storage_writer=writer, ...)``, its failure raised as a ``VerifiedCkptError``."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    try:
        dcp_save(state_dict, storage_writer=writer, **kwargs)
    except CheckpointException as e:
        raise _ours(e) from None


def load(state_dict: dict[str, Any], reader: VerifiedStorageReader, **kwargs: Any) -> None:
    """``dcp.load(state_dict, storage_reader=reader, ...)``, its failure raised as a ``VerifiedCkptError``."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    try:
        dcp_load(state_dict, storage_reader=reader, **kwargs)
    except CheckpointException as e:
        raise _ours(e, reader.error) from None


def _ours(e: CheckpointException, hidden: BaseException | None = None) -> VerifiedCkptError:
    """The first failing rank's error, as the library's (DCP swallows what ``read_metadata`` raises: ``hidden``)."""
    failures = [exc for _, (exc, _trace) in sorted(e.failures.items())]
    for exc in [*failures, *([hidden] if hidden is not None else [])]:
        if isinstance(exc, VerifiedCkptError):
            return exc
    first = failures[0] if failures else e
    return StorageError(f"torch.distributed.checkpoint failed: {type(first).__name__}: {str(first).splitlines()[0][:300]}")
