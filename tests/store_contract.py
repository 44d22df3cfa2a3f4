"""One contract for every storage backend.

Subclass :class:`StoreContract` and provide a ``url`` fixture (a fresh, empty
run URL) and ``storage_options``. The fixtures read and write raw bytes
through fsspec directly, never through the code under test.
"""

from __future__ import annotations

import json

import fsspec

import pytest

from verified_ckpt.errors import CheckpointNotFound, StorageError
from verified_ckpt.store import RunStore


class StoreContract:
    storage_options: dict = {}

    @pytest.fixture
    def store(self, url):
        return RunStore(url, self.storage_options)

    @pytest.fixture
    def raw(self, url):
        fs, root = fsspec.core.url_to_fs(url, **self.storage_options)
        return fs, root.rstrip("/")

    def test_empty_run_does_not_exist_and_lists_nothing(self, store):
        assert not store.exists()
        assert list(store.committed()) == []
        assert store.records.listing("verification") == []

    def test_only_folders_with_a_manifest_are_committed(self, store, raw):
        fs, root = raw
        with store.open_shard_for_write("ckpt-a", "shard-00000.safetensors") as f:
            f.write(b"x" * 10)
        with store.open_shard_for_write("ckpt-b", "shard-00000.safetensors") as f:
            f.write(b"y" * 10)
        store.commit_manifest("ckpt-b", b"{}")
        assert list(store.committed()) == ["ckpt-b"]
        assert fs.cat_file(f"{root}/checkpoints/ckpt-b/manifest.json") == b"{}"
        assert store.exists()

    def test_shard_bytes_round_trip_with_size(self, store, raw):
        fs, root = raw
        payload = bytes(range(256)) * 1000
        with store.open_shard_for_write("c1", "s.safetensors") as f:
            f.write(payload)
        assert fs.cat_file(f"{root}/checkpoints/c1/s.safetensors") == payload
        assert store.shard_size("c1", "s.safetensors") == len(payload)
        seen = bytearray()
        buf = store.read_shard("c1", "s.safetensors", len(payload), lambda chunk: seen.extend(chunk))
        assert bytes(buf.numpy()) == payload and bytes(seen) == payload

    def test_manifest_is_immutable(self, store):
        store.commit_manifest("c1", b'{"a":1}')
        with pytest.raises(StorageError, match="immutable"):
            store.commit_manifest("c1", b'{"a":2}')
        assert store.read_manifest("c1") == b'{"a":1}'

    def test_missing_manifest_is_checkpoint_not_found(self, store):
        with pytest.raises(CheckpointNotFound, match="vckpt list"):
            store.read_manifest("nope")

    def test_records_are_append_only_and_oldest_first(self, store):
        first = store.records.append("verification", b'{"n":1}')
        second = store.records.append("verification", b'{"n":1}')
        third = store.records.append("verification", b'{"n":2}')
        got = store.records.listing("verification")
        assert [r.name for r in got] == [first, second, third]
        assert [json.loads(r.data)["n"] for r in got] == [1, 1, 2] and all(r.problem is None for r in got)
        assert len({first, second, third}) == 3

    def test_objects_that_are_not_records_are_reported_not_dropped(self, store, raw):
        fs, root = raw
        store.records.append("incident", b'{"n":1}')
        fs.pipe_file(f"{root}/records/incident/notes.txt", b"hello")  # a name this library never writes
        got = store.records.listing("incident")
        assert len(got) == 2
        [odd] = [r for r in got if r.name == "notes.txt"]
        assert odd.data is None and "not a record name" in odd.problem

    def test_delete_removes_manifest_and_shards(self, store, raw):
        fs, root = raw
        with store.open_shard_for_write("c1", "s.safetensors") as f:
            f.write(b"data")
        store.commit_manifest("c1", b"{}")
        store.delete_checkpoint("c1")
        assert list(store.committed()) == []
        assert not fs.exists(f"{root}/checkpoints/c1/s.safetensors")

    @pytest.mark.parametrize("bad", ["../escape", "/abs", "a/b", "s3://bucket/x", "a\\b", "..", ".", "", "~root"])
    def test_names_that_could_escape_are_refused_before_any_io(self, store, raw, bad):
        fs, root = raw
        with pytest.raises(StorageError, match="not a plain name"):
            with store.open_shard_for_write("c1", bad):
                pass
        with pytest.raises(StorageError, match="not a plain name"):
            store.commit_manifest(bad, b"{}")
        assert not fs.exists(f"{root}/checkpoints")
