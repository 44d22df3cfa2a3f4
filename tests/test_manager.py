"""CheckpointManager: bitwise round trips, commit protocol, corruption, refusals, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import fsspec
import pytest
import safetensors.torch
import torch

from helpers import flip_byte, fresh_state, resealed, trained_state
from verified_ckpt import (
    CheckpointManager,
    CheckpointNotFound,
    CheckpointNotRestorable,
    CorruptCheckpoint,
    InvalidRunURL,
    InvalidState,
    RunNotFound,
    Status,
    state_fingerprint,
)


def snapshot(url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(url)
    return {p: fs.cat_file(p) for p in fs.find(root)}


def tensors_equal_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
        elif isinstance(a[k], dict):
            tensors_equal_bitwise(a[k], b[k])
        else:
            assert a[k] == b[k], k


@pytest.fixture(params=["memory", "local"])
def url(request, memory_url, local_url):
    return memory_url if request.param == "memory" else local_url


def test_round_trip_model_adamw_scheduler_rng_is_bitwise(url):
    saved = trained_state(seed=1)
    mgr = CheckpointManager(url)
    info = mgr.save(3, saved)
    expected_draws = torch.rand(5)  # drawn after saving: the restored RNG must repeat them
    target = fresh_state(seed=7)
    assert state_fingerprint(target) != state_fingerprint(saved)
    got = mgr.restore(target, allow_unverified=True)
    assert got.id == info.id
    tensors_equal_bitwise(saved["model"].state_dict(), target["model"].state_dict())
    assert saved["optim"].state_dict()["param_groups"] == target["optim"].state_dict()["param_groups"]
    for k, v in saved["optim"].state_dict()["state"].items():
        tensors_equal_bitwise(v, target["optim"].state_dict()["state"][k])
    assert saved["sched"].state_dict() == target["sched"].state_dict()
    assert target["data"] == {"position": 1234, "epoch": 2}
    assert torch.equal(torch.rand(5), expected_draws)
    assert info.manifest.state_fingerprint == str(state_fingerprint(target))


def test_training_continues_identically_after_restore(local_url):
    a = trained_state(seed=2)
    mgr = CheckpointManager(local_url)
    mgr.save(3, a)

    def step(s):
        x = torch.randint(0, 32, (4, 5))
        loss = torch.nn.functional.cross_entropy(s["model"](x).reshape(-1, 32), x.reshape(-1))
        loss.backward()
        s["optim"].step()
        s["optim"].zero_grad()
        s["sched"].step()

    step(a)
    b = fresh_state()
    mgr.restore(b, allow_unverified=True)
    step(b)
    assert state_fingerprint({"m": a["model"], "o": a["optim"]}) == state_fingerprint({"m": b["model"], "o": b["optim"]})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int32,
                                   torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_every_supported_dtype_round_trips(local_url, dtype):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (7, 5 * torch.empty((), dtype=dtype).element_size()), dtype=torch.uint8, generator=g)
    t = (src[:, :5] & 1).bool() if dtype == torch.bool else src.view(dtype)
    mgr = CheckpointManager(local_url)
    info = mgr.save(1, {"t": t, "plain": {"x": t[1:3]}})
    shard = info.manifest.shards[0].path
    # The safetensors library itself reads the shard we wrote.
    lib = safetensors.torch.load_file(os.path.join(local_url, "checkpoints", info.id, shard))
    assert torch.equal(lib["t"].view(torch.uint8), t.view(torch.uint8))
    into = {"t": torch.zeros_like(t), "plain": None}
    mgr.restore(into, allow_unverified=True)
    assert torch.equal(into["t"].view(torch.uint8), t.view(torch.uint8))
    assert torch.equal(into["plain"]["x"].view(torch.uint8), t[1:3].view(torch.uint8))


def test_tied_weights_are_stored_once_and_stay_tied(local_url):
    s = trained_state()
    info = CheckpointManager(local_url).save(3, s)
    names = set(info.manifest.tensors)
    assert ("model/emb.weight" in names) != ("model/out.weight" in names)
    t = fresh_state()
    CheckpointManager(local_url).restore(t, allow_unverified=True)
    assert t["model"].out.weight is t["model"].emb.weight
    assert torch.equal(t["model"].out.weight, s["model"].emb.weight)
    shared = torch.arange(6.0)
    CheckpointManager(local_url).save(4, {"pair": {"a": shared, "b": shared}})
    back = {"pair": None}
    CheckpointManager(local_url).restore(back, step=4, allow_unverified=True)
    assert back["pair"]["a"] is back["pair"]["b"]


def test_non_contiguous_tensors_round_trip(local_url):
    base = torch.randn(8, 6)
    state = {"t": base.t(), "s": base[::2, 1:]}
    CheckpointManager(local_url).save(0, state)
    into = {"t": torch.zeros(6, 8).t().contiguous().t(), "s": torch.zeros(4, 5)}
    CheckpointManager(local_url).restore(into, allow_unverified=True)
    assert torch.equal(into["t"], base.t()) and torch.equal(into["s"], base[::2, 1:])


def test_shards_split_by_size_and_all_are_listed(local_url):
    state = {f"w{i}": torch.full((256,), float(i)) for i in range(10)}
    info = CheckpointManager(local_url, shard_bytes=2048).save(5, state)
    assert len(info.manifest.shards) == 5
    into = {k: torch.zeros(256) for k in state}
    CheckpointManager(local_url).restore(into, allow_unverified=True)
    assert all(torch.equal(into[k], state[k]) for k in state)


def test_a_save_killed_before_its_manifest_leaves_no_listed_checkpoint(local_url):
    mgr = CheckpointManager(local_url)
    mgr.save(1, {"w": torch.ones(10)})
    script = textwrap.dedent(f"""
        import os, signal, torch
        from verified_ckpt import CheckpointManager
        from verified_ckpt.store import RunStore
        def die(self, cid, data):  # the kill point: every shard written, manifest not yet
            os.kill(os.getpid(), signal.SIGKILL)
        RunStore.commit_manifest = die
        CheckpointManager({local_url!r}).save(2, {{"w": torch.zeros(10)}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode == -9
    folders = os.listdir(os.path.join(local_url, "checkpoints"))
    assert len(folders) == 2  # the killed save did write its shards
    assert [i.step for i in mgr.list()] == [1]
    into = {"w": torch.zeros(10)}
    assert mgr.restore(into, allow_unverified=True).step == 1
    assert torch.equal(into["w"], torch.ones(10))


def test_one_flipped_byte_is_caught_by_verify_and_by_restore(url):
    mgr = CheckpointManager(url)
    info = mgr.save(2, trained_state())
    fs, root = fsspec.core.url_to_fs(url)
    shard = f"{root}/checkpoints/{info.id}/{info.manifest.shards[0].path}"
    flip_byte(fs, shard, fs.size(shard) - 3)
    target = fresh_state()
    before = state_fingerprint(target)
    with pytest.raises(CorruptCheckpoint, match="digest"):
        mgr.restore(target, allow_unverified=True)
    assert state_fingerprint(target) == before  # nothing loaded from a bad checkpoint
    [result] = mgr.verify()
    assert not result.ok and result.problems[0].kind == "digest"
    assert mgr.list()[0].status is Status.CORRUPT
    with pytest.raises(CheckpointNotRestorable, match="corrupt"):
        mgr.restore(target, step=2, allow_unverified=True)


def test_changed_bytes_with_a_recomputed_digest_are_caught_by_fingerprints(local_url):
    """An attacker or bug that rewrites the shard *and* its digest still fails the fingerprint check."""
    mgr = CheckpointManager(local_url)
    info = mgr.save(2, {"w": torch.arange(100.0)})
    d = os.path.join(local_url, "checkpoints", info.id)
    shard = os.path.join(d, info.manifest.shards[0].path)
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 0x01
    open(shard, "wb").write(data)
    import blake3

    from verified_ckpt.crc import Crc64

    crc = Crc64()
    crc.update(bytes(data))
    m = json.loads(open(os.path.join(d, "manifest.json")).read())
    m["shards"][0]["digest"] = blake3.blake3(bytes(data)).hexdigest()
    m["shards"][0]["crc64nvme"] = crc.hexdigest()  # both digests rewritten: the fingerprints still see it
    os.remove(os.path.join(d, "manifest.json"))
    open(os.path.join(d, "manifest.json"), "w").write(json.dumps(resealed(m)))  # its own digest too, as a forger would
    [result] = mgr.verify()
    assert [p.kind for p in result.problems] == ["fingerprint"]


def test_verify_flags_nonfinite_values(local_url):
    mgr = CheckpointManager(local_url)
    mgr.save(1, {"w": torch.tensor([1.0, float("nan")])})
    [r] = mgr.verify()
    assert not r.ok and r.problems[0].kind == "nonfinite"
    assert mgr.list()[0].status is Status.SUSPECT


def test_verify_does_not_flag_finite_values_whose_sum_overflows(local_url):
    """The NaN/Inf scan's fast path is a sum; an overflowing sum must fall back to the exact check."""
    mgr = CheckpointManager(local_url)
    mgr.save(1, {"big": torch.full((10,), 3e38), "half": torch.full((100,), 60000.0, dtype=torch.float16),
                 "inf_pair": torch.tensor([3e38, -3e38, 1.0])})
    mgr.save(2, {"big": torch.full((10,), 3e38), "bad": torch.tensor([float("inf"), -float("inf")]).bfloat16()})
    r1, r2 = mgr.verify()
    assert r1.ok, r1.problems
    assert not r2.ok and [p.kind for p in r2.problems] == ["nonfinite"] and "bad" in r2.problems[0].detail


def test_unverified_is_refused_without_allow_unverified(url):
    mgr = CheckpointManager(url)
    mgr.save(1, {"w": torch.ones(3)})
    into = {"w": torch.zeros(3)}
    with pytest.raises(CheckpointNotRestorable, match="allow_unverified"):
        mgr.restore(into)
    with pytest.raises(CheckpointNotRestorable, match="allow_unverified"):
        mgr.restore(into, step=1)
    assert torch.equal(into["w"], torch.zeros(3))
    assert mgr.list()[0].status is Status.UNVERIFIED


def test_list_is_oldest_first_with_sizes(local_url):
    mgr = CheckpointManager(local_url)
    for step in (5, 3, 9):
        mgr.save(step, {"w": torch.ones(step)})
    infos = mgr.list()
    assert [i.step for i in infos] == [5, 3, 9]
    assert [i.size_bytes for i in infos] == [sum(s.size for s in i.manifest.shards) for i in infos]


# ---------------------------------------------------------------- bad input
def test_unknown_url_scheme():
    with pytest.raises(InvalidRunURL, match="nosuchproto"):
        CheckpointManager("nosuchproto://bucket/run")


def test_missing_run(local_url):
    mgr = CheckpointManager(local_url)
    with pytest.raises(RunNotFound, match="no run at"):
        mgr.restore({"w": torch.zeros(1)})
    with pytest.raises(RunNotFound):
        mgr.verify()
    assert not os.path.exists(local_url)


def test_step_that_does_not_exist(local_url):
    mgr = CheckpointManager(local_url)
    mgr.save(10, {"w": torch.ones(1)})
    before = snapshot(local_url)
    with pytest.raises(CheckpointNotFound, match="steps present: 10"):
        mgr.restore({"w": torch.zeros(1)}, step=11, allow_unverified=True)
    with pytest.raises(CheckpointNotFound):
        mgr.verify(step=11)
    assert snapshot(local_url) == before


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing-field", "wrong-type", "escape", "absolute", "backslash"])
def test_malformed_manifest_is_corrupt_and_never_restored(local_url, damage):
    mgr = CheckpointManager(local_url)
    info = mgr.save(1, {"w": torch.ones(4)})
    path = os.path.join(local_url, "checkpoints", info.id, "manifest.json")
    raw = open(path, "rb").read()
    m = json.loads(raw)
    if damage == "truncate":
        new = raw[: len(raw) // 2]
    elif damage == "garbage":
        new = b"\x00\xff not json"
    elif damage == "missing-field":
        del m["shards"]
        new = json.dumps(m).encode()
    elif damage == "wrong-type":
        m["step"] = "one"
        new = json.dumps(m).encode()
    else:
        evil = {"escape": "../../outside.safetensors", "absolute": "/etc/passwd", "backslash": "..\\..\\x"}[damage]
        m["shards"][0]["path"] = evil
        m["tensors"]["w"]["shard"] = evil
        new = json.dumps(m).encode()
    open(path, "wb").write(new)
    before = snapshot(local_url)
    [listed] = mgr.list()
    assert listed.status is Status.CORRUPT and "malformed" in listed.reasons[0]
    with pytest.raises(CheckpointNotRestorable, match="malformed"):
        mgr.restore({"w": torch.zeros(4)}, step=1, allow_unverified=True)
    assert snapshot(local_url) == before
    [r] = mgr.verify()
    assert not r.ok and r.problems[0].kind == "manifest"


def test_state_that_does_not_fit_is_refused_before_loading(local_url):
    mgr = CheckpointManager(local_url)
    mgr.save(1, {"w": torch.ones(4)})
    into = {"w": torch.zeros(5)}
    with pytest.raises(InvalidState, match="shape"):
        mgr.restore(into, allow_unverified=True)
    with pytest.raises(InvalidState, match="no entry 'other'"):
        mgr.restore({"other": torch.zeros(4)}, allow_unverified=True)
    assert torch.equal(into["w"], torch.zeros(5))


def test_unstorable_values_get_a_clear_error(local_url):
    with pytest.raises(InvalidState, match="cannot store a value of type object"):
        CheckpointManager(local_url).save(1, {"x": {"y": object()}})
    with pytest.raises(InvalidState, match="step must be"):
        CheckpointManager(local_url).save(-1, {"x": 1})
    assert not os.path.exists(os.path.join(local_url, "checkpoints"))


def test_shard_with_wrong_size_is_caught(local_url):
    mgr = CheckpointManager(local_url)
    info = mgr.save(1, {"w": torch.ones(64)})
    shard = os.path.join(local_url, "checkpoints", info.id, info.manifest.shards[0].path)
    with open(shard, "ab") as f:
        f.write(b"extra")
    [r] = mgr.verify()
    assert r.problems[0].kind == "size"
    os.remove(shard)
    [r] = mgr.verify()
    assert r.problems[0].kind == "missing"


def test_gc_removes_only_old_orphans_never_referenced_files(url):
    mgr = CheckpointManager(url)
    info = mgr.save(1, {"w": torch.ones(3)})
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(f"{root}/checkpoints/step-0000000002-deadbeef", exist_ok=True)
    fs.pipe_file(f"{root}/checkpoints/step-0000000002-deadbeef/shard-00000.safetensors", b"half a save")
    fs.pipe_file(f"{root}/checkpoints/{info.id}/rank-00001.json", b"{}")
    before = snapshot(url)
    assert mgr.gc(grace_s=3600) == []  # too young: a save may still be running
    assert sorted(mgr.gc(grace_s=0, dry_run=True)) == [f"{info.id}/rank-00001.json",
                                                        "step-0000000002-deadbeef/shard-00000.safetensors"]
    assert snapshot(url) == before
    assert len(mgr.gc(grace_s=0)) == 2
    left = {p.split("/checkpoints/", 1)[1] for p in snapshot(url) if "/checkpoints/" in p}
    assert left == {f"{info.id}/manifest.json", f"{info.id}/{info.manifest.shards[0].path}"}
    into = {"w": torch.zeros(3)}
    mgr.restore(into, allow_unverified=True)
    assert torch.equal(into["w"], torch.ones(3))

