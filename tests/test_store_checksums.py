"""The CRC-64/NVME every shard carries (issue 40): recorded in the manifest, equal to an independent computation,
sent with the upload to S3 (a real SeaweedFS on loopback) which keeps it for a single-part and a multipart shard
and rejects an upload whose bytes do not match it; older manifests without it verify as they always did."""

from __future__ import annotations

import json
import os

import pytest
import s3fs
import torch

from verified_ckpt import CheckpointManager, StorageError
from verified_ckpt.crc import from_base64, to_base64
from verified_ckpt.store import checksummed

pytestmark = pytest.mark.timeout(120)


def reference_crc64nvme(data: bytes) -> str:
    """CRC-64/NVME bit by bit from its definition (reflected polynomial 0x9A6C9329AC4BC9B5, all-ones in and out),
    independent of the library the project uses."""
    crc = 0xFFFFFFFFFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x9A6C9329AC4BC9B5 if crc & 1 else 0)
    return f"{crc ^ 0xFFFFFFFFFFFFFFFF:016x}"


def test_the_reference_is_crc64nvme():
    assert reference_crc64nvme(b"123456789") == "ae8b14860a799888"  # the catalogue's check value


def test_every_shard_of_a_new_manifest_carries_its_crc64nvme(local_url):
    mgr = CheckpointManager(local_url, shard_bytes=2048)
    info = mgr.save(1, {"a": torch.arange(1000.0), "b": torch.ones(300, dtype=torch.bfloat16), "n": 3})
    assert len(info.manifest.shards) >= 2
    for s in info.manifest.shards:
        data = open(os.path.join(local_url, "checkpoints", info.id, s.path), "rb").read()
        assert s.crc64nvme == reference_crc64nvme(data)
    [r] = mgr.verify()
    assert r.ok, r.problems


def test_a_manifest_without_crcs_verifies_and_restores_as_before(local_url):
    """A manifest written before issue 40 (no crc64nvme): verify and restore need nothing more."""
    mgr = CheckpointManager(local_url)
    info = mgr.save(1, {"w": torch.arange(10.0)})
    path = os.path.join(local_url, "checkpoints", info.id, "manifest.json")
    doc = json.loads(open(path).read())
    for s in doc["shards"]:
        del s["crc64nvme"]
    os.remove(path)
    open(path, "w").write(json.dumps(doc))
    again = CheckpointManager(local_url)
    [r] = again.verify()
    assert r.ok, r.problems
    assert again.list()[0].manifest.shards[0].crc64nvme is None
    out = {"w": torch.zeros(10)}
    again.restore(out, allow_unverified=True)
    assert torch.equal(out["w"], torch.arange(10.0))


def test_a_recorded_crc_that_does_not_match_its_shard_is_a_problem_of_the_record(local_url):
    mgr = CheckpointManager(local_url)
    info = mgr.save(1, {"w": torch.arange(10.0)})
    path = os.path.join(local_url, "checkpoints", info.id, "manifest.json")
    doc = json.loads(open(path).read())
    doc["shards"][0]["crc64nvme"] = "0" * 16
    os.remove(path)
    open(path, "w").write(json.dumps(doc))
    [r] = CheckpointManager(local_url).verify()
    assert not r.ok and r.problems[0].kind == "digest" and "CRC-64/NVME" in r.problems[0].detail


@pytest.mark.parametrize("numel", [1000, 3_000_000], ids=["one-part", "multipart"])
def test_s3_keeps_the_crc_the_manifest_records(s3_server, s3_bucket, numel):
    """12 MB of float32 goes up in two 8 MiB parts, under S3's full-object CRC-64/NVME; the server's value, read
    with HeadObject in checksum mode (no bytes), is the manifest's."""
    url = f"s3://{s3_bucket}/run"
    opts = s3_server.storage_options()
    info = CheckpointManager(url, storage_options=opts).save(1, {"w": torch.arange(numel, dtype=torch.float32)})
    fs = s3fs.S3FileSystem(**opts)
    for s in info.manifest.shards:
        head = fs.call_s3("head_object", Bucket=s3_bucket, Key=f"run/checkpoints/{info.id}/{s.path}",
                          ChecksumMode="ENABLED")
        assert from_base64(head["ChecksumCRC64NVME"]) == s.crc64nvme
        assert head.get("ChecksumType") in (None, "FULL_OBJECT")  # SeaweedFS 4.48 names it on multipart only
    [r] = CheckpointManager(url, storage_options=opts).verify()
    assert r.ok, r.problems


def test_s3_rejects_an_upload_whose_bytes_changed_after_their_crc_and_the_save_commits_nothing(
        s3_server, s3_bucket, monkeypatch):
    """Bytes corrupted between the CRC and the wire (here: the body of each request, after the writer took its
    CRC): the server refuses the object, the save raises, and no checkpoint or part is left."""
    real = checksummed.ChecksummedUpload.write

    def corrupting(self, data):
        n = real(self, data)
        if self.buffer:
            self.buffer[-1] ^= 0x01  # after self.crc saw it
        return n

    monkeypatch.setattr(checksummed.ChecksummedUpload, "write", corrupting)
    url = f"s3://{s3_bucket}/run"
    opts = s3_server.storage_options()
    with pytest.raises(StorageError):
        CheckpointManager(url, storage_options=opts).save(1, {"w": torch.arange(100.0)})
    monkeypatch.setattr(checksummed.ChecksummedUpload, "write", real)
    assert CheckpointManager(url, storage_options=opts).list() == []
    fs = s3fs.S3FileSystem(**opts)
    assert not fs.call_s3("list_multipart_uploads", Bucket=s3_bucket).get("Uploads")


def test_the_base64_form_s3_uses_round_trips():
    assert from_base64(to_base64("ae8b14860a799888")) == "ae8b14860a799888"
    assert from_base64("not base64!") is None and from_base64(to_base64("00" * 8)[:-4]) is None
