"""Single-owner state, on real gloo ranks: pieces of the model and optimizer state that exactly one rank holds.

Under pure FSDP2 (a 1 x 4 mesh) every parameter shard and its Adam moments live on one rank only, and under
FSDP2 + tensor parallel (2 x 2, dp x tp) so do the ``ColwiseParallel``/``RowwiseParallel`` pieces: no replica
holds the same bytes, so a cross-replica consensus has nothing to compare them with. The contract these tests
define, at the default ``GuardConfig()``:

- a clean job raises nothing and its guarded saves are ``restorable`` (not ``unverified`` for "a single
  replica"), and ``resume()`` into fresh objects ends bit for bit where the uninterrupted run ends;
- a fault in a piece held once, injected by the test's own hooks on one rank (the owner), is caught within
  ``WINDOW`` steps on every rank together, naming the owner alone: a weight shard or an ``exp_avg`` shard
  changed between steps (the chain: state changed between its update and its next use), one element of the
  optimizer's update made 10x (a peer recomputing a slice of the owner's update: the oracle); one element of the
  owner's local gradient of a sharded Linear made 10x, as its backward computes it (ABFT, at the step);
- after the catch, ``resume()`` rolls back to the checkpoint saved before the fault and the job ends bitwise
  equal to the clean run;
- and under DDP (3 ranks), a persistent wrong update on one rank is named within ``WINDOW`` steps, not at a
  consensus tens of steps later.

The faults are the test's own (hooks and in-place writes), never ``verified_ckpt.faults``: the guard is told
nothing about them. Batches are a pure function of (data-parallel position, step); the models have no dropout,
so a rerun from a checkpoint computes the same bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from dist_harness import run_ranks
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.timeout(300)

D = 16  # model width; the hidden layer is 2 * D
STEPS = 12  # a job is steps 0..STEPS-1
SAVE_AT = 2  # every run saves here: the restorable checkpoint a faulty run rolls back to
# A faulty run saves at 0 too: a persistent wrong update is suspect from the update after its element's slice was
# last checked clean, up to oracle_slices (8) steps before the catch, so its rollback may have to go further back.
FAULTY_SAVES = (0, SAVE_AT)
RESUME_AT = 6  # the clean run saves here too; a fresh job resumes from it
FAULT_AT = 4  # the fault lands at this step (after its update for the at-rest faults, in it for the update)
WINDOW = 10  # a fault must be caught within this many steps
OWNER = 2  # the rank whose single-owner state the fault hits
ELEM = 3  # the element of the owner's local shard it hits
BIT = 29  # the second-highest exponent bit: set for every |x| in [2^-63, 2); flipped, x shrinks 2^64-fold
INIT_SEED, FRESH_SEED = 0, 7  # the job's init; a resumed job's objects start from another one
FAULTS = ("weight", "exp_avg", "update", "grad")
# chain: state changed at rest between steps; oracle: a peer recomputed the update; abft: a gradient did not match
# the checksums of the GEMM that computed it
KINDS = {"weight": {"chain"}, "exp_avg": {"chain"}, "update": {"oracle"}, "grad": {"abft"}}
MESHES = {"1x4": (4,), "2x2": (2, 2)}


# ------------------------------------------------------------------------------------------------ the job
class Job:
    """One rank's model, optimizer, guard and manager on an FSDP2 (1-D) or FSDP2 + TP (2-D) mesh."""

    def __init__(self, rank: int, shape: tuple[int, ...], run: str, seed: int, fault: str | None = None) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from verified_ckpt import CheckpointManager, GuardConfig, SDCGuard

        self.rank, self.fault, self.step = rank, fault, -1
        tp = len(shape) == 2
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp") if tp else ("dp",))
        self.position = mesh.get_coordinate()[0]  # data-parallel position: TP ranks of one position share batches
        self.model = sharded_model(mesh, tp, seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        if fault == "update":  # before the guard exists: the wrong element is inside the optimizer's step
            # Persistent (every step from FAULT_AT): the oracle checks a rotating eighth of each update per step, so a
            # one-off wrong element is seen at its step with probability 1/8 (tests/test_oracle.py), a persistent
            # one within the rotation. Layer 0's weight leads the optimizer's tensors, so element ELEM lies in the
            # first of the oracle's windows: checked clean at step 0, next at step 8, which places the first suspect
            # step after the save at 0 (a window first checked after the fault began suspects every step before).
            wrong_update_hooks(self.opt, self.target(0), lambda: rank == OWNER and self.step >= FAULT_AT)
        if fault == "grad":  # one element of the owner's local gradient of a sharded Linear, 10x, at one step
            wrong_gradient_hook(self.model[2], lambda: rank == OWNER and self.step == FAULT_AT)
        self.guard = SDCGuard(self.model, self.opt, loss_fn, GuardConfig())
        self.mgr = CheckpointManager(run, guard=self.guard)
        self.state = {"model": self.model, "optim": self.opt}

    def target(self, i: int) -> torch.nn.Parameter:
        """Layer ``i``'s weight: a piece held once on either mesh (FSDP-sharded, and TP-sharded on 2 x 2)."""
        return self.model[i].weight  # type: ignore[index,return-value]

    def train(self, start: int, stop: int, saves: tuple[int, ...] = ()) -> list[Any]:
        """Steps ``start..stop-1``, saving at ``saves`` and injecting this job's at-rest fault; the infos saved."""
        infos = []
        for step in range(start, stop):
            self.step = step
            self.guard.backward(batch(self.position, step), step=step)
            self.guard.step()
            self.opt.zero_grad()
            if self.rank == OWNER and step == FAULT_AT and self.fault == "weight":
                flip(self.target(0))
            if self.rank == OWNER and step == FAULT_AT and self.fault == "exp_avg":
                flip(self.opt.state[self.target(2)]["exp_avg"])
            if step in saves:
                infos.append(self.mgr.save(step, self.state))
        return infos


def sharded_model(mesh: Any, tp: bool, seed: int, head: bool | None = None) -> torch.nn.Module:
    """Two Linear layers (FSDP over ``dp``); on 2 x 2 the first colwise, the second rowwise on ``tp`` and a LayerNorm
    and a head replicated across ``tp`` (torchtitan's recipe, as ``tests/test_guard_fsdp.py`` builds it). ``head``
    (default: with tensor parallel) adds the LayerNorm and the head; ``mesh=None``: the plain model, one process."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    layers = [torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Linear(2 * D, D)]
    if tp if head is None else head:
        layers += [torch.nn.LayerNorm(D), torch.nn.Linear(D, 4)]
    m = torch.nn.Sequential(*layers)
    if mesh is None:
        return m
    dp = mesh["dp"] if tp else mesh
    if tp:
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in m:
        if list(layer.parameters()):
            fully_shard(layer, mesh=dp)
    fully_shard(m, mesh=dp)
    return m


def loss_fn(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def batch(position: int, step: int) -> torch.Tensor:
    """A pure function of (data-parallel position, step): a rerun from a checkpoint sees the same data."""
    return torch.randn(8, D, generator=torch.Generator().manual_seed(1000 * step + position))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (a view: writing it writes the DTensor), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def flip(t: torch.Tensor) -> None:
    """Flip ``BIT`` of element ``ELEM`` of this rank's piece of ``t``, in place: the value stays finite (it shrinks
    2^64-fold), so nothing but a check of the bytes themselves can see it."""
    with torch.no_grad():
        bits = local(t).view(-1).view(torch.int32)
        assert bits.numel() > ELEM and bits[ELEM] >> BIT & 1, "the test's fault must hit a set bit of a held element"
        bits[ELEM] ^= 1 << BIT


def wrong_update_hooks(opt: torch.optim.Optimizer, p: torch.Tensor, when: Any) -> None:
    """While ``when()``: element ``ELEM`` of this rank's piece of ``p`` moves 10x as far as the optimizer moved it."""
    before: list[torch.Tensor] = []

    def pre(*_: Any) -> None:
        before[:] = [local(p).detach().view(-1)[ELEM].clone()] if when() else []

    def post(*_: Any) -> None:
        if before:
            with torch.no_grad():
                flat = local(p).view(-1)
                flat[ELEM] = before[0] + 10 * (flat[ELEM] - before[0])

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)


def wrong_gradient_hook(layer: torch.nn.Module, when: Any) -> None:
    """While ``when()``: element ``ELEM`` of this rank's gradient of ``layer``'s weight, as its backward computes it
    (the whole, all-gathered weight under FSDP2; this rank's slice under tensor parallel), is 10x: a hook on the
    tensor the forward uses, before FSDP reduce-scatters the gradient."""
    def wrong(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        local(g).view(-1)[ELEM] *= 10
        return g

    def pre(mod: torch.nn.Module, args: Any) -> None:
        if when() and torch.is_grad_enabled():
            handle = mod.weight.register_hook(lambda g: (handle.remove(), wrong(g))[1])

    layer.register_forward_pre_hook(pre)


def shards(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """A digest of the bytes of this rank's piece of every parameter and optimizer state, by name."""
    def digest(t: torch.Tensor) -> str:
        x = local(t).detach().contiguous().view(-1)
        return f"{tuple(local(t).shape)} {hashlib.sha256(x.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]}"

    out = {}
    for name, p in model.named_parameters():
        out[name] = digest(p)
        out.update({f"{name}.{k}": digest(v) for k, v in sorted(opt.state[p].items())})
    return out


def consolidated(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer state as a whole tensor, by parameter name (collective on a mesh)."""
    def full(t: torch.Tensor) -> torch.Tensor:
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        return t.detach().clone().reshape(-1) if t.dim() == 0 else t.detach().clone()

    out = {}
    for name, p in model.named_parameters():
        out[name] = full(p)
        out.update({f"{name}.{k}": full(v) for k, v in sorted(opt.state[p].items())})
    return out


def caught(e: Any, step: int) -> dict:
    """What every rank must agree on about a catch: the incident, and the step of the loop at which it raised."""
    inc = e.incident
    return {"kind": inc.kind, "ranks": inc.ranks, "step": step, "detected": inc.detected_step,
            "first_suspect": inc.first_suspect_step}


# ------------------------------------------------------------------------------------------ rank functions
def campaign(rank: int, world: int, shape: tuple[int, ...], run: str) -> dict:
    """One 4-rank launch: the clean run (saving at SAVE_AT and RESUME_AT), then each fault in a fresh job of its own
    run, each caught one rolled back by ``resume()`` in fresh objects and trained to the end."""
    from verified_ckpt import SilentCorruptionDetected

    warnings.simplefilter("ignore")
    shape = tuple(shape)
    clean = Job(rank, shape, f"{run}-clean", INIT_SEED)
    out: dict = {}
    try:
        infos = clean.train(0, RESUME_AT + 1, (SAVE_AT, RESUME_AT))
        full = consolidated(clean.model, clean.opt)  # the whole tensors at the newest save, for restores elsewhere
        if rank == 0:
            save_file(full, f"{run}-full.safetensors")
        infos += clean.train(RESUME_AT + 1, STEPS)
        cov = clean.guard.coverage()
        out["clean"] = {"caught": None, "statuses": [i.status.value for i in infos],
                        "reasons": [list(i.reasons) for i in infos], "final": shards(clean.model, clean.opt),
                        "abft": {"modules": cov.modules, "left_out": [n for n, _ in cov.left_out]} if cov else None,
                        "abft_passed": clean.guard.counters()["abft"].passed}
    except SilentCorruptionDetected as e:  # a false alarm: reported, not raised, so the other scenarios still run
        out["clean"] = {"caught": caught(e, clean.step)}
    out["clean"]["incidents"] = len(clean.mgr.incidents())
    for fault in FAULTS:
        job = Job(rank, shape, f"{run}-{fault}", INIT_SEED, fault)
        got: dict = {"caught": None}
        try:
            infos = job.train(0, FAULT_AT + WINDOW + 1, FAULTY_SAVES)
        except SilentCorruptionDetected as e:
            got["caught"] = caught(e, job.step)
            fresh = Job(rank, shape, f"{run}-{fault}", FRESH_SEED)
            got["resumed_at"] = start = fresh.mgr.resume(fresh.state)
            fresh.train(start, STEPS)
            got["final"] = shards(fresh.model, fresh.opt)
        else:
            got["statuses"] = [i.status.value for i in infos]
        out[fault] = got
    return out


def resumed(rank: int, world: int, shape: tuple[int, ...], run: str) -> dict:
    """A fresh launch: new objects from another init seed, ``resume()`` from the clean run, trained to the end."""
    warnings.simplefilter("ignore")
    job = Job(rank, tuple(shape), f"{run}-clean", FRESH_SEED)
    start = job.mgr.resume(job.state)
    job.train(start, STEPS)
    return {"start": start, "final": shards(job.model, job.opt)}


@pytest.fixture(scope="module", params=list(MESHES))
def mesh_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both launches on one mesh: every rank's campaign, then every rank's resume in a new process group. Tensor
    parallel retires the pool after each (DTensor's plan cache keys on meshes of destroyed process groups)."""
    shape = MESHES[request.param]
    run = str(tmp_path_factory.mktemp(f"single-{request.param}") / "run")
    camp = run_ranks(campaign, 4, shape, run, timeout=200, retire=len(shape) == 2)
    res = run_ranks(resumed, 4, shape, run, timeout=90, retire=len(shape) == 2)
    return {"mesh": request.param, "campaign": camp, "resumed": res, "run": run}


# ------------------------------------------------------------------------------------------------- tests
def test_a_clean_single_owner_job_is_quiet_and_its_saves_are_restorable(mesh_runs):
    """On 1 x 4 (pure FSDP2) and 2 x 2 (FSDP2 + TP) at the default config: 12 steps raise nothing, no incident is
    recorded, and both guarded saves commit ``restorable``: state held by one rank is verified by other means than
    a replica's copy, so a single-owner job has checkpoints it may resume from."""
    got = [r["clean"] for r in mesh_runs["campaign"]]
    for r in got:
        assert r["caught"] is None, f"{mesh_runs['mesh']}: a false alarm on a clean run: {r['caught']}"
        assert r["incidents"] == 0
    assert all(r["statuses"] == got[0]["statuses"] for r in got), "every rank commits the same checkpoints"
    assert got[0]["statuses"] == ["restorable", "restorable"], (mesh_runs["mesh"], got[0]["reasons"])


def test_abft_checks_the_sharded_layers_gradients_at_every_step(mesh_runs):
    """ABFT runs on sharded compute at the defaults: both Linear layers are covered (under tensor parallel their
    weights over each rank's slice, their biases left out and said so), the 2 x 2 model's LayerNorm and replicated
    head too, and the check passed at steps of the clean run."""
    for r in mesh_runs["campaign"]:
        cov = r["clean"]["abft"]
        assert cov is not None and r["clean"]["abft_passed"] >= 1, r["clean"]
        if mesh_runs["mesh"] == "1x4":
            assert cov == {"modules": {"Linear": 2}, "left_out": []}, cov
        else:
            assert cov["modules"] == {"Linear": 3, "LayerNorm": 1}, cov
            assert sorted(cov["left_out"]) == ["0.bias", "2.bias"], cov


def test_resume_in_a_fresh_launch_ends_bitwise_equal_to_the_uninterrupted_run(mesh_runs):
    """A second launch builds the model and optimizer from another seed, ``resume()``s (without
    ``allow_unverified``) from the clean run's newest checkpoint and trains to the end: every rank's local shards of
    every parameter and optimizer state equal the uninterrupted run's, bit for bit."""
    for rank, (camp, res) in enumerate(zip(mesh_runs["campaign"], mesh_runs["resumed"], strict=True)):
        assert camp["clean"]["caught"] is None, f"{mesh_runs['mesh']}: the clean run raised: {camp['clean']['caught']}"
        assert res["start"] == RESUME_AT + 1, f"{mesh_runs['mesh']} rank {rank}: resume() found nothing restorable"
        diff = [k for k in camp["clean"]["final"] if camp["clean"]["final"][k] != res["final"].get(k)]
        assert diff == [], f"{mesh_runs['mesh']} rank {rank}: these local shards differ from the uninterrupted run's"


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_in_state_held_once_is_caught_soon_naming_the_owner_on_every_rank(mesh_runs, fault):
    """weight: an exponent bit of one element of the owner's weight shard flipped after step 4's update;
    exp_avg: the same in the owner's shard of a weight's Adam ``exp_avg``; update: at step 4 one element of the
    owner's update is 10x what AdamW computed, inside ``optimizer.step()`` (hooks registered before the guard).
    Every rank raises SilentCorruptionDetected at the same step, within WINDOW steps, with the owner as the only
    suspect, and an incident kind that says how single-owner state was checked (the chain or the oracle)."""
    got = [r[fault] for r in mesh_runs["campaign"]]
    where = f"{mesh_runs['mesh']} {fault}"
    assert all(r["caught"] is not None for r in got), \
        f"{where}: not caught within {WINDOW} steps (steps {FAULT_AT}..{FAULT_AT + WINDOW}; saves {got[0].get('statuses')})"
    first = got[0]["caught"]
    assert all(r["caught"] == first for r in got), f"{where}: the ranks disagree: {[r['caught'] for r in got]}"
    at_rest = fault in ("weight", "exp_avg")  # injected after step FAULT_AT's update: seen from the next step
    assert first["step"] >= FAULT_AT + at_rest, (where, "a catch before the fault is a false alarm", first)
    assert first["step"] - FAULT_AT <= WINDOW, (where, first)  # the latency, in steps
    assert first["ranks"] == [OWNER], (where, first)
    assert first["kind"] in KINDS[fault], (where, first)
    if fault == "grad":  # the target: at its step, before the update
        assert first["step"] == first["detected"] == FAULT_AT, (where, first)
    # The incident's interval covers the fault: nothing from the fault on is left restorable.
    assert first["first_suspect"] <= FAULT_AT + at_rest, (where, first)


@pytest.mark.parametrize("fault", FAULTS)
def test_after_the_catch_resume_rolls_back_and_the_job_ends_bitwise_equal_to_the_clean_run(mesh_runs, fault):
    """Fresh objects (another init seed) on the faulty run: ``resume()`` answers the incident with the newest
    checkpoint before its first suspect step (step 2 for a change at rest, caught at the next step; step 0 for a
    persistent wrong update, whose first suspect step lies up to a rotation before the catch), and training to
    the end gives every rank's local shards bit for bit the clean run's."""
    where = f"{mesh_runs['mesh']} {fault}"
    for rank, r in enumerate(mesh_runs["campaign"]):
        assert r[fault]["caught"] is not None, f"{where}: never caught, so nothing to recover from"
        assert r["clean"]["caught"] is None, f"{where}: the clean run to compare with raised: {r['clean']['caught']}"
        target = max(s for s in FAULTY_SAVES if s < r[fault]["caught"]["first_suspect"])
        assert r[fault]["resumed_at"] == target + 1, f"{where} rank {rank}: resume() did not roll back to step {target}"
        diff = [k for k in r["clean"]["final"] if r["clean"]["final"][k] != r[fault]["final"].get(k)]
        assert diff == [], f"{where} rank {rank}: these local shards differ from the clean run's"


# -------------------------------------------------------------------------------------- restores elsewhere
ELSEWHERE = {"1x4": (1, 4), "4x1": (4,), "single": None}  # dp x tp; 4 x 1: FSDP2 alone; single: one process


def restore_elsewhere(rank: int, world: int, shape: tuple[int, ...] | None, run: str) -> list[str]:
    """The 2 x 2 job's newest checkpoint restored (without ``allow_unverified``) into the same model on another mesh
    or in one process: the names whose whole tensors differ from the saving job's at that step."""
    from verified_ckpt import CheckpointManager

    warnings.simplefilter("ignore")
    mesh = None
    if shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(shape)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp") if len(shape) == 2 else ("dp",))
    model = sharded_model(mesh, shape is not None and len(shape) == 2, FRESH_SEED, head=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = CheckpointManager(f"{run}-clean")
    info = mgr.restore({"model": model, "optim": opt})
    assert info.step == RESUME_AT and info.status.value == "restorable", info
    [verified] = mgr.verify(step=RESUME_AT)
    assert verified.ok, verified.problems
    got, want = consolidated(model, opt), load_file(f"{run}-full.safetensors")
    assert sorted(got) == sorted(want)
    return [k for k in want if not torch.equal(got[k], want[k])]


@pytest.mark.parametrize("mesh_runs", ["2x2"], indirect=True)
@pytest.mark.parametrize("target", list(ELSEWHERE))
def test_a_2x2_checkpoint_restores_verified_onto_another_mesh_equal_to_the_whole_tensors(mesh_runs, target):
    """The FSDP2 + TP checkpoint (restorable on its single-owner evidence) restored onto 1 x 4 (tensor parallel over
    4), 4 x 1 (FSDP2 over 4, no tensor parallel) and one plain process: ``verify`` passes, and every parameter and
    Adam state equals the saving job's ``full_tensor()`` at that step, bit for bit."""
    run = mesh_runs["run"]
    if ELSEWHERE[target] is None:
        assert restore_elsewhere(0, 1, None, run) == []
    else:
        tp = len(ELSEWHERE[target]) == 2
        assert run_ranks(restore_elsewhere, 4, ELSEWHERE[target], run, timeout=90, retire=tp) == [[]] * 4


# ---------------------------------------------------------------------------------------------------- DDP
DDP_RANK = 1  # the rank whose update is wrong
DDP_FROM = 3  # from this step on, every step


def ddp_wrong_update(rank: int, world: int) -> dict:
    """DDP on 3 ranks, default config, AdamW: from step DDP_FROM on, rank DDP_RANK's update of one element is 10x."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

    warnings.simplefilter("ignore")
    torch.manual_seed(INIT_SEED)
    net = torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.ReLU(), torch.nn.Linear(2 * D, D))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    now = {"step": -1}
    wrong_update_hooks(opt, net[0].weight, lambda: rank == DDP_RANK and now["step"] >= DDP_FROM)
    guard = SDCGuard(model, opt, loss_fn, GuardConfig())
    for step in range(DDP_FROM + WINDOW + 1):
        now["step"] = step
        try:
            guard.backward(batch(rank, step), step=step)
            guard.step()
        except SilentCorruptionDetected as e:
            return {"caught": caught(e, step)}
        opt.zero_grad()
    return {"caught": None, "checks": {k: c.passed for k, c in guard.counters().items()}}


@pytest.mark.timeout(120)
def test_ddp_a_persistent_wrong_update_on_one_rank_is_named_within_the_window():
    """Replicas that all hold the same bytes: rank 1's AdamW moves one element 10x too far on every step from step 3.
    Every rank raises together within WINDOW steps naming rank 1, not only at a budget consensus tens of steps
    on."""
    got = [r["caught"] for r in run_ranks(ddp_wrong_update, 3, timeout=100)]
    assert got[0] is not None, f"not caught within {WINDOW} steps of step {DDP_FROM}"
    assert all(r == got[0] for r in got), got
    assert got[0]["ranks"] == [DDP_RANK], got[0]
    assert got[0]["kind"] in {"oracle", "consensus"}, got[0]  # the oracle, or the consensus it asks for when the inputs of its slice already differ
    assert 0 <= got[0]["step"] - DDP_FROM <= WINDOW, got[0]


# ----------------------------------------------------------------------------------------------- pipeline
PIPELINE_STEPS = FAULT_AT + WINDOW  # the example's steps are 1..PIPELINE_STEPS
PIPELINE_FAULTS = {"weight": "chain", "exp_avg": "chain", "update": "oracle", "grad": "abft"}


def pipeline_story(rank: int, world: int, base: str) -> dict:
    """``examples/pipeline_train.py`` as its users run it, 2 stages of one rank each (no data-parallel replica,
    so every piece is held once), at the default config: a clean run saving every 3 steps, then resumed from its
    newest save in a fresh job; and for each of the test's own faults on stage 1, a run that stops on the catch,
    then ``--resume`` in a fresh job (no fault) to the end."""
    import pipeline_train

    from verified_ckpt import CheckpointManager

    warnings.simplefilter("ignore")

    def example(name: str, steps: int, *flags: str) -> dict:
        args = pipeline_train.parse(["--stages", "2", "--replicas", "1", "--steps", str(steps), "--save-every", "3",
                                     "--run", f"{base}/{name}", *flags])
        out = pipeline_train.train(rank, world, args)
        statuses = [i.status.value for i in CheckpointManager(f"{base}/{name}").list()]
        return {**{k: out[k] for k in ("completed", "final_step", "incidents", "fingerprint", "rollbacks")},
                "statuses": statuses, "abft": out["checks"].get("abft")}

    clean = example("clean", PIPELINE_STEPS)
    restored_parts(rank, world, base, 2)
    # A fresh job resumes the clean run from its newest save (step 12) and ends where the clean run ended.
    out = {"clean": clean, "resumed": example("clean", PIPELINE_STEPS, "--resume")}
    for fault in PIPELINE_FAULTS:
        with owner_faults(rank, fault):
            out[fault] = example(fault, PIPELINE_STEPS)
        out[f"{fault} resumed"] = example(fault, PIPELINE_STEPS, "--resume")
    return out


@contextlib.contextmanager
def owner_faults(rank: int, fault: str) -> Iterator[None]:
    """The test's own faults on stage 1 (rank 1) of a job the example builds: after step FAULT_AT, one element of
    its first weight shard or of that weight's ``exp_avg`` flipped; from step FAULT_AT on, one element of its
    update 10x; or at step FAULT_AT, one element of its first Linear's local weight gradient 10x, in every
    microbatch's backward. Hooked onto the example's guard from outside (``SDCGuard.step`` wrapped for the block),
    so the example is run unchanged."""
    from verified_ckpt import SDCGuard

    step = SDCGuard.step
    hooked: set[int] = set()

    def wrapped(self: Any) -> None:
        s = self.current_step
        target = next(p for p in self.model.parameters() if p.dim() == 2)
        if id(self) not in hooked:  # the first step's end: the hooks act from the next step on
            hooked.add(id(self))
            if fault == "update":
                wrong_update_hooks(self.optimizer, target, lambda: rank == 1 and cur[0] >= FAULT_AT)
            if fault == "grad":
                linear = next(m for m in self.model.modules() if isinstance(m, torch.nn.Linear))
                wrong_gradient_hook(linear, lambda: rank == 1 and self.current_step == FAULT_AT)
        cur[0] = s
        step(self)
        if rank == 1 and s == FAULT_AT and fault in ("weight", "exp_avg"):
            flip(target if fault == "weight" else self.optimizer.state[target]["exp_avg"])

    cur = [-1]
    SDCGuard.step = wrapped  # type: ignore[method-assign]
    try:
        yield
    finally:
        SDCGuard.step = step  # type: ignore[method-assign]


def restored_parts(rank: int, world: int, base: str, stages: int) -> None:
    """The clean run's step-6 checkpoint restored into ``stages`` fresh stages (one rank each, built as the
    example builds them, from another seed; ``world == 1``: the whole model in this process), and every restored
    tensor written whole, by the whole model's names, to ``parts-<stages>-r<rank>.safetensors``."""
    import models

    from verified_ckpt import CheckpointManager, StageState

    warnings.simplefilter("ignore")
    torch.manual_seed(FRESH_SEED)
    whole = models.TinyGPT(d=32, layers=4, tied=False)
    if world == 1:
        module = whole
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (stages, 1, 1), mesh_dim_names=("pp", "replicate", "shard"))
        module = models.pipeline_stage(whole, mesh.get_local_rank("pp"), stages)
        for block in module.blocks.values():
            fully_shard(block, mesh=mesh["replicate", "shard"])
        fully_shard(module, mesh=mesh["replicate", "shard"])
    part = StageState(module, torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.01))
    info = CheckpointManager(f"{base}/clean").restore({"model": part}, step=6)
    assert info.status.value == "restorable", info
    got = part.state_dict()
    tensors = {f"{k}/{n}": t for k in ("model", "optim") for n, t in got[k].items() if isinstance(t, torch.Tensor)}
    save_file({n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone().contiguous()
               for n, t in tensors.items()}, f"{base}/parts-{stages}-r{rank}.safetensors")


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("pipeline")
    out = run_ranks(pipeline_story, 2, str(base), timeout=270)[0]
    return {**out, "base": base}


def test_a_pipeline_without_replicas_saves_restorable_checkpoints_and_resumes_bitwise(pipeline_runs):
    """Two pipeline stages of one rank each: the stage's shards have no replica anywhere. The chain and the oracle
    stand for the consensus: the saves are restorable, ABFT checks every step inside the schedule, and ``--resume``
    in a fresh job from the newest save ends with every stage's parameters bit for bit the uninterrupted run's."""
    s = pipeline_runs
    assert s["clean"]["completed"] and s["clean"]["incidents"] == [], s["clean"]
    assert set(s["clean"]["statuses"]) == {"restorable"} and len(s["clean"]["statuses"]) == PIPELINE_STEPS // 3
    assert s["clean"]["abft"]["passed"] == PIPELINE_STEPS and s["clean"]["abft"]["failed"] == 0, s["clean"]["abft"]
    assert s["resumed"]["completed"] and s["resumed"]["fingerprint"] == s["clean"]["fingerprint"], s
    assert s["resumed"]["abft"]["passed"] == PIPELINE_STEPS - 12, s["resumed"]  # from the save at 12, not afresh


@pytest.mark.parametrize("fault", list(PIPELINE_FAULTS))
def test_a_fault_on_a_pipeline_stage_is_caught_then_resume_ends_bitwise_equal_to_the_clean_run(pipeline_runs, fault):
    """The test's own faults on stage 1: a flip at rest (weight or ``exp_avg``) is caught at the next step naming
    rank 1 (its own chain); a gradient element 10x at its step naming rank 1 (ABFT inside the schedule); a
    persistent wrong update within the oracle's rotation, naming nobody: with two ranks no third recompute can
    tell the owner from its witness. Then ``--resume`` in a fresh job rolls back before the fault and ends bitwise
    equal to the clean run."""
    got, again = pipeline_runs[fault], pipeline_runs[f"{fault} resumed"]
    (inc,) = got["incidents"]
    assert not got["completed"] and inc["kind"] == PIPELINE_FAULTS[fault], got
    if fault == "update":
        assert inc["ranks"] == [] and FAULT_AT < inc["detected_step"] <= FAULT_AT + WINDOW, inc
    else:
        latency = 0 if fault == "grad" else 1
        assert (inc["ranks"], inc["detected_step"]) == ([1], FAULT_AT + latency), inc
    assert again["completed"] and again["incidents"] == [], again
    if fault != "update":  # rolled back to the save at 3, not started afresh (an update's suspects may reach 0)
        assert again["abft"]["passed"] == PIPELINE_STEPS - 3, again
    assert again["fingerprint"] == pipeline_runs["clean"]["fingerprint"], (again, pipeline_runs["clean"])


def test_a_pipeline_checkpoint_restores_onto_another_stage_count_and_into_the_whole_model(pipeline_runs):
    """The 2-stage run's checkpoint restored, verified, onto 4 stages (4 ranks) and into the whole model in one
    process: every parameter and optimizer state, by the whole model's names, equals bit for bit what the 2 stages
    restore, and the parts together hold every name once."""
    base = pipeline_runs["base"]
    run_ranks(restored_parts, 4, str(base), 4, timeout=120)
    restored_parts(0, 1, str(base), 1)

    def merged(stages: int, ranks: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for r in range(ranks):
            part = load_file(f"{base}/parts-{stages}-r{r}.safetensors")
            assert not set(part) & set(out), sorted(set(part) & set(out))  # each name in one stage's part only
            out.update(part)
        return out

    two, four, one = merged(2, 2), merged(4, 4), merged(1, 1)
    # What was restored is what the checkpoint holds: each stage's DTensors are one chunk each (a stage of one
    # rank), so every restored whole tensor has the fingerprint its stored chunk has in the manifest.
    from verified_ckpt import CheckpointManager, tensor_fingerprint

    m = CheckpointManager(str(base / "clean")).list()[1].manifest
    assert m is not None and m.step == 6
    for name, t in one.items():
        entry = m.layout.get(f"model/{name}")
        stored = entry.chunks[0].tensor if entry is not None else f"model/{name}"
        assert entry is None or len(entry.chunks) == 1, name
        assert str(tensor_fingerprint(t)) == m.tensors[stored].fingerprint, name
    assert set(two) == set(four) == set(one) and any(n.startswith("optim/state.blocks.3.") for n in one)
    for n, t in two.items():
        for other in (four, one):
            assert other[n].dtype == t.dtype and torch.equal(other[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), n


@pytest.mark.parametrize("layers", [3, 5])
def test_a_whole_model_that_is_not_the_saved_one_is_refused_and_left_untouched(pipeline_runs, layers):
    """Into one process, a model with a block fewer (a part of the checkpoint nobody would hold) or a block more
    (a part the checkpoint lacks): refused with one line naming it, and the model and its stepped optimizer keep
    every byte."""
    import models

    from verified_ckpt import CheckpointManager, InvalidState, StageState, state_fingerprint

    torch.manual_seed(FRESH_SEED)
    model = models.TinyGPT(d=32, layers=layers, tied=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model(torch.zeros(2, 8, dtype=torch.long)).square().mean().backward()
    opt.step()  # a stepped optimizer: state of its own, which a failed restore must keep
    part = StageState(model, opt)
    before = str(state_fingerprint({"model": model, "optim": opt}))
    with pytest.raises(InvalidState) as e:
        CheckpointManager(str(pipeline_runs["base"] / "clean")).restore({"model": part}, step=6)
    missing = "blocks.3" if layers == 3 else "blocks.4"
    assert missing in str(e.value) and "nothing was restored" in str(e.value) and "\n" not in str(e.value), e.value
    assert str(state_fingerprint({"model": model, "optim": opt})) == before
