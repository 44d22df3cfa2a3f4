"""Every manifest checks itself, key or no key (issue 48, finding 2).

An unsigned manifest (the default) used to be trusted as read: an edited learning rate, step counter, byte
string type or stream position passed `vckpt verify` and was restored. Now each manifest carries a blake3 digest
of its canonical body, and its ``state_fingerprint`` is recomputed from its tensor table and skeleton, at every
parse; a mismatch lists the checkpoint as ``corrupt`` and nothing is restored from it.

The digests these tests write (to forge a consistent body) are computed here from raw bytes, not by the code
under test.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import blake3
import pytest
import torch
from click.testing import CliRunner

from verified_ckpt import CheckpointManager, CheckpointNotRestorable, CorruptCheckpoint, ManifestError, Status
from verified_ckpt.jsonx import canonical_json
from verified_ckpt.manifest import Manifest
from verified_ckpt_cli.main import main

pytestmark = pytest.mark.timeout(120)

DIGEST = "manifest_digest"
OLD_RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "run-before-byte-strings")
OLD_ID = "step-0000000001-51f34f66"


def saved_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    stream = io.BytesIO(b"abcdef")
    stream.seek(3)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.003), "progress": {"step": 20},
            "blobs": {"token": b"xyz", "stream": stream}}


def live_state() -> dict:
    torch.manual_seed(5)
    model = torch.nn.Linear(3, 2)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.5), "progress": {"step": 0},
            "blobs": {"token": b"mine", "stream": io.BytesIO(b"")}}


def snapshot(state: dict) -> tuple:
    """What a restore could change in ``state``, as plain values."""
    stream = state["blobs"]["stream"]
    return ({k: v.tolist() for k, v in state["model"].state_dict().items()},
            state["optim"].param_groups[0]["lr"], dict(state["progress"]), type(state["blobs"]["token"]),
            state["blobs"]["token"], stream.getvalue(), stream.tell())


def save(url: str, key: str | None = None) -> str:
    """One checkpoint of :func:`saved_state` at step 20; the path of its manifest."""
    info = CheckpointManager(url, signing_key=key).save(20, saved_state())
    return os.path.join(url, "checkpoints", info.id, "manifest.json")


def reseal(doc: dict) -> dict:
    """``doc`` with its digest recomputed as a writer would: blake3 of the canonical JSON minus digest and seal."""
    body = {k: v for k, v in doc.items() if k not in (DIGEST, "signature")}
    return {**doc, DIGEST: blake3.blake3(canonical_json(body)).hexdigest()}


def assert_refused(url: str, path: str, why: str) -> None:
    """The checkpoint lists as corrupt naming ``why``, fails `vckpt verify`, and a restore touches nothing."""
    [listed] = CheckpointManager(url).list()
    assert listed.status is Status.CORRUPT and why in listed.reasons[0], listed.reasons
    assert "\n" not in listed.reasons[0] and "restore another checkpoint" in listed.reasons[0]
    r = CliRunner().invoke(main, ["verify", url, "--json"])
    [row] = json.loads(r.stdout)
    assert r.exit_code == 1 and not row["ok"] and why in row["problems"][0], r.output
    live = live_state()
    before = snapshot(live)
    with pytest.raises((CorruptCheckpoint, CheckpointNotRestorable)):
        CheckpointManager(url).restore(live, step=20, allow_unverified=True)
    assert snapshot(live) == before


# The issue's four edits, each one bit of the stored manifest's text.
EDITS = {
    "lr 0.003 -> 0.007": (rb'"lr":0\.003,', b'"lr":0.007,'),
    "progress.step 20 -> 28": (rb'"progress":\{"stateful":false,"value":\{"step":20\}\}',
                               b'"progress":{"stateful":false,"value":{"step":28}}'),
    "bytes -> bytearray": (rb'"__bytes__"', b'"__bytearray__"'),
    "BytesIO position 3 -> 2": (rb'("__bytesio__":\["[^"]+",)3\]', rb"\g<1>2]"),
}


def test_an_unedited_manifest_restores_every_value(local_url):
    """The control for the edits below: the same save, unedited, restores what was saved."""
    save(local_url)
    live = live_state()
    CheckpointManager(local_url).restore(live, step=20, allow_unverified=True)
    want = saved_state()
    assert snapshot(live) == snapshot(want)
    [r] = CheckpointManager(local_url).verify()
    assert r.ok, r.problems


@pytest.mark.parametrize("edit", list(EDITS))
def test_each_edit_of_an_unsigned_manifest_from_the_issue_is_corrupt_and_restores_nothing(local_url, edit):
    path = save(local_url)
    pattern, replacement = EDITS[edit]
    data, n = re.subn(pattern, replacement, Path(path).read_bytes())
    assert n == 1, edit
    with open(path, "wb") as f:
        f.write(data)
    assert_refused(local_url, path, DIGEST)


def test_a_resealed_digest_over_an_edited_state_is_refused_by_the_state_fingerprint(local_url):
    """The digest recomputed after the edit (a consistent body): the skeleton no longer gives the recorded
    ``state_fingerprint``, checked at every read, verify and restore."""
    path = save(local_url)
    doc = json.loads(Path(path).read_bytes())
    doc["state"]["progress"]["value"]["step"] = 28
    with open(path, "wb") as f:
        f.write(canonical_json(reseal(doc)))
    assert_refused(local_url, path, "state_fingerprint")


def test_a_tensor_fingerprint_edited_under_a_resealed_digest_is_refused_by_the_state_fingerprint(local_url):
    path = save(local_url)
    doc = json.loads(Path(path).read_bytes())
    entry = doc["tensors"]["model/weight"]
    entry["fingerprint"] = entry["fingerprint"][:-1] + ("1" if entry["fingerprint"][-1] != "1" else "2")
    with open(path, "wb") as f:
        f.write(canonical_json(reseal(doc)))
    assert_refused(local_url, path, "state_fingerprint")


@pytest.mark.parametrize("change", ["digest deleted", "version 1 with a digest", "digest not hex"])
def test_a_current_manifest_without_a_good_digest_is_refused(local_url, change):
    path = save(local_url)
    doc = json.loads(Path(path).read_bytes())
    if change == "digest deleted":
        del doc[DIGEST]
    elif change == "version 1 with a digest":
        doc["schema_version"] = 1
    else:
        doc[DIGEST] = doc[DIGEST].upper()
    with open(path, "wb") as f:
        f.write(canonical_json(doc))
    assert_refused(local_url, path, DIGEST if change != "version 1 with a digest" else "has no manifest_digest")


def test_a_manifest_of_schema_1_reads_without_a_digest_and_its_state_fingerprint_is_still_checked():
    """Manifests written before the digest (tests/data) still read; an edit of their state does not."""
    raw = Path(OLD_RUN, "checkpoints", OLD_ID, "manifest.json").read_bytes()
    m = Manifest.from_json(raw, OLD_ID)
    assert m.schema_version == 1 and DIGEST not in m.to_dict()
    assert Manifest.from_json(m.to_json(), OLD_ID).to_dict() == m.to_dict()  # as rank 0 sends it to the others
    edited = raw.replace(b'"epoch":2', b'"epoch":3')
    assert edited != raw
    with pytest.raises(ManifestError, match="state_fingerprint"):
        Manifest.from_json(edited, OLD_ID)


def test_a_signed_manifest_seals_its_digest(local_url):
    key = b"k" * 32
    path = save(local_url, key=key)
    doc = json.loads(Path(path).read_bytes())
    assert doc["signature"]["mac"] and len(doc[DIGEST]) == 64
    [listed] = CheckpointManager(local_url, signing_key=key).list()
    assert listed.signature == "valid" and listed.status is Status.UNVERIFIED
    m = Manifest.from_json(listed.manifest.to_json(), listed.id)  # re-encoded (exports, Dask tasks): still itself
    assert m.to_dict() == listed.manifest.to_dict()


def test_every_flipped_byte_of_a_manifest_is_refused_or_changes_nothing(local_url):
    """Each byte of a small manifest flipped in turn (each of its 8 bits, bits 0-1 together, and all 8): every flip
    is refused at parse, or (were one to parse) is the same manifest and restores the same values. A sample goes
    through the run's own read: listed corrupt, nothing restored."""
    info = CheckpointManager(local_url).save(20, {"w": torch.arange(3.0), "lr": 0.003, "tok": b"ab"})
    path = os.path.join(local_url, "checkpoints", info.id, "manifest.json")
    raw = Path(path).read_bytes()
    want = Manifest.from_json(raw, info.id).to_dict()
    assert len(raw) < 2048, len(raw)  # small, so that every byte is cheap to try
    parsed = []
    for at in range(len(raw)):
        for mask in (*(1 << bit for bit in range(8)), 0x03, 0xFF):  # 0x03: schema_version 2 -> 1
            flipped = bytearray(raw)
            flipped[at] ^= mask
            try:
                m = Manifest.from_json(bytes(flipped), info.id)
            except ManifestError as e:
                assert "\n" not in str(e) and "malformed" in str(e)
                continue
            assert m.to_dict() == want, (at, mask)
            parsed.append(bytes(flipped))
    for flipped in parsed:  # a flip that parses must restore exactly what was saved
        with open(path, "wb") as f:
            f.write(flipped)
        live = {"w": torch.zeros(3), "lr": 1.0, "tok": b""}
        CheckpointManager(local_url).restore(live, step=20, allow_unverified=True)
        assert torch.equal(live["w"], torch.arange(3.0)) and live["lr"] == 0.003 and live["tok"] == b"ab"
    for at in range(0, len(raw), 29):
        flipped = bytearray(raw)
        flipped[at] ^= 0x01
        with open(path, "wb") as f:
            f.write(bytes(flipped))
        [listed] = CheckpointManager(local_url).list()
        assert listed.status is Status.CORRUPT, (at, listed)
        live = {"w": torch.zeros(3), "lr": 1.0, "tok": b""}
        with pytest.raises((CorruptCheckpoint, CheckpointNotRestorable)):
            CheckpointManager(local_url).restore(live, step=20, allow_unverified=True)
        assert torch.equal(live["w"], torch.zeros(3)) and live["lr"] == 1.0 and live["tok"] == b""
