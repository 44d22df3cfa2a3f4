"""`vckpt replay` on recorded incidents of real 3-rank gloo jobs (the DDP example, the guard's defaults but the
example's own audit and consensus intervals): a persistent fault is reproduced, a transient one is not, a
poisoned batch blames no host, and a bundle altered on the store is refused with nothing loaded or changed."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from dist_harness import run_ranks

import ddp_train
from verified_ckpt import CheckpointManager, GuardConfig, SDCGuard, SilentCorruptionDetected
from verified_ckpt_cli.main import main as vckpt

pytestmark = pytest.mark.timeout(240)
MODEL = os.path.join(os.path.dirname(__file__), "..", "examples", "ddp_train.py") + ":replay_model"
KEY = "replay-test-signing-key-0123456789"


def jobs(rank: int, world: int, root: str) -> dict:
    """Three runs: a wrong gradient on rank 1 at step 7, an Inf in rank 1's batch at step 7, and the first again
    with a bundle bound smaller than the model (no bundle, the incident still recorded)."""
    out = {}
    for name, extra in (("grad", {"inject": ["grad:1:7:scale=10"]}), ("data", {"bad_batch": "1:7"})):
        args = ddp_train.parse(["--steps", "9", "--save-every", "4", "--run", os.path.join(root, name)])
        for k, v in extra.items():
            setattr(args, k, v)
        got = ddp_train.train(rank, world, args)
        out[name] = [(i["kind"], i["ranks"], i["detected_step"]) for i in got["incidents"]]
    model = ddp_train.DDP(ddp_train.build_model(0))
    opt = ddp_train.torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = SDCGuard(model, opt, ddp_train.loss_fn, GuardConfig(faults=("grad:1:2:scale=10",), replay_max_bytes=1000))
    mgr = CheckpointManager(os.path.join(root, "small"), guard=guard)
    try:
        for step in range(1, 4):
            guard.backward(ddp_train.make_batch(0, step, rank), step=step)
            guard.step()
            opt.zero_grad()
    except SilentCorruptionDetected as e:
        out["small"] = [(e.incident.kind, e.incident.ranks, step)]
    out["small recorded"] = len(mgr.incidents())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("replay"))
    saved = os.environ.get("VCKPT_SIGNING_KEY")
    os.environ["VCKPT_SIGNING_KEY"] = KEY  # every record and bundle signed: tampering must be caught
    try:
        got = run_ranks(jobs, 3, root, timeout=200)
    finally:
        if saved is None:
            del os.environ["VCKPT_SIGNING_KEY"]
        else:
            os.environ["VCKPT_SIGNING_KEY"] = saved
    return root, got[0]


def replay(run: str, *extra: str) -> tuple[int, dict | str]:
    [inc] = CheckpointManager(run).incidents()
    r = CliRunner().invoke(vckpt, ["replay", run, "--incident", inc.id, "--model", MODEL, *extra],
                           env={"VCKPT_SIGNING_KEY": KEY})
    assert "Traceback" not in r.output, r.output
    return r.exit_code, json.loads(r.output) if "--json" in extra else r.output


def test_a_persistent_fault_is_reproduced_and_a_transient_one_is_not(runs):
    root, got = runs
    assert got["grad"] == [["abft", [1], 7]], got
    run = os.path.join(root, "grad")
    code, doc = replay(run, "--json")
    assert code == 0 and doc["replays"][0]["outcome"] == "not-reproduced" and doc["replays"][0]["rank"] == 1
    assert doc["signature"] == "valid" and doc["step"] == 7
    # The bundle's size is stated and bounded: the step's weights and buffers plus the suspect's microbatch and
    # its random state (about 30 KB for this model), far below GuardConfig's default bound of 1 GiB.
    [inc] = CheckpointManager(run).incidents()
    stored = os.path.getsize(os.path.join(run, "replay", f"{inc.id}.safetensors"))
    assert doc["bundle_bytes"] == stored and stored < 64 << 10 <= GuardConfig().replay_max_bytes
    # The same fault, still there: the host that computed it computes it again.
    code, out = replay(run, "--inject", "grad:1:7:scale=10")
    assert code == 4 and "reproduced on this host" in out and "persistent fault" in out


def test_a_poisoned_batch_blames_no_host(runs):
    root, got = runs
    assert got["data"] == [["nonfinite_local", [1], 7]], got  # the guard named the rank whose batch held the Inf
    code, doc = replay(os.path.join(root, "data"), "--json")
    assert code == 6 and doc["replays"][0]["outcome"] == "no-host-to-blame"


def test_a_state_above_the_bound_gets_no_bundle_and_the_incident_is_still_recorded(runs):
    root, got = runs
    assert got["small"] == [["abft", [1], 2]] and got["small recorded"] == 1
    assert not os.path.exists(os.path.join(root, "small", "replay"))
    code, out = replay(os.path.join(root, "small"))
    assert code == 2 and "has no replay bundle" in out


@pytest.mark.parametrize("part", ["safetensors", "json"])
def test_an_altered_bundle_is_refused_and_nothing_is_changed(runs, tmp_path, part):
    import shutil

    root, _ = runs
    run = str(tmp_path / "grad")
    shutil.copytree(os.path.join(root, "grad"), run)
    [inc] = CheckpointManager(run).incidents()
    path = os.path.join(run, "replay", f"{inc.id}.{part}")
    data = bytearray(open(path, "rb").read())
    if part == "json":  # a plausible edit: the step moved
        doc = json.loads(data)
        doc["step"] = 6
        data = bytearray(json.dumps(doc).encode())
    else:
        data[-5] ^= 0x01  # one bit of a tensor
    open(path, "wb").write(bytes(data))
    before = {n: open(os.path.join(run, "replay", n), "rb").read() for n in os.listdir(os.path.join(run, "replay"))}
    code, out = replay(run)
    assert code == 1 and ("invalid signature" if part == "json" else "damaged or altered") in out, out
    assert out.count("\n") == 1 and "never replayed" in out
    assert before == {n: open(os.path.join(run, "replay", n), "rb").read() for n in os.listdir(os.path.join(run, "replay"))}


def test_replay_refuses_a_model_that_is_not_the_trained_one_in_one_line(runs, tmp_path):
    root, _ = runs
    other = tmp_path / "other.py"
    other.write_text("import torch\n\ndef build():\n    return torch.nn.Linear(3, 3), lambda m, b: m(b).sum()\n")
    [inc] = CheckpointManager(os.path.join(root, "grad")).incidents()
    r = CliRunner().invoke(vckpt, ["replay", os.path.join(root, "grad"), "--incident", inc.id, "--model",
                                   f"{other}:build"], env={"VCKPT_SIGNING_KEY": KEY})
    assert r.exit_code == 2 and "not the one trained" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(vckpt, ["replay", os.path.join(root, "grad"), "--incident", inc.id, "--model", "nothing"])
    assert r.exit_code == 2 and "FILE.py:FUNC" in r.output
