"""Sharded (FSDP2/HSDP) checkpoints on real gloo ranks: verified saves, resharding restores, bitwise equality."""

from __future__ import annotations

import itertools

import pytest
import torch
from dist_harness import run_ranks
from helpers import resealed
from safetensors.torch import load_file, save_file

from verified_ckpt import CheckpointManager, CorruptCheckpoint

pytestmark = pytest.mark.timeout(240)

WIDTHS = [12, 15, 9, 6]  # 15 and 9 split unevenly over 2 and 4 shards


def build(mesh_shape: tuple[int, int] | None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same model on any mesh (``None``: one plain process), with AdamW."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in itertools.pairwise(WIDTHS)])
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, WIDTHS[0], generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def consolidated(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full parameters and optimizer moments by name (collective on a mesh)."""
    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    out = {f"model.{k}": full(v).clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim.{names[id(p)]}.{k}"] = full(v).clone().reshape(-1) if v.dim() == 0 else full(v).clone()
    return out


def save_hsdp(rank: int, world: int, run: str, ref: str) -> str:
    model, opt = build((3, 2))
    train(model, opt, range(3), rank)
    mgr = CheckpointManager(run)
    pending = mgr.save(3, {"model": model, "optim": opt}, blocking=False)  # the non-blocking path, sharded
    info = pending.result()
    full = consolidated(model, opt)
    train(model, opt, range(3, 6), rank)  # the uninterrupted run, for the resumed one to match
    later = consolidated(model, opt)
    if rank == 0:
        save_file(full, ref)
        save_file(later, ref + ".later")
    return info.id


def restore_on(rank: int, world: int, run: str, ref: str, mesh: list[int] | None, resume: bool = False) -> list[str]:
    model, opt = build(tuple(mesh) if mesh else None)
    CheckpointManager(run).restore({"model": model, "optim": opt}, allow_unverified=True)
    if resume:
        train(model, opt, range(3, 6), rank)
    full = consolidated(model, opt)
    want = load_file(ref + ".later" if resume else ref)
    assert sorted(full) == sorted(want)
    return [k for k in want if not torch.equal(full[k], want[k])]


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("hsdp")
    run, ref = str(d / "run"), str(d / "ref.safetensors")
    ids = run_ranks(save_hsdp, 6, run, ref)
    assert len(set(ids)) == 1
    return run, ref


def test_hsdp_save_writes_each_chunk_once_with_its_global_layout(hsdp_run):
    run, _ = hsdp_run
    [info] = CheckpointManager(run).list()
    m = info.manifest
    assert m.topology.world_size == 6
    w = m.layout["model/1.weight"]
    assert w.shape == [9, 15] and len(w.chunks) == 2  # sharded over 2, replicated over 3: stored once per shard
    assert sorted(c.offsets[0] for c in w.chunks) == [0, 5]
    assert {s.path.split("-")[1] for s in m.shards if s.path.startswith("chunks-")} != {"r00000"}  # spread out
    assert "optim/state/0/exp_avg" in m.layout and "optim/state/0/step" in m.tensors
    [result] = CheckpointManager(run).verify(step=3)
    assert result.ok, result.problems


@pytest.mark.parametrize("world,mesh", [(4, [2, 2]), (4, [1, 4]), (1, None)], ids=["2x2", "1x4", "single"])
def test_hsdp_checkpoint_restores_bitwise_on_another_mesh(hsdp_run, world, mesh):
    run, ref = hsdp_run
    if world == 1:
        assert restore_on(0, 1, run, ref, None) == []
    else:
        assert run_ranks(restore_on, world, run, ref, mesh) == [[]] * world


def test_a_run_resumed_at_3x2_matches_the_uninterrupted_run_bit_for_bit(hsdp_run):
    run, ref = hsdp_run
    assert run_ranks(restore_on, 6, run, ref, [3, 2], True) == [[]] * 6


def test_a_flipped_byte_in_a_chunk_fails_the_restore_before_anything_is_touched(hsdp_run, tmp_path):
    import shutil

    run, _ = hsdp_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    [info] = CheckpointManager(str(copy)).list()
    shard = next(s.path for s in info.manifest.shards if s.path.startswith("chunks-"))
    path = copy / "checkpoints" / info.id / shard
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(data)
    model, opt = build(None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CorruptCheckpoint):
        CheckpointManager(str(copy)).restore({"model": model, "optim": opt}, allow_unverified=True)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not opt.state


def dcp_roundtrip(rank: int, world: int, run: str, flip: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from verified_ckpt.integrations.dcp import VerifiedStorageReader, VerifiedStorageWriter, load

    model, opt = build((3, 2))
    train(model, opt, range(2), rank)
    msd, osd = get_state_dict(model, opt)
    mgr = CheckpointManager(run)
    writer = VerifiedStorageWriter(mgr, 2)
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
    want = consolidated(model, opt)
    if flip:
        if rank == 0:
            [info] = mgr.list()
            shard = sorted(s.path for s in info.manifest.shards)[-1]
            path = f"{run}/checkpoints/{info.id}/{shard}"
            with open(path, "r+b") as f:
                f.seek(-2, 2)
                b = f.read(1)
                f.seek(-2, 2)
                f.write(bytes([b[0] ^ 1]))
        torch.distributed.barrier()
    fresh, fopt = build((3, 2))
    train(fresh, fopt, range(5, 6), rank)  # other values, and optimizer state to load into
    before = consolidated(fresh, fopt)
    msd, osd = get_state_dict(fresh, fopt)
    try:
        load({"model": msd, "optim": osd}, VerifiedStorageReader(mgr, allow_unverified=True))
    except BaseException as e:
        after = consolidated(fresh, fopt)
        return {"error": type(e).__name__ + ": " + str(e),
                "untouched": all(torch.equal(after[k], before[k]) for k in before)}
    set_state_dict(fresh, fopt, model_state_dict=msd, optim_state_dict=osd)
    got = consolidated(fresh, fopt)
    return {"error": None, "equal": all(torch.equal(got[k], want[k]) for k in want)}


def test_dcp_save_and_load_through_the_verified_storage_round_trip_on_hsdp(tmp_path):
    results = run_ranks(dcp_roundtrip, 6, str(tmp_path / "run"), False)
    assert all(r["error"] is None and r["equal"] for r in results), results
    [info] = CheckpointManager(str(tmp_path / "run")).list()
    assert info.manifest.layout and not any(s.path.endswith(".metadata") for s in info.manifest.shards)
    [result] = CheckpointManager(str(tmp_path / "run")).verify()
    assert result.ok, result.problems


def test_dcp_load_of_a_flipped_chunk_fails_on_every_rank_before_a_parameter_is_touched(tmp_path):
    results = run_ranks(dcp_roundtrip, 6, str(tmp_path / "run"), True)
    assert all(r["error"] and "digest" in r["error"] and r["untouched"] for r in results), results
    # The library's own error, the same on every rank (DCP would wrap it in its CheckpointException).
    assert len({r["error"] for r in results}) == 1 and results[0]["error"].startswith("CorruptCheckpoint: ")


def test_the_cli_lists_shows_verifies_and_exports_a_sharded_checkpoint(hsdp_run, tmp_path):
    import json

    from click.testing import CliRunner

    from verified_ckpt_cli.main import main

    run, _ = hsdp_run

    def vckpt(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, list(args))
        assert "Traceback" not in result.output
        return result.exit_code, result.output

    code, out = vckpt("list", run, "--json")
    assert code == 0 and json.loads(out)[0]["step"] == 3
    code, out = vckpt("show", run, "3", "--json")
    assert code == 0 and "model/1.weight" in json.loads(out)["manifest"]["layout"]
    code, out = vckpt("verify", run, "--step", "3")
    assert code == 0, out
    code, out = vckpt("restore", run, "--step", "3", "--to", str(tmp_path / "out"), "--allow-unverified")
    assert code == 0, out
    [info] = CheckpointManager(run).list()
    assert {p.name for p in (tmp_path / "out").iterdir()} == {s.path for s in info.manifest.shards} | {"manifest.json"}


def test_a_sharded_restore_and_verify_never_unpickle(hsdp_run, monkeypatch):
    import _pickle
    import pickle

    run, ref = hsdp_run
    calls = []

    def refuse(*a, **k):
        calls.append(a[:1])
        raise RuntimeError("pickle loading is forbidden on the load path")

    for mod in (pickle, _pickle):
        monkeypatch.setattr(mod, "load", refuse)
        monkeypatch.setattr(mod, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    assert restore_on(0, 1, run, ref, None) == []
    assert all(r.ok for r in CheckpointManager(run).verify())
    assert calls == []


def _manifest_with_layout(layout: dict, tensors: dict) -> bytes:
    import json

    shard = {"path": "chunks-r00000-00000.safetensors", "size": 1 << 20, "digest": "0" * 64, "tensors": sorted(tensors)}
    doc = {"schema_version": 1, "run_id": "r", "checkpoint_id": "step-0000000001-abcd", "step": 1,
           "created_at": "2026-01-01T00:00:00+00:00", "topology": {}, "shards": [shard],
           "tensors": {n: {"dtype": "float32", "shape": s, "shard": shard["path"], "fingerprint": "0" * 32}
                       for n, s in tensors.items()},
           "state_fingerprint": "0" * 32, "state": {"w": {"stateful": False, "value": {"__tensor__": "w"}}},
           "evidence": {}, "status": "unverified", "reasons": [], "layout": layout}
    return json.dumps(resealed(doc)).encode()


@pytest.mark.parametrize("chunks,tensors,why", [
    ([{"offsets": [0], "tensor": "w@0"}, {"offsets": [4], "tensor": "w@4"}], {"w@0": [4], "w@4": [4]}, None),
    ([{"offsets": [0], "tensor": "w@0"}, {"offsets": [6], "tensor": "w@4"}], {"w@0": [4], "w@4": [4]}, "outside"),
    ([{"offsets": [0], "tensor": "w@0"}, {"offsets": [2], "tensor": "w@4"}], {"w@0": [4], "w@4": [2]}, "elements"),
    ([{"offsets": [0], "tensor": "w@0"}, {"offsets": [4], "tensor": "nope"}], {"w@0": [4], "w@4": [4]}, "not stored"),
    ([{"offsets": [0], "tensor": "w@0"}, {"offsets": [4], "tensor": "w@0"}], {"w@0": [4]}, "two chunks"),
    ([{"offsets": [0, 0], "tensor": "w@0"}], {"w@0": [8]}, "dimensions"),
    ([], {"w@0": [8]}, "1 to"),
])
def test_a_manifest_layout_is_refused_unless_its_chunks_fit_the_tensor(chunks, tensors, why):
    from verified_ckpt.errors import ManifestError
    from verified_ckpt.manifest import Manifest

    layout = {"w": {"dtype": "float32", "shape": [8], "chunks": chunks}}
    data = _manifest_with_layout(layout, tensors)
    if why is None:
        assert Manifest.from_json(data, "x").layout["w"].shape == [8]
    else:
        with pytest.raises(ManifestError, match=why):
            Manifest.from_json(data, "x")


def test_overlapping_chunks_that_add_up_are_refused_when_a_restore_assembles_them():
    from verified_ckpt.layout import Chunk, LayoutEntry
    from verified_ckpt.sharding import assemble

    entry = LayoutEntry("float32", [8], [Chunk([0], "a"), Chunk([2], "b"), Chunk([6], "c")])  # 4 + 2 + 2 = 8, overlap
    loaded = {"a": torch.zeros(4), "b": torch.ones(2), "c": torch.ones(2)}
    with pytest.raises(CorruptCheckpoint, match="exactly once"):
        assemble("w", entry, None, {n: list(t.shape) for n, t in loaded.items()}, loaded)


@pytest.mark.parametrize("value,ok", [({"0": 1, "1": 2}, True), ({"0": 1, "2": 2}, False), ({}, False), ([1, 2], False)])
def test_a_per_rank_entry_holds_one_value_per_rank_0_to_w_minus_1(value, ok):
    import json

    from verified_ckpt.errors import ManifestError
    from verified_ckpt.manifest import Manifest

    doc = json.loads(_manifest_with_layout({"w": {"dtype": "float32", "shape": [4], "chunks": [
        {"offsets": [0], "tensor": "w@0"}]}}, {"w@0": [4]}))
    doc["state"]["rng"] = {"stateful": True, "per_rank": True, "value": value}
    if ok:
        m = Manifest.from_json(json.dumps(resealed(doc)).encode(), "x")
        assert m.for_rank(1).state["rng"]["value"] == 2 and m.for_rank(3).state["rng"]["value"] == 2
    else:
        with pytest.raises(ManifestError, match="per-rank"):
            Manifest.from_json(json.dumps(doc).encode(), "x")
