"""A long-lived reader (``vckpt serve``) reads each record once, and still sees every change its listing shows."""

from __future__ import annotations

import os

import torch

from verified_ckpt import CheckpointManager


def test_records_are_read_once_per_reader_and_reread_when_their_listing_changes(tmp_path):
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run))  # one reader that looks again and again
    mgr.save(1, {"w": torch.ones(3)})
    mgr.flag(1, reason="first look")
    assert [i.reason for i in mgr.view().incidents] == ["first look"]
    [record] = (run / "records" / "incident").iterdir()
    st, data = record.stat(), record.read_bytes()
    altered = data.replace(b"first look", b"FIRST LOOK")
    assert len(altered) == len(data)
    # Rewritten in place with the same size and modification time: this reader keeps what it parsed (the
    # documented blind spot, as for manifests), while a fresh reader - every CLI command - reads the new bytes.
    record.write_bytes(altered)
    os.utime(record, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert [i.reason for i in mgr.view().incidents] == ["first look"]
    assert [i.reason for i in CheckpointManager(str(run)).view().incidents] == ["FIRST LOOK"]
    # A new stamp, a record appended by another process, a record cut short: each is seen at the next look.
    os.utime(record, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert [i.reason for i in mgr.view().incidents] == ["FIRST LOOK"]
    CheckpointManager(str(run)).flag(1, reason="second")
    assert sorted(i.reason for i in mgr.view().incidents) == ["FIRST LOOK", "second"]
    record.write_bytes(b"{")
    view = mgr.view()
    assert [(i.kind, i.reason) for i in view.incidents] == [("manual", "second")]
    assert [u for u in view.unreadable if record.name in u and "not JSON" in u]
