"""The checks on FSDP2 and HSDP models: inside FSDP's own collectives every step, and consensus per shard.

FSDP2 reduces gradients without DDP's communication hook. Each FSDP module
reduce-scatters one flat buffer of its local (unsharded) gradients over the
shard group and, with HSDP, all-reduces the reduced shard over the replicate
group. The guard takes part through FSDP's own extension points:
``set_custom_reduce_scatter`` (a :class:`ShardedTap` sees the local
gradients before the reduce-scatter and the reduced shard after it) and
``set_all_reduce_hook`` (the shard after the cross-replica all-reduce). Each
call leaves one small row of projections on the device; ``step()`` gathers
one row per rank, the step's only host synchronisation, and judges:

* ``nonfinite_local``: NaN/Inf in a rank's local gradients before the reduce-scatter;
* ``nonfinite_averaged``: NaN/Inf in a reduced shard although every input was finite;
* ``checksum``: projections are linear, so rank j's reduced shard must project to the mean
  (or sum) over its shard group of the pieces each rank sent to j, and after the all-reduce
  every replica's shard to the mean over the replicas of what they brought. A mismatch names
  the rank whose result is wrong;
* ``consensus`` (every ``consensus_every`` steps and before saves): for each shard index, the
  replicas' exact fingerprints of their local shards of parameters and optimizer state must
  agree; a strict majority (3 or more replica groups) names the odd ones out;
* ``audit`` (every ``audit_every`` steps, before the update): every replica group recomputes the
  microbatches of another, all its shard ranks together, and each rank's local-gradient
  projections and loss must equal those of the rank it recomputed; a third group breaks ties.

What each mesh can conclude is in docs/GUARD.md. ABFT checks each rank's local gradients before the
reduce-scatter (``abft/sharded.py``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ..errors import GuardUsageError
from ..fingerprint import lanes_hex
from ..history import Event
from .boxes import judge as box_votes
from .budget import Stopwatch
from .checksum import sigma_bound
from .consensus import state_lanes, state_tensors
from .nocast import own_precision
from .stats import Projector, Verdict

__all__ = ["MeshView", "ShardedTap", "audit_vector", "check_parameters", "data_parallel_mesh", "fsdp_roots", "judge_audit",
           "judge_state", "judge_step", "rank_steps", "state_row"]


@dataclasses.dataclass(frozen=True)
class MeshView:
    """Global ranks by (replica group, shard index) in each column: ``columns[c][r][s]``.

    A column is one coordinate of the mesh dimensions FSDP does not span (tensor parallel): the data-parallel mesh
    has the same shape in each, and a rank's reduce-scatter group, its replicas and its audit ring stay inside its
    column. Without such dimensions there is one column. A 1-D (pure FSDP) mesh is one replica group."""

    columns: list[list[list[int]]]

    @classmethod
    def of(cls, grids: Sequence[Sequence[int]], shape: Sequence[int]) -> MeshView:
        """From every rank's data-parallel grid (flattened, of ``shape``: 1-D or 2-D): the distinct grids are the
        columns, in order of their first rank."""
        distinct = sorted({tuple(g) for g in grids}, key=min)
        rows, cols = (1, shape[0]) if len(shape) == 1 else (shape[0], shape[1])
        return cls([[list(g[r * cols:(r + 1) * cols]) for r in range(rows)] for g in distinct])

    @property
    def ranks(self) -> list[list[int]]:
        """Every reduce-scatter group (one replica group of one column), in shard order."""
        return [row for col in self.columns for row in col]

    @property
    def replicas(self) -> int:
        return len(self.columns[0])

    @property
    def shards(self) -> int:
        return len(self.columns[0][0])

    @property
    def size(self) -> int:
        return sum(len(row) for row in self.ranks)

    def replica_sets(self) -> list[list[int]]:
        """For every column and shard index, the ranks holding that shard, one per replica group (HSDP's
        all-reduce groups)."""
        return [[col[r][s] for r in range(len(col))] for col in self.columns for s in range(len(col[0]))]

    def shifted(self, rank: int, by: int) -> int:
        """The rank ``by`` places after ``rank`` in the audit ring: the same shard index in another replica
        group (HSDP), or, with one replica group (pure FSDP), the next shard rank, always in ``rank``'s column.
        Audits pair ranks that compute the same full weights from the same all-gather; every rank of one
        data-parallel position (across the columns) audits together, as tensor parallel needs."""
        col, g, j = next((col, g, row.index(rank)) for col in self.columns for g, row in enumerate(col) if rank in row)
        if self.replicas > 1:
            return col[(g + by) % self.replicas][j]
        return col[0][(j + by) % self.shards]

    @property
    def ring(self) -> int:
        """How many distinct ranks the audit ring visits for each rank (replica groups, or shards on 1-D)."""
        return self.replicas if self.replicas > 1 else self.shards


def fsdp_roots(model: torch.nn.Module) -> list[FSDPModule]:
    """The outermost ``fully_shard``-ed modules: the ones whose settings reach every FSDP module below them."""
    inner = {id(m) for r in model.modules() if isinstance(r, FSDPModule) for m in r.modules() if m is not r}
    return [m for m in model.modules() if isinstance(m, FSDPModule) and id(m) not in inner]


def data_parallel_mesh(model: torch.nn.Module) -> DeviceMesh | None:
    """The mesh FSDP shards (and, for HSDP, replicates) over, from its own parameter groups: not the parameters'
    mesh, which also spans tensor-parallel dimensions when the model is parallelised on a larger mesh."""
    meshes: dict[tuple[Any, ...], DeviceMesh] = {}
    for m in model.modules():
        state = m._get_fsdp_state() if isinstance(m, FSDPModule) else None
        info = getattr(getattr(state, "_fsdp_param_group", None), "mesh_info", None)
        mesh = getattr(info, "mesh", None)
        if isinstance(mesh, DeviceMesh):
            meshes[(mesh.ndim, tuple(mesh.mesh.reshape(-1).tolist()))] = mesh
    if len(meshes) > 1:
        raise GuardUsageError("the model's modules are sharded over different meshes; SDCGuard needs one "
                              "data-parallel mesh for the whole model (docs/GUARD.md, 'Sharded models')")
    return next(iter(meshes.values()), None)


def check_parameters(named: Iterable[tuple[str, torch.Tensor]], dp_mesh: DeviceMesh | None) -> None:
    """Refuse what the guard would misread, saying what to do: a parameter FSDP does not manage (its gradient
    would never be reduced, so the replicas drift apart by design), and a data-parallel mesh of more than 2-D."""
    named = list(named)
    plain = [n for n, p in named if not isinstance(p, DTensor)]
    if plain or dp_mesh is None:
        some = ", ".join(plain[:3]) + (f" and {len(plain) - 3} more" if len(plain) > 3 else "")
        raise GuardUsageError(f"parameters {some or 'of the model'} are not sharded by fully_shard: their gradients "
                              "are never reduced; fully_shard the module that holds them (or the root module)")
    if dp_mesh.ndim > 2:
        raise GuardUsageError(f"a {dp_mesh.ndim}-D data-parallel mesh: the guard knows 1-D (FSDP) and 2-D (HSDP, "
                              "replicate x shard) meshes")


class ShardedTap:
    """FSDP's reduce-scatter, with projections of what goes in and out; also its all-reduce hook.

    Rows per reduce-scatter call, float64, ``k`` lanes, ``S`` shards:
    ``[in_proj (S*k), in_norm (S), rs_proj (k), rs_norm, ar_proj (k), ar_norm]``.
    """

    def __init__(self, project: Projector, reduce_scatter: Callable[..., Any], *, two_d: bool,
                 inject: Callable[[str, torch.Tensor], None], watch: Stopwatch | None = None) -> None:
        self.project, self.reduce_scatter, self.two_d, self.inject = project, reduce_scatter, two_d, inject
        # The projections are the guard's per-step work, and the budget's floor; FSDP's collective is not.
        self.watch = watch or Stopwatch()
        self.rows: list[torch.Tensor] = []
        self.modes: list[str | None] = []  # "avg", "sum", or None: a scaled sum whose factor is not known here
        self.paused = False
        self.auditing = False  # recording a recomputation: rows, but no injected faults
        # The buffers FSDP allocated for its next reduction (its input, then its output), and whether it was
        # reduce-scattered: over one shard FSDP only copies the input and all-reduces it across the replicas.
        self._buffers: list[torch.Tensor] = []
        self._scattered = False

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = torch.empty(tuple(size), dtype=dtype, device=device)
        self._buffers = [*self._buffers[-1:], buf]
        self._scattered = False
        return buf

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        if self.paused:
            return self.reduce_scatter(output_tensor, input_tensor, group, op, async_op)
        if not self.auditing:  # a recomputation reproduces the computation, not the reduction's faults
            self.inject("grad", input_tensor)
        self._scattered = True
        t0 = time.perf_counter()
        pieces = input_tensor.view(group.size(), -1)
        with own_precision():  # a backward the caller runs under autocast: the checks' sums stay float32
            before = [self.project(p) for p in pieces] + [_norms(pieces)]
        t1 = time.perf_counter()
        work = self.reduce_scatter(output_tensor, input_tensor, group, op, False)
        t2 = time.perf_counter()
        if not self.two_d and not self.auditing:
            self.inject("allreduce", output_tensor)  # no all-reduce follows: the reduced shard is the result
        name = str(op).rsplit(".", 1)[-1].lower()
        self.modes.append(name if name in ("avg", "sum") else None)
        after = self._stats(output_tensor)
        self.rows.append(torch.cat([*before, after, after]))  # the all-reduce hook replaces the last part
        if not self.auditing:  # an audit's whole time is the audit's
            self.watch.floor += (t1 - t0) + (time.perf_counter() - t2)
        return work

    def after_all_reduce(self, output: torch.Tensor) -> None:
        """FSDP's all-reduce hook: the shard after the cross-replica all-reduce (after the reduce-scatter on 1-D)."""
        if self.paused:
            self._buffers = []  # a pass not checked (shape inference, a replay): its buffers are no reduction's
            return
        if self.two_d and not self._scattered and len(self._buffers) == 2:
            self._unscattered(self._buffers[0])
        self._buffers = []
        if not self.rows:
            return
        if self.two_d and not self.auditing:
            self.inject("allreduce", output)
        t0 = time.perf_counter()
        k = self.project.k + 1
        self.rows[-1] = torch.cat([self.rows[-1][:-k], self._stats(output)])
        if not self.auditing:
            self.watch.floor += time.perf_counter() - t0

    def _unscattered(self, local: torch.Tensor) -> None:
        """The row of a reduction over one shard (HSDP with one shard per replica group, which is how FSDP2
        replicates): its input is the local gradient, copied as it is into the shard the replicas then all-reduce.
        FSDP averages float32 and bfloat16 in the all-reduce itself, and other dtypes by a sum of inputs it has
        already divided (``_get_gradient_divide_factors``; a custom ``set_gradient_divide_factor`` is not seen)."""
        t0 = time.perf_counter()
        stats = self._stats(local)
        self.rows.append(torch.cat([stats, stats, stats]))  # in (one shard), reduce-scattered, all-reduced (replaced)
        self.modes.append("avg" if local.dtype in (torch.float32, torch.bfloat16) else "sum")
        if not self.auditing:
            self.watch.floor += time.perf_counter() - t0

    def _stats(self, x: torch.Tensor) -> torch.Tensor:
        with own_precision():  # FSDP's hooks run in the backward, which a caller may run under autocast
            return torch.cat([self.project(x), torch.linalg.vector_norm(x.float(), dtype=torch.float64).view(1)])

    def reset(self) -> None:
        self.rows, self.modes = [], []


def _norms(pieces: torch.Tensor) -> torch.Tensor:
    norms: torch.Tensor = torch.linalg.vector_norm(pieces.float(), dim=1, dtype=torch.float64)
    return norms


@dataclasses.dataclass(frozen=True)
class _Call:
    """One reduce-scatter call's row on one rank, split."""

    in_proj: list[list[float]]  # per destination shard, k lanes
    in_norm: list[float]
    rs_proj: list[float]
    rs_norm: float
    ar_proj: list[float]
    ar_norm: float


def _row_width(shards: int, k: int) -> int:
    """Values per reduce-scatter call in a rank's row (see :class:`ShardedTap`)."""
    return shards * (k + 1) + 2 * (k + 1)


def _split(row: Sequence[float], shards: int, k: int) -> _Call:
    ins = [list(row[j * k:(j + 1) * k]) for j in range(shards)]
    at = shards * k
    norms = list(row[at:at + shards])
    at += shards
    return _Call(ins, norms, list(row[at:at + k]), row[at + k], list(row[at + k + 1:at + 2 * k + 1]), row[at + 2 * k + 1])


def judge_step(step: int, rows: Sequence[Sequence[float]], view: MeshView, modes: Sequence[str | None], k: int,
               eps: float, slack: float, rms_weight: float) -> list[Verdict]:
    """The per-step verdicts over every rank's gathered row (the calls' rows, concatenated)."""
    width = _row_width(view.shards, k)
    calls = [[_split(r[c * width:(c + 1) * width], view.shards, k) for c in range(len(modes))] for r in rows]
    world = len(rows)
    bad_local = [r for r, cs in enumerate(calls) if not all(math.isfinite(v) for c in cs for p in c.in_proj for v in p)]
    if bad_local:
        return [Verdict("nonfinite_local", False, bad_local, "NaN/Inf in local gradients before the reduce-scatter")]
    bad_avg = [r for r, cs in enumerate(calls) if not all(math.isfinite(v) for c in cs for v in c.rs_proj + c.ar_proj)]
    if bad_avg:
        named = bad_avg if len(bad_avg) < world else []
        return [Verdict("nonfinite_local", True), Verdict(
            "nonfinite_averaged", False, named, "NaN/Inf in reduced gradient shards although every local gradient "
            "was finite")]
    suspects: set[int] = set()
    worst = 0.0
    for c, mode in enumerate(modes):
        for group in view.ranks:  # the reduce-scatter within each replica group
            for j, dest in enumerate(group):
                if mode is None:
                    continue
                n = len(group) if mode == "avg" else 1
                parts = [calls[r][c].in_proj[j] for r in group]
                m = sum(calls[r][c].in_norm[j] for r in group) / n
                b = sigma_bound(m, len(group), eps, slack, rms_weight)
                d = _deviation(parts, calls[dest][c].rs_proj, n)
                worst = max(worst, d / b)
                if d > b:
                    suspects.add(dest)
        if view.replicas > 1 and mode is not None:
            for members in view.replica_sets():  # the all-reduce across replica groups
                n = len(members) if mode == "avg" else 1
                parts = [calls[r][c].rs_proj for r in members]
                m = sum(calls[r][c].rs_norm for r in members) / n
                b = sigma_bound(m, len(members), eps, slack, rms_weight)
                for r in members:
                    d = _deviation(parts, calls[r][c].ar_proj, n)
                    worst = max(worst, d / b)
                    if d > b:
                        suspects.add(r)
    fine = [Verdict("nonfinite_local", True), Verdict("nonfinite_averaged", True)]
    if not suspects:
        return [*fine, Verdict("checksum", True, margin=worst)]
    named = sorted(suspects) if len(suspects) < world else []
    return [*fine, Verdict("checksum", False, named, "reduced gradient shards do not match the local gradients "
                           f"(worst deviation {worst:.3g} of the bound)")]


def _deviation(parts: Sequence[Sequence[float]], actual: Sequence[float], n: int) -> float:
    expected = [sum(p[i] for p in parts) / n for i in range(len(actual))]
    d = max((abs(a - e) for a, e in zip(actual, expected, strict=True)), default=0.0)
    return d if math.isfinite(d) else math.inf


def state_row(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, device: torch.device) -> torch.Tensor:
    """This rank's local shards of parameters and optimizer state: exact lanes, then a non-finite count."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in state_tensors(params, optimizer)]
    floats = [t for t in local if t.is_floating_point() and t.numel()]
    bad = (~torch.stack([t.sum(dtype=torch.float64) for t in floats]).isfinite()).sum() if floats else \
        torch.zeros((), dtype=torch.int64, device=device)
    return torch.cat([state_lanes(local, device), bad.to(torch.int64).to(device).view(1)])


def judge_state(step: int, rows: Sequence[Sequence[int]], boxes: Sequence[Sequence[Sequence[int]]],
                first_suspect: int) -> tuple[list[Verdict], list[str]]:
    """Consensus per box (``boxes.judge``: ranks holding the same piece of the state must hold the same bytes) over
    every rank's ``(key, lanes)`` rows; NaN/Inf from each rank's state row; every rank's fingerprint as hex."""
    world = len(rows)
    bad = [r for r in range(world) if rows[r][2]]
    nonfinite = Verdict("nonfinite_state", True) if not bad else Verdict(
        "nonfinite_state", False, bad if len(bad) < world else [],
        f"NaN/Inf in the parameter or optimizer-state shards of rank(s) {bad}", first_suspect)
    fps = [lanes_hex((rows[r][0], rows[r][1])) for r in range(world)]
    votes = box_votes(boxes)
    suspects = votes.suspects
    held: dict[int, int] = {}
    for mine in boxes:
        for key, *_ in mine:
            if key != -1:
                held[key] = held.get(key, 0) + 1
    # The replicas this vote compared: the fewest holders of any piece. Pure FSDP holds each piece once, so its
    # votes compare no replica (a step count every rank holds is no replica of the state): the ledger says so.
    replicas = min(held.values(), default=0)

    def ledger() -> list[Event]:
        return [Event(step, "consensus", r, "fail" if r in suspects else "pass", (rows[r][0], rows[r][1]),
                      loss=float(replicas)) for r in range(world)]

    if votes.agree:
        return [nonfinite, Verdict("consensus", True, rows=ledger)], fps
    detail = votes.detail() + " (" + ", ".join(f"rank {r} {fps[r][:12]}" for r in range(world)) + ")"
    software = not suspects and votes.every_copy_differs > 0
    return [nonfinite, Verdict("consensus", False, suspects, detail, first_suspect, ledger, software=software)], fps


@dataclasses.dataclass(frozen=True)
class RankStep:
    """One rank's step as the ledger shows it (``stats.step_rows``): no exact lanes are taken on sharded layouts."""

    loss: float
    norm: float
    lanes: tuple[int, int] = (0, 0)


def rank_steps(rows: Sequence[Sequence[float]], calls: int, shards: int, k: int) -> list[RankStep]:
    """Every rank's loss and local gradient norm from its gathered row (the calls' rows, then the loss)."""
    out = []
    for row in rows:
        loss, _, norms = audit_vector(row, calls, shards, k)
        out.append(RankStep(loss, math.sqrt(sum(n * n for n in norms))))
    return out


def audit_vector(row: Sequence[float], calls: int, shards: int, k: int) -> tuple[float, list[float], list[float]]:
    """(loss, the local-gradient projections, their norms) of one rank's gathered row (calls' rows, then the loss)."""
    width = _row_width(shards, k)
    proj: list[float] = []
    norms: list[float] = []
    for c in range(calls):
        part = _split(row[c * width:(c + 1) * width], shards, k)
        proj += [v for p in part.in_proj for v in p]
        norms += part.in_norm
    return row[calls * width], proj, norms


def judge_audit(step: int, owner: Sequence[tuple[float, list[float], list[float]]],
                first: Sequence[tuple[float, list[float], list[float]]],
                second: Sequence[tuple[float, list[float], list[float]]] | None, view: MeshView, *, exact: bool,
                rtol: float, rms_weight: float, first_suspect: int) -> tuple[Verdict, list[int]]:
    """Each rank recomputed the microbatches of the rank one place before it in the audit ring (``first``;
    ``MeshView.shifted``), and on a mismatch of the rank two places before (``second``, the tiebreak).
    Returns the verdict and the owners whose recomputation differed.

    Every rank of the auditing group recomputes the rank at its own shard index: the same
    all-gathered weights, the same microbatches and random state, so in exact mode the loss and the
    projections of the local gradients must be equal bit for bit.
    """
    def same(a: tuple[float, list[float], list[float]], b: tuple[float, list[float], list[float]]) -> bool:
        if exact:
            return a[0] == b[0] and a[1] == b[1]
        scale = [rms_weight * n for n in b[2] for _ in range(len(b[1]) // max(len(b[2]), 1))]
        return math.isclose(a[0], b[0], rel_tol=rtol) and all(
            abs(x - y) <= rtol * (abs(y) + z) for x, y, z in zip(a[1], b[1], scale, strict=False))

    def auditor(o: int, back: int) -> int:
        return view.shifted(o, back)

    differ = [o for row in view.ranks for o in row if not same(owner[o], first[auditor(o, 1)])]

    def rows(failed: Sequence[int]) -> Callable[[], list[Event]]:
        # One row per audited rank: the loss its auditor recomputed (no exact lanes on sharded layouts).
        return lambda: [Event(step, "audit", o, "fail" if o in failed else "pass", (0, 0), first[auditor(o, 1)][0])
                        for row in view.ranks for o in row]

    if not differ:
        return Verdict("audit", True, rows=rows([])), []
    if second is None:
        return Verdict("audit", False, [], f"the recomputation of rank(s) {differ}'s microbatches by another rank "
                       "differs; with two in the audit ring there is no third to tell which is wrong",
                       first_suspect, rows(differ)), differ
    named: set[int] = set()
    for o in differ:
        a1, a2 = auditor(o, 1), auditor(o, 2)
        if same(first[a1], second[a2]):
            named.add(o)  # two other groups agree on what o should have computed
        elif same(owner[o], second[a2]):
            named.add(a1)  # the third group reproduces o: its first auditor computed wrongly
    detail = (f"recomputing rank(s) {differ}'s microbatches on other replica groups gave other gradients or loss"
              + (f"; the third replica group names rank(s) {sorted(named)}" if named else "; no majority"))
    return Verdict("audit", False, sorted(named), detail, first_suspect, rows(differ)), differ
