"""torchtitan's tensor-parallel plans under SDCGuard at its defaults, on FSDP2 + TP 2x2 ``(dp_shard, tp)`` gloo meshes.

torchtitan itself is not used: ``pip install torchtitan==0.3.0`` would replace the installed fsspec (2026.9.0 ->
2026.2.0, which s3fs pins) and pull in pandas, datasets and wandb. The stand-in below is a Llama with torchtitan's
module names (``tok_embeddings``, ``layers.N.attention.wq/wk/wv/wo``, ``feed_forward.w1/w2/w3``,
``attention_norm``, ``ffn_norm``, ``norm``, ``output``), parallelised as torchtitan's ``parallelize_llama``
(``apply_tp``, then ``apply_fsdp``: each block, then the model) writes it, one test per plan:

- ``replicated_head``: blocks colwise/rowwise, the head ``ColwiseParallel(output_layouts=Replicate())``;
- ``loss_parallel``: the head ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)``, the loss
  computed under ``loss_parallel()``: a DTensor;
- ``sequence_parallel``: torchtitan's plan with ``loss_parallel`` off: ``SequenceParallel`` norms,
  ``PrepareModuleInput`` redistributions, ``Shard(1)`` activations between blocks;
- ``sp_loss_parallel``: torchtitan llama3's default (sequence parallel and loss parallel).

Each set-up (a plan, and on three of them torchtitan's per-block extras: full activation checkpointing, selective
(op-level) activation checkpointing, and each block ``torch.compile``-d): 15 clean steps raise nothing and every
save is ``restorable``; a 10x element of a TP-sharded Linear's gradient is named by ABFT at its step on its rank, and
(on the plain and the sequence-parallel plan) a 10x element of a slice's forward output, rowwise partial sums and
colwise columns; a bit flipped in a weight shard at rest is named at the next step; rank 1 killed by SIGKILL, then every rank resumed,
ends bit for bit where the clean run ended. Each extra rides on one plan rather than every combination (four 4-rank
launches a set-up on two cores): the extras change how a block's forward runs again or is traced, which the plan's
placements do not depend on.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_ranks

from verified_ckpt.dtensors import local

pytestmark = pytest.mark.timeout(800)  # a bound over three launches (story, killed, resumed), each bounded below

DIM, HEADS, VOCAB, SEQ, BATCH = 16, 2, 32, 8, 2
OWNER = 1  # the rank every fault is injected on
FAULT_AT = 2
# Saves after steps 4, 9 and 14 (the guard's consensus before each, an audit in each), the kill after the first.
# Thirty steps (saves every ten) made these four set-ups a seventh of the suite's time.
STEPS, SAVE_EVERY, KILL_AT = 15, 5, 7
# (plan, per-block extra): every plan once, torchtitan's AC and compile each on one of them
# (sequence + loss parallel with ABFT inside its blocks is torchtitan's own llama3 in tests/test_titan_real.py)
SETUPS = (("replicated_head", None), ("loss_parallel", "full_ac"), ("sequence_parallel", "selective_ac"),
          ("sp_loss_parallel", "compile"))


# ------------------------------------------------------------------------------------------------ the model
class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 heads: under tensor parallel each rank holds its share of the heads, as torchtitan's Attention
        q, k, v = (w(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class FeedForward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(DIM, 2 * DIM, bias=False), torch.nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = torch.nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention, self.feed_forward = Attention(), FeedForward()
        self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(DIM), torch.nn.RMSNorm(DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(torch.nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleDict({str(i): Block() for i in range(n_layers)})
        self.norm = torch.nn.RMSNorm(DIM)
        self.output = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))  # type: ignore[no-any-return]


def parallelize(model: Transformer, mesh: Any, plan: str, extra: str | None = None) -> Transformer:
    """torchtitan's ``apply_tp`` (``sequence_parallel``: its plan as written; otherwise the blocks' plain
    colwise/rowwise plan), then ``extra`` on each block (its AC, then its compile), then ``apply_fsdp`` over
    ``dp_shard``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp, sp, lp = mesh["tp"], plan.startswith("s"), plan.endswith("loss_parallel")
    # "sp_head_unprepared": a mistake that trains, the head's input_layouts=Shard(1) forgotten, so DTensor gathers
    # the sequence-sharded activations inside the head's GEMM
    head_input = Shard(1) if sp and plan != "sp_head_unprepared" else Replicate()
    head = ColwiseParallel(input_layouts=head_input, output_layouts=Shard(-1) if lp else Replicate(),
                           use_local_output=not lp)
    if sp:
        top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
               "norm": SequenceParallel(), "output": head}
    else:
        top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), "output": head}
    parallelize_module(model, tp, top)
    for block in model.layers.values():
        layer_plan: dict[str, Any] = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                                      "attention.wv": ColwiseParallel(), "feed_forward.w1": ColwiseParallel(),
                                      "feed_forward.w3": ColwiseParallel()}
        if sp:
            layer_plan |= {"attention_norm": SequenceParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                           "ffn_norm": SequenceParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}
        if sp:
            layer_plan |= {
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        else:
            layer_plan |= {"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()}
        parallelize_module(block, tp, layer_plan)
    for name, block in list(model.layers.items()):
        model.layers[name] = per_block(block, extra)
    dp = mesh["dp_shard"]
    for block in model.layers.values():
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def per_block(block: torch.nn.Module, extra: str | None) -> torch.nn.Module:
    """torchtitan's ``apply_ac`` (``full``: the block under ``checkpoint_wrapper``; ``selective``: op-level, a
    policy saving every other matmul) and ``apply_compile`` (each block alone, ``fullgraph=True``; backend
    ``aot_eager``: dynamo and AOTAutograd trace the block without inductor's C++ build, a minute a launch here)."""
    from test_activation_checkpointing import _selective_policy
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if extra == "full_ac":
        return checkpoint_wrapper(block, preserve_rng_state=False)
    if extra == "selective_ac":
        return checkpoint_wrapper(block, preserve_rng_state=False,
                                  context_fn=lambda: create_selective_checkpoint_contexts(_selective_policy()))
    if extra == "compile":
        return torch.compile(block, fullgraph=True, backend="aot_eager")  # type: ignore[return-value]
    return block


def loss_fn(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan's cross-entropy; under loss parallel the logits are a DTensor sharded over the vocabulary, and
    the loss a replicated DTensor."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1))


def forward_only_loss_fn(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """A mistake: the loss under ``loss_parallel()``, which its backward (outside it) needs too."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        return loss_fn(model, tokens)


def full_loss_fn(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The loss reduced to a plain tensor inside the loop's ``loss_parallel()``: nothing in it says it needs the
    context, which the guard's audits must still replay under."""
    loss = loss_fn(model, tokens)
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


LOSSES = {"dtensor": loss_fn, "forward_only": forward_only_loss_fn, "full": full_loss_fn}


def train_context(plan: str) -> contextlib.AbstractContextManager[Any]:
    """torchtitan's ``train_context``: the forward and backward under ``loss_parallel()`` when the plan uses it."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if plan.endswith("loss_parallel") else contextlib.nullcontext()


def tokens(position: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 * step + position))


# ------------------------------------------------------------------------------------------------ faults
def wrong_gradient_hook(layer: torch.nn.Module, when: Any) -> None:
    """While ``when()``: element 3 of this rank's slice of ``layer``'s weight gradient, as its backward computes it,
    is 10x (a hook on the tensor the forward uses, before FSDP reduce-scatters it), once however often activation
    checkpointing runs the forward again."""
    armed = [False]

    def wrong(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        local(g).view(-1)[3] *= 10
        return g

    def pre(mod: torch.nn.Module, args: Any) -> None:
        if when() and torch.is_grad_enabled() and not armed[0]:
            armed[0] = True
            handle = mod.weight.register_hook(lambda g: (handle.remove(), wrong(g))[1])

    layer.register_forward_pre_hook(pre)


def wrong_output_hook(layer: torch.nn.Module, when: Any) -> None:
    """While ``when()``: this rank's local GEMM output's largest element 10x, as the forward computed it (a forward
    hook registered after the guard's and put ahead of it: what its forward check reads, before the plan's output
    hook reduces or gathers it)."""
    def hook(mod: torch.nn.Module, args: Any, out: Any) -> None:
        if when() and torch.is_grad_enabled():
            with torch.no_grad():
                flat = local(out).view(-1)
                flat[int(flat.abs().argmax())] *= 10

    layer.register_forward_hook(hook, prepend=True)


def flip(t: torch.Tensor, bit: int = 29) -> None:
    """Flip an exponent bit of element 0 of this rank's piece of ``t``, in place (the value stays finite)."""
    with torch.no_grad():
        local(t).view(-1).view(torch.int32)[0] ^= 1 << bit


# ------------------------------------------------------------------------------------------------ rank function
def unwrapped(module: torch.nn.Module) -> Any:
    """The block inside torchtitan's wrappers (``checkpoint_wrapper``, ``torch.compile``)."""
    for attr in ("_checkpoint_wrapped_module", "_orig_mod"):
        module = getattr(module, attr, module)
    return module


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of every parameter and AdamW state, whole (``full_tensor``: a collective, every rank calls it)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        for t in [p, *(v for _, v in sorted(opt.state[p].items()) if v.dim())]:
            h.update(t.full_tensor().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_plan(rank: int, world: int, plan: str, fault: str | None, run: str | None, steps: int,
             loss: str = "dtensor", extra: str | None = None, resume: bool = False) -> dict:
    """One guarded job at the default GuardConfig(): ``steps`` steps, a save every SAVE_EVERY when ``run`` names a
    run, ``fault`` (``grad``, ``weight``, ``kill``) on rank OWNER; ``resume`` continues from the run's newest
    restorable checkpoint."""
    from torch.distributed.device_mesh import init_device_mesh

    from verified_ckpt import (
        CheckpointManager,
        GuardConfig,
        GuardConfigurationError,
        SDCGuard,
        SilentCorruptionDetected,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    position = mesh.get_coordinate()[0]
    torch.manual_seed(0)
    model = parallelize(Transformer(), mesh, plan, extra)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    at = [-1]
    target = unwrapped(model.layers["0"]).feed_forward  # type: ignore[index]
    if fault == "grad":  # the plan's own layer: the head's colwise slice, or sequence parallel's rowwise one; the
        # head when blocks are compiled (ABFT cannot see inside them, and their coverage line says so)
        wrong = target.w2 if plan.startswith("s") and extra != "compile" else model.output
        wrong_gradient_hook(wrong, lambda: rank == OWNER and at[0] == FAULT_AT)
    guard = SDCGuard(model, opt, LOSSES[loss], GuardConfig())
    if fault == "forward":  # a rowwise slice's partial sums (the plain plan), a colwise slice's columns (sequence's)
        wrong_output_hook(target.w1 if plan.startswith("s") else target.w2, lambda: rank == OWNER and at[0] == FAULT_AT)
    mgr = CheckpointManager(run, guard=guard) if run else None
    first = mgr.resume({"model": model, "optim": opt}) if mgr is not None and resume else 0
    statuses = []
    try:
        for step in range(first, steps):
            at[0] = step
            if fault == "kill" and rank == OWNER and step == KILL_AT:
                os.kill(os.getpid(), signal.SIGKILL)
            with train_context(plan) if loss != "forward_only" else contextlib.nullcontext():
                guard.backward(tokens(position, step), step=step)
            guard.step()
            opt.zero_grad()
            if fault == "weight" and rank == OWNER and step == FAULT_AT:
                flip(target.w1.weight)
            if mgr is not None and ((step + 1) % SAVE_EVERY == 0 or step == steps - 1):
                statuses.append(mgr.save(step, {"model": model, "optim": opt}).status.value)
    except SilentCorruptionDetected as e:
        return {"caught": [e.incident.kind, e.incident.ranks, step], "detail": e.incident.detail}
    except GuardConfigurationError as e:
        return {"refused": [e.kind, e.step], "message": str(e)}
    except RuntimeError as e:  # gloo, when a peer was killed: this rank's next collective fails
        if fault != "kill":
            raise
        return {"peer died": type(e).__name__}
    cov = guard.coverage()
    return {"statuses": statuses, "checks": {k: c.passed for k, c in guard.counters().items()},
            "incidents": len(guard.incidents), "first": first, "digest": digest(model, opt),
            "coverage": cov.summary() if cov else None}


def plan_story(rank: int, world: int, plan: str, extra: str | None, run: str) -> dict:
    got = {"clean": run_plan(rank, world, plan, None, run, STEPS, extra=extra),
           "grad": run_plan(rank, world, plan, "grad", None, FAULT_AT + 1, extra=extra),
           "weight": run_plan(rank, world, plan, "weight", None, FAULT_AT + 2, extra=extra)}
    # What the guard cannot check is refused at the first step, in one line, on every rank: the mistakes next to
    # each plan (a loss-parallel loss backpropagated outside its context; sequence-sharded activations reaching a
    # colwise head declared to take replicated ones, which DTensor all-gathers inside the GEMM).
    if plan in ("replicated_head", "sequence_parallel"):  # a slice's forward output: rowwise partial sums, colwise
        got["forward"] = run_plan(rank, world, plan, "forward", None, FAULT_AT + 1, extra=extra)
    if plan == "loss_parallel":
        got["refused"] = run_plan(rank, world, plan, None, None, 1, loss="forward_only", extra=extra)
        got["full"] = run_plan(rank, world, plan, None, run + "-full", 2, loss="full", extra=extra)
    if plan == "sequence_parallel":
        got["refused"] = run_plan(rank, world, "sp_head_unprepared", None, None, 1, extra=extra)
    return got


def resumed(rank: int, world: int, plan: str, extra: str | None, run: str) -> dict:
    return run_plan(rank, world, plan, None, run, STEPS, extra=extra, resume=True)


@pytest.mark.parametrize(("plan", "extra"), SETUPS, ids=[f"{p}-{e}" if e else p for p, e in SETUPS])
def test_titan_plan_is_guarded_at_the_defaults(plan, extra, tmp_path):
    """One 2x2 job per set-up: 15 clean steps are quiet and every save is restorable; a 10x element of a TP-sharded
    Linear's gradient is named by ABFT at its step on its rank; a weight shard's flip at rest, at the next step;
    rank 1 killed by SIGKILL after the first save, then every rank resumed, ends bit for bit as the clean run."""
    run = str(tmp_path / plan)
    got = run_ranks(plan_story, 4, plan, extra, run, timeout=300, retire=True)
    clean = got[0]["clean"]
    assert "caught" not in clean and clean["incidents"] == 0, clean
    assert clean["statuses"] == ["restorable"] * 3, clean
    assert clean["checks"]["abft"] >= STEPS, clean
    # Each save audits (recomputing outside the loop's train context: under loss parallel, in loss_parallel() again).
    assert clean["checks"]["audit"] >= 3, clean
    if extra == "compile":
        assert "inside a torch.compile'd module" in clean["coverage"], clean["coverage"]
    for r in got:
        assert r["clean"]["digest"] == clean["digest"]  # the ranks' collectives agree on one state
        assert r["grad"]["caught"][:3] == ["abft", [OWNER], FAULT_AT], r["grad"]
        assert r["weight"]["caught"][1:] == [[OWNER], FAULT_AT + 1], r["weight"]
        if "forward" in r:  # the forward check of the slice's own GEMM output, at its step
            assert r["forward"]["caught"][:3] == ["abft", [OWNER], FAULT_AT], r["forward"]
            assert "the forward output of layers.0." in r["forward"]["detail"], r["forward"]
            assert "feed_forward.w" in r["forward"]["detail"], r["forward"]
        if plan == "loss_parallel":
            assert r["refused"]["refused"] == ["abft", 0], r["refused"]
            assert "outside loss_parallel()" in r["refused"]["message"], r["refused"]
            # The save's audit replays the plain loss under the loss_parallel() its step ran in.
            assert r["full"]["statuses"] == ["restorable"] and r["full"]["checks"]["audit"] >= 2, r["full"]
        if plan == "sequence_parallel":
            assert r["refused"]["refused"] == ["abft", 0], r["refused"]
            assert "Linear output: its weight placed (Shard(dim=0)) on an input placed (Shard(dim=1))" \
                in r["refused"]["message"], r["refused"]
    # kill -9 of rank 1 at step 7 (after the save at 4), then a fresh job resumes from the run.
    killed = str(tmp_path / "killed")
    died = run_ranks(run_plan, 4, plan, "kill", killed, STEPS, "dtensor", extra, killed=frozenset({OWNER}),
                     timeout=240)
    assert died[OWNER] is None and all("peer died" in died[r] for r in range(4) if r != OWNER), died
    back = run_ranks(resumed, 4, plan, extra, killed, timeout=240, retire=True)
    for r in back:
        assert r["first"] == SAVE_EVERY and r["incidents"] == 0, r
        assert r["statuses"] == ["restorable"] * 2, r
        assert r["digest"] == clean["digest"], r  # every parameter and AdamW moment, bit for bit


# ------------------------------------------------------------------------------------------------ pure rules
def test_linear_problem_accepts_the_local_gemms_and_names_the_rest():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from verified_ckpt.guard.tp import linear_problem

    assert linear_problem("wq", (Shard(0),), (Replicate(),), 3) is None  # colwise
    assert linear_problem("wo", (Shard(1),), (Shard(2),), 3) is None  # rowwise
    assert linear_problem("wo", (Shard(1),), (Shard(-1),), 3) is None
    assert linear_problem("head", (Replicate(),), (Shard(1),), 3) is None  # a replicated weight on local tokens
    for w, x in [((Shard(0),), (Shard(1),)), ((Shard(1),), (Replicate(),)), ((Replicate(),), (Shard(2),)),
                 ((Shard(0),), ()), ((Shard(0),), (Partial(),))]:
        got = linear_problem("layers.0.wq", w, x, 3)
        assert got is not None and got.startswith("ABFT cannot check tensor-parallel Linear layers.0.wq"), (w, x)
        assert "PrepareModuleInput" in got and "\n" not in got


def test_the_forward_check_takes_the_local_gemms_own_output_and_a_rowwise_slices_share_of_its_bias():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from verified_ckpt.guard.tp import bias_shares, linear_plan, output_is_the_gemms

    assert output_is_the_gemms((Partial(),), (Partial(),), 3)  # rowwise partial sums, before the plan reduces them
    assert output_is_the_gemms((Shard(-1),), (Shard(2),), 3)  # colwise columns
    assert not output_is_the_gemms((Partial(),), (Replicate(),), 3)  # already all-reduced: each rank holds the sum
    assert not output_is_the_gemms((Shard(-1),), (Replicate(),), 3)  # already gathered
    assert bias_shares((Shard(1),), (Replicate(),), (4,)) == 4  # DTensor adds b / 4 to each partial sum
    assert bias_shares((Shard(0),), (Shard(0),), (4,)) == 1  # colwise: each slice adds its own piece
    assert bias_shares((Replicate(), Shard(1)), (Replicate(), Replicate()), (2, 3)) == 3
    # What a slice's forward hook asks at every forward, from the placements alone: whether it can be checked, and
    # whether the output its hooks see is the GEMM's own
    assert linear_plan("wo", (Shard(1),), (Shard(-1),), 3, (Partial(),)) == (None, True)
    assert linear_plan("wo", (Shard(1),), (Shard(-1),), 3, (Replicate(),)) == (None, False)
    assert linear_plan("wq", (Shard(0),), (Replicate(),), 3, ()) == (None, False)  # a plain output: not known
    problem, own = linear_plan("wq", (Shard(0),), (Shard(1),), 3, (Shard(2),))
    assert problem is not None and problem.startswith("ABFT cannot check tensor-parallel Linear wq") and not own

    class Unhashable(Replicate):  # a placement that does not hash: answered afresh, never a TypeError in a hook
        __hash__ = None  # type: ignore[assignment]

    assert linear_plan("wq", (Shard(0),), (Unhashable(),), 3, (Shard(2),)) == (None, True)


def test_loss_problem_names_a_sharded_loss_and_a_missing_loss_parallel_context():
    from torch.distributed.tensor import Partial, Replicate, Shard

    from verified_ckpt.guard.tp import loss_problem

    assert loss_problem((), False) is None
    assert loss_problem((Replicate(),), True) is None
    assert "outside loss_parallel()" in (loss_problem((Replicate(),), False) or "")
    for p in (Shard(0), Partial()):
        assert "return a replicated loss" in (loss_problem((p,), True) or "")


def test_an_audit_replays_under_loss_parallel_once_and_leaves_an_enclosing_context_whole():
    """``loss_parallel()``'s exit drops its handlers, and only on a normal exit: the guard's replay enters it only
    when it is off, and leaves it off after a failure."""
    from torch.distributed.tensor.parallel import loss_parallel

    from verified_ckpt.guard.tp import loss_parallel_active, replaying_under

    with loss_parallel():
        with replaying_under(True):
            assert loss_parallel_active()
        assert loss_parallel_active()  # the enclosing context still has its handlers
    assert not loss_parallel_active()
    with pytest.raises(ValueError), replaying_under(True):
        assert loss_parallel_active()
        raise ValueError("a failed recomputation")
    assert not loss_parallel_active()
    with replaying_under(False):
        assert not loss_parallel_active()


def test_a_refusal_is_one_line_the_fix_said_once_and_the_other_layers_named():
    from verified_ckpt.guard.tp import refusal

    problems = [f"ABFT cannot check tensor-parallel Linear layers.{i}.wo: its forward hooks see ...; apply the plan "
                "with torch's parallelize_module" for i in range(4)] + ["the loss is a DTensor placed (Partial(sum))"]
    got = refusal(problems)
    assert got.startswith(problems[0]) and got.count("parallelize_module") == 1 and "\n" not in got
    assert "3 more Linear layers cannot be checked either: layers.1.wo, layers.2.wo, layers.3.wo" in got
    assert got.endswith("; the loss is a DTensor placed (Partial(sum))")
    assert refusal(problems[:1]) == problems[0]
