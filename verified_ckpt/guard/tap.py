"""The gradient tap: per-bucket statistics taken inside DDP's communication hook.

DDP hands every gradient bucket to a communication hook before it is
reduced. The tap measures the local bucket (``stats.local_stats``), starts
the reduction through the communicator, and measures the averaged result when
it lands, so the checks see both sides of the all-reduce without an extra
pass or a host synchronisation. One process (no DDP) is a world of one: the
local gradients are the averaged ones.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..comm import Communicator
from ..faults import FaultPlan
from .abft import GradientChecks
from .aside import set_aside
from .budget import Stopwatch
from .nocast import own_precision
from .stats import BucketStats, Projector, local_stats

__all__ = ["GradientTap"]

_GradBucket = getattr(dist, "GradBucket")  # noqa: B009 - torch exports it without declaring it (no stub)


class GradientTap:
    """Records this step's bucket statistics and the parameter layout of each bucket.

    Args:
        params: the module's parameters (bucket layouts index into them).
        comm: the replica group the buckets are reduced over.
        project: the checksum's projections.
        faults: fault injection (sites ``grad`` and ``allreduce``).
        step: returns the step being computed (for fault injection).
        fixed_order: average by all-gather and a sum in rank order instead of the backend's all-reduce.
    """

    def __init__(self, params: Sequence[torch.Tensor], comm: Communicator, *, project: Projector, faults: FaultPlan,
                 step: Callable[[], int | None], fixed_order: bool, abft: GradientChecks | None,
                 want_lanes: Callable[[], bool] = lambda: True, watch: Stopwatch | None = None) -> None:
        self.abft, self.want_lanes = abft, want_lanes
        self.watch = watch or Stopwatch()
        self.params = list(params)
        self.comm, self.project, self.faults, self._step = comm, project, faults, step
        self.fixed_order = fixed_order
        self._pindex = {id(p): i for i, p in enumerate(self.params)}
        self.warming = False  # a warm-up pass: a plain average, no checks, no faults, nothing recorded
        self.buckets: list[BucketStats] = []
        self.layout: dict[int, list[int]] = {}
        # Per bucket index: its buffer and that buffer's projection rows (two views). DDP keeps a bucket's buffer
        # for the whole run, so the views are made once, not twice per bucket per step; a rebuilt bucket (a new
        # buffer; the kept views hold the old one alive, so no new one can reuse its address) is noticed.
        self._rows: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._flat: torch.Tensor | None = None  # one process: the step's gradients, one after another

    def reset(self) -> None:
        self.buckets = []
        self.layout = {}
        if self.abft is not None:
            self.abft.reset()

    def install(self, model: DDP) -> None:
        """Register the hook on ``model`` (DDP allows one hook per model)."""
        def hook(state: Any, bucket: Any) -> Any:
            with own_precision():  # a backward the caller runs under autocast: the checks' sums stay float32
                return self._hook(bucket)

        # DDP inspects the annotations as objects; this module's
        # ``from __future__ import annotations`` would leave strings.
        hook.__annotations__ = {"state": object, "bucket": _GradBucket, "return": torch.futures.Future[torch.Tensor]}
        model.register_comm_hook(None, hook)

    def _hook(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        index = bucket.index()
        world = self.comm.world
        # Averaged as DDP's reducer averages without a hook (a multiplication by 1 / world, fused into its copy into the
        # bucket): the same bits, and a multiplication streams where a division does not (0.15 against 0.5 ms
        # for 1.1M floats on this host's CPU).
        if self.warming:
            buf.mul_(1.0 / world)
            return self.comm.all_reduce_async(buf).then(lambda f: f.value()[0])
        rank, step = self.comm.rank, self._step()
        t0 = time.perf_counter()
        self.layout[index] = [self._pindex[id(p)] for p in bucket.parameters()]
        if index == 0:
            self.faults.apply("grad", rank, step, buf)
        rows = self._rows_of(index, buf)
        stats = local_stats(index, buf, self.project, self.want_lanes(), rows)
        t1 = time.perf_counter()
        self.watch.floor += t1 - t0
        if self.abft is not None:  # before the all-reduce: the local gradients, as this rank computed them
            self.abft.flat(list(bucket.parameters()), buf, stats.sumsq)
            self.watch.abft += time.perf_counter() - t1
        if self.fixed_order:
            parts = [torch.empty_like(buf) for _ in range(world)]
            fut = self.comm.all_gather_async(parts, buf)
        else:
            buf.mul_(1.0 / world)
            fut = self.comm.all_reduce_async(buf)

        def averaged(f: torch.futures.Future[Any]) -> torch.Tensor:
            out: torch.Tensor
            if self.fixed_order:
                # Element-wise sum in rank order: independent of bucket boundaries.
                out = buf
                out.copy_(parts[0])
                for p in parts[1:]:
                    out.add_(p)
                out.div_(world)
            else:
                out = f.value()[0]
            if index == 0:
                self.faults.apply("allreduce", rank, step, out)
            t = time.perf_counter()
            with own_precision():  # the callback carries the backward's thread state, autocast included
                stats.avg_part = self.project.part(*self._rows_of(index, out))
            self.watch.floor += time.perf_counter() - t
            self.buckets.append(stats)
            return out

        return fut.then(averaged)

    def _rows_of(self, index: int, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``Projector.split`` of bucket ``index``'s buffer, kept while the bucket keeps its float32 buffer."""
        if buf.dtype != torch.float32 or not buf.is_contiguous():
            return self.project.split(buf)  # a float32 copy each time: nothing to keep
        kept = self._rows.get(index)
        if kept is None or kept[0].data_ptr() != buf.data_ptr() or kept[0].numel() != buf.numel():
            if kept is not None:  # DDP rebuilt its buckets: let go of every old buffer, not just this one
                self._rows.clear()
            kept = self._rows[index] = (buf, self.project.split(buf))
        return kept[1]

    def _flat_of(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The gradients one after another. On CPU in a buffer kept from step to step (as a DDP bucket is): a fresh
        one each step costs a page fault per page (2.5x the copy itself). On a GPU the caching allocator makes a
        fresh one cheap, and a kept one would hold a gradient's worth of memory through the next forward."""
        if not grads:
            return torch.zeros(0)
        n = sum(g.numel() for g in grads)
        dtype, device = grads[0].dtype, grads[0].device
        if device.type != "cpu" or any(g.dtype != dtype or g.device != device for g in grads):
            return torch.cat([g.reshape(-1) for g in grads])  # (mixed dtypes: the promoted copy)
        flat = self._flat
        if flat is None or flat.numel() != n or flat.dtype != dtype or flat.device != device:
            flat = self._flat = torch.empty(n, dtype=dtype, device=device)
        return torch.cat([g.reshape(-1) for g in grads], out=flat)

    def warm_up(self, model: torch.nn.Module, module: torch.nn.Module,
                loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], batch: Any) -> None:
        """One forward-backward that leaves no trace but DDP's rebuilt bucket layout (see ``prepare_resume``):
        a plain average, no checks, no faults; RNG, buffers and gradients put back afterwards."""
        with self.aside(module):
            loss_fn(model, batch).backward()

    @contextlib.contextmanager
    def aside(self, module: torch.nn.Module) -> Iterator[None]:
        """Passes that are not the step's own (a warm-up, ``ReplicatedLayout.calibrate``'s replays): no faults, a plain
        average if a reduction runs; they start from no gradient, and RNG, buffers and gradients are put back."""
        self.warming = True
        try:
            with set_aside(self.params, list(module.buffers())):
                yield
        finally:
            self.warming = False

    def single_process(self) -> None:
        """No DDP hook ran (one process): measure the gradients as one bucket, local and averaged alike."""
        step = self._step()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flat_of(grads)
        self.faults.apply("grad", 0, step, flat)
        rows = self._rows_of(-1, flat) if flat is self._flat else self.project.split(flat)  # kept with it
        stats = local_stats(0, flat, self.project, self.want_lanes(), rows)
        if self.abft is not None:
            t = time.perf_counter()
            self.abft.flat(self.params, flat, stats.sumsq)
            self.watch.abft += time.perf_counter() - t
        self.faults.apply("allreduce", 0, step, flat)
        stats.avg_part = self.project.part(*rows)
        self.layout = {0: list(range(len(self.params)))}
        self.buckets = [stats]
