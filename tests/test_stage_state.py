"""State held in parts (``StageState``) and stages that save one entry, on 2 real gloo ranks.

Each rank holds a different part of one model (``ModuleDict`` keys ``a`` on rank 0, ``b`` on rank 1), each
``fully_shard``-ed over a mesh of its own rank, so every tensor is a DTensor: the case where the ranks hold the
same entry names and the same plain tensors, and different modules.

- a plain module saved by every rank under one name is refused at the save, nothing written (it used to commit
  rank 0's skeleton alone: a checkpoint rank 1 could never restore);
- a ``StageState`` of each part is saved as the union, and restores whole into one process, bit for bit;
- two parts that hold one key with different values are refused at the save, and so are two stages that name
  different layers alike (their parts share some keys and differ in others).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from dist_harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def part(rank: int, lr: float = 0.1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(rank)
    module = torch.nn.ModuleDict({"ab"[rank]: torch.nn.Linear(4, 4)})
    fully_shard(module["ab"[rank]], mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))["dp"])
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    module["ab"[rank]](torch.ones(2, 4)).sum().backward()
    opt.step()
    return module, opt


def saves(rank: int, world: int, base: str) -> dict:
    from verified_ckpt import CheckpointManager, InvalidState, StageState

    warnings.simplefilter("ignore")
    module, opt = part(rank)
    out: dict = {}
    try:
        CheckpointManager(f"{base}/plain").save(1, {"model": module})
        out["plain"] = "saved"
    except InvalidState as e:
        out["plain"] = str(e)
    out["plain listed"] = len(CheckpointManager(f"{base}/plain").list())
    CheckpointManager(f"{base}/parts").save(1, {"model": StageState(module, opt)})
    out["full"] = {n: p.full_tensor().tolist() for n, p in module.named_parameters()}
    other, other_opt = part(rank, lr=0.1 if rank == 0 else 0.2)  # the same names on both ranks below
    renamed = torch.nn.ModuleDict({"a": other["ab"[rank]]})
    try:
        CheckpointManager(f"{base}/clash").save(1, {"model": StageState(renamed, other_opt)})
        out["clash"] = "saved"
    except InvalidState as e:
        out["clash"] = str(e)
    # Rank 1's stage renamed from 0: its first layer is "a" like rank 0's, and it has a "c" of its own.
    alike = torch.nn.ModuleDict({"a": other["ab"[rank]]} | ({"c": part(rank)[0]["ab"[rank]]} if rank else {}))
    try:
        CheckpointManager(f"{base}/alike").save(1, {"model": StageState(alike)})
        out["alike"] = "saved"
    except InvalidState as e:
        out["alike"] = str(e)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("parts")
    return base, run_ranks(saves, 2, str(base), timeout=100)


def test_one_entry_that_the_ranks_hold_as_different_modules_is_refused_at_the_save(saved):
    _, got = saved
    for r in got:
        assert "different contents" in r["plain"] and "StageState" in r["plain"], r["plain"]
        assert r["plain listed"] == 0


def test_parts_are_saved_as_their_union_and_restore_whole_into_one_process(saved):
    from verified_ckpt import CheckpointManager, StageState

    base, got = saved
    m = CheckpointManager(str(base / "parts")).list()[-1].manifest
    assert m is not None and m.state["model"]["parts"] is True and {"a.weight", "b.weight"} <= set(
        m.state["model"]["value"]["model"])
    torch.manual_seed(5)
    whole = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
    opt = torch.optim.AdamW(whole.parameters(), lr=0.1)
    CheckpointManager(str(base / "parts")).restore({"model": StageState(whole, opt)}, allow_unverified=True)
    for rank, r in enumerate(got):
        for n, v in r["full"].items():
            assert torch.equal(whole.get_parameter(n), torch.tensor(v)), (rank, n)
    assert all(float(s["exp_avg"].abs().sum()) > 0 for s in opt.state.values()) and len(opt.state) == 4


def test_parts_that_hold_one_key_with_different_values_are_refused(saved):
    base, got = saved
    for r in got:
        assert "different values" in r["clash"] and "lr" in r["clash"], r["clash"]
        assert "name different layers alike" in r["alike"] and "'model/a.weight'" in r["alike"], r["alike"]
    from verified_ckpt import CheckpointManager

    assert CheckpointManager(str(base / "clash")).list() == [] == CheckpointManager(str(base / "alike")).list()


@pytest.mark.parametrize("entry, why", [
    ({"stateful": False, "value": {}, "parts": True}, "when stateful"),
    ({"stateful": True, "value": [1], "parts": True}, "not a mapping"),
    ({"stateful": True, "value": {}, "parts": False}, r"parts \(true\)"),
])
def test_a_manifest_entry_marked_in_parts_is_parsed_strictly(tmp_path, entry, why):
    from verified_ckpt import CheckpointManager, ManifestError, Manifest

    CheckpointManager(str(tmp_path)).save(1, {"x": {"y": 1}})
    info = CheckpointManager(str(tmp_path)).list()[-1]
    assert info.manifest is not None
    doc = info.manifest.to_dict()
    doc["state"]["x"] = entry
    with pytest.raises(ManifestError, match=why):
        Manifest.from_dict(json.loads(json.dumps(doc)), "test")
