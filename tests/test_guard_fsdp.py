"""SDCGuard on FSDP2/HSDP models, on real gloo ranks: every injected fault class caught, naming the rank; no false alarms."""

from __future__ import annotations

import itertools

import pytest
import torch
from dist_harness import run_ranks

pytestmark = pytest.mark.timeout(300)

WIDTHS = [16, 24, 15, 8]


def build(mesh_shape: tuple[int, ...], dropout: float = 0.0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(WIDTHS)]
    if dropout:
        layers.insert(1, torch.nn.Dropout(dropout))
    model = torch.nn.Sequential(*layers)
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).square().mean()


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(8, WIDTHS[0], generator=torch.Generator().manual_seed(1000 * step + rank))


def train_until_incident(rank: int, mesh: tuple[int, ...], faults: list[str], steps: int, dropout: float = 0.0,
                         **cfg) -> dict | None:
    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    model, opt = build(mesh, dropout)
    torch.manual_seed(100 + rank)  # each rank its own dropout stream
    guard = SDCGuard(model, opt, loss_fn, GuardConfig(faults=faults, consensus_every=5, **cfg))
    assert guard.layout.kind == "sharded"
    for step in range(steps):
        try:
            guard.backward(batch(rank, step), step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            return {"kind": e.incident.kind, "ranks": e.incident.ranks, "step": step,
                    "hosts": [h.host for h in e.incident.hosts]}
        opt.zero_grad()
    final = [t.tolist() for t in consolidated(model, opt)]
    return {"clean": steps, "checks": {k: c.passed for k, c in guard.counters().items()}, "final": final}


CASES = {
    # An Inf takes the NaN's path (isfinite); a reduced shard x10 is the contract suite's, on HSDP 2x2 and FSDP 4;
    # a wrong local gradient found by an audit takes the persistent compute fault's path.
    "local gradient NaN on rank 3": ("grad:3:4:nan", "nonfinite_local", [3], 4),
    "one rank's all-reduced shard, exponent flip (rank 2)": ("allreduce:2:3:bitflip=27", "checksum", [2], 3),
    # A change at rest is named at the next step by the holder's own at-rest chain (issue 48, finding 7); one that
    # lands right before a consensus (after step 5's update) is that consensus's.
    "a weight flip on rank 5's shard": ("weights:5:3:bitflip=22", "chain", [5], 4),
    "an inf in rank 0's optimizer state": ("optim:0:5:inf", "nonfinite_state", [0], 5),
    "a persistent compute fault on rank 2": ("compute:2:3-:scale=1.5", "audit", [2], 4),
}


def hsdp_campaign(rank: int, world: int, run: str) -> dict:
    """Every fault class on HSDP 3 x 2 and pure FSDP 6, a clean run, and the rollback story (one 6-rank launch)."""
    warnings_off()
    out = {name: train_until_incident(rank, (3, 2), [spec], 6, audit_every=4) for name, (spec, *_) in CASES.items()}
    out["replica group 1 computes wrongly"] = train_until_incident(
        rank, (3, 2), ["compute:2:3-:scale=1.5", "compute:3:3-:scale=1.5"], 6, audit_every=4)
    out["clean"] = train_until_incident(rank, (3, 2), [], 10, audit_every=5)
    out["fsdp compute"] = train_until_incident(rank, (6,), ["compute:2:3-:scale=1.5"], 6, audit_every=4)
    out["story clean"] = rollback_story(rank, world, f"{run}-clean", [])
    out["story faulty"] = rollback_story(rank, world, f"{run}-faulty", ["weights:4:5:bitflip=22"])
    return out


def warnings_off() -> None:
    import warnings

    warnings.simplefilter("ignore")


def test_hsdp_catches_every_fault_class_naming_the_rank_stays_quiet_and_rolls_back_bit_identical(tmp_path):
    results = run_ranks(hsdp_campaign, 6, str(tmp_path / "run"), timeout=280)
    got = results[0]
    for r in results:  # every rank reaches the same verdict (the full state is rank 0's alone)
        assert {k: v for k, v in r.items() if not k.startswith("story")} == {
            k: v for k, v in got.items() if not k.startswith("story")}
        assert r["story faulty"]["incidents"] == got["story faulty"]["incidents"]
    for name, (_, kind, ranks, step) in CASES.items():
        assert (got[name]["kind"], got[name]["ranks"], got[name]["step"]) == (kind, ranks, step), (name, got[name])
        assert len(got[name]["hosts"]) == len(ranks)
    assert got["clean"]["clean"] == 10 and got["clean"]["checks"]["checksum"] == 10, got["clean"]
    assert got["clean"]["checks"]["consensus"] == 2 and got["clean"]["checks"]["audit"] == 2
    group = got["replica group 1 computes wrongly"]
    assert (group["kind"], group["ranks"], group["step"]) == ("audit", [2, 3], 4)
    assert (got["fsdp compute"]["kind"], got["fsdp compute"]["ranks"], got["fsdp compute"]["step"]) == ("audit", [2], 4)
    clean, faulty = got["story clean"], got["story faulty"]
    assert clean["incidents"] == [] and clean["statuses"] == ["restorable"] * 3
    # Rows reach the ledger with each save: steps 0-8 by the last save (step 8), audits every 2 steps.
    assert clean["ledger"] == {"step": 9, "audit": 5, "losses": 9}, clean["ledger"]
    assert faulty["incidents"] == [["chain", [4], 6]]  # flipped after step 5's update: rank 4's own chain at step 6
    assert faulty["rollbacks"] == [4]  # step 4 predates the suspect interval (5, 6]
    assert faulty["full"] == clean["full"]  # bit for bit (float lists compare exactly)


def consolidated(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Full parameters, then full optimizer moments, in a fixed order (collective)."""
    out = [p.full_tensor() for p in model.parameters()]
    for p in model.parameters():
        out += [v.full_tensor() if hasattr(v, "full_tensor") else v for _, v in sorted(opt.state[p].items())]
    return out


def rollback_story(rank: int, world: int, run: str, faults: list[str]) -> dict:
    """Train 12 steps saving every 4; on an incident roll back and carry on (the rollback demo's story)."""
    from verified_ckpt import CheckpointManager, GuardConfig, SDCGuard, SilentCorruptionDetected

    warnings_off()
    model, opt = build((3, 2))
    guard = SDCGuard(model, opt, loss_fn, GuardConfig(faults=faults, consensus_every=2, audit_every=2))
    mgr = CheckpointManager(run, guard=guard)
    state = {"model": model, "optim": opt}
    step, incidents, rollbacks = 0, [], []
    while step < 12:
        try:
            guard.backward(batch(rank, step), step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            incidents.append((e.incident.kind, e.incident.ranks, step))
            target = mgr.rollback(state)
            rollbacks.append(target.step)
            step = target.step + 1
            continue
        opt.zero_grad()
        if step % 4 == 0:
            mgr.save(step, state)
        step += 1
    full = consolidated(model, opt)
    ledger = None
    if rank == 0:  # the same ledger rows as a DDP run: a step row per rank, audit rows, a loss curve
        counts = mgr.ledger_summary()["counts"]
        series = mgr.history_report()["steps"]
        ledger = {"step": counts["step"]["checks"], "audit": counts["audit"]["checks"],
                  "losses": sum(x is not None for x in series.get("loss", []))}
    return {"incidents": incidents, "rollbacks": rollbacks, "ledger": ledger,
            "statuses": [i.status.value for i in mgr.list()] if rank == 0 else None,
            "full": [t.tolist() for t in full] if rank == 0 else None}


def test_the_fsdp_example_refuses_a_malformed_mesh_before_any_rank_starts():
    """The example's training runs in-process in the TP recovery story below; its command line shares the DDP
    example's launcher and JSON line (tests/test_guard_dist.py runs that under torchrun)."""
    import os
    import subprocess
    import sys

    import fsdp_train

    script = os.path.join(os.path.dirname(fsdp_train.__file__), "fsdp_train.py")
    bad = subprocess.run([sys.executable, script, "--mesh", "3y2"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert bad.returncode == 2 and "--mesh must look like 3x2" in bad.stderr
    assert bad.stdout == ""


class Wrapper(torch.nn.Module):
    """A framework's module around the sharded one (Lightning's ``ModelParallelStrategy``: ``fully_shard`` applied
    to modules inside the ``LightningModule``, never to the ``LightningModule`` itself)."""

    def __init__(self, net: torch.nn.Module, extra: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.net, self.extra = net, extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x if self.extra is None else self.extra(x))


def framework_loop(rank: int, faults: list[str], steps: int) -> dict:
    """begin/backward_of as a framework calls them (it runs the forward itself), two microbatches a step."""
    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    net, _ = build((3,))
    model = Wrapper(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = SDCGuard(model, opt, loss_fn, GuardConfig(faults=faults))
    out: dict = {"layout": guard.layout.kind, "targets": guard.targets}
    try:
        for step in range(steps):
            for i in range(2):
                mb = batch(rank, 10 * step + i)
                guard.begin(mb, step=step)
                guard.backward_of(loss_fn(model, mb), sync=i == 1)
            guard.step()
            opt.zero_grad()
        out["audit_now"] = guard.audit_now()  # a save's fresh audit, on the sharded layout
    except SilentCorruptionDetected as e:
        out["caught"] = [e.incident.kind, e.incident.ranks, e.incident.detected_step]
    out["checks"] = {k: c.passed for k, c in guard.counters().items()}
    return out


def refusals(rank: int) -> dict:
    """A layout the guard would misread is refused at construction, saying what to do."""
    from verified_ckpt import SDCGuard
    from verified_ckpt.errors import GuardUsageError

    def refused(model: torch.nn.Module) -> str:
        try:
            SDCGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
        except GuardUsageError as e:
            return str(e)
        return "accepted"

    net, _ = build((3,))
    return {"unsharded": refused(Wrapper(net, torch.nn.Linear(WIDTHS[0], WIDTHS[0])))}


def sharded_framework_story(rank: int, world: int) -> dict:
    warnings_off()
    return {"clean": framework_loop(rank, [], 4), "fault": framework_loop(rank, ["allreduce:1:2:elem=10"], 4),
            "compute": framework_loop(rank, ["compute:2:3-:scale=1.5"], 4), "refused": refusals(rank)}


def test_the_framework_path_runs_on_a_sharded_model_inside_a_wrapper_and_an_unsharded_parameter_is_refused():
    got = run_ranks(sharded_framework_story, 3, timeout=200)
    assert all(r == got[0] for r in got), "every rank reaches the same verdict"
    clean, fault, compute, refused = (got[0][k] for k in ("clean", "fault", "compute", "refused"))
    assert clean["layout"] == "sharded" and clean["targets"] == [2, 0, 1] and clean["audit_now"] is True
    assert clean["checks"]["checksum"] == 4 and clean["checks"]["audit"] >= 2, clean  # the budget's, then audit_now
    assert fault["caught"] == ["checksum", [1], 2]
    # A compute fault from step 3, the last, on: the budget's audit at that step or, after it, the save's fresh
    # audit (audit_now) recomputes and names the rank, for step 3 either way.
    assert compute["caught"] == ["audit", [2], 3], compute
    assert refused["unsharded"].startswith("parameters extra.weight, extra.bias are not sharded by fully_shard")


def tp_model(mesh: object, dropout: float) -> torch.nn.Module:
    """A small MLP on a (dp, tp) mesh as torchtitan builds one: a colwise and a rowwise Linear on ``tp``, a
    LayerNorm and a head replicated across ``tp``, then ``fully_shard`` over ``dp``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.Dropout(dropout),
                            torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})  # type: ignore[index]
    for i in (0, 2, 4, 5):
        fully_shard(m[i], mesh=mesh["dp"])  # type: ignore[index]
    fully_shard(m, mesh=mesh["dp"])  # type: ignore[index]
    return m


def tp_run(rank: int, shape: tuple[int, int], faults: list[str], flips: dict[int, int], dropout: float = 0.0,
           steps: int = 6) -> dict:
    """Train on a (dp, tp) mesh; ``flips``: rank -> bit flipped in its copy of the LayerNorm weight after step 1
    (the evaluator's own injection: a TP-replicated parameter drifting on some TP ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    dp = mesh.get_coordinate()[0]
    m = tp_model(mesh, dropout)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    guard = SDCGuard(m, opt, loss_fn, GuardConfig(faults=faults, consensus_every=2))
    try:
        for step in range(steps):
            guard.backward(torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + dp)), step=step)
            guard.step()
            opt.zero_grad()
            if step == 1 and rank in flips:
                with torch.no_grad():
                    m[4].weight.to_local().view(-1).view(torch.int32)[0] ^= 1 << flips[rank]
    except SilentCorruptionDetected as e:
        return {"caught": [e.incident.kind, e.incident.ranks, e.incident.detected_step], "detail": e.incident.detail}
    return {"checks": {k: c.passed for k, c in guard.counters().items()}}


def full_state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> list[list[float]]:
    """Every parameter and optimizer moment as a full tensor, in a fixed order (collective)."""
    out = [p.full_tensor() for p in m.parameters()]
    out += [v.full_tensor() for p in m.parameters() for _, v in sorted(opt.state[p].items()) if v.dim()]
    return [t.reshape(-1).tolist() for t in out]


def tp_reshard(rank: int, run: str) -> dict:
    """Save a 2x2 FSDP2 + TP job, restore it onto 2x2, 1x4 (all TP) and 4x1 (all FSDP): the full state, bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from verified_ckpt import CheckpointManager, GuardConfig, SDCGuard

    def job(shape: tuple[int, int] | None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        if shape is None:  # no tensor parallel: the same model, fully_shard over all four ranks
            torch.manual_seed(0)
            m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.Dropout(0.0),
                                    torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
            mesh4 = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
            for i in (0, 2, 4, 5):
                fully_shard(m[i], mesh=mesh4)
            fully_shard(m, mesh=mesh4)
        else:
            m = tp_model(init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp")), 0.0)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(torch.zeros(1, 8)).sum().backward()  # optimizer state to restore into, then zeroed by the restore
        opt.step()
        opt.zero_grad()
        return m, opt

    m, opt = job((2, 2))
    dp = rank // 2
    guard = SDCGuard(m, opt, loss_fn, GuardConfig())
    mgr = CheckpointManager(run, guard=guard)
    for step in range(3):
        guard.backward(torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + dp)), step=step)
        guard.step()
        opt.zero_grad()
    mgr.save(2, {"model": m, "optim": opt})
    saved = full_state(m, opt)
    out = {"status": mgr.list()[0].status.value, "saved": saved if rank == 0 else None}
    for name, shape in (("2x2", (2, 2)), ("1x4", (1, 4)), ("4x1", None)):
        m2, opt2 = job(shape)
        CheckpointManager(run).restore({"model": m2, "optim": opt2}, step=2)  # restorable: no allow_unverified
        out[name] = full_state(m2, opt2) == saved
    return out


def tp_recovery(rank: int, world: int, run: str) -> dict:
    """The example's TinyGPT on replicate 2 x tp 2 (``fsdp_train.py --mesh 2x1 --tp 2``, dropout on) saving every 4
    steps: clean; a wrong reduced gradient at step 6 rolled back in process; the same fault stopping the run, then
    a resume into fresh objects."""
    import fsdp_train

    def go(name: str, *extra: str) -> dict:
        args = fsdp_train.parse(["--mesh", "2x1", "--tp", "2", "--steps", "8", "--save-every", "4", "--run",
                                 f"{run}-{name}", *extra])
        out = fsdp_train.train(rank, world, args)
        return {"fingerprint": out["fingerprint"], "completed": out["completed"], "rollbacks": out["rollbacks"],
                "incidents": [[i["kind"], i["ranks"], i["detected_step"]] for i in out["incidents"]]}

    fault = ("--inject", "allreduce:1:6:elem=10")
    return {"clean": go("clean"), "rolled back": go("rolled", *fault, "--on-incident", "rollback"),
            "stopped": go("stopped", *fault), "resumed": go("stopped", "--resume")}


def tp_story(rank: int, world: int, run: str) -> dict:
    warnings_off()
    return {"reshard": tp_reshard(rank, run), "recovery": tp_recovery(rank, world, run),
            "clean": tp_run(rank, (2, 2), [], {}, dropout=0.1),
            "two copies": tp_run(rank, (2, 2), [], {1: 22}), "both copies": tp_run(rank, (2, 2), [], {0: 20, 1: 21}),
            "one of four": tp_run(rank, (1, 4), [], {2: 22}),
            "every copy": tp_run(rank, (1, 4), [], {0: 20, 1: 21, 2: 22, 3: 23})}


def test_fsdp2_with_tensor_parallel_on_2x2_and_1x4_meshes_compares_only_what_is_replicated(tmp_path):
    from verified_ckpt import CheckpointManager

    run = str(tmp_path / "tp")
    got = run_ranks(tp_story, 4, run, timeout=200, retire=True)
    saved = [r["reshard"].pop("saved") for r in got][0]  # rank 0's full state after the save
    assert all(r == got[0] for r in got), "every rank reaches the same verdict"
    s = got[0]
    # Tensor-parallel shards are never compared as replicas (the old mesh reading took (dp, tp) for HSDP).
    assert s["clean"]["checks"]["checksum"] == 6 and s["clean"]["checks"]["consensus"] == 3, s["clean"]
    # The LayerNorm weight is replicated across the TP ranks: its drift is caught at the next step (step 2). One
    # copy changed at rest is named by its holder's own at-rest chain (its bytes no longer match what its optimizer
    # wrote; issue 48, finding 7); when several changed at once the consensus decides per piece with the chains'
    # flags: both copies changed, or four different ones, are software divergence.
    assert s["two copies"]["caught"] == ["chain", [1], 2] and "changed at rest" in s["two copies"]["detail"]
    assert s["both copies"]["caught"] == ["consensus", [], 2] and "software divergence" in s["both copies"]["detail"]
    assert s["one of four"]["caught"] == ["chain", [2], 2]
    assert s["every copy"]["caught"] == ["consensus", [], 2] and "software divergence" in s["every copy"]["detail"]
    # With two replicas of every piece (replicate 2 x tp 2) saves are restorable: a fault is named at its step, and
    # both the in-process rollback and a stop then resume end bit-identical to the clean run.
    rec = s["recovery"]
    assert rec["clean"]["completed"] and rec["clean"]["incidents"] == [], rec["clean"]
    assert rec["rolled back"]["incidents"] == [["checksum", [1], 6]] and rec["rolled back"]["rollbacks"] == [
        {"from_step": 6, "to_step": 4}], rec["rolled back"]
    assert rec["stopped"]["incidents"] == [["checksum", [1], 6]] and not rec["stopped"]["completed"]
    assert rec["clean"]["fingerprint"] == rec["rolled back"]["fingerprint"] == rec["resumed"]["fingerprint"], rec
    assert [c.status.value for c in CheckpointManager(run + "-clean").list()] == ["restorable", "restorable"]
    # _StridedShard and TP-sharded tensors are saved chunk by chunk and restore bitwise onto other meshes; the
    # 2x2 save (one replica group) is restorable on the update oracle and the at-rest chain (issue 38).
    assert s["reshard"] == {"status": "restorable", "2x2": True, "1x4": True, "4x1": True}, s["reshard"]
    from click.testing import CliRunner

    from verified_ckpt_cli.main import main as cli

    r = CliRunner().invoke(cli, ["verify", run, "--all"])
    assert r.exit_code == 0, r.output
    torch.manual_seed(1)  # one process, no mesh: whole tensors, into a model and an optimizer that has not stepped
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.Dropout(0.0),
                                torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    CheckpointManager(run).restore({"model": plain, "optim": opt}, step=2)
    got = [p.reshape(-1).tolist() for p in plain.parameters()]
    got += [v.reshape(-1).tolist() for p in plain.parameters() for _, v in sorted(opt.state[p].items()) if v.dim()]
    assert got == saved


def hsdp_tp_run(mesh: object, faults: list[str], steps: int) -> object:
    """``tp_model``'s MLP with dropout, FSDP over the (replicate, shard) part of a 3-D mesh: what the guard counted
    in ``steps`` steps, or what it caught."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.Dropout(0.1),
                            torch.nn.LayerNorm(8), torch.nn.Linear(8, 1))
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})  # type: ignore[index]
    for i in (0, 2, 4, 5):
        fully_shard(m[i], mesh=mesh["rep", "shard"])  # type: ignore[index]
    fully_shard(m, mesh=mesh["rep", "shard"])  # type: ignore[index]
    rep, shard, _ = mesh.get_coordinate()  # type: ignore[attr-defined]
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    guard = SDCGuard(m, opt, loss_fn, GuardConfig(faults=faults, consensus_every=2))
    try:
        for s in range(steps):
            guard.backward(torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * s + 2 * rep + shard)), step=s)
            guard.step()
            opt.zero_grad()
    except SilentCorruptionDetected as e:
        return [e.incident.kind, e.incident.ranks, e.incident.detected_step]
    return {k: c.passed for k, c in guard.counters().items()}


def hsdp_tp(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    warnings_off()
    torch.manual_seed(100 + rank)  # each rank its own dropout stream
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
    return {"clean": hsdp_tp_run(mesh, [], 4), "weight": hsdp_tp_run(mesh, ["weights:5:2:bitflip=22"], 3)}


@pytest.mark.timeout(200)
def test_hsdp_with_tensor_parallel_on_2x2x2_is_quiet_and_names_a_faulty_rank():
    """8 processes, the suite's one: replicate 2 x shard 2 x tp 2. A weight bit flipped on rank 5 (its piece has two
    holders, one per replica group) right before a consensus is named by its own at-rest chain's flags: the copy
    changed at rest.
    (A wrong reduced shard on this layout's axes is the contract suite's, on 4 ranks.)"""
    got = run_ranks(hsdp_tp, 8, timeout=180, retire=True)
    assert all(r == got[0] for r in got), "every rank reaches the same verdict"
    s = got[0]
    assert s["clean"]["checksum"] == 4 and s["clean"]["consensus"] == 2, s["clean"]
    assert s["weight"] == ["consensus", [5], 2]
