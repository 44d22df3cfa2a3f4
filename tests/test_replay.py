"""`vckpt replay` on recorded incidents of real 3-rank gloo jobs (the DDP example, the guard's defaults but the
example's own audit and consensus intervals): a persistent fault is reproduced, a transient one is not, a
poisoned batch blames no host, and a bundle altered on the store is refused with nothing loaded or changed,
including one rewritten with its digest recomputed in an unsigned run (every field, in one line, never a
traceback, never a verdict's output)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
import torch
from click.testing import CliRunner
from dist_harness import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

import ddp_train
from verified_ckpt import CheckpointManager, GuardConfig, SDCGuard, SilentCorruptionDetected, batches
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


def test_not_reproduced_on_the_named_host_clears_it_and_a_rollback_or_a_drill_does_not(runs, tmp_path):
    """Issue 48, finding 6: a rollback answers the incident for checkpoints only; the replay's verdict on the host
    the incident names is the evidence that clears it, recorded (signed) in the run."""
    import shutil

    root, _ = runs
    run = str(tmp_path / "grad")
    shutil.copytree(os.path.join(root, "grad"), run, ignore=shutil.ignore_patterns("clearance"))  # no earlier replay's
    [inc] = CheckpointManager(run).incidents()
    [host] = inc.exclude_hosts
    env = {"VCKPT_SIGNING_KEY": KEY}

    def health() -> int:
        return CliRunner().invoke(vckpt, ["node-health", run, "--host", host], env=env).exit_code

    assert health() == 1
    rolled = CliRunner().invoke(vckpt, ["rollback", run, "--json"], env=env)
    assert rolled.exit_code == 0 and json.loads(rolled.output)["recorded"], rolled.output
    assert CheckpointManager(run).view().open_incidents() == [] and health() == 1  # still suspect
    assert replay(run, "--inject", "grad:1:7:scale=10")[0] == 4 and health() == 1  # a drill clears nothing
    code, doc = replay(run, "--json")
    assert code == 0 and doc["replays"][0]["outcome"] == "not-reproduced" and doc["replays"][0]["cleared"], doc
    assert health() == 0
    [rec] = CheckpointManager(run).view().clearances  # read without the key: signed, not checked
    assert (rec.host, rec.by, rec.answers, rec.signature) == (host, "replay", [inc.id], "unchecked")
    status = CliRunner().invoke(vckpt, ["status", run, "--json"], env=env)
    assert json.loads(status.output)["exclude_hosts"] == [], status.output


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


# A bundle altered in an unsigned run: the record re-written with its digest recomputed (and no signature), so
# the digest and signature checks pass and only the replay's own checks stand between the bundle and the model.
# Each alteration is (record edit, tensors edit, raw bytes edit), written without the code under test.
DELETE = object()


def rng_of(size: int) -> Callable[[dict], None]:
    return lambda ts: ts.__setitem__("rng/1/0/cpu", ts["rng/1/0/cpu"][:size].clone())


def sets(path: str, value: object) -> Callable[[dict], None]:
    """An edit of the record: the field at a dotted path (list positions as numbers) set to ``value``, or deleted."""

    def edit(doc: dict) -> None:
        *parents, leaf = path.split(".")
        node: object = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]  # type: ignore[index]
        if value is DELETE:
            del node[leaf]  # type: ignore[attr-defined]
        else:
            node[int(leaf) if isinstance(node, list) else leaf] = value  # type: ignore[index]

    return edit


MB = "suspects.0.microbatches.0"
ALTERED = {  # name: (record edit, tensors edit, raw edit, exit code, what the line names)
    "microbatch shape": (None, lambda ts: ts.__setitem__("mb/1/0/0", ts["mb/1/0/0"][:, :15].clone()), None, 2,
                         "do not run through the given model"),
    "microbatch dtype": (None, lambda ts: ts.__setitem__("mb/1/0/0", ts["mb/1/0/0"].double()), None, 2,
                         "do not run through the given model"),
    "leaf count up": (sets(f"{MB}.leaves", 3), None, None, 1, "leaves where its spec takes 2"),
    "leaf count down": (sets(f"{MB}.leaves", 1), None, None, 1, "leaves where its spec takes 2"),
    "spec and leaves of one tensor": (lambda d: d["suspects"][0]["microbatches"][0].update(spec=["tuple", ["t"]], leaves=1),
                                      None, None, 1, "its record does not name"),
    "spec of three tensors": (sets(f"{MB}.spec", ["tuple", ["t", "t", "t"]]), None, None, 1, "spec takes 3"),
    "spec not a structure": (sets(f"{MB}.spec", ["tuple", [["t"]]]), None, None, 1, "is not a batch structure"),
    "spec a map of two keys for one part": (sets(f"{MB}.spec", ["map", ["x", "y"], ["t"], ""]), None, None, 1,
                                            "is not a batch structure"),
    "spec a map the loss cannot take": (sets(f"{MB}.spec", ["map", ["x", "y"], ["t", "t"], ""]), None, None, 2,
                                        "do not run through the given model"),
    "spec a leaf that is an object": (sets(f"{MB}.spec", ["tuple", ["t", "t", ["leaf", {"a": 1}]]]), None, None, 1,
                                      "is not a batch structure"),
    "suspect rank negative": (sets("suspects.0.rank", -1), None, None, 1, "suspects[0].rank must be an int"),
    "suspect rank past the world": (sets("suspects.0.rank", 3), None, None, 1, "its tensors lack mb/3/0/0"),
    "suspect rank huge": (sets("suspects.0.rank", 1 << 40), None, None, 1, "suspects[0].rank must be an int"),
    "suspect rank a string": (sets("suspects.0.rank", "1"), None, None, 1, "suspects[0].rank must be an int"),
    "suspect rank a float": (sets("suspects.0.rank", 1.0), None, None, 1, "suspects[0].rank must be an int"),
    "suspect rank a bool": (sets("suspects.0.rank", True), None, None, 1, "suspects[0].rank must be an int"),
    "suspect is its own reference": (sets("suspects.0.reference_rank", 1), None, None, 1, "is a suspect"),
    "suspect twice": (lambda d: d["suspects"].append(d["suspects"][0]), None, None, 1, "name rank 1 twice"),
    "no suspect": (sets("suspects", []), None, None, 1, "suspects must be a list of 1"),
    "no microbatch": (sets("suspects.0.microbatches", []), None, None, 1, "microbatches must be a list of 1"),
    "missing field": (sets("layout", DELETE), None, None, 1, "'layout' differ"),
    "missing suspect field": (sets("suspects.0.recorded", DELETE), None, None, 1, "'recorded' differ"),
    "missing microbatch field": (sets(f"{MB}.cuda", DELETE), None, None, 1, "'cuda' differ"),
    "extra field": (sets("extra", 1), None, None, 1, "'extra' differ"),
    "extra suspect field": (sets("suspects.0.extra", 1), None, None, 1, "'extra' differ"),
    "cuda state claimed": (sets(f"{MB}.cuda", True), None, None, 1, "its tensors lack rng/1/0/cuda"),
    "layout past the parameters": (sets("layout", [[0, [0, 1, 2, 3, 4, 99]]]), None, None, 1, "layout[0][1][5]"),
    "layout empty bucket": (sets("layout", [[0, []]]), None, None, 1, "layout[0][1] must be a list of 1"),
    "layout parameter twice": (sets("layout", [[0, [0, 1, 2]], [1, [2, 3, 4, 5]]]), None, None, 1, "repeats"),
    "layout no bucket": (sets("layout", []), None, None, 1, "layout must be a list of 1"),
    "lanes zero": (sets("lanes", 0), None, None, 1, "lanes must be an int from 1 to 16"),
    "lanes huge": (sets("lanes", 10**9), None, None, 1, "lanes must be an int from 1 to 16"),
    "lanes not the projections": (sets("lanes", 2), None, None, 1, "holds 1 projections, and the bundle's lanes say 2"),
    "seed overflowing": (sets("seed", 1 << 70), None, None, 1, "seed must be an int"),
    "mode unknown": (sets("mode", "fast"), None, None, 1, "mode must be one of"),
    "rtol not a float": (sets("rtol", "x"), None, None, 1, "rtol must be a float"),
    "rtol negative": (sets("rtol", (-1.0).hex()), None, None, 1, "rtol a finite float > 0"),
    "step negative": (sets("step", -1), None, None, 1, "step must be an int"),
    "step a string": (sets("step", "7"), None, None, 1, "step must be an int"),
    "recorded loss not a float": (sets("suspects.0.recorded.loss", 3), None, None, 1, "recorded.loss must be a float"),
    "recorded lanes of one": (sets("suspects.0.recorded.lanes", [1]), None, None, 1, "recorded.lanes must be null"),
    "host not a name": (sets("suspects.0.host", 5), None, None, 1, "suspects[0].host: host 5 is not an RFC 1123"),
    "host with a newline": (sets("suspects.0.host", "vm\nnot reproduced"), None, None, 1, "suspects[0].host: host 'vm\\nnot reproduced' is not"),
    "kind with an escape": (sets("kind", "abft\x1b[2J"), None, None, 1, "kind must be a printable name"),
    "parameter name with a newline": (sets("params.0", "0.weight\nok"), None, None, 1, "params[0] must be a printable"),
    "parameter named twice": (sets("params.1", "0.weight"), None, None, 1, "params names one entry twice"),
    "parameter renamed": (sets("params.0", "0.w"), None, None, 2, "not the one trained"),
    "parameter reshaped": (None, lambda ts: ts.__setitem__("param/0", ts["param/0"][:, :15].clone()), None, 2,
                           "parameter 0.weight is (64, 16)"),
    "parameter retyped": (None, lambda ts: ts.__setitem__("param/0", ts["param/0"].double()), None, 2,
                          "build the same architecture"),
    "buffer added": (sets("buffers", ["running_mean"]), lambda ts: ts.__setitem__("buffer/0", ts["param/1"].clone()),
                     None, 2, "not the one trained"),
    "tensor removed": (None, lambda ts: ts.pop("mb/1/0/1"), None, 1, "its tensors lack mb/1/0/1"),
    "tensor added": (None, lambda ts: ts.__setitem__("mb/1/0/2", ts["mb/1/0/1"].clone()), None, 1,
                     "hold mb/1/0/2, which its record does not name"),
    "random state truncated": (None, rng_of(100), None, 1, "rng/1/0/cpu is (100,) torch.uint8, not a random state"),
    "random state garbled": (None, lambda ts: ts["rng/1/0/cpu"].random_(0, 256), None, 1,
                             "rng/1/0/cpu is not a random state torch can take"),
    "random state retyped": (None, lambda ts: ts.__setitem__("rng/1/0/cpu", ts["rng/1/0/cpu"].float()), None, 1,
                             "not a random state"),
    "tensors truncated": (None, None, lambda raw: raw[: len(raw) // 2], 1, "holds no readable tensors"),
    "size not an int": (lambda d: d.update(nbytes=str(d["nbytes"])), None, None, 1, "nbytes must be an int"),
    "digest not a digest": (sets("digest", "zz"), None, None, 1, "digest must be a blake3 hex digest"),
}


def alter(root: str, tmp_path, record=None, tensors=None, raw=None) -> tuple[str, str]:
    import shutil

    import blake3
    from safetensors.torch import load, save

    run = str(tmp_path / "grad")
    shutil.copytree(os.path.join(root, "grad"), run)
    [inc] = CheckpointManager(run).incidents()
    base = os.path.join(run, "replay", inc.id)
    with open(base + ".json") as f:
        doc = json.load(f)
    with open(base + ".safetensors", "rb") as f:
        data = f.read()
    if tensors is not None:
        ts = load(data)
        tensors(ts)
        data = save(ts)
    if raw is not None:
        data = raw(data)
    doc["nbytes"], doc["digest"], doc["signature"] = len(data), blake3.blake3(data).hexdigest(), None
    if record is not None:
        record(doc)
    with open(base + ".safetensors", "wb") as f:
        f.write(data)
    with open(base + ".json", "w") as f:
        json.dump(doc, f)
    return run, inc.id


@pytest.mark.parametrize("name", sorted(ALTERED))
def test_a_bundle_altered_with_its_digest_recomputed_is_refused_in_one_line_never_a_traceback(runs, tmp_path, name):
    record, tensors, raw, code, phrase = ALTERED[name]
    run, inc = alter(runs[0], tmp_path, record, tensors, raw)
    r = CliRunner().invoke(vckpt, ["replay", run, "--incident", inc, "--model", MODEL, "--json"],
                           env={"VCKPT_SIGNING_KEY": None})  # the unsigned run the red team wrote into
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output and r.output.count("\n") == 1, r.output
    assert r.exit_code == code and r.stderr.startswith("error: no verdict: ") and phrase in r.stderr, r.output
    assert r.stdout == ""  # no verdict printed, not even with --json: a refusal is not an "inconclusive"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["microbatch shape", "leaf count up", "spec of three tensors", "suspect rank past the world"])
def test_the_red_teams_altered_bundles_end_a_real_vckpt_replay_with_one_line_and_no_verdict(runs, tmp_path, name):
    import subprocess
    import sys

    record, tensors, raw, code, phrase = ALTERED[name]
    run, inc = alter(runs[0], tmp_path, record, tensors, raw)
    env = {k: v for k, v in os.environ.items() if k != "VCKPT_SIGNING_KEY"}
    done = subprocess.run([sys.executable, "-m", "verified_ckpt_cli.main", "replay", run, "--incident", inc, "--model",
                           MODEL, "--json"], capture_output=True, text=True, timeout=100, env=env, check=False)
    assert done.returncode == code and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: no verdict: ") and phrase in done.stderr
    assert "Traceback" not in done.stderr


def test_an_incident_id_that_is_not_one_is_a_usage_error_before_the_store_is_read(runs):
    run = os.path.join(runs[0], "grad")
    for ident in ("../grad", "../../etc/passwd", "a/b", "", ".."):
        r = CliRunner().invoke(vckpt, ["replay", run, "--incident", ident, "--model", MODEL])
        assert r.exit_code == 2 and "Traceback" not in r.output and r.output.count("\n") == 1, r.output
        assert f"--incident {ident!r} is not an incident id" in r.output, r.output


def test_replay_says_that_model_imports_the_file_it_names():
    r = CliRunner().invoke(vckpt, ["replay", "--help"])
    assert r.exit_code == 0 and "imported: its top-level code runs" in " ".join(r.output.split())
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "RECOVERY.md")) as f:
        assert "`--model` imports" in f.read()


_SCALARS = st.none() | st.booleans() | st.integers(-(1 << 60), 1 << 60) | st.text(max_size=8) \
    | st.floats(allow_nan=False, allow_infinity=False)
_BATCHES = st.recursive(
    _SCALARS | st.integers(0, 3).map(lambda n: torch.zeros(n)),
    lambda inner: st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(_BATCHES)
def test_every_batch_structure_the_guard_writes_is_one_the_bundle_reader_takes(batch):
    tensors, spec = batches.encode(batch)
    spec = json.loads(json.dumps(spec))  # as the record stores it
    assert batches.leaves(spec) == len(tensors)
    rebuilt = batches.decode(tensors, spec)
    assert batches.encode(rebuilt)[1] == spec
