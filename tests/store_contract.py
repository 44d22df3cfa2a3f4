"""One contract for every storage backend.

Subclass :class:`StoreContract` and provide a ``url`` fixture (a fresh, empty
run URL) and ``storage_options``. The fixtures read and write raw bytes
through fsspec directly, never through the code under test.
"""

from __future__ import annotations

import json

import fsspec

import pytest

from verified_ckpt.errors import CheckpointNotFound, ManifestError, StorageError, UnsafePath
from verified_ckpt.store import RunStore


class StoreContract:
    storage_options: dict = {}
    local_disk = False  # a path on this machine's disk (links and special files can exist there)

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
        got = store.records.listing("verification")
        assert got == [], got

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

    def test_names_that_could_escape_are_refused_before_any_io(self, store, raw):
        fs, root = raw
        for bad in ["../escape", "/abs", "a/b", "s3://bucket/x", "a\\b", "..", ".", "", "~root"]:
            with pytest.raises(StorageError, match="not a plain name"):
                with store.open_shard_for_write("c1", bad):
                    pass
            with pytest.raises(StorageError, match="not a plain name"):
                store.commit_manifest(bad, b"{}")
        assert not fs.exists(f"{root}/checkpoints")

    # -- the rest of the surface ------------------------------------------------------------------
    def test_capabilities_are_chosen_once_and_match_the_backend(self, store):
        caps = store.backend.caps
        assert caps.links == caps.needs_dirs == (not caps.atomic_put) == (caps.reads == "file") == self.local_disk
        assert store.is_local_disk == caps.node_local == self.local_disk

    def test_run_meta_round_trips_and_makes_the_run_exist(self, store):
        assert store.run_meta() is None
        store.write_run_meta({"run_id": "abc"})
        assert store.run_meta() == {"run_id": "abc"} and store.exists()

    def test_a_record_the_reader_holds_already_is_listed_but_not_read_again(self, store):
        first = store.records.append("incident", b'{"n":1}')
        second = store.records.append("incident", b'{"n":2}')
        got = store.records.listing("incident", known=lambda name, size, stamp: name == first)
        by_name = {r.name: r for r in got}
        assert by_name[first].data is None and by_name[first].problem is None and by_name[first].stamp
        assert by_name[second].data == b'{"n":2}'
        assert store.records.staged() == []  # published whole: nothing left where writes are staged

    def test_a_deleted_record_is_gone_and_deleting_it_again_is_fine(self, store):
        name = store.records.append("verification", b'{"n":1}')
        store.records.delete("verification", name)
        store.records.delete("verification", name)
        got = store.records.listing("verification")
        assert got == [], got

    def test_objects_beside_the_shards_round_trip_and_are_never_a_commit(self, store):
        assert store.read_optional("c1", "rank-00001.json") is None
        store.write_aside("c1", "rank-00001.json", b"report")
        assert store.read_optional("c1", "rank-00001.json") == b"report"
        assert list(store.committed()) == []
        assert [n for n, _ in store.checkpoint_files()["c1"]] == ["rank-00001.json"]
        store.delete_file("c1", "rank-00001.json")
        store.delete_file("c1", "rank-00001.json")  # gone already is fine
        assert store.read_optional("c1", "rank-00001.json") is None
        with pytest.raises(StorageError, match="not a plain name"):
            store.write_aside("c1", "../x", b"")

    def test_a_commit_is_refused_unless_every_shard_is_stored_with_its_size(self, store):
        with store.open_shard_for_write("c1", "s.safetensors") as f:
            f.write(b"1234")
        store.check_shards("c1", {"s.safetensors": 4})
        with pytest.raises(StorageError, match="holds 4 bytes"):
            store.check_shards("c1", {"s.safetensors": 5})
        with pytest.raises(StorageError, match="is missing"):
            store.check_shards("c1", {"t.safetensors": 4})

    def test_deleting_a_checkpoint_that_is_not_there_is_fine(self, store):
        store.delete_checkpoint("never-written")
        assert list(store.committed()) == []

    def test_replay_objects_round_trip_within_their_bound(self, store):
        assert store.replays.read("inc1", "json", 100) is None
        store.replays.write("inc1", b'{"r":1}', b"tensors")
        assert store.replays.read("inc1", "json", 100) == b'{"r":1}'
        assert store.replays.read("inc1", "safetensors", 100) == b"tensors"
        with pytest.raises(ManifestError, match="it is never read"):
            store.replays.read("inc1", "safetensors", 3)

    def test_an_empty_run_has_no_ledger(self, store):
        assert not store.ledger.exists() and store.ledger.chunks("step") == 0 and store.ledger.check_objects(10) == 0


class LocalDiskContract:
    """What only a local disk can hold: links out of the run and special files, which are never followed or read."""

    def test_a_fifo_where_a_manifest_or_record_belongs_is_refused_without_blocking(self, store, raw):
        import os

        fs, root = raw
        os.makedirs(f"{root}/checkpoints/c1", exist_ok=True)
        os.mkfifo(f"{root}/checkpoints/c1/manifest.json")
        with pytest.raises(UnsafePath, match="not a regular file"):
            store.read_manifest("c1")
        store.records.append("incident", b'{"n":1}')
        os.mkfifo(f"{root}/records/incident/fifo.json")
        [odd] = [r for r in store.records.listing("incident") if r.name == "fifo.json"]
        assert odd.data is None and "not a regular file" in odd.problem

    def test_a_symlink_out_of_the_run_is_never_followed(self, store, raw, tmp_path):
        import os

        fs, root = raw
        outside = tmp_path / "outside.bin"
        outside.write_bytes(b"secret")
        os.makedirs(f"{root}/checkpoints/c1", exist_ok=True)
        os.symlink(outside, f"{root}/checkpoints/c1/s.safetensors")
        with pytest.raises(UnsafePath, match="resolves outside the run"):
            store.shard_size("c1", "s.safetensors")
        with pytest.raises(UnsafePath, match="resolves outside the run"):
            store.read_shard("c1", "s.safetensors", 6, lambda chunk: None)
        store.delete_checkpoint("c1")  # removes the link, never what it points at
        assert outside.read_bytes() == b"secret" and not os.path.lexists(f"{root}/checkpoints/c1/s.safetensors")
