"""``SDCGuard``: silent-data-corruption checks inside a DDP training loop.

Four checks, all decided by pure functions in ``decisions`` from data every
rank has gathered, so every rank reaches the same verdict and raises together
(no rank is left waiting in a collective):

1. **NaN/Inf** in each rank's local gradients (in the DDP communication hook,
   before the all-reduce) and in the averaged gradients (before the update).
2. **All-reduce checksum.** Each rank projects its local bucket onto a few
   seeded random vectors before the all-reduce and projects the result after
   it. Projections are linear, so the projection of the average must equal the
   average of the projections up to a rounding bound computed from the data.
   This catches a wrong finite value produced *inside* the averaging, the
   blind spot the published three-check design admits.
3. **Recompute audit.** Every ``audit_every`` steps (and at once when a rank's
   gradient norm is an outlier) each auditor recomputes another node's
   microbatches with the same pre-update weights and compares the loss and an
   exact fingerprint of the gradient buckets with what the owner recorded
   before the all-reduce; on a mismatch a third rank breaks the tie.
4. **Weight consensus.** Every ``consensus_every`` steps and before every save,
   all replicas' fingerprints of parameters and optimizer state are compared;
   a strict majority names the odd ones out.

Checks 1-3 run before the optimizer step: a failure withholds the update, so
the weights never absorb the bad value. The per-step checks cost one small
all-gather and one device-to-host copy per step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from . import decisions
from .errors import GuardUsageError, SilentCorruptionDetected
from .faults import FaultPlan
from .fingerprint import tensor_lanes
from .history import NO_RANK, Event
from .manifest import Incident

_EPS32 = 2.0**-24
_LANES = 1024  # projection vector length; buckets are folded onto it row by row
_HOST_BYTES = 192


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """What the guard checks and how often.

    Args:
        consensus_every: run the weight consensus after the update every N steps (>= 1).
        audit_every: run a recompute audit every N steps (>= 1), or ``None`` for none.
        mode: ``"exact"`` compares audits bitwise (deterministic kernels, as on CPU);
            ``"tolerance"`` compares relatively (nondeterministic GPU kernels).
        rtol: relative tolerance of audits in tolerance mode.
        checksum_lanes: random projections per all-reduce checksum.
        checksum_slack: safety factor on the rounding bound of the checksum.
        outlier_factor: a rank whose gradient norm is this many times above or below
            the median of the others is audited at once.
        fixed_order_reduce: average gradients by all-gather and a sum in rank order instead of
            the backend's all-reduce, so the result never depends on DDP's bucket layout. Costs
            about W/2 times the all-reduce traffic; not needed for bitwise resume, which
            :meth:`SDCGuard.prepare_resume` handles with one warm-up iteration.
        seed: seed of the checksum projections (identical on every rank).
        ledger_rank_rows: up to this world size the ledger gets one row per rank per step;
            above it, one job-wide row per step (mean loss, largest local gradient norm)
            plus rows for the ranks a failed check names, so the ledger grows with steps, not ranks.
        faults: fault-injection specs ``SITE:RANK:STEP[:MODE]`` (testing only).
    """

    consensus_every: int = 100
    audit_every: int | None = 500
    mode: str = "exact"
    rtol: float = 1e-4
    checksum_lanes: int = 2
    checksum_slack: float = 16.0
    outlier_factor: float = 4.0
    fixed_order_reduce: bool = False
    seed: int = 0
    ledger_rank_rows: int = 64
    faults: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.consensus_every, int) or self.consensus_every < 1:
            raise ValueError(f"consensus_every must be >= 1, got {self.consensus_every!r}")
        if self.audit_every is not None and (not isinstance(self.audit_every, int) or self.audit_every < 1):
            raise ValueError(f"audit_every must be >= 1 or None, got {self.audit_every!r}")
        if self.mode not in ("exact", "tolerance"):
            raise ValueError(f"mode must be 'exact' or 'tolerance', got {self.mode!r}")
        if not self.rtol > 0:
            raise ValueError(f"rtol must be > 0, got {self.rtol!r}")
        if not 1 <= self.checksum_lanes <= 16:
            raise ValueError(f"checksum_lanes must be in 1..16, got {self.checksum_lanes!r}")
        if not self.checksum_slack >= 1:
            raise ValueError(f"checksum_slack must be >= 1, got {self.checksum_slack!r}")
        if not self.outlier_factor > 1:
            raise ValueError(f"outlier_factor must be > 1, got {self.outlier_factor!r}")
        FaultPlan(self.faults)  # raises ValueError naming a bad spec


@dataclasses.dataclass
class _Bucket:
    index: int
    sumsq: torch.Tensor  # float64 scalar
    numel: int
    proj: torch.Tensor  # float64[k], local bucket
    lanes: torch.Tensor  # int64[2], exact fingerprint of the local bucket
    avg_proj: torch.Tensor | None = None  # float64[k], all-reduced bucket


@dataclasses.dataclass
class CheckCounts:
    """Per check kind: passes, failures, and the last step it passed."""

    passed: int = 0
    failed: int = 0
    last_pass: int | None = None


def describe_device(device: torch.device) -> str:
    """How incidents and manifests name a device: index, model and UUID (what an operator pulls)."""
    if device.type != "cuda":
        return device.type
    props = torch.cuda.get_device_properties(device)
    return f"cuda:{device.index} {props.name} {getattr(props, 'uuid', '')}".strip()


def _pack_host(text: str) -> torch.Tensor:
    raw = text.encode()[:_HOST_BYTES]
    return torch.tensor(list(raw) + [0] * (_HOST_BYTES - len(raw)), dtype=torch.uint8)


def _unpack_host(t: torch.Tensor) -> str:
    return bytes(t.tolist()).rstrip(b"\0").decode(errors="replace")


class SDCGuard:
    """Silent-data-corruption checks for one DDP replica.

    Args:
        model: the ``DistributedDataParallel`` model (a plain module for a single process).
        optimizer: its optimizer; :meth:`step` calls ``optimizer.step()`` only when the checks pass.
        loss_fn: ``loss_fn(module, batch) -> scalar loss``; the same function is used for
            training and for audit recomputation (put autocast inside it).
        config: a :class:`GuardConfig`.
        batch_for: optional ``batch_for(rank, step) -> list of microbatches`` for a
            deterministic data pipeline; by default audited microbatches travel by collectives.
        process_group: the data-parallel group (default: the world).

    Usage::

        guard = SDCGuard(ddp_model, opt, loss_fn, GuardConfig(audit_every=100))
        for step in range(start, steps):
            for i, mb in enumerate(microbatches):
                guard.backward(mb, step=step, sync=i == len(microbatches) - 1)
            clip_grad_norm_(ddp_model.parameters(), 1.0)   # optional, as usual
            guard.step()          # raises SilentCorruptionDetected; the update is withheld
            opt.zero_grad(); sched.step()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
        config: GuardConfig | None = None,
        *,
        batch_for: Callable[[int, int], Sequence[Any]] | None = None,
        process_group: Any = None,
    ) -> None:
        self.cfg = config or GuardConfig()
        self.model = model
        self.module = model.module if isinstance(model, DDP) else model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.batch_for = batch_for
        self.pg = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(self.pg) if self.distributed else 1
        self.rank = dist.get_rank(self.pg) if self.distributed else 0
        if self.world > 1 and not isinstance(model, DDP):
            raise GuardUsageError("with more than one process the model must be wrapped in DistributedDataParallel")
        self.params = list(self.module.parameters())
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self._pindex = {id(p): i for i, p in enumerate(self.params)}
        self.faults = FaultPlan(self.cfg.faults)
        self.topology = self._exchange_topology()
        self.node_of = decisions.nodes_from([t["group_rank"] for t in self.topology], [t["host"] for t in self.topology])
        self.targets = decisions.audit_targets(self.node_of)
        g = torch.Generator().manual_seed(self.cfg.seed)
        k = self.cfg.checksum_lanes
        # Magnitudes in [1, 2] with random signs: no weight is near zero, so any
        # single wrong element moves every projection, and max|r| <= 2 keeps the bound tight.
        signs = torch.randint(0, 2, (_LANES, k), generator=g) * 2 - 1
        self._proj64 = ((torch.rand(_LANES, k, generator=g) + 1) * signs).to(torch.float64).to(self.device)
        self._proj_max = 2.0
        self.checks: dict[str, CheckCounts] = {}
        self.incidents: list[Incident] = []
        self._listeners: list[Callable[[Incident], None]] = []
        self._event_listeners: list[Callable[[list[Event]], None]] = []
        self.fixed_order = bool(self.cfg.fixed_order_reduce)
        self._ran_backward = False
        self._warmup_pending = False
        self._warming = False
        self._audit_requested = False
        self._step: int | None = None
        self._start: int | None = None
        self._reset_step()
        if isinstance(model, DDP):
            def hook(state: Any, bucket: Any) -> Any:
                return self._comm_hook(state, bucket)

            # DDP inspects the annotations as objects; this module's
            # ``from __future__ import annotations`` would leave strings.
            hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
            model.register_comm_hook(None, hook)
        if self.faults.has_site("compute"):
            self.module.register_forward_hook(self._compute_fault)

    # ------------------------------------------------------------ topology
    def _exchange_topology(self) -> list[dict[str, Any]]:
        host = socket.gethostname()
        device = describe_device(self.device)
        group_rank = os.environ.get("GROUP_RANK")
        mine = torch.cat([
            _pack_host(host), _pack_host(device),
            torch.tensor(list(int(group_rank if group_rank and group_rank.isdigit() else -1).to_bytes(8, "little", signed=True)), dtype=torch.uint8),
        ])
        rows = self._all_gather(mine.to(self._comm_device()))
        out = []
        for r, row in enumerate(rows):
            row = row.cpu()
            gr = int.from_bytes(bytes(row[2 * _HOST_BYTES:].tolist()), "little", signed=True)
            out.append({"rank": r, "host": _unpack_host(row[:_HOST_BYTES]),
                        "device": _unpack_host(row[_HOST_BYTES:2 * _HOST_BYTES]), "group_rank": gr if gr >= 0 else None})
        return out

    def _comm_device(self) -> torch.device:
        if self.distributed and dist.get_backend(self.pg) == "nccl":
            return self.device
        return torch.device("cpu") if self.distributed else self.device

    def _all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        if not self.distributed or self.world == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t.contiguous(), group=self.pg)
        return out

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's byte string, on every rank (two all-gathers; no pickle)."""
        if self.world == 1 or not self.distributed:
            return [data]
        dev = self._comm_device()
        sizes = [int(t.item()) for t in self._all_gather(torch.tensor([len(data)], dtype=torch.int64, device=dev))]
        buf = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        return [bytes(t[:n].cpu().numpy().tobytes()) for t, n in zip(self._all_gather(buf), sizes)]

    def barrier(self) -> None:
        if self.distributed and self.world > 1:
            dist.barrier(group=self.pg)

    def host_of(self, rank: int) -> dict[str, Any]:
        t = self.topology[rank]
        return {"rank": rank, "host": t["host"], "device": t["device"]}

    # ------------------------------------------------------- per-step state
    def _reset_step(self) -> None:
        self._batches: list[Any] = []
        self._losses: list[torch.Tensor] = []
        self._buckets: list[_Bucket] = []
        self._layout: dict[int, list[int]] = {}

    @property
    def current_step(self) -> int | None:
        return self._step

    def request_audit(self) -> None:
        """Audit at the next :meth:`step`, whatever the schedule."""
        self._audit_requested = True

    # ------------------------------------------------------------ training
    def backward(self, batch: Any, *, step: int, sync: bool = True) -> torch.Tensor:
        """Forward and backward one microbatch through the DDP model, recording it for audits.

        Args:
            batch: what ``loss_fn`` takes (a tensor, or a tuple/list/dict of tensors).
            step: the training step this microbatch belongs to.
            sync: ``False`` for all but the last microbatch of a step (runs under ``no_sync``).

        Returns:
            The loss (attached to the graph is not needed: it is detached).
        """
        if self._step is not None and step != self._step and self._batches:
            raise GuardUsageError(f"backward for step {step} while step {self._step} has not been closed with step()")
        if self._step != step:
            self._reset_step()
        self._step = step
        if self._start is None:
            self._start = step
        if self._warmup_pending:
            self._warmup_pending = False
            self._warmup(batch)
        self._ran_backward = True
        ctx = self.model.no_sync() if (not sync and isinstance(self.model, DDP)) else contextlib.nullcontext()
        with ctx:
            loss = self.loss_fn(self.model, batch)
            loss.backward()
        self._batches.append(batch)
        self._losses.append(loss.detach().to(torch.float64))
        return loss.detach()

    def prepare_resume(self) -> None:
        """State was just restored into this process: match DDP's bucket layout before the next step.

        DDP rebuilds its gradient buckets after its first iteration, and the
        floating-point order of an all-reduce depends on the bucket layout
        (with 3+ gloo ranks). A fresh process that restores at step k would
        reduce step k in the initial layout while the uninterrupted run used
        the rebuilt one, and results would drift by rounding. So before the
        first real backward in such a process, one warm-up forward-backward
        (RNG, buffers and gradients put back afterwards, no checks, no
        faults) brings DDP to the same rebuilt layout. In-process rollbacks
        need nothing: the layout is already rebuilt.
        """
        if isinstance(self.model, DDP) and not self._ran_backward:
            self._warmup_pending = True

    def _warmup(self, batch: Any) -> None:
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        buffers = [b.detach().clone() for b in self.module.buffers()]
        self._warming = True
        try:
            self.loss_fn(self.model, batch).backward()
        finally:
            self._warming = False
            for p in self.params:
                p.grad = None
            with torch.no_grad():
                for b, saved in zip(self.module.buffers(), buffers):
                    b.copy_(saved)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)

    def _compute_fault(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if self._warming:
            return None
        if isinstance(output, torch.Tensor) and self.faults.firing("compute", self.rank, self._step):
            output = output.clone()
            self.faults.apply("compute", self.rank, self._step, output)
            return output
        return None

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """Seeded random projections of ``x``: 1024 contiguous block sums, then one small matvec.

        Linear in ``x``, so P(mean of buckets) = mean of P(buckets) up to
        rounding; every weight is nonzero, so any single wrong element moves
        every lane. One memory pass (contiguous row sums run at ~bandwidth)
        whatever the number of lanes.
        """
        x = x if x.dtype in (torch.float32, torch.float64) else x.float()
        per_block = x.numel() // _LANES
        out = torch.zeros(self._proj64.shape[1], dtype=torch.float64, device=x.device)
        if per_block:
            out += x[: per_block * _LANES].view(_LANES, per_block).sum(1).to(torch.float64) @ self._proj64
        rem = x.numel() - per_block * _LANES
        if rem:
            out += x[per_block * _LANES:].to(torch.float64) @ self._proj64[:rem]
        return out

    def _local_stats(self, index: int, buf: torch.Tensor) -> _Bucket:
        # Three passes over the local bucket: squared norm (outlier trigger and
        # checksum bound), projection (checksum; NaN/Inf shows up here), exact lanes (audit).
        x = buf if buf.dtype in (torch.float32, torch.float64) else buf.float()
        return _Bucket(
            index=index,
            sumsq=torch.dot(x, x).to(torch.float64),
            numel=buf.numel(),
            proj=self._project(x),
            lanes=tensor_lanes(buf),
        )

    def _comm_hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        index = bucket.index()
        if self._warming:  # a plain average: no checks, no faults, nothing recorded
            buf.div_(self.world)
            return dist.all_reduce(buf, group=self.pg, async_op=True).get_future().then(lambda f: f.value()[0])
        self._layout[index] = [self._pindex[id(p)] for p in bucket.parameters()]
        if index == 0:
            self.faults.apply("grad", self.rank, self._step, buf)
        stats = self._local_stats(index, buf)
        if self.fixed_order:
            parts = [torch.empty_like(buf) for _ in range(self.world)]
            fut = dist.all_gather(parts, buf, group=self.pg, async_op=True).get_future()
        else:
            buf.div_(self.world)
            fut = dist.all_reduce(buf, group=self.pg, async_op=True).get_future()

        def averaged(f: torch.futures.Future) -> torch.Tensor:
            if self.fixed_order:
                # Element-wise sum in rank order: independent of bucket boundaries.
                out = buf
                out.copy_(parts[0])
                for p in parts[1:]:
                    out.add_(p)
                out.div_(self.world)
            else:
                out = f.value()[0]
            if index == 0:
                self.faults.apply("allreduce", self.rank, self._step, out)
            stats.avg_proj = self._project(out)
            self._buckets.append(stats)
            return out

        return fut.then(averaged)

    def _single_process_buckets(self) -> None:
        # No DDP hook ran (one process): the local gradients are the averaged ones.
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        self.faults.apply("grad", self.rank, self._step, flat)
        stats = self._local_stats(0, flat)
        self.faults.apply("allreduce", self.rank, self._step, flat)
        stats.avg_proj = self._project(flat)
        self._layout = {0: list(range(len(self.params)))}
        self._buckets = [stats]

    # ------------------------------------------------------------ the step
    def step(self) -> None:
        """Check this step's gradients; apply the optimizer update only if every check passes.

        Raises:
            SilentCorruptionDetected: a check failed; the update was withheld
                (or, for consensus, the replicas disagree after it).
            GuardUsageError: :meth:`backward` was not called for this step.
        """
        if self._step is None or not self._batches:
            raise GuardUsageError("call guard.backward(batch, step=...) before guard.step()")
        s = self._step
        try:
            if not isinstance(self.model, DDP):
                self._single_process_buckets()
            if not self._buckets:
                raise GuardUsageError(
                    "no gradient bucket was reduced this step; the last backward() of a step must have sync=True"
                )
            gathered = self._gather_step_stats()
            self._check_nonfinite(s, gathered)
            self._check_checksum(s, gathered)
            self._emit(lambda: self._step_events(s, gathered, []))
            suspects = decisions.outliers([math.sqrt(max(x["sumsq"], 0.0)) for x in gathered], self.cfg.outlier_factor)
            scheduled = self.cfg.audit_every is not None and s % self.cfg.audit_every == 0
            if self.world >= 2 and (scheduled or suspects or self._audit_requested):
                self._audit(s, gathered, only=None if (scheduled or self._audit_requested) else suspects)
                self._audit_requested = False
            self.optimizer.step()
            if self.faults.firing("weights", self.rank, s) and self.params:
                self.faults.apply("weights", self.rank, s, self.params[0].data)
            if s % self.cfg.consensus_every == 0:
                self.consensus(s)
        except SilentCorruptionDetected:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        finally:
            self.faults.step_done(s)
            self._reset_step()
            self._step = None

    def _gather_step_stats(self) -> list[dict[str, Any]]:
        k = self.cfg.checksum_lanes
        bs = sorted(self._buckets, key=lambda b: b.index)
        dev = bs[0].sumsq.device
        sumsq = torch.stack([b.sumsq for b in bs]).sum()
        numel = sum(b.numel for b in bs)
        proj = torch.stack([b.proj for b in bs]).sum(0)
        avg = torch.stack([b.avg_proj for b in bs]).sum(0)  # type: ignore[misc]
        w = torch.tensor([2 * b.index + 1 for b in bs], dtype=torch.int64, device=dev)
        lanes = (torch.stack([b.lanes for b in bs]) * w[:, None]).sum(0)
        loss = torch.stack(self._losses).sum().to(dev)
        floats = torch.cat([sumsq.view(1), torch.full((1,), float(numel), dtype=torch.float64, device=dev),
                            loss.view(1), proj, avg])
        packed = torch.cat([floats.view(torch.int64), lanes]).to(self._comm_device())
        rows = torch.stack(self._all_gather(packed)).cpu()  # the step's one device-to-host copy
        out = []
        for row in rows:
            f = row[: 3 + 2 * k].view(torch.float64).tolist()
            out.append({"sumsq": f[0], "numel": f[1], "loss": f[2], "proj": f[3 : 3 + k], "avg_proj": f[3 + k :],
                        "lanes": tuple(row[3 + 2 * k :].tolist())})
        return out

    # -------------------------------------------------------------- checks
    def _passed(self, kind: str, step: int) -> None:
        c = self.checks.setdefault(kind, CheckCounts())
        c.passed += 1
        c.last_pass = step

    def _last_pass(self, kind: str) -> int:
        c = self.checks.get(kind)
        if c and c.last_pass is not None:
            return c.last_pass
        return (self._start if self._start is not None else 0) - 1

    def _fail(self, kind: str, step: int, ranks: list[int], detail: str, first_suspect: int | None = None,
              events: Callable[[], list[Event]] | None = None) -> None:
        c = self.checks.setdefault(kind, CheckCounts())
        c.failed += 1
        if events is not None:
            self._emit(events)  # the failed check's own rows reach the ledger before the incident
        inc = Incident(
            kind=kind, detected_step=step,
            first_suspect_step=step if first_suspect is None else first_suspect,
            ranks=sorted(ranks), hosts=[self.host_of(r) for r in sorted(ranks)], detail=detail,
        )
        self.incidents.append(inc)
        for listener in self._listeners:
            listener(inc)
        raise SilentCorruptionDetected(inc)

    def add_incident_listener(self, fn: Callable[[Incident], None]) -> None:
        """Call ``fn(incident)`` on every rank whenever a check fails (before raising)."""
        self._listeners.append(fn)

    def add_event_listener(self, fn: Callable[[list[Event]], None]) -> None:
        """Call ``fn(events)`` with the ledger rows of every check this rank runs."""
        self._event_listeners.append(fn)

    def _emit(self, build: Callable[[], list[Event]]) -> None:
        if not self._event_listeners:
            return  # ranks without a ledger build no rows
        events = build()
        for fn in self._event_listeners:
            fn(events)

    def _step_events(self, s: int, gathered: list[dict[str, Any]], failed: Sequence[int]) -> list[Event]:
        bad = set(failed) if failed else set(range(self.world)) if failed is None else set()

        def row(r: int) -> Event:
            x = gathered[r]
            return Event(s, "step", r, "fail" if r in bad else "pass", x["lanes"], x["loss"], math.sqrt(max(x["sumsq"], 0.0)))

        if self.world <= self.cfg.ledger_rank_rows:
            return [row(r) for r in range(self.world)]
        norms = [math.sqrt(max(x["sumsq"], 0.0)) for x in gathered]
        summary = Event(s, "step", NO_RANK, "fail" if bad else "pass", (0, 0),
                        sum(x["loss"] for x in gathered) / self.world, max(norms))
        return [summary] + [row(r) for r in sorted(bad)]

    def counters(self) -> dict[str, dict[str, Any]]:
        """A snapshot of every check's pass/fail counts and last passing step."""
        return {k: {"passed": c.passed, "failed": c.failed, "last_pass": c.last_pass} for k, c in self.checks.items()}

    @property
    def audits_enabled(self) -> bool:
        return self.cfg.audit_every is not None and self.world >= 2

    def _check_nonfinite(self, s: int, gathered: list[dict[str, Any]]) -> None:
        # A projection with nonzero weights is NaN/Inf exactly when an element
        # is (short of sums beyond 3e38); the squared norm would also overflow
        # on huge finite values, which belong to the audit.
        bad_local = [r for r, x in enumerate(gathered) if not all(math.isfinite(v) for v in x["proj"])]
        if bad_local:
            self._fail("nonfinite_local", s, bad_local, "NaN/Inf in local gradients before the all-reduce",
                       events=lambda: self._step_events(s, gathered, bad_local))
        self._passed("nonfinite_local", s)
        bad_avg = [r for r, x in enumerate(gathered) if not all(math.isfinite(v) for v in x["avg_proj"])]
        if bad_avg:
            # Local gradients were finite, so the averaging itself produced the value.
            named = bad_avg if len(bad_avg) < self.world else []
            self._fail("nonfinite_averaged", s, named, "NaN/Inf in averaged gradients although every local gradient was finite",
                       events=lambda: self._step_events(s, gathered, named or None))
        self._passed("nonfinite_averaged", s)

    def checksum_bound(self, gathered: list[dict[str, Any]]) -> float:
        """Rounding bound of the all-reduce checksum, derived from the data.

        Each averaged element is off by at most ~(W + 2) * eps32 times the mean
        of the local magnitudes, and the projections' own fp32 column sums add
        ~log2(n / 1024) * eps32; with weights <= max|r| the projection is off by
        that times the mean L1 norm, which Cauchy-Schwarz bounds by
        sqrt(n) * ||g||_2 (so the bound never under-estimates, at the price of
        being loose for sparse gradients). ``checksum_slack`` is a safety factor.
        """
        n = max(x["numel"] for x in gathered)
        mean_l2 = sum(math.sqrt(max(x["sumsq"], 0.0)) for x in gathered) / len(gathered)
        gamma = (self.world + 2 + math.log2(max(n / _LANES, 2.0))) * _EPS32
        return self.cfg.checksum_slack * gamma * self._proj_max * math.sqrt(n) * mean_l2 + 1e-30

    def _check_checksum(self, s: int, gathered: list[dict[str, Any]]) -> None:
        if self.world < 2:
            return  # one replica: nothing was averaged, the check is unavailable
        bound = self.checksum_bound(gathered)
        bad = decisions.checksum_suspects([x["proj"] for x in gathered], [x["avg_proj"] for x in gathered],
                                          [bound] * self.cfg.checksum_lanes)
        if bad:
            named = bad if len(bad) < self.world else []
            self._fail("checksum", s, named, f"all-reduced gradients do not match the local ones (bound {bound:.3g})",
                       events=lambda: self._step_events(s, gathered, named or None))
        self._passed("checksum", s)

    # --------------------------------------------------------------- audit
    def _gather_batches(self, s: int) -> list[list[Any]]:
        if self.batch_for is not None:
            return [list(self.batch_for(r, s)) for r in range(self.world)]
        return _exchange_batches(self._batches, self._all_gather, self._comm_device(), self.device)

    def _recompute(self, microbatches: Sequence[Any]) -> dict[str, Any]:
        """The loss and gradient fingerprint of ``microbatches`` with the current (pre-update) weights."""
        acc: list[torch.Tensor] | None = None
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        for mb in microbatches:
            with torch.enable_grad():
                loss = self.loss_fn(self.module, mb)
            grads = torch.autograd.grad(loss, self.params, allow_unused=True)
            grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, self.params)]
            # Same order of additions as autograd's accumulation into .grad.
            acc = list(grads) if acc is None else [a + g for a, g in zip(acc, grads)]
            loss_total = loss_total + loss.detach().to(torch.float64)
        assert acc is not None
        lanes = torch.zeros(2, dtype=torch.int64, device=self.device)
        proj = torch.zeros(self.cfg.checksum_lanes, dtype=torch.float64, device=self.device)
        for index, members in sorted(self._layout.items()):
            flat = torch.cat([acc[i].reshape(-1) for i in members])
            lanes += tensor_lanes(flat) * (2 * index + 1)
            proj += self._project(flat)
        return {"loss": loss_total, "lanes": lanes, "proj": proj}

    def _same(self, a: dict[str, Any], b: dict[str, Any]) -> bool:
        if self.cfg.mode == "exact":
            return a["loss"] == b["loss"] and tuple(a["lanes"]) == tuple(b["lanes"])
        tol = self.cfg.rtol
        if not math.isclose(a["loss"], b["loss"], rel_tol=tol, abs_tol=1e-12):
            return False
        scale = max(math.sqrt(max(b.get("sumsq", 0.0), 0.0)), max((abs(v) for v in b["proj"]), default=0.0), 1e-30)
        return all(abs(x - y) <= tol * scale for x, y in zip(a["proj"], b["proj"]))

    def _recompute_round(self, jobs: dict[int, int], batches: list[list[Any]]) -> dict[int, dict[str, Any]]:
        """Each rank in ``jobs`` recomputes ``jobs[rank]``'s microbatches; everyone learns every result."""
        k = self.cfg.checksum_lanes
        if self.rank in jobs:
            res = self._recompute(batches[jobs[self.rank]])
            floats = torch.cat([res["loss"].view(1), res["proj"]])
            mine = torch.cat([floats.view(torch.int64), res["lanes"]])
        else:
            mine = torch.zeros(3 + k, dtype=torch.int64, device=self.device)
        rows = torch.stack(self._all_gather(mine.to(self._comm_device()))).cpu()
        out = {}
        for r in jobs:
            f = rows[r][: 1 + k].view(torch.float64).tolist()
            out[r] = {"loss": f[0], "proj": f[1:], "lanes": tuple(rows[r][1 + k :].tolist())}
        return out

    def _audit(self, s: int, gathered: list[dict[str, Any]], only: list[int] | None) -> None:
        """Recompute audited microbatches before the update and judge any disagreement by a third rank."""
        batches = self._gather_batches(s)
        jobs = {a: t for a, t in enumerate(self.targets) if t is not None and (only is None or t in only)}
        if only:
            for t in only:  # an outlier is audited even if its usual auditor is busy elsewhere
                if t not in jobs.values():
                    a = next(r for r in range(self.world) if r != t and r not in jobs)
                    jobs[a] = t
        results = self._recompute_round(jobs, batches)
        disputes = [(a, t) for a, t in jobs.items() if not self._same(results[a], gathered[t])]

        def audit_events(disputed: set[int]) -> list[Event]:
            # One row per audited rank: the auditor's recomputed loss and gradient lanes.
            # Who is to blame is the incident's business (tie-breaks can name the auditor).
            return [Event(s, "audit", t, "fail" if t in disputed else "pass", results[a]["lanes"], results[a]["loss"])
                    for a, t in sorted(jobs.items(), key=lambda j: j[1])]

        if not disputes:
            self._emit(lambda: audit_events(set()))
            self._passed("audit", s)
            return
        suspects: set[int] = set()
        details = []
        for a, t in disputes:
            b = decisions.tiebreaker(t, a, self.node_of)
            third = self._recompute_round({b: t}, batches)[b] if b is not None else None
            owner = gathered[t]
            key = (lambda x: (x["loss"], tuple(x["lanes"]))) if self.cfg.mode == "exact" else None
            if key is not None:
                verdict, roles = decisions.audit_verdict(key(owner), key(results[a]), key(third) if third else None)
            else:
                verdict, roles = self._tolerance_verdict(owner, results[a], third)
            named = {"owner": t, "auditor": a}
            suspects |= {named[r] for r in roles}
            details.append(f"rank {a} recomputed rank {t}'s microbatch and disagreed; "
                           + (f"rank {b} broke the tie: {verdict} is wrong" if b is not None else "no third rank to break the tie"))
        self._fail("audit", s, sorted(suspects), "; ".join(details), first_suspect=self._last_pass("audit") + 1,
                   events=lambda: audit_events({t for _, t in disputes}))

    def _tolerance_verdict(self, owner: dict, auditor: dict, third: dict | None) -> tuple[str, list[str]]:
        if third is None:
            return "undetermined", []
        if self._same(third, auditor):
            return "owner", ["owner"]
        if self._same(third, owner):
            return "auditor", ["auditor"]
        return "undetermined", ["owner", "auditor"]

    # ----------------------------------------------------------- consensus
    def state_lanes(self) -> torch.Tensor:
        """Exact fingerprint lanes of this replica's parameters and optimizer state, on device."""
        tensors = [p.detach() for p in self.params]
        for p in self.params:
            st = self.optimizer.state.get(p, {})
            tensors += [v for _, v in sorted(st.items()) if isinstance(v, torch.Tensor)]
        if not tensors:
            return torch.zeros(2, dtype=torch.int64, device=self.device)
        lanes = torch.stack([tensor_lanes(t).to(self.device) for t in tensors])
        w = torch.arange(len(tensors), device=self.device, dtype=torch.int64) * 2 + 1
        return (lanes * w[:, None]).sum(0)

    def consensus(self, step: int) -> list[str]:
        """Compare every replica's weight and optimizer-state fingerprint now.

        Call it before saving (``CheckpointManager`` does). Returns each rank's
        fingerprint as hex when all agree.

        Raises:
            SilentCorruptionDetected: replicas disagree; a strict majority names the others.
        """
        if self.world < 2:
            return []  # unavailable with one replica: reported by the caller as such, never as a pass
        mine = self.state_lanes().to(self._comm_device())
        rows = torch.stack(self._all_gather(mine)).cpu().tolist()
        fps = ["".join(f"{v & (2**64 - 1):016x}" for v in row) for row in rows]
        unanimous, _, suspects = decisions.vote(fps)

        def consensus_events() -> list[Event]:
            bad = set(suspects) if suspects or unanimous else set(range(self.world))
            return [Event(step, "consensus", r, "fail" if r in bad else "pass", tuple(row)) for r, row in enumerate(rows)]

        if not unanimous:
            detail = "replica fingerprints disagree: " + ", ".join(f"rank {r} {fp[:12]}" for r, fp in enumerate(fps))
            self._fail("consensus", step, suspects, detail, first_suspect=self._last_pass("consensus") + 1,
                       events=consensus_events)
        self._emit(consensus_events)
        self._passed("consensus", step)
        return fps


def _flatten_batch(batch: Any) -> tuple[list[torch.Tensor], Any]:
    if isinstance(batch, torch.Tensor):
        return [batch], "t"
    if isinstance(batch, (list, tuple)):
        parts = [_flatten_batch(b) for b in batch]
        return [t for p in parts for t in p[0]], (type(batch).__name__, [p[1] for p in parts])
    if isinstance(batch, dict):
        keys = sorted(batch)
        parts = [_flatten_batch(batch[k]) for k in keys]
        return [t for p in parts for t in p[0]], ("dict", keys, [p[1] for p in parts])
    raise GuardUsageError(f"audited batches must be tensors or tuples/lists/dicts of tensors, got {type(batch).__name__}; "
                          "or pass batch_for=")


def _rebuild(tensors: list[torch.Tensor], spec: Any) -> Any:
    it = iter(tensors)

    def go(sp: Any) -> Any:
        if sp == "t":
            return next(it)
        if sp[0] == "dict":
            return {k: go(s) for k, s in zip(sp[1], sp[2])}
        seq = [go(s) for s in sp[1]]
        return tuple(seq) if sp[0] == "tuple" else seq

    return go(spec)


def _exchange_batches(mine: list[Any], all_gather: Callable[[torch.Tensor], list[torch.Tensor]],
                      comm: torch.device, device: torch.device) -> list[list[Any]]:
    """Every rank's microbatches of this step, on every rank (shapes may differ between ranks).

    Tensors travel as raw bytes through all-gathers: no pickle, whatever the dtype.
    """
    flat, specs = [], []
    for mb in mine:
        ts, spec = _flatten_batch(mb)
        flat += ts
        specs.append((spec, len(ts)))
    meta = torch.zeros(len(flat), 9, dtype=torch.int64)
    for i, t in enumerate(flat):
        if t.dim() > 8:
            raise GuardUsageError("audited batch tensors may have at most 8 dimensions")
        meta[i, 0] = t.dim()
        meta[i, 1 : 1 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    metas = [m.cpu() for m in all_gather(meta.to(comm))]
    per_rank: list[list[torch.Tensor]] = [[] for _ in metas]
    for i, t in enumerate(flat):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        sizes = [int(torch.Size(m[i, 1 : 1 + int(m[i, 0])].tolist()).numel()) * t.element_size() for m in metas]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=comm)
        padded[: raw.numel()] = raw.to(comm)
        for r, got in enumerate(all_gather(padded)):
            shape = metas[r][i, 1 : 1 + int(metas[r][i, 0])].tolist()
            per_rank[r].append(got[: sizes[r]].to(device).view(t.dtype).reshape(shape))
    out = []
    for tensors in per_rank:
        mbs, pos = [], 0
        for spec, n in specs:
            mbs.append(_rebuild(tensors[pos : pos + n], spec))
            pos += n
        out.append(mbs)
    return out
