"""The Hugging Face integration on 2 gloo ranks under torchrun (nothing here needs a majority: ABFT and the checksums name a rank among two), and `vckpt export --format hf`.

One torchrun launch runs the whole story (examples/hf_train.py --story), every phase with the guard's defaults:
plain `Trainer` and `VerifiedTrainer` side by side (GPT-2 from a small config: HF's Conv1D blocks; labels padded
with -100 and two accumulated microbatches, so `num_items_in_batch` matters), a run whose rank 1 computes a wrong
gradient of `h.0.mlp.c_fc` at a step that is not an audit step, its resume from the rollback target,
`load_best_model_at_end` with `save_total_limit=1`, and `torch_compile=True`. Importing transformers costs about
8 CPU-seconds per rank on this machine, so the phases share one launch.
"""

from __future__ import annotations

import json
import os

import fsspec
import pytest
import torch
from click.testing import CliRunner
from helpers import flip_byte, torchrun
from safetensors.torch import load_file

from verified_ckpt import CheckpointManager, CorruptCheckpoint, InvalidState, state_fingerprint
from verified_ckpt_cli.main import main as cli

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("hf"))
    done = torchrun(os.path.join(EXAMPLES, "hf_train.py"), 2, "--story", root, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(os.path.join(root, "story.json")) as f:
        return root, json.load(f)


@pytest.mark.timeout(300)
def test_verified_trainer_trains_exactly_as_plain_trainer(story):
    _, s = story
    # Loss and gradient norm at every step, then the final weights, bit for bit: the guard changes nothing.
    assert s["verified"]["history"] == s["plain"]["history"] and len(s["plain"]["history"]) == 12
    assert s["verified"]["fingerprint"] == s["plain"]["fingerprint"]


@pytest.mark.timeout(300)
def test_trainer_catches_a_wrong_conv1d_gradient_at_its_step_naming_the_rank_and_resumes_bit_identical(story):
    root, s = story
    clean = CheckpointManager(os.path.join(root, "clean")).list()
    assert [(c.step, c.status.value) for c in clean] == [(4, "restorable"), (8, "restorable"), (12, "restorable")]
    assert s["caught"]["ranks"] == [1] and s["caught"]["step"] == 7 and s["caught"]["kind"] == "abft"  # no audit step
    assert "transformer.h.0.mlp.c_fc.weight" in s["caught"]["detail"]
    assert s["resumed_from"].startswith("step-0000000004-")  # the rollback target: the save before step 7
    assert s["resumed"] == s["clean"]  # the resumed run ends bit-identical to the uninterrupted one
    assert [tuple(c) for c in s["checkpoints"]] == [(4, "restorable"), (8, "restorable"), (12, "restorable")]
    [inc] = CheckpointManager(os.path.join(root, "faulty")).incidents()
    assert inc.ranks == [1]


@pytest.mark.timeout(300)
def test_the_guard_reports_its_coverage_of_gpt2_once_at_the_first_step(story):
    root, _ = story
    [row] = [r for r in CheckpointManager(os.path.join(root, "clean")).ledger_summary()["coverage"]]
    assert row["step"] == 1 and row["params"] > 0.95 and row["flops"] > 0.9  # Conv1D blocks included


@pytest.mark.timeout(300)
def test_load_best_model_at_end_restores_the_best_restorable_checkpoint_and_retention_keeps_it(story):
    from transformers import GPT2LMHeadModel

    import hf_train

    root, s = story
    best = CheckpointManager(os.path.join(root, "best"))
    # save_total_limit=1: the newest restorable checkpoint, and the best one, which retention never takes.
    assert sorted(c.step for c in best.list()) == sorted({s["best"]["step"], 12}) and s["best"]["step"] != 12

    def weights(step: int) -> str:
        m: GPT2LMHeadModel = hf_train.model()
        best.restore({"model": m}, step=step)
        return str(state_fingerprint({"model": m}))

    assert s["best"]["fingerprint"] == weights(s["best"]["step"]) != weights(12)


@pytest.mark.timeout(300)
def test_torch_compile_trains_and_says_what_abft_leaves_out(story):
    root, s = story
    assert len(s["compiled"]["history"]) == 4
    assert [c.status.value for c in CheckpointManager(os.path.join(root, "compiled")).list()] == ["restorable"]
    assert "inside a torch.compile'd module" in s["compiled"]["coverage"]


@pytest.mark.timeout(120)
def test_hf_export_loads_with_from_pretrained_equal_to_the_trained_weights_tied_included(story, tmp_path):
    from transformers import GPT2LMHeadModel

    root, _ = story
    dest = str(tmp_path / "hf")
    r = CliRunner().invoke(cli, ["export", os.path.join(root, "clean"), "--format", "hf", "--to", dest])
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(dest)) == ["config.json", "model.safetensors"]
    assert "lm_head.weight" not in load_file(os.path.join(dest, "model.safetensors"))  # tied: stored once
    model = GPT2LMHeadModel.from_pretrained(dest)
    trained = load_file(os.path.join(root, "clean-final.safetensors"))  # rank 0's weights at the end of training
    loaded = model.state_dict()
    assert set(loaded) == set(trained)
    for name, t in trained.items():
        assert torch.equal(loaded[name], t), name
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight


def test_hf_export_of_a_plain_module_writes_first_names_and_refuses_what_it_cannot_export(tmp_path):
    run, m = str(tmp_path / "run"), Tied()
    mgr = CheckpointManager(run)
    mgr.save(1, {"model": m, "hf_config": '{"model_type": "x"}'})
    mgr.save(2, {"weights": m})
    got = tmp_path / "a"
    mgr.export(str(got), step=1, format="hf", allow_unverified=True)
    tensors = load_file(str(got / "model.safetensors"))
    assert list(tensors) == ["emb.weight"] and torch.equal(tensors["emb.weight"], m.emb.weight)
    assert (got / "config.json").read_text() == '{"model_type": "x"}'
    with pytest.raises(InvalidState, match="no 'model' entry"):
        mgr.export(str(tmp_path / "b"), step=2, format="hf", allow_unverified=True)
    with pytest.raises(InvalidState, match="unknown export format"):
        mgr.export(str(tmp_path / "c"), step=1, format="onnx", allow_unverified=True)
    # Unverified without the flag is refused as today, and a flipped byte leaves nothing behind.
    r = CliRunner().invoke(cli, ["export", run, "--step", "1", "--format", "hf", "--to", str(tmp_path / "d")])
    assert r.exit_code != 0 and "unverified" in r.output and "Traceback" not in r.output
    [info] = [i for i in mgr.list() if i.step == 1]
    shard = tmp_path / "run" / "checkpoints" / info.id / info.manifest.shards[0].path
    flip_byte(fsspec.filesystem("file"), str(shard), info.manifest.shards[0].size - 1)
    with pytest.raises(CorruptCheckpoint):
        mgr.export(str(tmp_path / "e"), step=1, format="hf", allow_unverified=True)
    assert not (tmp_path / "e").exists() or not os.listdir(tmp_path / "e")


@pytest.mark.parametrize("option,said", [({"push_to_hub": True}, "push_to_hub"), ({"save_only_model": True}, "resuming"),
                                          ({"optim": "adalomo"}, "inside the backward")])
def test_trainer_options_the_guard_cannot_honour_are_refused_at_construction(tmp_path, option, said):
    import hf_train
    from transformers import TrainingArguments

    from verified_ckpt.integrations.transformers import VerifiedTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", hub_model_id="x/y", **option)
    with pytest.raises(ValueError, match=said):  # before Trainer's own set-up, which would reach the Hub
        VerifiedTrainer(model=hf_train.model(), args=args, train_dataset=hf_train.RandomTokens(4), run=str(tmp_path / "r"))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_total_limit=2)
    with pytest.raises(ValueError, match="disagree"):
        VerifiedTrainer(model=hf_train.model(), args=args, run=str(tmp_path / "r"), keep_last=3)
    assert VerifiedTrainer(model=hf_train.model(), args=args, run=str(tmp_path / "r")).keep_last == 2
