"""The CRC-64/NVME every shard carries (issue 40): recorded in the manifest, equal to an independent computation,
sent with the upload to S3 (a real SeaweedFS on loopback) which keeps it for a single-part and a multipart shard
and rejects an upload whose bytes do not match it; older manifests without it verify as they always did."""

from __future__ import annotations

import json
import os

import pytest
import s3fs
import torch

from helpers import resealed
from verified_ckpt import CheckpointManager, StorageError
from verified_ckpt.crc import Crc64, from_base64, to_base64
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
    open(path, "w").write(json.dumps(resealed(doc)))
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
    open(path, "w").write(json.dumps(resealed(doc)))
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


# ------------------------------------------------------------------------------ the scrub that reads no bytes
def test_a_head_scrub_reads_no_shard_byte_and_finds_an_object_replaced_by_one_of_the_same_size(s3_server, s3_bucket):
    """An object replaced by another of the same size with one byte changed (written straight to the store, as a
    stray process or a wrong restore would): ``verify(depth="head")`` finds it with one HEAD per shard and 0 bytes of
    shard data, counted at a proxy in front of the server; the checkpoint is ``corrupt`` from then on, the others
    pass, and the record says what the check covered."""
    from flaky_proxy import FlakyProxy

    from verified_ckpt import Status

    url = f"s3://{s3_bucket}/run"
    direct = s3_server.storage_options()
    mgr = CheckpointManager(url, storage_options=direct, shard_bytes=1 << 16)
    good = mgr.save(1, {"a": torch.arange(40_000.0), "b": torch.ones(20_000)})
    bad = mgr.save(2, {"a": torch.arange(40_000.0) + 1, "b": torch.ones(20_000)})
    fs = s3fs.S3FileSystem(**direct)
    victim = f"{s3_bucket}/run/checkpoints/{bad.id}/{bad.manifest.shards[-1].path}"
    data = bytearray(fs.cat_file(victim))
    data[len(data) // 2] ^= 0x10
    # The same size, one byte changed, uploaded with the CRC-64/NVME of its own bytes: what AWS S3 stores for an
    # upload that sends none (its default since 2025), and what a current SDK sends.
    crc = Crc64()
    crc.update(bytes(data))
    bucket, key, _ = fs.split_path(victim)
    fs.call_s3("put_object", Bucket=bucket, Key=key, Body=bytes(data), ChecksumCRC64NVME=to_base64(crc.hexdigest()))
    port = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    with FlakyProxy(port, lambda *_: False) as proxy:
        opts = {**direct, "client_kwargs": {**direct["client_kwargs"], "endpoint_url": f"http://127.0.0.1:{proxy.port}"}}
        s3fs.S3FileSystem.clear_instance_cache()
        scrub = CheckpointManager(url, storage_options=opts)
        infos = scrub.list()
        before = len(proxy.seen)
        results = scrub.verify(infos, depth="head")
        seen = proxy.seen[before:]
    s3fs.S3FileSystem.clear_instance_cache()
    shard_requests = [(m, p, n) for m, p, n in seen if ".safetensors" in p]
    shards = len(good.manifest.shards) + len(bad.manifest.shards)
    assert sorted(m for m, _, _ in shard_requests) == ["HEAD"] * shards and sum(n for *_, n in shard_requests) == 0
    ok = {r.id: r for r in results}
    assert ok[good.id].ok and ok[good.id].depth == "head"
    assert ok[good.id].coverage == f"the store's CRC-64/NVME of {len(good.manifest.shards)} shard(s), the size alone of 0"
    assert not ok[bad.id].ok and [p.kind for p in ok[bad.id].problems] == ["checksum"]
    statuses = {i.id: i.status for i in CheckpointManager(url, storage_options=direct).list()}
    assert statuses[bad.id] is Status.CORRUPT and statuses[good.id] is not Status.CORRUPT
    [read] = CheckpointManager(url, storage_options=direct).verify(bad.id)  # a read agrees: the bytes changed
    assert not read.ok and read.problems[0].kind == "digest"


def test_a_head_scrub_of_a_local_run_checks_sizes_and_says_so(local_url):
    """A local folder keeps no checksum: the head check compares sizes, finds a truncated shard, and its record says
    that sizes alone were compared."""
    mgr = CheckpointManager(local_url)
    info = mgr.save(1, {"w": torch.arange(1000.0)})
    [r] = mgr.verify(depth="head")
    assert r.ok and r.coverage == "the store's CRC-64/NVME of 0 shard(s), the size alone of 1"
    shard = os.path.join(local_url, "checkpoints", info.id, info.manifest.shards[0].path)
    with open(shard, "r+b") as f:
        f.truncate(100)
    [r] = mgr.verify(depth="head")
    assert not r.ok and r.problems[0].kind == "size"
    os.remove(shard)
    [r] = CheckpointManager(local_url).verify(depth="head")
    assert not r.ok and r.problems[0].kind == "missing"


def test_an_object_replaced_without_a_checksum_fails_a_head_check_as_checksum_missing(s3_server, s3_bucket):
    """An object rewritten by a client that sends no checksum, on a store that computes none (SeaweedFS), keeps no
    CRC to compare, though its upload sent one: the head check says so (``checksum-missing``, issue 48; it used to
    pass on the size alone), and its record says what it covered. A read sees the changed byte."""
    url = f"s3://{s3_bucket}/run"
    opts = s3_server.storage_options()
    info = CheckpointManager(url, storage_options=opts).save(1, {"w": torch.arange(1000.0)})
    fs = s3fs.S3FileSystem(**opts)
    victim = f"{s3_bucket}/run/checkpoints/{info.id}/{info.manifest.shards[0].path}"
    data = bytearray(fs.cat_file(victim))
    data[-1] ^= 0x01
    fs.pipe_file(victim, bytes(data))
    [head] = CheckpointManager(url, storage_options=opts).verify(depth="head")
    assert not head.ok and [p.kind for p in head.problems] == ["checksum-missing"]
    assert head.coverage == ("the store's CRC-64/NVME of 0 shard(s), the size alone of 1; 1 of those without the "
                             "CRC-64/NVME their upload sent")
    [read] = CheckpointManager(url, storage_options=opts).verify()
    assert not read.ok and read.problems[0].kind == "digest"


def test_the_service_plans_head_checks_between_reads():
    """A read every 24 h and a head check every hour: never read -> read now; read 25 h ago -> read (a read covers
    what a head check does); read 2 h ago -> head; read 2 h ago and head-checked 30 min ago -> nothing."""
    import datetime

    from verified_ckpt import CheckpointInfo, Status, VerificationResult
    from verified_ckpt.service.scrub import plan

    now = 1_000_000.0
    service = {"service": "vckpt serve"}

    def at(hours_ago: float) -> str:
        return datetime.datetime.fromtimestamp(now - 3600 * hours_ago, datetime.timezone.utc).isoformat()

    def info(cid: str) -> CheckpointInfo:
        return CheckpointInfo(cid, 1, Status.RESTORABLE, at(100), 10, [], object())  # type: ignore[arg-type]

    def rec(cid: str, hours_ago: float, depth: str) -> VerificationResult:
        return VerificationResult(cid, 1, True, [], at(hours_ago), service, depth=depth)

    infos = [info(c) for c in ("new", "old", "mid", "fresh")]
    recs = {"old": [rec("old", 25, "read")], "mid": [rec("mid", 2, "read")],
            "fresh": [rec("fresh", 2, "read"), rec("fresh", 0.5, "head")]}
    p = plan(infos, recs, None, now, 24 * 3600, 3600)
    assert [c.id for c in p.new] == ["new"] and [c.id for c in p.due] == ["old"] and [c.id for c in p.head] == ["mid"]
    assert plan(infos, recs, None, now, 24 * 3600, 0).head == []


# ------------------------------------------------------------------------ the deep scrub by S3 Batch Operations
def report_row(bucket: str, key: str, crc_hex: str | None, status: str = "succeeded", algorithm: str = "CRC64NVME") -> list:
    """A row of a completion report as AWS documents it (Report_CSV_20180820: Bucket, Key, VersionId, TaskStatus,
    ErrorCode, HTTPStatusCode, ResultMessage), a "Compute checksum" task's message a JSON object with the checksum."""
    import urllib.parse

    message = "" if crc_hex is None else json.dumps({"checksum_base64": to_base64(crc_hex), "checksumAlgorithm": algorithm,
                                                     "checksumType": "FULL_OBJECT"})
    return [bucket, urllib.parse.quote(key), "", status, "" if status == "succeeded" else "AccessDenied",
            "200" if status == "succeeded" else "403", message]


def test_a_completion_report_with_one_mismatching_checksum_makes_exactly_that_checkpoint_corrupt(
        s3_server, s3_bucket, monkeypatch, tmp_path):
    """The manifest lists every shard; the report (one file with a header, one without; a failed task, a row of
    another algorithm, a malformed row) is joined back: the checkpoint whose recomputed CRC differs is corrupt, the
    others record what was recomputed, the records are signed, and the CLI says so with exit 1."""
    import csv
    import io
    import subprocess
    import sys

    from verified_ckpt import Status

    monkeypatch.setenv("VCKPT_SIGNING_KEY", "k" * 32)
    url = f"s3://{s3_bucket}/run"
    opts = s3_server.storage_options()
    mgr = CheckpointManager(url, storage_options=opts, shard_bytes=1 << 12)
    infos = [mgr.save(step, {"w": torch.arange(2000.0) + step}) for step in (1, 2, 3)]
    manifest = list(csv.reader(io.StringIO(mgr.batch().manifest())))
    keys = [(ck.id, s) for ck in infos for s in ck.manifest.shards]
    assert [tuple(r) for r in manifest] == [(s3_bucket, f"run/checkpoints/{cid}/{s.path}") for cid, s in keys]
    rows = [report_row(b, k, s.crc64nvme) for (b, k), (_, s) in zip(manifest, keys)]
    wrong = next(i for i, (cid, _) in enumerate(keys) if cid == infos[1].id)
    rows[wrong] = report_row(*manifest[wrong], "0123456789abcdef")  # the bytes at rest give another CRC
    third = [i for i, (cid, _) in enumerate(keys) if cid == infos[2].id]
    rows[third[0]] = report_row(*manifest[third[0]], None, status="failed")  # no conclusion: coverage, not a problem
    rows[third[-1]] = report_row(*manifest[third[-1]], "00" * 8, algorithm="SHA256") if len(third) > 1 else rows[third[-1]]

    def csv_bytes(rs: list, header: bool) -> bytes:
        buf = io.StringIO()
        w = csv.writer(buf)
        if header:
            w.writerow(["Bucket", "Key", "VersionId", "TaskStatus", "ErrorCode", "HTTPStatusCode", "ResultMessage"])
        w.writerows(rs)
        return buf.getvalue().encode()

    half = len(rows) // 2
    files = [csv_bytes(rows[:half], True), csv_bytes(rows[half:], False) + b"only,three,columns\n"]
    fs = s3fs.S3FileSystem(**opts)
    for i, data in enumerate(files):  # where the job writes them: its report prefix, results/*.csv
        fs.pipe_file(f"{s3_bucket}/reports/job-1/results/{i:040x}.csv", data)
    env = {**os.environ, "VCKPT_SIGNING_KEY": "k" * 32}
    args = [sys.executable, "-m", "verified_ckpt_cli.main", "batch-record", url,
            f"s3://{s3_bucket}/reports/job-1/results/*.csv", "--json"]
    args += [x for k, v in (("key", opts["key"]), ("secret", opts["secret"])) for x in ("-o", f"{k}={v}")]
    args += ["-o", f"client_kwargs={json.dumps(opts['client_kwargs'])}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 1, done.stderr
    got = json.loads(done.stdout)
    assert got["malformed_rows"] == 1
    by_id = {r["id"]: r for r in got["results"]}
    assert not by_id[infos[1].id]["ok"] and by_id[infos[1].id]["problems"][0].startswith("checksum:")
    assert by_id[infos[0].id]["ok"] and by_id[infos[0].id]["depth"] == "store"
    statuses = {i.id: i for i in CheckpointManager(url, storage_options=opts).list()}
    assert statuses[infos[1].id].status is Status.CORRUPT
    assert all(statuses[ck.id].status is not Status.CORRUPT for ck in (infos[0], infos[2]))
    recorded = [json.loads(fs.cat_file(p)) for p in fs.find(f"{s3_bucket}/run/records/verification")]
    assert recorded and all("signature" in r and r.get("depth") == "store" for r in recorded)


def test_batch_operations_need_an_s3_run(local_url):
    from verified_ckpt import InvalidRunURL

    mgr = CheckpointManager(local_url)
    mgr.save(1, {"w": torch.ones(3)})
    with pytest.raises(InvalidRunURL, match="not an S3 run"):
        mgr.batch().manifest()


def test_a_hostile_report_is_bounded_and_never_crashes():
    from verified_ckpt.checkpoint.batchops import MAX_REPORT_BYTES, parse_report

    rows, bad = parse_report([b"b,k,,succeeded,,200,{not json\n", b'b,k,,succeeded,,200,"[1,2]"\n',
                              b"b,k,,succeeded,,200,\"{\"\"checksumAlgorithm\"\":\"\"CRC64NVME\"\"}\"\n", b"\n\n"])
    assert rows == {} and bad == 3
    with pytest.raises(ValueError, match="more than"):
        parse_report([b"x" * (MAX_REPORT_BYTES + 1)])
    with pytest.raises(ValueError, match="UTF-8"):
        parse_report([b"\xff\xfe"])


def test_batch_record_names_a_report_it_cannot_read(local_url, tmp_path):
    import subprocess
    import sys

    CheckpointManager(local_url).save(1, {"w": torch.ones(3)})
    done = subprocess.run([sys.executable, "-m", "verified_ckpt_cli.main", "batch-record", local_url,
                           str(tmp_path / "results" / "*.csv")], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "cannot read the completion report" in done.stderr, done.stderr
