"""Small models people actually train, for the examples, the campaign and the tests.

``TinyGPT`` is GPT-2 in miniature: learned token and position embeddings,
pre-norm blocks of causal self-attention and a GELU MLP, dropout on the
embeddings, the attention weights and both residual branches (0.1 by
default, as in GPT-2's config), and an output head tied to the token
embedding. ``BNMLP`` is an MLP with BatchNorm and dropout.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float, context: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        # A buffer every replica holds identically: the causal mask (as GPT-2's "bias" buffer).
        self.register_buffer("mask", torch.tril(torch.ones(context, context, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (self.attn_drop(att) @ v).transpose(1, 2).reshape(b, t, d)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float, context: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, dropout, context)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT-2 in miniature (see the module docstring). ``forward(ids) -> logits``.

    ``functional_head=True`` ties the output head as many codebases do, with no head module:
    ``F.linear(x, self.tok.weight)``. ``tied=False`` gives the head its own weight (a pipeline whose first and last
    stages differ cannot share one)."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, heads: int = 4, context: int = 16,
                 dropout: float = 0.1, functional_head: bool = False, tied: bool = True) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout, context) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head: nn.Linear | None = None
        if not functional_head:
            self.head = nn.Linear(d, vocab, bias=False)
            if tied:
                self.head.weight = self.tok.weight  # tied, as in GPT-2
        self.vocab = vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.drop(self.tok(ids) + self.pos(torch.arange(t, device=ids.device)))
        for block in self.blocks:
            x = block(x)
        x = self.ln(x)
        return self.head(x) if self.head is not None else nn.functional.linear(x, self.tok.weight)


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a batch of token ids."""
    return token_loss(model(batch[:, :-1]), batch[:, 1:])


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits`` against the next tokens ``targets`` (a pipeline schedule's ``loss_fn``)."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class PipelineStage(nn.Module):
    """Stage ``k`` of ``n`` of an untied ``TinyGPT``, split by hand as torchtitan splits: the stage keeps its
    blocks and, first, the embeddings or, last, the final norm and head, under the full model's names (so the
    stages' names never collide and a checkpoint's keys do not depend on the split)."""

    def __init__(self, full: TinyGPT, k: int, n: int) -> None:
        super().__init__()
        if full.head is None or full.head.weight is full.tok.weight:
            raise ValueError("a pipeline needs TinyGPT(tied=False): the first and last stages cannot share a weight")
        if len(full.blocks) % n:
            raise ValueError(f"{len(full.blocks)} blocks do not split into {n} stages")
        per = len(full.blocks) // n
        self.first, self.last = k == 0, k == n - 1
        self.tok, self.pos, self.drop = (full.tok, full.pos, full.drop) if self.first else (None, None, None)
        # A dict keyed by the block's index in the full model: the names stay "blocks.<i>..." on every stage.
        self.blocks = nn.ModuleDict({str(i): full.blocks[i] for i in range(k * per, (k + 1) * per)})
        self.ln, self.head = (full.ln, full.head) if self.last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None and self.pos is not None and self.drop is not None:
            x = self.drop(self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        if self.ln is not None and self.head is not None:
            x = self.head(self.ln(x))
        return x


def pipeline_stage(full: TinyGPT, k: int, n: int) -> PipelineStage:
    """Stage ``k`` of ``n`` of ``full`` (see ``PipelineStage``)."""
    return PipelineStage(full, k, n)


class BNMLP(nn.Module):
    """An MLP with BatchNorm and dropout: buffers that change in every forward, and randomness."""

    def __init__(self, d_in: int = 16, hidden: int = 64, d_out: int = 4, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mlp(width: int, depth: int, out: int = 8) -> nn.Sequential:
    """``depth`` x (Linear(width, width), GELU), then Linear(width, out), seeded: the guard benchmarks' model."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, out))


def mse_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss of ``mlp`` on (inputs, targets)."""
    return nn.functional.mse_loss(model(batch[0]), batch[1])
