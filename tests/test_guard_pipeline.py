"""The guard under pipeline parallelism: 2 stages x 2 data-parallel replicas (4 gloo ranks),
``torch.distributed.pipelining``'s ``ScheduleGPipe`` over a small GPT split by hand (the FQNs kept, as torchtitan
splits), each stage ``fully_shard``-ed over its own replicate x shard mesh (2 x 1: replicas), at the default
``GuardConfig()`` but for the faults:

- a clean run with dropout raises nothing, and every check's passes are counted once per step for the job;
- a wrong reduced gradient on a stage's rank is caught at its step, naming that rank, and every rank of both
  stages raises at the same step, the update withheld;
- a weight flipped on one replica of a stage is caught at the next step by that rank's own at-rest chain (the
  flipped copy changed after its optimizer wrote it), naming it alone, and every rank raises; flipped to a huge
  value too, before the NaN it makes reaches the earlier stage of its replica and blames that stage's rank;
- every rank's step row carries its replica's loss, the stages before the last included;
- ``examples/pipeline_train.py`` (``Schedule1F1B``) saves each stage's entries once, names a fault at its step,
  and its rollback and its resume end bit-identical to the clean run; stages that save their modules under one
  name are refused, nothing written;
- with three replicas (6 ranks), a recompute audit replays another replica's whole step through the schedule:
  faults ABFT cannot see (a wrong gradient sent upstream, a wrong attention output) are caught at their step,
  naming the ranks the pipeline's direction leaves as suspects.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_ranks

pytestmark = pytest.mark.timeout(240)


def run(rank: int, world: int, faults: list[str], steps: int, misnamed: str | None = None) -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import models
    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "rep", "shard"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("rep")
    torch.manual_seed(0)
    stage_mod = models.pipeline_stage(models.TinyGPT(d=16, layers=2, tied=False), pp, 2)
    for block in stage_mod.blocks.values():
        fully_shard(block, mesh=mesh["rep", "shard"])
    fully_shard(stage_mod, mesh=mesh["rep", "shard"])
    stage = PipelineStage(stage_mod, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=models.token_loss)
    opt = torch.optim.AdamW(stage_mod.parameters(), lr=3e-3)
    guard = SDCGuard(stage_mod, opt, None, GuardConfig(faults=tuple(faults)), pipeline=schedule)
    from verified_ckpt.guard.protocol import Layout

    assert isinstance(guard.layout, Layout), "the pipeline layout does not satisfy Layout"
    losses: list[float] = []
    guard.add_event_listener(lambda events: losses.extend(e.loss for e in events if e.kind == "step" and e.rank == rank))
    torch.manual_seed(100 + rank)  # dropout draws differ per rank, as in real jobs
    before = None
    try:
        for step in range(steps):
            ids = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(10 * step + dp))
            before = [p.to_local().clone() for p in stage_mod.parameters()]
            if pp == 0:
                guard.pipeline_step(ids[:, :-1], step=step)
            else:
                guard.pipeline_step(target=ids[:, 1:], step=step)
            guard.step()
            opt.zero_grad(set_to_none=True)
        guard.consensus(steps - 1)  # as a save asks for one
        if misnamed is not None:  # every stage's module under one name: refused, nothing written
            from verified_ckpt import CheckpointManager, InvalidState

            try:
                CheckpointManager(misnamed, guard=guard).save(steps, {"model": stage_mod, "optim": opt})
            except InvalidState as e:
                return {"refused": str(e), "listed": len(CheckpointManager(misnamed).list())}
    except SilentCorruptionDetected as e:
        withheld = all(torch.equal(a.view(torch.int32), b.to_local().view(torch.int32))  # bitwise: NaN too
                       for a, b in zip(before or [], stage_mod.parameters(), strict=True))
        return {"caught": [e.incident.kind, e.incident.ranks, e.incident.detected_step], "withheld": withheld}
    counts = {k: [c.passed, c.failed] for k, c in guard.counters().items()}
    return {"counts": counts, "losses": losses}


def campaign(rank: int, world: int, base: str) -> dict:
    import pipeline_train

    def example(name: str, *flags: str) -> dict:
        args = pipeline_train.parse(["--steps", "4", "--save-every", "2", "--run", f"{base}/{name}", *flags])
        out = pipeline_train.train(rank, world, args)
        return {k: out[k] for k in ("completed", "final_step", "incidents", "rollbacks", "fingerprint")}

    fault = ("--inject", "allreduce:3:3:elem=10")
    return {
        "example": {"clean": example("clean"), "rolled back": example("rolled", *fault, "--on-incident", "rollback"),
                    "stopped": example("stopped", *fault), "resumed": example("stopped", "--resume")},
        "misnamed": run(rank, world, [], 1, misnamed=f"{base}/misnamed"),
        "clean": run(rank, world, [], 6),
        "reduced": run(rank, world, ["allreduce:1:2:elem=10"], 4),
        "weight": run(rank, world, ["weights:3:1:bitflip=20"], 3),
        "huge weight": run(rank, world, ["weights:3:1:bitflip=30"], 4),
    }


def test_a_pipeline_with_data_parallel_stages_is_guarded_on_every_stage(tmp_path):
    from verified_ckpt import CheckpointManager

    got = run_ranks(campaign, 4, str(tmp_path), timeout=220)
    # The example (1F1B, 4 blocks over 2 stages, dropout) as its users run it, saving every 2 steps: a fault is
    # named at its step; the in-process rollback and a stop then resume end bit-identical to the clean run.
    ex = got[0]["example"]
    assert ex["clean"]["completed"] and len(ex["clean"]["fingerprint"].split("/")) == 2, ex["clean"]
    for name in ("rolled back", "stopped"):
        assert [(i["kind"], i["ranks"], i["detected_step"]) for i in ex[name]["incidents"]] == [("checksum", [3], 3)]
    assert ex["rolled back"]["rollbacks"] == [{"from_step": 3, "to_step": 2}] and not ex["stopped"]["completed"]
    assert ex["clean"]["fingerprint"] == ex["rolled back"]["fingerprint"] == ex["resumed"]["fingerprint"], ex
    # Each stage's part is written once: the checkpoint holds every stage's part, no tensor twice.
    newest = CheckpointManager(str(tmp_path / "clean")).list()[-1]
    m = newest.manifest
    assert m is not None and m.state["model"].get("parts") is True  # one entry, the stages' union
    assert newest.status.value == "restorable"
    stored = [n for s in m.shards for n in s.tensors]
    assert len(stored) == len(set(stored)) and any(n.startswith("model/model/blocks.3.") for n in stored)
    assert all(r["misnamed"]["listed"] == 0 and "name them apart" in r["misnamed"]["refused"] for r in got)
    from click.testing import CliRunner

    from verified_ckpt_cli.main import main as cli

    verified = CliRunner().invoke(cli, ["verify", str(tmp_path / "clean"), "--all"])
    assert verified.exit_code == 0 and "2 checked, 0 failed" in verified.output, verified.output
    clean = got[0]["clean"]
    assert "caught" not in clean, clean
    assert all(clean["counts"][k] == [6, 0] for k in ("checksum", "nonfinite_local")), clean["counts"]
    assert clean["counts"]["consensus"][1] == 0 and clean["counts"]["consensus"][0] >= 1
    # The stages before the last hold no loss: their rows carry their replica's, from the last stage.
    assert got[0]["clean"]["losses"] == got[2]["clean"]["losses"] and len(got[0]["clean"]["losses"]) == 6
    assert got[1]["clean"]["losses"] == got[3]["clean"]["losses"] != got[0]["clean"]["losses"]
    for r in range(4):
        assert got[r]["reduced"] == {"caught": ["checksum", [1], 2], "withheld": True}, (r, got[r]["reduced"])
        assert got[r]["weight"]["caught"][:2] == ["chain", [3]], (r, got[r]["weight"])
        # The NaN it makes would cross from stage 1 to stage 0 of its replica (and name rank 1 too): the chain,
        # judged before the gradient checks, names the flipped rank alone.
        assert got[r]["huge weight"] == {"caught": ["chain", [3], 2], "withheld": True}, got[r]


# ------------------------------------------------------------------------------- audits of a pipeline
AUDIT_FAULT_AT = 3
AUDIT_FAULTS = {  # (the stage hooked, the direction): replica 1 of that stage, at AUDIT_FAULT_AT
    "the gradient stage 1 sends": (1, "backward"), "stage 0's forward": (0, "forward"),
}


def audited(rank: int, world: int, base: str) -> dict:
    """``examples/pipeline_train.py --stages 2 --replicas 3`` (6 ranks: stage 0 on ranks 0-2, stage 1 on 3-5), an
    audit every step, each run with one of the test's own faults on replica 1 of one stage at AUDIT_FAULT_AT, in a
    computation ABFT does not check: the gradient a stage's first block sends back out of its input (the residual
    stream's, ``backward``), or a block's attention output (``forward``). Only in the step's own pass, not in the
    audit's recomputation of it."""
    import warnings

    import pipeline_train

    from verified_ckpt import SDCGuard

    warnings.simplefilter("ignore")
    step, out = SDCGuard.step, {}

    for name, (stage, direction) in AUDIT_FAULTS.items():
        hooked: set[int] = set()

        def wrapped(self, stage=stage, direction=direction) -> None:
            if id(self) not in hooked:
                hooked.add(id(self))
                mine = self.layout.stage.stage_index == stage and rank == 3 * stage + 1

                def firing() -> bool:
                    return mine and self.current_step == AUDIT_FAULT_AT and not self.abft.paused

                block = next(iter(self.model.blocks.values()))
                if direction == "backward":
                    def pre(mod, args):
                        if firing() and args[0].requires_grad:
                            args[0].register_hook(lambda g: g * 1.5)
                    block.register_forward_pre_hook(pre)
                else:
                    block.attn.register_forward_hook(lambda mod, args, y: y * 1.5 if firing() else None)
            step(self)

        SDCGuard.step = wrapped  # type: ignore[method-assign]
        try:
            args = pipeline_train.parse(["--stages", "2", "--replicas", "3", "--steps", "5", "--audit-every", "1"])
            got = pipeline_train.train(rank, world, args)
        finally:
            SDCGuard.step = step  # type: ignore[method-assign]
        out[name] = {"incidents": [(i["kind"], i["ranks"], i["detected_step"]) for i in got["incidents"]],
                     "details": [i.get("detail", "") for i in got["incidents"]], "audits": got["checks"]["audit"]}
    return out


def test_a_pipeline_audit_recomputes_another_replicas_step_and_names_the_stage_that_made_the_fault():
    """Six ranks, an audit every step: each replica of the whole pipeline recomputes the step of the replica
    before it, a third breaks the tie. A wrong gradient sent upstream by stage 1 makes only stage 0's reductions
    differ; the loss agrees, so stage 0's rank and the stage after it (the sender) are named, no other replica's.
    A fault in stage 0's forward changes the loss and every stage of that replica: both its ranks are named. ABFT
    sees neither (the faults are outside the layers it checks), nor does any reduction check."""
    got = run_ranks(audited, 6, "", timeout=220)
    for r in range(6):
        assert got[r] == got[0], r  # every rank reached the same verdicts
    out = got[0]
    assert out["the gradient stage 1 sends"]["incidents"] == [["audit", [1, 4], AUDIT_FAULT_AT]], out
    assert "the loss agrees" in out["the gradient stage 1 sends"]["details"][0], out
    assert out["stage 0's forward"]["incidents"] == [["audit", [1, 4], AUDIT_FAULT_AT]], out
    assert "the loss differs too" in out["stage 0's forward"]["details"][0], out
    for name in AUDIT_FAULTS:
        assert out[name]["audits"]["passed"] == AUDIT_FAULT_AT - 1, out[name]  # the clean steps before it, audited


@pytest.mark.parametrize("named, moved, want", [
    ([0, 3], False, [3]),  # stage 0 and the last stage of position 0 differ, the loss agrees: the last stage alone
    ([0], False, [0, 3]),  # only stage 0: it, or the gradient stage 1 sent it
    ([0, 3], True, [0, 3]),  # the loss moved: a forward's fault, on one of them
    ([1, 2, 4], False, [4, 2, 5]),  # positions apart: replica 1 (stages 0, 1: the last) and replica 2 (stage 0 only)
])
def test_an_audit_under_a_pipeline_names_the_stages_the_direction_of_the_gradients_leaves(named, moved, want):
    from verified_ckpt.guard.pipeline import upstream_explained

    stage, position = [0, 0, 0, 1, 1, 1], [0, 1, 2, 0, 1, 2]  # two stages of three replicas, stage-major
    got = upstream_explained(named, stage, position, lambda r: moved and stage[r] == 1)
    assert got == sorted(want)


def test_a_pipelines_coverage_line_is_the_whole_jobs_each_stage_weighted_by_its_parameters():
    from verified_ckpt.guard.abft.layers import Coverage

    first = Coverage({"Linear": 2, "Embedding": 2}, 1.0, 0.9, 1.0, [], {})
    last = Coverage({"Linear": 1}, 0.5, 0.6, 1.0, [("head.weight", "why")], {"Custom": 1})
    job = Coverage.of_parts([(first, 300), (last, 100)])
    assert job.modules == {"Linear": 3, "Embedding": 2} and job.uncovered == {"Custom": 1}
    assert job.param_fraction == pytest.approx(0.875) and job.flop_fraction == pytest.approx(0.825)
    assert job.left_out == [("head.weight", "why")] and "87.5% of parameters" in job.summary()
