"""A head check where the store keeps no CRC-64/NVME for a shard whose upload sent one (the manifest records it, and
every S3 upload of a shard sends it): the object was replaced after its upload (by a client that sent none, or
boto3's default CRC32) or copied by a tool that dropped it. It reads as ``checksum-missing``, and the checkpoint is
``suspect`` until a full read checks its bytes: a read that finds them changed makes it ``corrupt``, one that finds
them right answers the finding. A store that keeps no checksums at all (a local folder) raises no such finding, and
the CLI's summary says when shards were checked by their size alone. Real SeaweedFS S3 on loopback."""

from __future__ import annotations

import json

import pytest
import s3fs
import torch
from click.testing import CliRunner

from verified_ckpt import CheckpointManager, Status
from verified_ckpt.decisions import derive_status, verifications_to_keep
from verified_ckpt.records import Problem, VerificationResult
from verified_ckpt_cli.main import main

pytestmark = pytest.mark.timeout(120)


def statuses(url: str, opts: dict | None = None) -> dict[str, Status]:
    return {i.id: i.status for i in CheckpointManager(url, storage_options=opts).list()}


def test_a_same_size_shard_uploaded_without_the_crc_its_upload_sent_is_suspect_until_a_full_read(s3_server, s3_bucket):
    url = f"s3://{s3_bucket}/run"
    opts = s3_server.storage_options()
    mgr = CheckpointManager(url, storage_options=opts, shard_bytes=1 << 14)
    kept, changed, copied = (mgr.save(i, {"a": torch.arange(5000.0) + i, "b": torch.ones(5000)}) for i in (1, 2, 3))
    assert len(changed.manifest.shards) > 1 and all(s.crc64nvme for s in changed.manifest.shards)
    fs = s3fs.S3FileSystem(**opts)

    def key(info, shard) -> str:
        return f"run/checkpoints/{info.id}/{shard.path}"

    # One byte changed, the same size, uploaded as s3fs does (no checksum: SeaweedFS then keeps none).
    victim = f"{s3_bucket}/{key(changed, changed.manifest.shards[1])}"
    data = bytearray(fs.cat_file(victim))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(victim, bytes(data))
    # The same bytes again, uploaded with boto3's default CRC32 (a copy through a client), which keeps no CRC-64/NVME.
    shard = copied.manifest.shards[0]
    same = fs.cat_file(f"{s3_bucket}/{key(copied, shard)}")
    fs.call_s3("put_object", Bucket=s3_bucket, Key=key(copied, shard), Body=same, ChecksumAlgorithm="CRC32")
    s3fs.S3FileSystem.clear_instance_cache()

    env = {"AWS_ACCESS_KEY_ID": opts["key"], "AWS_SECRET_ACCESS_KEY": opts["secret"]}
    args = ["verify", url, "--depth", "head", "-o", f"client_kwargs.endpoint_url={s3_server.endpoint_url}",
            "-o", f"client_kwargs.region_name={s3_server.region}"]
    human = CliRunner().invoke(main, args, env=env)
    assert human.exit_code == 1, human.output
    assert human.output.count("checksum-missing: 1 shard(s) kept without the CRC-64/NVME their upload sent") == 2
    assert "3 checked, 2 failed; 2 shard(s) of 2 checkpoint(s) checked by their size alone" in human.output
    rows = {r["id"]: r for r in json.loads(CliRunner().invoke(main, [*args, "--json"], env=env).stdout)}
    assert rows[kept.id]["ok"] and rows[kept.id]["coverage"] == (
        f"the store's CRC-64/NVME of {len(kept.manifest.shards)} shard(s), the size alone of 0")
    assert not rows[changed.id]["ok"] and [p.split(":")[0] for p in rows[changed.id]["problems"]] == ["checksum-missing"]
    assert rows[copied.id]["coverage"].endswith("the size alone of 1; 1 of those without the CRC-64/NVME their upload sent")
    # Saved without a guard, each committed unverified: what the head check makes them, and what a read gives back.
    assert statuses(url, opts) == {kept.id: Status.UNVERIFIED, changed.id: Status.SUSPECT, copied.id: Status.SUSPECT}

    # A full read settles each: the changed bytes are corrupt, the copied ones right, which answers the head finding.
    reads = {r.id: r for r in CheckpointManager(url, storage_options=opts).verify()}
    assert reads[changed.id].problems[0].kind == "digest" and reads[copied.id].ok
    assert statuses(url, opts) == {kept.id: Status.UNVERIFIED, changed.id: Status.CORRUPT,
                                   copied.id: Status.UNVERIFIED}
    # A head check cannot vouch for that object later either: suspect again until the next read.
    CheckpointManager(url, storage_options=opts).verify(copied.id, depth="head")
    assert statuses(url, opts)[copied.id] is Status.SUSPECT


def test_a_local_head_check_finds_no_missing_checksum_and_its_summary_says_size_alone(local_url):
    """A local folder keeps no checksum for anything: sizes alone, no finding (no false alarm), and the CLI's summary
    line says so, not only the coverage beside each checkpoint."""
    mgr = CheckpointManager(local_url)
    mgr.save(1, {"w": torch.arange(1000.0)})
    mgr.save(2, {"w": torch.arange(1000.0)})
    got = CliRunner().invoke(main, ["verify", local_url, "--depth", "head"])
    assert got.exit_code == 0, got.output
    assert "2 checked, 0 failed; 2 shard(s) of 2 checkpoint(s) checked by their size alone (the store keeps no " \
           "checksum for them): a same-size change there is seen only by a read (`vckpt verify`)" in got.output
    assert set(statuses(local_url).values()) == {Status.UNVERIFIED}  # as committed: no finding
    read = CliRunner().invoke(main, ["verify", local_url])
    assert read.exit_code == 0 and "size alone" not in read.output


def rec(at: str, ok: bool, *kinds: str, depth: str = "read") -> VerificationResult:
    return VerificationResult("c", 1, ok, [Problem(k, "x") for k in kinds], at, depth=depth)


def test_only_a_later_passing_full_read_answers_a_missing_checksum():
    missing = rec("t2", False, "checksum-missing", depth="head")
    assert derive_status(Status.RESTORABLE, [], [missing])[0] is Status.SUSPECT
    assert derive_status(Status.RESTORABLE, [], [missing, rec("t3", True)])[0] is Status.RESTORABLE
    assert derive_status(Status.RESTORABLE, [], [rec("t1", True), missing])[0] is Status.SUSPECT  # read before it
    assert derive_status(Status.RESTORABLE, [], [missing, rec("t3", True, depth="head")])[0] is Status.SUSPECT
    assert derive_status(Status.RESTORABLE, [], [missing, rec("t3", True, depth="store")])[0] is Status.SUSPECT
    both = rec("t2", False, "checksum-missing", "size", depth="head")  # a wrong size is corrupt, whatever follows
    assert derive_status(Status.RESTORABLE, [], [both, rec("t3", True)])[0] is Status.CORRUPT
    assert derive_status(Status.UNVERIFIED, [], [missing, rec("t3", True)])[0] is Status.UNVERIFIED  # never improves


def test_compaction_keeps_the_read_that_answers_a_missing_checksum():
    recs = [("a", rec("t1", False, "checksum-missing", depth="head")), ("b", rec("t2", True)),
            ("c", rec("t3", True, depth="head"))]
    keep = verifications_to_keep(recs)
    assert keep == {"a", "b", "c"}
    assert derive_status(Status.RESTORABLE, [], [r for n, r in recs if n in keep])[0] is Status.RESTORABLE


def test_an_unanswered_failure_outranks_an_answered_one_of_the_same_severity_in_compaction():
    recs = [("a", rec("t1", False, "checksum-missing", depth="head")), ("b", rec("t2", False, "nonfinite")),
            ("c", rec("t3", True)), ("d", rec("t4", True, depth="head"))]
    kept = [r for n, r in recs if n in verifications_to_keep(recs)]
    assert derive_status(Status.RESTORABLE, [], kept)[0] is Status.SUSPECT


def test_the_records_keep_the_finding_and_the_problem_names_the_shards():
    from verified_ckpt.checkpoint.verification import missing_checksum

    line = missing_checksum([f"ck/shard-{i}.safetensors" for i in range(5)])
    assert "\n" not in line and line.startswith("5 shard(s) kept without the CRC-64/NVME their upload sent")
    assert "ck/shard-2.safetensors and 2 more" in line and "vckpt verify" in line
