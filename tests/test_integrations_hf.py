"""The Hugging Face integration on 3 gloo ranks under torchrun, and `vckpt export --format hf`.

One torchrun launch runs the whole story (examples/hf_train.py --story): an uninterrupted GPT-2 run,
a run with a gradient fault at an audit step, and its resume from the rollback target. Importing
transformers costs about 8 CPU-seconds per rank on this machine, so the phases share one launch.
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

from verified_ckpt import CheckpointManager, CorruptCheckpoint, InvalidState
from verified_ckpt_cli.main import main as cli

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    root = str(tmp_path_factory.mktemp("hf"))
    done = torchrun(os.path.join(EXAMPLES, "hf_train.py"), 3, "--story", root, timeout=280)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(os.path.join(root, "story.json")) as f:
        return root, json.load(f)


@pytest.mark.timeout(300)
def test_trainer_saves_verified_catches_a_fault_naming_the_rank_and_resumes_bit_identical(story):
    root, s = story
    clean = CheckpointManager(os.path.join(root, "clean")).list()
    assert [(c.step, c.status.value) for c in clean] == [(4, "restorable"), (8, "restorable"), (12, "restorable")]
    assert s["caught"] is not None and s["caught"]["ranks"] == [1] and s["caught"]["step"] == 8  # an audit step
    assert s["resumed_from"].startswith("step-0000000004-")  # the rollback target: the save before step 8
    assert s["resumed"] == s["clean"]  # the resumed run ends bit-identical to the uninterrupted one
    assert [tuple(c) for c in s["checkpoints"]] == [(4, "restorable"), (8, "restorable"), (12, "restorable")]
    [inc] = CheckpointManager(os.path.join(root, "faulty")).incidents()
    assert inc.ranks == [1]


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
