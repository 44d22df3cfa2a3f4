"""The Lightning integration on 3 gloo ranks under torchrun: Trainer(strategy="ddp", devices=3, accelerator="cpu").

One launch runs the story (examples/lightning_train.py --story): an uninterrupted run, a run with a
gradient fault at an audit step (ABFT off, so the cross-rank audit is what catches it), and its resume
from the rollback target.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
from helpers import torchrun

from verified_ckpt import CheckpointManager
from verified_ckpt.integrations.lightning import RESUME, VerifiedCheckpointIO

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


@pytest.mark.timeout(300)
def test_lightning_ddp_saves_verified_catches_a_fault_naming_the_rank_and_resumes_bit_identical(tmp_path):
    root = str(tmp_path)
    done = torchrun(os.path.join(EXAMPLES, "lightning_train.py"), 3, "--story", root, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(os.path.join(root, "story.json")) as f:
        s = json.load(f)
    clean = CheckpointManager(os.path.join(root, "clean")).list()
    assert [(c.step, c.status.value) for c in clean] == [(4, "restorable"), (8, "restorable"), (12, "restorable")]
    assert s["caught"] == {"kind": "audit", "ranks": [1], "step": 6}
    first, *after = s["checkpoints"]
    assert first[:2] == [4, "restorable"]  # saved before the fault, covered by the audit at step 4
    assert [c[:2] for c in after] == [[8, "restorable"], [12, "restorable"]]
    assert all(c[2] is not None and c[2].startswith("step-0000000004-") for c in after)  # resumed from step 4
    assert s["resumed"] == s["clean"]  # bit-identical to the uninterrupted run
    [inc] = CheckpointManager(os.path.join(root, "faulty")).incidents()
    assert inc.ranks == [1] and [h.host for h in inc.hosts] == [socket.gethostname()]
    # Every start can pass io.resume_path(): RESUME with something to continue from, None on a fresh run.
    assert VerifiedCheckpointIO(os.path.join(root, "clean")).resume_path() == RESUME
    assert VerifiedCheckpointIO(str(tmp_path / "empty")).resume_path() is None
