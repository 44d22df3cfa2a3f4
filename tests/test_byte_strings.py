"""Byte strings in a saved state (bytes, bytearray, io.BytesIO): raw bytes in the shards, their type in the skeleton,
checked like every tensor, and back with the same type and content through restore, DCP and export."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from dist_harness import run_ranks
from helpers import resealed

from verified_ckpt import CheckpointManager, CorruptCheckpoint, InvalidState, ManifestError
from verified_ckpt.flatten import flatten, unflatten
from verified_ckpt.manifest import Manifest

pytestmark = pytest.mark.timeout(180)

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
BIG = 5 << 20


def flip_within(path: str, needle: bytes, at: int) -> None:
    """Flip one bit of the stored copy of ``needle`` in the file ``path``, ``at`` bytes into it (raw file I/O)."""
    data = bytearray(Path(path).read_bytes())
    data[data.index(needle) + at] ^= 0x01
    Path(path).write_bytes(bytes(data))


def big_blob() -> bytes:
    return torch.randint(0, 256, (BIG,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)).numpy().tobytes()


class BlobState:
    """A Stateful whose state is a byte string, as PyTorch's own DCP tests keep one (test_file_system_checkpoint_cpu)."""

    def __init__(self, value: bytes) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state_dict: dict) -> None:
        self.state = state_dict


class WithExtraState(torch.nn.Module):
    """A module whose extra state is a byte string (a tokenizer file kept with the weights)."""

    def __init__(self, blob: bytes = b"") -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.blob = blob

    def get_extra_state(self) -> bytes:
        return self.blob

    def set_extra_state(self, state: bytes) -> None:
        self.blob = state


def saved_state() -> dict:
    torch.manual_seed(0)
    reader = io.BytesIO(b"records: one two three")
    reader.seek(9)  # a reader part-way through its stream: where it stands is state too
    return {
        "model": WithExtraState(b"tokenizer.json \x00\xff contents"),
        "tokenizer": b"\x00\x01raw tokenizer file\xff",
        "loader": {"state": bytearray(b"loader-state"), "stream": reader, "empty": b"", "nested": [b"a", (b"b", 3)]},
        "vocab": {b"\xe4\xb8\xad": 0, b"": 1, "plain": 2},
        "blob": BlobState(b"SomeBlobForTesting"),
        "big": big_blob(),
    }


def fresh_state() -> dict:
    torch.manual_seed(9)
    return {"model": WithExtraState(), "tokenizer": None, "loader": {"stream": io.BytesIO(b"other")}, "vocab": {},
            "blob": BlobState(b""), "big": b""}


def assert_same(got: dict, want: dict) -> None:
    assert got["model"].blob == want["model"].blob
    live, saved = got["model"].state_dict(), want["model"].state_dict()
    assert all(torch.equal(live[k], saved[k]) for k in ("lin.weight", "lin.bias"))
    assert type(got["tokenizer"]) is bytes and got["tokenizer"] == want["tokenizer"]
    loader = got["loader"]
    assert type(loader["state"]) is bytearray and loader["state"] == want["loader"]["state"]
    assert type(loader["stream"]) is io.BytesIO and loader["stream"].getvalue() == b"records: one two three"
    assert loader["stream"].tell() == 9 and loader["stream"].read(3) == b"one"
    assert loader["empty"] == b"" and type(loader["empty"]) is bytes
    assert loader["nested"] == [b"a", (b"b", 3)]
    assert got["vocab"] == {b"\xe4\xb8\xad": 0, b"": 1, "plain": 2}
    assert got["blob"].state == {"blob": b"SomeBlobForTesting"}
    assert type(got["big"]) is bytes and got["big"] == want["big"]


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("where", ["memory", "local"])
def test_byte_strings_round_trip_with_their_type_and_content_wherever_they_sit_in_the_state(
        where, blocking, memory_url, local_url):
    url = memory_url if where == "memory" else local_url
    want = saved_state()
    mgr = CheckpointManager(url)
    mgr.save(1, want, blocking=blocking)
    mgr.wait()
    want["loader"]["state"][0:6] = b"LATER!"  # changed after the save: the checkpoint holds what was saved
    got = fresh_state()
    CheckpointManager(url).restore(got, allow_unverified=True)
    want["loader"]["state"][0:6] = b"loader"
    assert_same(got, want)
    [result] = mgr.verify()
    assert result.ok, result.problems


def test_a_byte_string_is_raw_bytes_in_a_shard_and_never_inflates_the_manifest(local_url):
    blob, written = big_blob(), io.BytesIO()
    written.write(b"x" * 1000)  # a buffer just written: its position is at its end
    info = CheckpointManager(local_url).save(1, {"big": blob, "io": written})
    folder = os.path.join(local_url, "checkpoints", info.id)
    assert os.path.getsize(os.path.join(folder, "manifest.json")) < 4096  # no base64 of 5 MiB
    assert info.manifest.tensors["big"].dtype == "uint8" and info.manifest.tensors["big"].shape == [BIG]
    assert info.manifest.state["big"]["value"] == {"__bytes__": "big"}
    assert info.manifest.state["io"]["value"] == {"__bytesio__": ["io", 1000]}
    assert blob in Path(folder, info.manifest.tensors["big"].shard).read_bytes()


def test_a_flipped_byte_in_a_stored_byte_string_fails_verify_and_restore_with_nothing_touched(local_url):
    blob = bytes(range(256)) * 64
    mgr = CheckpointManager(local_url)
    info = mgr.save(1, {"w": torch.ones(8), "tok": blob})
    path = os.path.join(local_url, "checkpoints", info.id, info.manifest.tensors["tok"].shard)
    flip_within(path, blob, 1000)
    into = {"w": torch.zeros(8), "tok": b"mine"}
    with pytest.raises(CorruptCheckpoint, match="digest"):
        CheckpointManager(local_url).restore(into, step=1, allow_unverified=True)
    assert torch.equal(into["w"], torch.zeros(8)) and into["tok"] == b"mine"
    [result] = mgr.verify()
    assert not result.ok and result.problems[0].kind == "digest"


def test_the_skeleton_grammar_takes_byte_strings_and_refuses_every_malformed_one(memory_url):
    info = CheckpointManager(memory_url).save(1, {"w": torch.ones(2), "b": b"xy", "io": io.BytesIO(b"z")})
    doc = info.manifest.to_dict()

    def parses(entry: str, value: object) -> bool:
        changed = json.loads(json.dumps(doc))
        changed["state"][entry]["value"] = value
        try:
            Manifest.from_dict(resealed(changed), "test")
        except ManifestError:
            return False
        return True

    good = [{"__bytes__": "b"}, {"__bytearray__": "b"}, {"__bytesio__": ["b", 0]}, {"__bytesio__": ["io", 5]},
            {"__dict__": [[{"__bytes__": "b"}, 1]]}, {"__dict__": [[{"__tuple__": [{"__bytes__": "b"}]}, 1]]}]
    assert all(parses("b", v) for v in good)
    bad = [{"__bytes__": "w"},  # a float tensor is no byte string
           {"__bytes__": "missing"}, {"__bytes__": 3}, {"__bytearray__": ["b"]},
           {"__bytesio__": "io"}, {"__bytesio__": ["io"]}, {"__bytesio__": ["io", -1]}, {"__bytesio__": ["io", True]},
           {"__bytesio__": ["io", 2**63]}, {"__bytesio__": ["io", "0"]}, {"__bytesio__": ["io", 0, 1]},
           {"__dict__": [[{"__bytearray__": "b"}, 1]]}, {"__dict__": [[{"__bytesio__": ["b", 0]}, 1]]}]
    assert not any(parses("b", v) for v in bad)
    # unflatten, which restores and DCP loads call, holds the same line on the tensors it is handed.
    with pytest.raises(ManifestError, match="not 1-D uint8"):
        unflatten({"__bytes__": "t"}, {"t": torch.ones(2)})
    with pytest.raises(ManifestError, match="not 1-D uint8"):
        unflatten({"__bytesio__": ["t", 0]}, {"t": torch.zeros(2, 2, dtype=torch.uint8)})


def test_values_that_would_share_one_stored_name_are_refused_at_save(local_url):
    # Two keys of one dict that print the same: their tensors were stored under one name, and a restore gave
    # both the second one's values.
    with pytest.raises(InvalidState, match="stored under this one name"):
        flatten({"d": {1: torch.ones(2), "1": torch.zeros(2)}})
    with pytest.raises(InvalidState, match="byte strings"):
        CheckpointManager(local_url).save(1, {"m": memoryview(b"ab")})  # the message says what can be stored
    assert not os.path.exists(os.path.join(local_url, "checkpoints"))


def test_a_checkpoint_saved_before_byte_strings_still_restores(tmp_path):
    # Saved by the release before byte strings (tests/data/run-before-byte-strings): old tags and names,
    # a dict keyed by a tensor under its old name (``<key>``).
    run = str(tmp_path / "run")
    shutil.copytree(os.path.join(DATA, "run-before-byte-strings"), run)
    into = {"w": torch.zeros(4), "opt": None, "keyed": None, "meta": None}
    CheckpointManager(run).restore(into, allow_unverified=True)
    assert torch.equal(into["w"], torch.arange(4.0)) and into["meta"] == {"epoch": 2, "t": (1, 2.5), "inf": float("inf")}
    assert torch.equal(into["opt"][0]["m"], torch.full((2,), 0.5))
    [(key, value)] = into["keyed"].items()
    assert torch.equal(key, torch.tensor([7])) and value == "seven"
    assert all(r.ok for r in CheckpointManager(run).verify())


def test_native_export_round_trips_byte_strings_and_hf_export_leaves_them_out(local_url, tmp_path):
    from safetensors.torch import load_file

    want = saved_state()
    mgr = CheckpointManager(local_url)
    info = mgr.save(1, want)
    mgr.export(str(tmp_path / "native"), step=1, allow_unverified=True)
    copy = tmp_path / "copy"
    os.makedirs(copy / "checkpoints")
    shutil.copy(os.path.join(local_url, "run.json"), copy / "run.json")
    shutil.copytree(tmp_path / "native", copy / "checkpoints" / info.id)
    got = fresh_state()
    CheckpointManager(str(copy)).restore(got, allow_unverified=True)
    assert_same(got, want)
    mgr.export(str(tmp_path / "hf"), step=1, allow_unverified=True, format="hf")
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(weights) == ["lin.bias", "lin.weight"]  # save_pretrained writes tensors only: no extra state


def dcp_blobs(rank: int, world: int, run: str, flip: bool) -> dict:
    import torch.distributed.checkpoint as dcp

    from verified_ckpt.integrations.dcp import VerifiedStorageReader, VerifiedStorageWriter, load

    mgr = CheckpointManager(run)
    stream = io.BytesIO(b"data-loader state")
    stream.seek(5)
    state = {"w": torch.arange(6.0), "test_blob": BlobState(b"SomeBlobForTesting"), "stream": stream,
             "blobs": [b"", b"tok" * 1000]}
    dcp.save(state, storage_writer=VerifiedStorageWriter(mgr, 1))
    if flip:
        if rank == 0:
            [info] = mgr.list()
            entry = info.manifest.tensors["blobs/1"]
            path = f"{run}/checkpoints/{info.id}/{entry.shard}"
            flip_within(path, b"tok" * 1000, 7)
        torch.distributed.barrier()
    into = {"w": torch.zeros(6), "test_blob": BlobState(b""), "stream": io.BytesIO(), "blobs": [b"x", b"y"]}
    unpickle, calls = torch.load, []
    torch.load = lambda *a, **k: calls.append(a)  # DCP's own reader unpickles each value with it; ours never may
    try:
        load(into, VerifiedStorageReader(mgr, allow_unverified=True))
    except CorruptCheckpoint as e:
        return {"error": str(e), "untouched": torch.equal(into["w"], torch.zeros(6))
                and into["test_blob"].state == {"blob": b""} and into["blobs"] == [b"x", b"y"]}
    finally:
        torch.load = unpickle
    assert calls == []
    got = into["stream"]
    return {"error": None, "w": into["w"].tolist(), "blob": into["test_blob"].state["blob"].decode(),
            "stream": [type(got).__name__, got.getvalue().decode(), got.tell()],
            "blobs": [type(b).__name__ + ":" + b.decode() for b in into["blobs"]]}


@pytest.mark.parametrize("world", [1, 2])
def test_dcp_save_and_load_round_trip_bytes_and_bytesio_through_the_verified_storage(tmp_path, world):
    results = run_ranks(dcp_blobs, world, str(tmp_path / "run"), False)
    want = {"error": None, "w": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "blob": "SomeBlobForTesting",
            "stream": ["BytesIO", "data-loader state", 5], "blobs": ["bytes:", "bytes:" + "tok" * 1000]}
    assert results == [want] * world
    [info] = CheckpointManager(str(tmp_path / "run")).list()
    assert {"test_blob.blob", "stream", "blobs/0", "blobs/1"} <= info.manifest.tensors.keys()
    assert not any(s.path.endswith(".metadata") for s in info.manifest.shards)
    [result] = CheckpointManager(str(tmp_path / "run")).verify()
    assert result.ok, result.problems


def test_dcp_load_of_a_flipped_byte_string_fails_on_every_rank_before_a_value_is_set(tmp_path):
    results = run_ranks(dcp_blobs, 2, str(tmp_path / "run"), True)
    assert all(r["error"] and "digest" in r["error"] and r["untouched"] for r in results), results


def per_rank_blobs(rank: int, world: int, run: str) -> dict:
    class Loader:
        per_rank = True  # every rank's own position in its data

        def __init__(self, blob: bytes) -> None:
            self.blob = blob

        def state_dict(self) -> dict:
            return {"blob": self.blob}

        def load_state_dict(self, sd: dict) -> None:
            self.blob = sd["blob"]

    mgr = CheckpointManager(run)
    mgr.save(1, {"w": torch.ones(3), "shared": b"same on every rank" * 100, "loader": Loader(f"rank {rank}".encode())})
    into = {"w": torch.zeros(3), "shared": None, "loader": Loader(b"")}
    mgr.restore(into, allow_unverified=True)
    return {"shared": into["shared"] == b"same on every rank" * 100, "loader": into["loader"].blob.decode()}


def test_per_rank_and_shared_byte_strings_round_trip_on_two_ranks(tmp_path):
    results = run_ranks(per_rank_blobs, 2, str(tmp_path / "run"))
    assert results == [{"shared": True, "loader": "rank 0"}, {"shared": True, "loader": "rank 1"}]
