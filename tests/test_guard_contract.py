"""The guard's contract, the same behaviours on every layout (as ``store_contract.py`` is for stores): DDP, FSDP2,
HSDP, FSDP2 + tensor parallel and a pipeline (2 stages of 2 replicas, ``ScheduleGPipe``), on 4 gloo ranks in one
launch, each at the defaults but where a behaviour needs a fault or an audit schedule:

- a clean run through the framework path (``begin`` / ``backward_of``, two microbatches a step; under the
  pipeline, ``pipeline_step`` over two microbatches) raises nothing;
- a wrong reduced gradient on rank 1 is caught at its step, naming rank 1, and the update is withheld (the state
  after the failed step is the state before it, bit for bit);
- audits leave no trace (with dropout, an audit every step ends bit-identical to no audits);
- the ledger gets the same rows on every layout: a step row per rank per step.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

pytestmark = pytest.mark.timeout(300)

LAYOUTS = ("ddp", "fsdp", "hsdp", "fsdp+tp", "pipeline")


def model(layout: str) -> tuple[torch.nn.Module, int]:
    """The same MLP (two Linears, dropout, a LayerNorm, a head) on ``layout``, and this rank's data-parallel index."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.Dropout(0.1),
                            torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    rank = dist.get_rank()
    if layout == "ddp":
        return DDP(m), rank
    if layout == "pipeline":  # stage 0 holds the first Linear (ranks 0, 1), stage 1 the rest (ranks 2, 3)
        mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "rep", "shard"))
        stage = m[0:2] if mesh.get_local_rank("pp") == 0 else m[2:6]  # the Sequential's names kept
        for layer in stage:
            if list(layer.parameters()):
                fully_shard(layer, mesh=mesh["rep", "shard"])
        fully_shard(stage, mesh=mesh["rep", "shard"])
        return stage, mesh.get_local_rank("rep")
    shape, names = {"fsdp": ((4,), ("dp",)), "hsdp": ((2, 2), ("rep", "dp")), "fsdp+tp": ((2, 2), ("dp", "tp"))}[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp = mesh if layout != "fsdp+tp" else mesh["dp"]
    if layout == "fsdp+tp":
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for i in (0, 2, 4, 5):
        fully_shard(m[i], mesh=dp)
    fully_shard(m, mesh=dp)
    return m, rank // 2 if layout == "fsdp+tp" else rank


def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
    return m(b).square().mean()


def full(m: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[float]]:
    def whole(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()
    out = [whole(p) for p in m.parameters()]
    out += [whole(v) for p in m.parameters() for _, v in sorted(opt.state[p].items()) if v.dim()]
    return [t.reshape(-1).tolist() for t in out]


def run(layout: str, faults: list[str], steps: int = 3, **cfg: object) -> dict:
    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    m, replica = model(layout)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    schedule = pipeline_schedule(m) if layout == "pipeline" else None
    guard = SDCGuard(m, opt, None if schedule else loss_fn, GuardConfig(faults=faults, **cfg),  # type: ignore[arg-type]
                     pipeline=schedule)
    from verified_ckpt.guard.protocol import Layout

    assert isinstance(guard.layout, Layout), f"{layout}: {type(guard.layout).__name__} does not satisfy Layout"
    rows: list[tuple[int, int]] = []
    guard.add_event_listener(lambda events: rows.extend((e.step, e.rank) for e in events if e.kind == "step"))
    torch.manual_seed(7)  # the same dropout stream on every rank (tensor-parallel ranks must agree)
    before = None
    try:
        for step in range(steps):
            before = full(m, opt)
            if schedule is not None:  # the schedule runs both microbatches: inputs on the first stage, target on the last
                x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * step + replica))
                first = schedule._stage.is_first
                guard.pipeline_step(*([x] if first else []), step=step, target=None if first else torch.zeros(8, 1))
            for i in range(0 if schedule is not None else 2):  # the framework path: it runs the forward itself
                mb = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + 10 * i + replica))
                guard.begin(mb, step=step)
                no_sync = getattr(m, "no_sync", None)
                with no_sync() if (no_sync is not None and i == 0) else torch.enable_grad():
                    guard.backward_of(loss_fn(m, mb), sync=i == 1)
            guard.step()
            opt.zero_grad()
    except SilentCorruptionDetected as e:
        return {"caught": [e.incident.kind, e.incident.ranks, e.incident.detected_step], "withheld": full(m, opt) == before}
    return {"final": full(m, opt), "failed": sum(c.failed for c in guard.counters().values()), "rows": sorted(set(rows))}


def pipeline_schedule(stage: torch.nn.Module) -> object:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "rep", "shard"))  # as ``model`` made it
    return ScheduleGPipe(PipelineStage(stage, mesh.get_local_rank("pp"), 2, torch.device("cpu"),
                                       group=mesh["pp"].get_group()), n_microbatches=2,
                         loss_fn=lambda y, _: y.square().mean())


def contract(rank: int, world: int) -> dict:
    import warnings

    warnings.simplefilter("ignore")
    out = {}
    for layout in LAYOUTS:
        # Both clean runs are the framework path; the defaults' own schedule runs in the fault run until its fault.
        audited, plain = run(layout, [], audit_every=1), run(layout, [], audit_every=None)
        out[layout] = {"clean failed": audited["failed"] + plain["failed"], "rows": plain["rows"],
                       "fault": run(layout, ["allreduce:1:2:elem=10"]),
                       "audits leave no trace": audited["final"] == plain["final"]}
    return out


def test_every_layout_keeps_the_guards_contract():
    got = run_ranks(contract, 4, timeout=280, retire=True)
    assert all(r == got[0] for r in got), "every rank reaches the same verdict"
    for layout in LAYOUTS:
        s = got[0][layout]
        assert s["clean failed"] == 0, (layout, s)
        assert s["rows"] == [[step, r] for step in range(3) for r in range(4)], (layout, s["rows"])
        assert s["fault"] == {"caught": ["checksum", [1], 2], "withheld": True}, (layout, s["fault"])
        assert s["audits leave no trace"], layout
