"""The job's communicator: the only module that calls ``torch.distributed`` collectives.

Like torchsnapshot's ``PGWrapper``, a :class:`Communicator` wraps one process
group and degrades to a single process when ``torch.distributed`` is not
initialised. The guard and the checkpoint manager both take one, so an
unguarded multi-rank save coordinates exactly as a guarded one does. Sharded
training will hold several (a replica group and a shard group), so nothing
here assumes the group is the world: ``rank`` and ``world`` are positions in
the group.

Byte strings and batches travel as uint8 tensors through all-gathers, never
through pickle.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import batches
from .errors import InvalidConfig, RanksDidNotArrive
from .hosts import Host, as_device, local_host

__all__ = ["Communicator", "describe_device"]


def describe_device(device: torch.device) -> str:
    """How incidents and manifests name a device: index, model and UUID (what an operator pulls), as printable
    text that the records' reader takes (``hosts.as_device``)."""
    if device.type != "cuda":
        return device.type
    props = torch.cuda.get_device_properties(device)
    return as_device(f"cuda:{device.index} {props.name} {getattr(props, 'uuid', '')}".strip())


class Communicator:
    """Collectives over one process group (or none: a single process).

    Args:
        group: a ``torch.distributed`` process group; ``None`` is the default (world) group.
        device: the device this rank computes on. NCCL groups move data on it; other
            backends move it through host memory.
    """

    def __init__(self, group: Any = None, *, device: torch.device | None = None, arrival_timeout_s: float = 300.0) -> None:
        if not arrival_timeout_s > 0:
            raise InvalidConfig(f"arrival_timeout_s must be > 0, got {arrival_timeout_s!r}")
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.device = device if device is not None else torch.device("cpu")
        self.arrival_timeout_s = arrival_timeout_s
        self._topology: list[Host] | None = None
        self._node_of: list[int] | None = None
        self._arrivals: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, world={self.world})"

    @property
    def comm_device(self) -> torch.device:
        """Where tensors must be to take part in this group's collectives."""
        if self.distributed and dist.get_backend(self.group) == "nccl":
            return self.device
        return torch.device("cpu")

    @property
    def active(self) -> bool:
        """Whether there is anyone to talk to."""
        return self.distributed and self.world > 1

    # ------------------------------------------------------------ tensors
    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape and dtype everywhere), on every rank, on ``t``'s device."""
        if not self.active:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """``all_gather`` of a 1-D tensor, stacked into ``(world, n)`` on the host: one device-to-host copy.

        Gathered straight into one tensor where torch has ``all_gather_single`` (no list of per-rank buffers and
        no stack: a per-step call, so every op counts)."""
        t = t.to(self.comm_device)
        gather_single = getattr(dist, "all_gather_single", None)
        if not self.active or gather_single is None:
            return torch.stack(self.all_gather(t)).cpu()
        out = torch.empty(self.world * t.numel(), dtype=t.dtype, device=t.device)
        gather_single(out, t.contiguous(), group=self.group)
        return out.view(self.world, -1).cpu()

    def any_of(self, mask: list[bool]) -> list[bool]:
        """Element-wise: whether any rank's ``mask`` marks it (one decision for every rank)."""
        if not self.active or not mask:
            return mask
        rows = self.all_gather_rows(torch.tensor(mask, dtype=torch.int64, device=self.device))
        return [bool(v) for v in rows.to("cpu").bool().any(0).tolist()]

    def all_reduce_async(self, buf: torch.Tensor) -> torch.futures.Future[Any]:
        """Start a sum all-reduce of ``buf`` in place; the future's value is ``[buf]``."""
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        assert work is not None
        fut: torch.futures.Future[Any] = work.get_future()
        return fut

    def all_gather_async(self, parts: list[torch.Tensor], buf: torch.Tensor) -> torch.futures.Future[Any]:
        """Start an all-gather of ``buf`` into ``parts`` (one per rank)."""
        work = dist.all_gather(parts, buf, group=self.group, async_op=True)
        assert work is not None
        fut: torch.futures.Future[Any] = work.get_future()
        return fut

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, group: Any, op: Any, async_op: bool) -> Any:
        """FSDP's reduce-scatter over its own sub-group (``group``), as FSDP's default communication issues it."""
        # reduce_scatter_single, not reduce_scatter_tensor: torch 2.13 deprecates the latter with a FutureWarning
        # on every call, which every FSDP step would print.
        return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)

    def shift(self, t: torch.Tensor, incoming: int, *, by: int = 1) -> torch.Tensor:
        """Send the 1-D ``t`` to the rank ``by`` places after this one in the group and receive ``incoming``
        elements of its dtype from the rank ``by`` places before (a ring, point to point: each rank moves only
        its own piece, not the world's, as an all-gather would). A shift by a multiple of the world is ``t``."""
        return self.shift_start(t, incoming, by=by)()

    def shift_start(self, t: torch.Tensor, incoming: int, *, by: int = 1) -> Callable[[], torch.Tensor]:
        """:meth:`shift`, started: the transfer runs while the caller goes on; the returned function waits for it
        and gives what was received. Every rank must start it, and wait before its next shift."""
        if not self.active or by % self.world == 0:
            return lambda: t
        dev = self.comm_device

        def member(r: int) -> int:  # the rank in the default group, which point-to-point ops address
            return int(dist.get_global_rank(self.group, r)) if self.group is not None else r

        out = torch.empty(max(incoming, 1), dtype=t.dtype, device=dev)  # gloo sends no empty tensor
        sent = t.to(dev).contiguous() if t.numel() else torch.zeros(1, dtype=t.dtype, device=dev)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, member((self.rank + by) % self.world), self.group),
                                        dist.P2POp(dist.irecv, out, member((self.rank - by) % self.world), self.group)])

        def wait() -> torch.Tensor:
            for work in works:
                work.wait()
            assert sent.numel()  # the send buffer is referenced here, so it lives until the send completed
            return out[:incoming].to(t.device)

        return wait

    # -------------------------------------------------------------- bytes
    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's byte string, on every rank (two all-gathers; no pickle)."""
        if not self.active:
            return [data]
        dev = self.comm_device
        sizes = [int(t.item()) for t in self.all_gather(torch.tensor([len(data)], dtype=torch.int64, device=dev))]
        buf = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        return [bytes(t[:n].cpu().numpy().tobytes()) for t, n in zip(self.all_gather(buf), sizes, strict=True)]

    def broadcast_bytes(self, data: bytes) -> bytes:
        """Rank 0's ``data`` on every rank (what the others pass is ignored)."""
        return self.gather_bytes(data if self.rank == 0 else b"")[0]

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.group)

    def arrive(self, what: str) -> None:
        """Wait, within ``arrival_timeout_s``, until every rank has reached the same ``what`` (its n-th call).

        Collectives wait forever for a rank that never comes (a ``save()``
        called on rank 0 only, the ``torch.save`` habit). Before its first
        collective, each bounded operation checks in through the group's
        key-value store instead, which can name who is missing.

        Raises:
            RanksDidNotArrive: naming the ranks that did not arrive in time.
        """
        if not self.active:
            return
        store = self._store()
        if store is None:
            return  # no store to check in with (a custom backend): the collective itself will wait
        n = self._arrivals[what] = self._arrivals.get(what, 0) + 1
        keys = [f"vckpt/arrive/{what}/{n}/{r}" for r in range(self.world)]
        store.set(keys[self.rank], b"1")
        try:
            store.wait(keys, datetime.timedelta(seconds=self.arrival_timeout_s))
        except (RuntimeError, dist.DistError):
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if not missing:
                return  # everyone arrived just as the wait gave up
            raise RanksDidNotArrive(
                f"{what}: rank(s) {missing} of {self.world} did not arrive within {self.arrival_timeout_s:g}s; "
                f"{what}() runs on every rank of the job, not only on rank 0 - call it on all ranks "
                "(or raise arrival_timeout_s if they are only slow)", missing) from None

    def _store(self) -> Any:
        # The process group's own key-value store (TCPStore or FileStore, prefixed per group):
        # torch exposes it only through this private accessor, so it is used defensively.
        try:
            pg = self.group if self.group is not None else dist.distributed_c10d._get_default_group()
            return dist.distributed_c10d._get_process_group_store(pg)
        except (AttributeError, KeyError, RuntimeError, ValueError):
            return None

    # ----------------------------------------------------------- topology
    def topology(self) -> list[Host]:
        """Every rank's host and device, exchanged once (a collective the first time)."""
        if self._topology is None:
            self._topology, self._node_of = self._exchange_topology()
        return self._topology

    def node_of(self) -> list[int]:
        """The node id of every rank: the launcher's node rank where each has one, else hostnames in order."""
        self.topology()
        assert self._node_of is not None
        return self._node_of

    def host_of(self, rank: int) -> Host:
        return self.topology()[rank]

    def _exchange_topology(self) -> tuple[list[Host], list[int]]:
        from .decisions import nodes_from

        group_rank = os.environ.get("GROUP_RANK")
        mine = {"host": local_host(), "device": describe_device(self.device),
                "group_rank": int(group_rank) if group_rank and group_rank.isdigit() else None}
        rows = [json.loads(b) for b in self.gather_bytes(json.dumps(mine).encode())]
        hosts = [Host(r, str(row["host"]), str(row["device"])) for r, row in enumerate(rows)]
        return hosts, nodes_from([row["group_rank"] for row in rows], [h.host for h in hosts])

    # ------------------------------------------------------------ batches
    def exchange_batches(self, mine: Sequence[Any]) -> list[list[Any]]:
        """Every rank's microbatches of this step, on every rank; shapes, dtypes and structure may differ.

        One small gather of each rank's structure (``batches.encode``), then one
        all-gather per tensor position of the raw bytes, padded to the largest.
        """
        flat: list[torch.Tensor] = []
        specs = []
        for i, mb in enumerate(mine):
            ts, spec = batches.encode(mb, f"microbatch {i}")
            flat += ts
            specs.append([spec, len(ts)])
        meta = {"specs": specs, "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in flat]}
        metas = [json.loads(b) for b in self.gather_bytes(json.dumps(meta).encode())]
        per_rank: list[list[torch.Tensor]] = [[] for _ in metas]
        dev = self.comm_device
        for i in range(max(len(m["tensors"]) for m in metas)):
            described = [m["tensors"][i] if i < len(m["tensors"]) else None for m in metas]
            sizes = [_nbytes(d) for d in described]
            padded = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
            if i < len(flat):
                raw = flat[i].detach().contiguous().reshape(-1).view(torch.uint8)
                padded[: raw.numel()] = raw.to(dev)
            for r, got in enumerate(self.all_gather(padded)):
                d = described[r]
                if d is not None:
                    dtype = getattr(torch, d[0])
                    per_rank[r].append(got[: sizes[r]].to(self.device).view(dtype).reshape(d[1]))
        out = []
        for m, tensors in zip(metas, per_rank, strict=True):
            mbs, pos = [], 0
            for spec, n in m["specs"]:
                mbs.append(batches.decode(tensors[pos : pos + n], spec))
                pos += n
            out.append(mbs)
        return out


def _nbytes(described: list[Any] | None) -> int:
    if described is None:
        return 0
    dtype = getattr(torch, described[0])
    n = 1
    for d in described[1]:
        n *= int(d)
    return n * int(dtype.itemsize)
