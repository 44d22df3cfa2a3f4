"""Hostile input and tamper evidence: signed manifests and records, path confinement,
no pickle on any load path, size limits, and secrets kept out of every output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import fsspec
import pytest
import torch
from click.testing import CliRunner

from helpers import fresh_state, trained_state
from verified_ckpt import CheckpointManager, InvalidState, Status, state_fingerprint
from verified_ckpt.shards import parse_header
from verified_ckpt_cli.main import main

pytestmark = pytest.mark.timeout(120)

KEY = "k3y-" + "s" * 28 + "-do-not-print"
OTHER = "another-key-of-32-bytes-long-xx!"


@pytest.fixture
def keyed(monkeypatch):
    monkeypatch.setenv("VCKPT_SIGNING_KEY", KEY)
    monkeypatch.delenv("VCKPT_SIGNING_KEY_FILE", raising=False)


@pytest.fixture
def no_key(monkeypatch):
    monkeypatch.delenv("VCKPT_SIGNING_KEY", raising=False)
    monkeypatch.delenv("VCKPT_SIGNING_KEY_FILE", raising=False)


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def manifest_path(url: str, info) -> str:
    return os.path.join(url, "checkpoints", info.id, "manifest.json")


def rewrite(path: str, edit) -> None:
    with open(path) as f:
        d = json.load(f)
    edit(d)
    with open(path, "w") as f:
        json.dump(d, f)


def saved_run(url: str) -> tuple[CheckpointManager, object]:
    mgr = CheckpointManager(url)
    info = mgr.save(3, trained_state(seed=1))
    return mgr, info


# -- signatures ------------------------------------------------------------------------------
def test_signed_manifest_is_valid_and_shown(local_url, keyed):
    mgr, info = saved_run(local_url)
    assert info.signature == "valid" and mgr.list()[0].signature == "valid"
    stored = json.load(open(manifest_path(local_url, info)))
    assert stored["signature"]["alg"] == "HMAC-SHA256" and len(stored["signature"]["mac"]) == 64
    r = invoke("show", local_url, "3", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["signature"] == "valid"
    target = fresh_state()
    mgr.restore(target, allow_unverified=True)  # a valid signature restores as before


def mutations(manifest: dict) -> list[tuple[str, callable]]:
    """One type-preserving edit of every top-level field (and of nested evidence), by name."""
    out = []
    for key, value in manifest.items():
        if key == "signature":
            continue
        if isinstance(value, bool) or value is None:
            edit = (lambda k: lambda d: d.__setitem__(k, not d[k] if isinstance(d[k], bool) else "x"))(key)
        elif isinstance(value, int):
            edit = (lambda k: lambda d: d.__setitem__(k, d[k] + 1))(key)
        elif isinstance(value, str):
            edit = (lambda k: lambda d: d.__setitem__(k, d[k][:-1] + ("0" if d[k][-1:] != "0" else "1")))(key)
        elif isinstance(value, list):
            edit = (lambda k: lambda d: d.__setitem__(k, d[k] + ["forged"] if k == "reasons" else d[k][:-1] or ["x"]))(key)
        else:
            edit = (lambda k: lambda d: d[k].__setitem__("forged", 1))(key)
        out.append((key, edit))
    return out


def test_editing_any_field_of_a_signed_manifest_is_detected(local_url, keyed):
    mgr, info = saved_run(local_url)
    path = manifest_path(local_url, info)
    original = open(path).read()
    fields = mutations(json.loads(original))
    assert {"step", "status", "evidence", "tensors", "shards", "state", "reasons", "created_at"} <= {k for k, _ in fields}
    for key, edit in fields:
        rewrite(path, edit)
        [listed] = mgr.list()
        assert listed.status is Status.CORRUPT, key
        assert listed.signature == "invalid" or "malformed" in listed.reasons[0], key
        r = invoke("show", local_url, info.id)
        assert r.exit_code in (0, 2) and ("INVALID" in r.output or "malformed" in r.output), (key, r.output)
        with open(path, "w") as f:
            f.write(original)
    assert mgr.list()[0].signature == "valid"


def test_unsigned_or_wrong_key_manifests_are_corrupt_and_the_cli_says_so(local_url, monkeypatch, no_key):
    mgr, info = saved_run(local_url)
    assert info.signature == "unsigned"
    r = invoke("show", local_url, "3")
    assert r.exit_code == 0 and "unsigned" in r.output
    monkeypatch.setenv("VCKPT_SIGNING_KEY", KEY)
    [listed] = CheckpointManager(local_url).list()
    assert listed.status is Status.CORRUPT and listed.signature == "missing"
    r = invoke("verify", local_url, "--json")
    assert r.exit_code == 1 and "signature" in json.loads(r.stdout)[0]["problems"][0]
    monkeypatch.setenv("VCKPT_SIGNING_KEY", OTHER)
    keyed_b = CheckpointManager(local_url)
    keyed_b.save(4, trained_state(seed=2))
    monkeypatch.setenv("VCKPT_SIGNING_KEY", KEY)
    by_step = {i.step: i for i in CheckpointManager(local_url).list()}
    assert by_step[4].status is Status.CORRUPT and by_step[4].signature == "invalid"
    with pytest.raises(Exception, match="not restorable|corrupt"):
        CheckpointManager(local_url).restore(fresh_state(), step=4, allow_unverified=True)
    monkeypatch.delenv("VCKPT_SIGNING_KEY")
    assert {i.step: i.signature for i in CheckpointManager(local_url).list()} == {3: "unsigned", 4: "unchecked"}


def test_edited_incident_and_verification_records_are_detected(local_url, keyed):
    mgr, info = saved_run(local_url)
    rec = mgr.flag(2, to_step=5, reason="bad node")
    incidents = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(local_url, "records", "incident")) for f in fs]
    rewrite(incidents[0], lambda d: d.__setitem__("to_step", 2))  # would free the checkpoint at step 3
    r = invoke("incidents", local_url, "--json")
    assert r.exit_code == 0
    [row] = json.loads(r.stdout)
    assert row["id"] == rec.id and row["signature"] == "invalid"
    assert "not trusted" in invoke("incidents", local_url).output
    assert mgr.list()[0].status is Status.SUSPECT  # an untrusted incident still marks (its edited) interval

    run2 = local_url + "-2"
    mgr2 = CheckpointManager(run2)
    good = mgr2.save(1, {"w": torch.ones(4)})
    shard = os.path.join(run2, "checkpoints", good.id, good.manifest.shards[0].path)
    data = bytearray(open(shard, "rb").read())
    data[-1] ^= 1
    open(shard, "wb").write(bytes(data))
    [res] = mgr2.verify()
    assert not res.ok and mgr2.list()[0].status is Status.CORRUPT
    ver = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(run2, "records", "verification")) for f in fs]
    rewrite(ver[0], lambda d: (d.__setitem__("ok", True), d.__setitem__("problems", [])))
    [after] = mgr2.list()
    assert after.status is not Status.RESTORABLE and any("verification record has an invalid signature" in r
                                                         for r in after.reasons)


def test_a_forged_rollback_record_answers_nothing(local_url, keyed):
    mgr, info = saved_run(local_url)
    mgr.flag(1, reason="bad node")
    assert mgr.list()[0].status is Status.SUSPECT
    # Dated before the checkpoint, a trusted rollback would make step 3 a new lineage again.
    forged = {"at": "2000-01-01T00:00:00+00:00", "to_checkpoint_id": info.id, "to_step": 3, "answers": [],
              "signature": None}
    fs = fsspec.filesystem("file")
    fs.makedirs(os.path.join(local_url, "records", "rollback"), exist_ok=True)
    fs.pipe_file(os.path.join(local_url, "records", "rollback", "0000-forged.json"), json.dumps(forged).encode())
    assert mgr.list()[0].status is Status.SUSPECT


def test_key_configuration_errors_are_one_line_and_never_quote_the_key(local_url, monkeypatch, tmp_path):
    monkeypatch.setenv("VCKPT_SIGNING_KEY", "short-secret")
    r = invoke("list", local_url)
    assert r.exit_code == 2 and "shorter than 16 bytes" in r.output and "short-secret" not in r.output
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    monkeypatch.setenv("VCKPT_SIGNING_KEY_FILE", os.fspath(key_file))
    r = invoke("list", local_url)
    assert r.exit_code == 2 and "unset one of them" in r.output
    monkeypatch.delenv("VCKPT_SIGNING_KEY")
    mgr = CheckpointManager(local_url)
    assert mgr.save(1, {"w": torch.ones(2)}).signature == "valid"
    monkeypatch.setenv("VCKPT_SIGNING_KEY", KEY)
    monkeypatch.delenv("VCKPT_SIGNING_KEY_FILE")
    assert CheckpointManager(local_url).list()[0].signature == "valid"  # the file's key is the same key
    monkeypatch.delenv("VCKPT_SIGNING_KEY")
    monkeypatch.setenv("VCKPT_SIGNING_KEY_FILE", os.fspath(tmp_path / "missing"))
    with pytest.raises(InvalidState, match="cannot read the signing key file"):
        CheckpointManager(local_url)


def test_the_key_appears_in_no_output_file_or_repr(local_url, keyed):
    mgr, info = saved_run(local_url)
    mgr.flag(1, reason="x")
    mgr.verify()
    outputs = [invoke(*args).output for args in (
        ("list", local_url, "--json"), ("show", local_url, "3", "--json"), ("show", local_url, "3"),
        ("verify", local_url, "--json"), ("incidents", local_url, "--json"), ("rollback", local_url, "--dry-run"),
        ("show", local_url, "99"), ("report", local_url, "--out", os.path.join(local_url, "r.html")))]
    stored = b"".join(open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(local_url) for f in fs)
    for text in outputs + [stored.decode("latin-1"), repr(mgr), repr(mgr._signer)]:
        assert KEY not in text and KEY[:12] not in text


# -- paths -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["../../outside.fifo", "/tmp/outside.fifo", "file:///tmp/outside.fifo",
                                 "s3://bucket/outside.fifo", "..\\..\\outside.fifo", "sub/outside.fifo", "..", ""])
def test_traversal_shard_paths_are_refused_before_any_read(local_url, tmp_path, no_key, bad):
    mgr, info = saved_run(local_url)
    fifo = tmp_path / "outside.fifo"
    os.mkfifo(fifo)  # opening it for reading would block: the test's timeout catches any open
    path = manifest_path(local_url, info)

    def edit(d):
        old = d["shards"][0]["path"]
        d["shards"][0]["path"] = bad.replace("/tmp/", os.fspath(tmp_path) + "/")
        for t in d["tensors"].values():
            if t["shard"] == old:
                t["shard"] = d["shards"][0]["path"]

    rewrite(path, edit)
    [listed] = mgr.list()
    assert listed.status is Status.CORRUPT and listed.manifest is None
    assert not mgr.verify()[0].ok
    target = fresh_state()
    before = state_fingerprint({"m": target["model"]})
    with pytest.raises(Exception, match="corrupt|malformed|not restorable"):
        mgr.restore(target, allow_unverified=True)
    assert state_fingerprint({"m": target["model"]}) == before
    assert fifo.exists() and sorted(os.listdir(tmp_path)) == sorted(["outside.fifo", "run"])


def test_symlinks_out_of_the_run_are_never_followed(local_url, tmp_path, no_key):
    mgr, info = saved_run(local_url)
    ckdir = os.path.join(local_url, "checkpoints", info.id)
    shard = os.path.join(ckdir, info.manifest.shards[0].path)
    outside = tmp_path / "outside"
    outside.mkdir()
    copy = outside / "shard.safetensors"
    copy.write_bytes(open(shard, "rb").read())  # identical bytes: only the link itself is wrong
    os.remove(shard)
    os.symlink(copy, shard)
    [res] = mgr.verify()
    assert not res.ok and "resolves outside the run" in res.problems[0].detail
    with pytest.raises(Exception, match="outside the run|corrupt"):
        mgr.restore(fresh_state(), checkpoint_id=info.id, allow_unverified=True)
    # a whole checkpoint folder linked in from elsewhere is neither listed nor read
    other = outside / "ck"
    os.rename(ckdir, other)
    os.symlink(other, ckdir)
    assert CheckpointManager(local_url).list() == []
    with pytest.raises(Exception, match="no checkpoint|no committed"):
        CheckpointManager(local_url).restore(fresh_state(), allow_unverified=True)
    # a record linked in from outside is ignored
    rec_dir = os.path.join(local_url, "records", "incident")
    os.makedirs(rec_dir, exist_ok=True)
    (outside / "inc.json").write_text(json.dumps({"id": "x", "first_suspect_step": 0, "kind": "manual"}))
    os.symlink(outside / "inc.json", os.path.join(rec_dir, "0000-linked.json"))
    assert CheckpointManager(local_url).incidents() == []
    # a symlink that stays inside the run is fine
    os.remove(ckdir)
    os.rename(other, ckdir)
    os.remove(shard)
    inside = os.path.join(local_url, "kept.safetensors")
    os.rename(copy, inside)
    os.symlink(inside, shard)
    assert CheckpointManager(local_url).verify()[0].ok


# -- limits ----------------------------------------------------------------------------------
def test_oversized_manifest_is_refused_before_it_is_read(local_url, no_key, monkeypatch):
    from fsspec.implementations.local import LocalFileSystem

    from verified_ckpt.store import run as store_mod

    mgr, info = saved_run(local_url)
    monkeypatch.setattr(store_mod, "MAX_MANIFEST_BYTES", 1000)
    reads = []
    real = LocalFileSystem.cat_file
    monkeypatch.setattr(LocalFileSystem, "cat_file", lambda self, p, *a, **k: reads.append(p) or real(self, p, *a, **k))
    [listed] = mgr.list()
    assert listed.status is Status.CORRUPT and "more than the 1000 allowed" in listed.reasons[0]
    assert not any(p.endswith("manifest.json") for p in reads)


def test_a_huge_declared_header_is_refused_before_allocation():
    import tracemalloc

    tracemalloc.start()
    with pytest.raises(Exception, match="header"):
        parse_header((2**62).to_bytes(8, "little"), 8, "x")
    with pytest.raises(Exception, match="header"):
        parse_header((1000).to_bytes(8, "little") + b"{}", 10, "x")  # claims more than the file holds
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20


def test_a_shard_larger_or_smaller_than_declared_is_refused_unread(local_url, no_key):
    mgr, info = saved_run(local_url)
    shard = os.path.join(local_url, "checkpoints", info.id, info.manifest.shards[0].path)
    with open(shard, "ab") as f:
        f.write(b"\0" * 4096)
    [res] = mgr.verify()
    assert not res.ok and res.problems[0].kind == "size"


# -- no pickle -------------------------------------------------------------------------------
NO_PICKLE_CHILD = textwrap.dedent(r"""
    import io, json, os, pickle, sys, _pickle
    sys.path.insert(0, "tests")
    import torch
    from helpers import fresh_state, trained_state
    from verified_ckpt import CheckpointManager, GuardConfig, state_fingerprint
    from verified_ckpt_cli.main import main
    from click.testing import CliRunner
    url = sys.argv[1]
    saved = trained_state(seed=5)
    stream = io.BytesIO(b"a data loader's stream")
    stream.seek(2)
    saved["blobs"] = {"tok": b"\x00tokenizer\xff", "buf": bytearray(b"mutable"), "stream": stream}
    mgr = CheckpointManager(url)
    mgr.save(5, saved)
    calls = []
    def refuse(*a, **k):
        calls.append(a[:1])
        raise RuntimeError("pickle loading is forbidden on the load path")
    class Refusing(pickle.Unpickler):
        def __init__(self, *a, **k):
            refuse()
    for mod in (pickle, _pickle):
        mod.load = mod.loads = refuse
        mod.Unpickler = Refusing
    torch.load = refuse
    import numpy
    numpy.load = refuse
    target = fresh_state()
    target["blobs"] = None
    info = CheckpointManager(url).restore(target, allow_unverified=True)
    assert state_fingerprint({"m": target["model"], "o": target["optim"]}) == state_fingerprint(
        {"m": saved["model"], "o": saved["optim"]})
    got = target["blobs"]
    assert got["tok"] == b"\x00tokenizer\xff" and got["buf"] == bytearray(b"mutable")
    assert got["stream"].getvalue() == b"a data loader's stream" and got["stream"].tell() == 2
    assert target["sched"].state_dict() == saved["sched"].state_dict()
    results = CheckpointManager(url).verify()
    assert [r.ok for r in results] == [True]
    for args in (["verify", url, "--all"], ["list", url], ["show", url, "5"], ["ledger", url], ["report", url, "--out", url + ".html"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code in (0, 2), (args, r.output)
        assert "forbidden" not in r.output, (args, r.output)
    assert calls == [], calls
    print("ok")
""")


def test_no_pickle_is_loaded_by_restore_verify_or_the_cli(local_url, no_key):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", NO_PICKLE_CHILD, local_url], capture_output=True, text=True,
                          timeout=110, cwd=root)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_a_save_the_reader_would_refuse_is_refused_before_anything_is_written(local_url, no_key):
    from verified_ckpt.tensorspec import MAX_NDIM

    deep: dict = {"leaf": 1}
    for _ in range(150):
        deep = {"d": deep}
    mgr = CheckpointManager(local_url)
    with pytest.raises(InvalidState, match="fewer levels"):
        mgr.save(1, {"w": torch.ones(2), "meta": deep})
    with pytest.raises(InvalidState, match="dimensions"):
        mgr.save(1, {"w": torch.ones([1] * (MAX_NDIM + 1))})
    with pytest.raises(InvalidState, match="step must be"):
        mgr.save(2**63, {"w": torch.ones(2)})
    assert not os.path.exists(os.path.join(local_url, "checkpoints"))
