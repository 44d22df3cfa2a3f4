"""The Lightning integration on 2 gloo ranks under torchrun (nothing here needs a majority: ABFT and the checksums name a rank among two), as the README sets it up: Trainer(strategy="ddp",
devices=3, accelerator="cpu") with VerifiedCheckpointIO and SDCGuardCallback() at the guard's defaults (ABFT on).

One launch runs the story (examples/lightning_train.py --story): a 60-step clean run with dropout, gradient
accumulation and a warm-up + cosine schedule; an uninterrupted run; a run whose rank 1 computes a wrong gradient
(x10, a hook on the parameter) at a step that is not an audit step; its resume from the rollback target; and the
same model as FSDP2 under Lightning's ModelParallelStrategy, clean and with a wrong reduced shard on rank 1.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
from click.testing import CliRunner
from helpers import torchrun
from test_service import by_service, checkpoints, service, until

from verified_ckpt import CheckpointManager
from verified_ckpt.integrations.lightning import RESUME, VerifiedCheckpointIO
from verified_ckpt_cli.main import main as cli

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("pl"))
    done = torchrun(os.path.join(EXAMPLES, "lightning_train.py"), 2, "--story", root, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(os.path.join(root, "story.json")) as f:
        return root, json.load(f)


@pytest.mark.timeout(300)
def test_lightning_defaults_raise_nothing_in_60_clean_steps_with_accumulation_and_a_schedule(story):
    root, s = story
    assert s["long"] is None
    long = CheckpointManager(os.path.join(root, "long"))
    assert [(c.step, c.status.value) for c in long.list()] == [(15, "restorable"), (30, "restorable"),
                                                               (45, "restorable"), (60, "restorable")]
    counts = long.ledger_summary()["counts"]
    assert counts["abft"] == {"checks": 60, "failed": 0} and counts["checksum"]["failed"] == 0
    assert long.incidents() == []


@pytest.mark.timeout(300)
def test_lightning_catches_a_wrong_gradient_at_its_step_naming_the_rank_and_resumes_bit_identical(story):
    root, s = story
    clean = CheckpointManager(os.path.join(root, "clean")).list()
    assert [(c.step, c.status.value) for c in clean] == [(4, "restorable"), (8, "restorable"), (12, "restorable")]
    assert s["caught"] == {"kind": "abft", "ranks": [1], "step": 6}  # step 6 is no audit step (audit_every=500)
    first, *after = s["checkpoints"]
    assert first[:2] == [4, "restorable"]  # saved before the fault, audited before its save
    assert [c[:2] for c in after] == [[8, "restorable"], [12, "restorable"]]
    assert all(c[2] is not None and c[2].startswith("step-0000000004-") for c in after)  # resumed from step 4
    assert s["resumed"] == s["clean"]  # bit-identical to the uninterrupted run
    [inc] = CheckpointManager(os.path.join(root, "faulty")).incidents()
    assert inc.ranks == [1] and [h.host for h in inc.hosts] == [socket.gethostname()]
    # Every start can pass io.resume_path(): RESUME with something to continue from, None on a fresh run.
    assert VerifiedCheckpointIO(os.path.join(root, "clean")).resume_path() == RESUME


@pytest.mark.timeout(120)
def test_verify_and_the_service_leave_every_clean_lightning_checkpoint_restorable(story, tmp_path):
    # ModelCheckpoint stores kth_value = inf when it monitors nothing: bookkeeping, not training state.
    root, _ = story
    run = os.path.join(root, "long")
    r = CliRunner().invoke(cli, ["verify", run, "--all"])
    assert r.exit_code == 0, r.output
    assert {c.status.value for c in CheckpointManager(run).list()} == {"restorable"}
    clean = os.path.join(root, "clean")
    with service(clean) as (client, _):
        got = until(lambda: (c := checkpoints(client, clean)) and len(c) == 3 and all(by_service(x) for x in c.values())
                    and c, what="the service to verify the clean run")
        assert {c["status"] for c in got.values()} == {"restorable"}
    assert {c.status.value for c in CheckpointManager(clean).list()} == {"restorable"}
    assert VerifiedCheckpointIO(str(tmp_path / "empty")).resume_path() is None


@pytest.mark.timeout(120)
def test_set_ups_the_guard_cannot_step_are_refused_when_training_starts_with_what_to_use(tmp_path):
    import lightning_train
    from lightning.pytorch import Trainer

    from verified_ckpt.integrations.lightning import SDCGuardCallback

    class Manual(lightning_train.MLP):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, default_root_dir=str(tmp_path), callbacks=[SDCGuardCallback()])
    with pytest.raises(ValueError, match="manual optimization"):
        trainer.fit(Manual())


@pytest.mark.timeout(300)
def test_the_callback_guards_an_fsdp2_model_under_lightnings_model_parallel_strategy(story):
    _, s = story
    clean, faulty = s["fsdp"], s["fsdp_fault"]
    assert clean["layout"] == "sharded" and clean["failed"] == 0
    assert clean["checks"]["checksum"] == 6 and clean["checks"]["audit"] >= 1, clean
    assert faulty["caught"] == {"kind": "checksum", "ranks": [1], "step": 4}
