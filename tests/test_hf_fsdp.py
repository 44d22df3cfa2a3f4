"""``VerifiedTrainer`` with FSDP2 (issue 49, finding 2) on 2 gloo ranks under torchrun, at ``GuardConfig()``.

Two launches (tests/hf_fsdp_story.py): the first trains a clean run of 30 steps through ``fsdp="full_shard"`` with
``fsdp_config={"version": 2}``, a run with gradient accumulation, ``gradient_checkpointing=True``,
``save_total_limit=1`` and ``load_best_model_at_end``, a run with a wrong gradient element and two with a weight
shard's bit flipped (with and without activation checkpointing; all on rank 1), then a run asked for only through
accelerate's environment (``ACCELERATE_USE_FSDP=true FSDP_VERSION=2``), with ``gradient_checkpointing=True``, whose
rank 1 is killed with SIGKILL at step 14; the second resumes that run with ``resume_from_checkpoint=True``.
The refusals are unit tests: no process group needed.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from helpers import torchrun

from verified_ckpt.integrations.transformers import _unsupported, fsdp_request

STORY = os.path.join(os.path.dirname(__file__), "hf_fsdp_story.py")


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, dict]:
    root = str(tmp_path_factory.mktemp("hf-fsdp"))
    killed = torchrun(STORY, 2, root, "train", timeout=240)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-4000:]  # rank 1, at step 14
    with open(os.path.join(root, "train.json")) as f:
        trained = json.load(f)
    done = torchrun(STORY, 2, root, "resume", timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(os.path.join(root, "resume.json")) as f:
        return root, trained, json.load(f)


@pytest.mark.timeout(500)
def test_fsdp2_trainer_is_guarded_through_the_sharded_layout_and_saves_restorable(story):
    _, s, _ = story
    clean = s["clean"]
    assert clean["fsdp"] and clean["layout"] == "ShardedLayout"  # fully_shard-ed by accelerate, never DDP
    assert clean["checkpoints"] == [[10, "restorable"], [20, "restorable"], [30, "restorable"]]  # 30 clean steps
    assert "100% of parameters" in clean["coverage"]


@pytest.mark.timeout(500)
def test_fsdp2_trainer_names_a_wrong_gradient_at_its_step_and_a_flipped_weight_shard_at_the_next(story):
    _, s, _ = story
    grad, weights = s["faults"]["grad"], s["faults"]["weights"]
    assert (grad["kind"], grad["ranks"], grad["step"]) == ("abft", [1], 3)  # x10 in c_fc's gradient at step 3
    assert "transformer.h.0.mlp.c_fc.weight" in grad["detail"]
    assert (weights["kind"], weights["ranks"], weights["step"]) == ("chain", [1], 3)  # flipped after step 2
    gc = s["faults"]["weights-gc"]  # the same under gradient_checkpointing=True
    assert (gc["kind"], gc["ranks"], gc["step"]) == ("chain", [1], 3)


@pytest.mark.timeout(500)
def test_fsdp2_through_accelerates_environment_resumes_after_kill_9_bit_identical_to_a_clean_run(story):
    _, s, resumed = story
    assert resumed["fsdp"] and resumed["layout"] == "ShardedLayout" and resumed["checkpointing"]
    assert resumed["resumed_from"].startswith("step-0000000010-")  # the newest save before the kill at step 14
    assert resumed["checkpoints"] == [[10, "restorable"], [20, "restorable"], [30, "restorable"]]
    assert resumed["incidents"] == 0
    # Full weights, bit for bit, as the clean run without activation checkpointing ended.
    assert resumed["digest"] == s["clean"]["digest"]


@pytest.mark.timeout(500)
def test_fsdp2_trainer_with_accumulation_checkpointing_retention_and_the_best_model(story):
    _, s, _ = story
    extras = s["extras"]
    assert extras["fsdp"] and extras["layout"] == "ShardedLayout"
    best = extras["best"]
    kept = [step for step, status in extras["checkpoints"]]
    assert all(status == "restorable" for _, status in extras["checkpoints"])
    # save_total_limit=1: the newest and the best (retention never takes it); one of 4, 8, 12 is gone.
    assert set(kept) == {best, 12} and len(kept) == len({best, 12})
    assert extras["digest"] == extras[f"digest-{best}"]  # load_best_model_at_end restored the best step's weights
    if best != 12:
        assert extras["digest"] != extras["digest-12"]


def args(fsdp: str = "", version: int | None = None, deepspeed: object = None) -> SimpleNamespace:
    config = {} if version is None else {"version": version}
    return SimpleNamespace(fsdp=fsdp, fsdp_config=config, deepspeed=deepspeed, fp16=False, n_gpu=1, optim="adamw_torch",
                           past_index=-1, push_to_hub=False, save_only_model=False)


@pytest.mark.parametrize("a,env,said", [
    (args("full_shard", 1), {}, "FSDP1 is not supported"),
    (args(), {"ACCELERATE_USE_FSDP": "true"}, "FSDP1 is not supported"),  # accelerate's default version is 1
    (args(), {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "FSDP1 is not supported"),
    (args(deepspeed="ds.json"), {}, "DeepSpeed is not supported"),
    (args(), {"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed is not supported"),
])
def test_fsdp1_and_deepspeed_are_refused_in_one_line_naming_the_fsdp2_setting(a, env, said):
    problem = _unsupported(a, env)
    assert problem is not None and said in problem and "\n" not in problem
    assert "fsdp_config={'version': 2}" in problem and "FSDP_VERSION=2" in problem


def test_the_fsdp_version_asked_for_arguments_first_then_accelerates_environment():
    assert fsdp_request(args(), {}) is None and _unsupported(args(), {}) is None
    assert fsdp_request(args("full_shard"), {}) == 2  # the Trainer's default version
    assert fsdp_request(args("full_shard", 2), {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}) == 2
    assert fsdp_request(args(), {"ACCELERATE_USE_FSDP": "True", "FSDP_VERSION": "2"}) == 2
    assert _unsupported(args(), {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}) is None
    assert fsdp_request(args(), {"ACCELERATE_USE_FSDP": "false", "FSDP_VERSION": "2"}) is None


def test_an_fsdp2_request_accelerate_would_drop_is_refused_never_trained_as_ddp(tmp_path, monkeypatch):
    import hf_train
    from accelerate.utils import DistributedType
    from transformers import TrainingArguments

    from verified_ckpt.integrations.transformers import VerifiedTrainer

    # One process, no process group: accelerate sets up no distributed type, so FSDP2 cannot run; refused.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    a = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="FSDP2 was asked for") as e:
        VerifiedTrainer(model=hf_train.model(), args=a, run=str(tmp_path / "r"))
    assert "\n" not in str(e.value) and str(DistributedType.NO) in str(e.value)
