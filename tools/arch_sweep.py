"""Clean training of Hugging Face architectures the project did not write, at the default ``GuardConfig()``: the
false alarms and configuration errors an outside user would meet first, and what ABFT covers in each.

Each architecture from a tiny configuration (hidden 64, 2 layers, 4 heads, vocabulary 128; random weights, its
default dropout and attention implementation), DDP on 3 gloo ranks, AdamW, each rank its own batches of 4 x 32
tokens; ``--steps`` steps per case, no fault. ``--precision`` picks fp32, bf16 autocast inside ``loss_fn`` (as
``hf_campaign.py``), or bf16 autocast around ``guard.backward`` (a plain ``with autocast(): loss.backward()`` loop's
shape: forward and backward inside it). ``--eager``: the named architectures once more with
``attn_implementation="eager"``. Per case: clean (its ABFT passes), an incident (a false alarm: its kind, step and
ranks), or the error that stopped it; and rank 0's coverage line.

    .venv/bin/python tools/arch_sweep.py --steps 40
    .venv/bin/python tools/arch_sweep.py --steps 200 --precision bf16-around --archs qwen2 gemma bert
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hf_campaign import WORLD, launched, loss_fn  # the campaign's ranks, launch and loss (T5's decoder too)

from verified_ckpt import GuardConfig, SDCGuard, SilentCorruptionDetected

PRECISIONS = ("fp32", "bf16-inside", "bf16-around")
IDS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}  # inside the tiny vocabulary


def _configs() -> dict[str, Callable[[], torch.nn.Module]]:
    import transformers as tf

    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 64}
    gqa = {**common, "num_key_value_heads": 2}
    return {
        "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**gqa)),
        "mistral": lambda: tf.MistralForCausalLM(tf.MistralConfig(**gqa, head_dim=16, **IDS)),
        "gemma": lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**gqa, head_dim=16, **IDS)),
        "gemma2": lambda: tf.Gemma2ForCausalLM(tf.Gemma2Config(**gqa, head_dim=16, sliding_window=16, **IDS)),
        "gptneox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common, bos_token_id=0, eos_token_id=0)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                                      num_attention_heads=4, max_position_embeddings=64,
                                                      word_embed_proj_dim=64)),
        "phi": lambda: tf.PhiForCausalLM(tf.PhiConfig(**common, bos_token_id=0, eos_token_id=0)),
        "phi3": lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**common, **IDS)),
        "falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                                               num_attention_heads=4, bos_token_id=0, eos_token_id=0)),
        "bloom": lambda: tf.BloomForCausalLM(tf.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4,
                                                            bos_token_id=0, eos_token_id=0)),
        "gptj": lambda: tf.GPTJForCausalLM(tf.GPTJConfig(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                                         rotary_dim=8, bos_token_id=0, eos_token_id=0)),
        "t5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128,
                                                                 num_layers=2, num_heads=4, decoder_start_token_id=0,
                                                                 pad_token_id=0, eos_token_id=1)),
        "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4, intermediate_size=128,
                                                         max_position_embeddings=64)),
    }


ARCHS = ("qwen2", "mistral", "gemma", "gemma2", "gptneox", "opt", "phi", "phi3", "falcon", "bloom", "gptj", "t5", "bert")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def case(rank: int, arch: str, eager: bool, precision: str, steps: int) -> dict[str, Any]:
    """One case on this rank: how it ended, and rank 0's coverage line."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = _configs()[arch]()
    if eager:
        model.set_attn_implementation("eager")
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inside, around = precision == "bf16-inside", precision == "bf16-around"

    def loss(m: torch.nn.Module, b: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16) if inside else contextlib.nullcontext():
            return loss_fn(m, b)

    lines = Lines()
    logging.getLogger("verified_ckpt").addHandler(lines)
    try:
        guard = SDCGuard(ddp, opt, loss, GuardConfig())
        for step in range(1, steps + 1):
            batch = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1000 * step + rank))
            with torch.autocast("cpu", dtype=torch.bfloat16) if around else contextlib.nullcontext():
                guard.backward(batch, step=step)
            guard.step()
            opt.zero_grad(set_to_none=True)
        got: dict[str, Any] = {"outcome": "clean", "abft": guard.checks["abft"].passed}
    except SilentCorruptionDetected as e:
        got = {"outcome": "incident", "kind": e.kind, "step": e.detected_step, "ranks": list(e.ranks),
               "detail": str(e)}
    except Exception as e:  # a case's error is its result; every rank raises alike (collective decisions)
        got = {"outcome": type(e).__name__, "detail": str(e)}
    finally:
        logging.getLogger("verified_ckpt").removeHandler(lines)
    got["coverage"] = next((line for line in lines.lines if "ABFT checks" in line), None)
    return got


def worker(rank: int, init: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.getLogger("verified_ckpt").setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=args.timeout))
    results = {}
    for arch, eager in [(a, False) for a in args.archs] + [(a, True) for a in args.eager]:
        name = f"{arch}{' (eager)' if eager else ''}, {args.precision}"
        results[name] = case(rank, arch, eager, args.precision, args.steps)
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", nargs="+", choices=ARCHS, default=list(ARCHS))
    ap.add_argument("--eager", nargs="*", choices=ARCHS, default=["qwen2", "gptneox", "bert"])
    ap.add_argument("--precision", choices=PRECISIONS, default="bf16-inside")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--timeout", type=int, default=180, help="seconds a collective may wait")
    ap.add_argument("--json", default=None, help="also write every case's result here")
    args = ap.parse_args()
    res = launched(worker, args)
    for name, r in res.items():
        what = f"clean, ABFT passed {r['abft']}" if r["outcome"] == "clean" else f"{r['outcome']}: {r.get('detail')}"
        print(f"{name}: {what}\n    {r['coverage']}")
    print(f"{sum(r['outcome'] == 'clean' for r in res.values())} of {len(res)} cases clean")


if __name__ == "__main__":
    main()
