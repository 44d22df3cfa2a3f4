"""torchtitan's OWN llama3 model, ``parallelize_llama``, loss and train context under SDCGuard at its defaults, on
FSDP2 + TP 2x2 ``(dp_shard, tp)`` gloo meshes.

torchtitan 0.3.0 cannot share the project's venv (its pins would replace fsspec, which s3fs pins, and pull in
datasets, wandb and pandas), so ``make .titan/.installed`` installs it and the few packages its model and
parallelize code import, without their dependencies, into ``.titan/``; only the ranks below put it on
``sys.path`` (their pool is retired after each call), so the rest of the suite never imports torchtitan or triton.

torchtitan 0.3.0's model is built as its ``Trainer`` builds it (meta device, its sharding config, selective AC,
``to_empty``, ``init_weights``), shrunk; its own SDPA module replaces FlexAttention, which has no backward on CPU.

- ``apply_tp`` (the guarded set-up): torchtitan's llama3, AC, ``apply_fsdp_to_decoder`` and loss (vocabulary-
  parallel over the head's sharded logits), tensor parallel by torch's ``parallelize_module`` plans as torchtitan's
  ``apply_tp`` wrote them before 0.3, with and without sequence parallel: 15 clean steps raise nothing and a save
  is ``restorable``; a 10x element of a TP-sharded Linear's gradient is named by ABFT at its step on its rank; a
  weight shard's flip at rest is named at the next step.
- torchtitan 0.3's own ``parallelize_llama`` (``spmd_backend`` ``partial_dtensor`` with and without sequence
  parallel, ``full_dtensor``): its modules redistribute inside their own ``forward``, where the guard's hooks
  cannot see the local GEMM, so each is refused at step 0 with a ``GuardConfigurationError`` naming the layers (or
  the loss), the placements and what to change. Its default ``spmd_types`` does not build on torch 2.13 even
  without the guard.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from dist_harness import run_ranks
from test_titan_plans import flip, wrong_gradient_hook  # the same faults as the stand-in's

from verified_ckpt.dtensors import local

pytestmark = pytest.mark.timeout(420)  # a bound: about 50 s a launch at rest, several times that beside busy processes

TITAN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".titan")
DIM, HEADS, LAYERS, VOCAB, SEQ, BATCH = 32, 4, 2, 64, 16, 2
OWNER = 1  # the rank every fault is injected on
FAULT_AT = 2


def _titan() -> None:
    """torchtitan on this rank's path (module doc): only inside rank processes, which are retired after the call."""
    if not os.path.isdir(os.path.join(TITAN, "torchtitan")):
        raise RuntimeError(f"{TITAN} is missing; run `make .titan/.installed`")
    if TITAN not in sys.path:
        sys.path.insert(0, TITAN)


# ------------------------------------------------------------------------------------------------ torchtitan's set-up
def build(backend: str, sp: bool, world: int) -> tuple[Any, Any, Any, Any]:
    """torchtitan's llama3 debug model shrunk, built and parallelised as its ``Trainer`` does (meta device,
    its sharding config, ``parallelize_llama`` with its default selective AC, ``to_empty``, ``init_weights``):
    (model, loss, train_context, parallel_dims)."""
    _titan()
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import parallel_dims as parallel_dims_module
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, parallelize_llama
    from torchtitan.models.llama3 import _build_llama3_layers as layers
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    plans = backend == "apply_tp"  # torchtitan's model and FSDP, TP by torch's plans (``apply_tp``)
    backend = "partial_dtensor" if plans else backend
    parallelism = ParallelismConfig(data_parallel_shard_degree=2, tensor_parallel_degree=2,
                                    enable_sequence_parallel=sp, spmd_backend=backend)  # type: ignore[arg-type]
    # float32 parameters: FSDP's default bfloat16 casts are what mixed precision tests are for, not these plans
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ, mixed_precision_param="float32")
    # torchtitan's meshes are "cuda" wherever no accelerator is found; these ranks are CPU gloo ones (the rank's
    # process is retired after the call, so the patch dies with it)
    parallel_dims_module.device_type = "cpu"
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    dist_utils.set_spmd_backend(backend)
    config = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, hidden_dim=2 * DIM, attn_backend="flex",
                      rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=4 * SEQ, theta=500000, scaling="llama"),
                      fuse_qkv=not plans),
    )

    # FlexAttention has no backward on CPU (its language models' only CPU-capable choice): torchtitan's own SDPA
    # module instead, causal, which it still builds for Flux
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    # update_from_config imports torchtitan.trainer (tensorboard, wandb, datasets: not installed); past its checks
    # it only sets the sharding configs, with this call of its own
    if not plans:
        set_llama3_sharding_config(config, enable_sp=sp)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    if plans:
        model = titan_apply_tp(model, dims, parallelism, training, sp)
    else:
        model = parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                                  compile_config=CompileConfig(), ac_config=SelectiveAC.Config(), dump_folder="/tmp")
    disable_fsdp_gradient_division(model)  # as its Trainer: the loss is already scaled by the global token count
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # gloo has no PREMUL_SUM, which FSDP's reduce-scatter uses for a divide factor of 1; a plain SUM is the
            # same arithmetic (what torchtitan's symmetric-memory option sets too)
            module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss = CrossEntropyLoss(CrossEntropyLoss.Config(global_vocab_size=VOCAB))
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    return model, loss, context, dims


def titan_apply_tp(model: Any, dims: Any, parallelism: Any, training: Any, sp: bool) -> Any:
    """torchtitan's model with the tensor-parallel plans of its ``apply_tp`` before 0.3 (torch's
    ``parallelize_module``; separate ``wq``/``wk``/``wv``; the head's logits sharded over the vocabulary for its
    loss-parallel cross-entropy), then the rest of its ``parallelize_llama`` as written: its selective AC and its
    ``apply_fsdp_to_decoder`` over ``fsdp``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    tp = dims.get_mesh("tp")
    act = Shard(1) if sp else Replicate()
    # The embedding stays whole on tp: torchtitan 0.3's Embedding runs its own vocabulary-parallel lookup on
    # local tensors (only once its parallelize gave it a group), which torch's RowwiseParallel would feed a DTensor
    head = ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)
    top: dict[str, Any] = {"lm_head": head}
    if sp:
        top |= {"norm": SequenceParallel(),
                "tok_embeddings": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))}
    parallelize_module(model, tp, top)
    for block in model.layers.values():
        plan: dict[str, Any] = {
            "attention.qkv_linear.wq": ColwiseParallel(), "attention.qkv_linear.wk": ColwiseParallel(),
            "attention.qkv_linear.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=act),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=act),
        }
        if sp:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                     desired_input_layouts=(Replicate(), None, None)),
                     "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),))}
        parallelize_module(block, tp, plan)
    SelectiveAC.Config().build(dump_folder="/tmp").apply(model)
    apply_fsdp_to_decoder(model, dims.get_mesh(["fsdp"]), param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                          reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce], pp_enabled=False,
                          reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward)
    return model


def tokens(position: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1000 * step + position))


def titan_loss(loss: Any, dims: Any) -> Any:
    """torchtitan's ``forward_backward_step``'s loss: the prediction from the tokens and their positions (one
    document per row; under ``full_dtensor`` wrapped as DTensors by its ``post_dataloading_process``), through
    its loss, scaled by the global count of valid tokens (each dp position holds BATCH x SEQ)."""
    from torchtitan.distributed import full_dtensor
    from torchtitan.distributed.utils import get_spmd_backend

    positions = torch.arange(SEQ).expand(BATCH, SEQ)

    def loss_fn(model: Any, batch: torch.Tensor) -> torch.Tensor:
        inputs, labels, extra = batch[:, :-1], batch[:, 1:], {"positions": positions}
        if get_spmd_backend() == "full_dtensor":
            inputs, labels, extra = full_dtensor.parallelize_inputs(dims, inputs, labels, extra)
        pred = model(inputs, **extra)
        return loss(pred, labels, torch.tensor(float(2 * BATCH * SEQ)))[0]  # type: ignore[no-any-return]
    return loss_fn


# ------------------------------------------------------------------------------------------------ faults
# ------------------------------------------------------------------------------------------------ rank functions
def unguarded(rank: int, world: int, backend: str, sp: bool, steps: int) -> list[float]:
    """torchtitan's train step without the guard: the losses."""
    model, loss, context, dims = build(backend, sp, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    position = dims.get_mesh("fsdp").get_local_rank() if backend == "partial_dtensor" else rank // 2
    fn, out = titan_loss(loss, dims), []
    for step in range(steps):
        with context():
            value = fn(model, tokens(position, step))
            value.backward()
        opt.step()
        opt.zero_grad()
        out.append(float(local(value).detach()))
    return out


def run_titan(rank: int, world: int, backend: str, sp: bool, fault: str | None, run: str | None, steps: int) -> dict:
    from verified_ckpt import (
        CheckpointManager,
        GuardConfig,
        GuardConfigurationError,
        SDCGuard,
        SilentCorruptionDetected,
    )

    model, loss, context, dims = build(backend, sp, world)
    position = rank // 2
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    at = [-1]
    target = model.layers["0"].feed_forward
    if fault == "grad":  # a rowwise slice under sequence parallel, a colwise one otherwise
        wrong = target.w2 if sp else target.w1
        wrong_gradient_hook(wrong, lambda: rank == OWNER and at[0] == FAULT_AT)
    guard = SDCGuard(model, opt, titan_loss(loss, dims), GuardConfig())
    mgr = CheckpointManager(run, guard=guard) if run else None
    statuses = []
    step = 0
    try:
        for step in range(steps):
            at[0] = step
            with context():
                guard.backward(tokens(position, step), step=step)
            guard.step()
            opt.zero_grad()
            if fault == "weight" and rank == OWNER and step == FAULT_AT:
                flip(target.w1.weight)
            if mgr is not None and step == steps - 1:
                statuses.append(mgr.save(step, {"model": model, "optim": opt}).status.value)
    except SilentCorruptionDetected as e:
        return {"caught": [e.incident.kind, e.incident.ranks, step], "detail": e.incident.detail}
    except GuardConfigurationError as e:
        return {"refused": [e.kind, e.step], "message": str(e)}
    return {"statuses": statuses, "checks": {k: c.passed for k, c in guard.counters().items()}}


def titan_story(rank: int, world: int, backend: str, sp: bool, run: str) -> dict:
    """One job per set-up: clean steps and a save, then each fault (or the refusal, which ends each at step 0)."""
    got = {"clean": run_titan(rank, world, backend, sp, None, run, CLEAN_STEPS)}
    if "refused" not in got["clean"]:
        got["grad"] = run_titan(rank, world, backend, sp, "grad", None, FAULT_AT + 1)
        got["weight"] = run_titan(rank, world, backend, sp, "weight", None, FAULT_AT + 2)
    return got


CLEAN_STEPS = 15


# torchtitan's default, sequence parallel on: without it (loss parallel alone) the plans are the stand-in's
# (tests/test_titan_plans.py), and a launch here costs about 50 s of the suite's 12 minutes.
@pytest.mark.parametrize("sp", [True], ids=["sp_loss_parallel"])
def test_titan_model_with_apply_tp_plans_is_guarded_at_the_defaults(sp, tmp_path):
    """torchtitan 0.3's llama3, its selective AC, FSDP and loss (vocabulary-parallel over the head's sharded logits),
    tensor parallel by torch's plans as torchtitan's ``apply_tp`` wrote them: 15 clean steps raise nothing and the
    save is ``restorable``; a 10x element of a TP-sharded Linear's gradient on rank 1 is named by ABFT at its step;
    a weight shard's exponent flip at rest on rank 1 is named at the next step."""
    got = run_ranks(titan_story, 4, "apply_tp", sp, str(tmp_path / "run"), timeout=400, retire=True)
    clean = got[0]["clean"]
    assert "caught" not in clean and "refused" not in clean, clean
    assert clean["statuses"] == ["restorable"], clean
    assert clean["checks"]["abft"] >= CLEAN_STEPS and clean["checks"]["audit"] >= 2, clean
    for r in got:
        assert r["grad"]["caught"][:3] == ["abft", [OWNER], FAULT_AT], r["grad"]
        assert r["weight"]["caught"][1:] == [[OWNER], FAULT_AT + 1], r["weight"]


REFUSED = (("partial_dtensor", False), ("partial_dtensor", True), ("full_dtensor", True))


def refusal_story(rank: int, world: int, run: str) -> dict:
    """torchtitan 0.3's own backends, each for up to two steps under the guard (one job: the imports dominate), and
    its default spmd_types backend without the guard."""
    got: dict[str, Any] = {f"{b}-{sp}": run_titan(rank, world, b, sp, None, f"{run}-{b}-{sp}", 2) for b, sp in REFUSED}
    try:
        unguarded(rank, world, "spmd_types", True, 1)
        got["spmd_types"] = "trained"
    except Exception as e:  # the reason is the result
        got["spmd_types"] = f"{type(e).__name__}: {e}"
    return got


def test_titan_own_backends_are_refused_at_step_0_never_a_raw_error_or_an_incident(tmp_path):
    """torchtitan's own parallelize_llama, loss and train context, the guard at GuardConfig(): what it cannot check
    is refused at step 0 on every rank, in one line naming the layer or the loss, the placement and what to change;
    never a raw error from inside a check, never an incident naming a healthy rank. torchtitan 0.3's modules
    redistribute inside their own forward: under sequence parallel the hooks see wo/w2's output already
    reduce-scattered; without it, wo/w2's weight gradient arrives Partial(sum); full_dtensor's loss is partial over
    the data-parallel axis. Its default spmd_types backend does not build on torch 2.13 CPU gloo even without the
    guard (torch's fully_shard takes no SPMD-typed plain parameters): this pins the reason, so a torch or
    torchtitan that builds it makes this test fail and its story get written."""
    got = run_ranks(refusal_story, 4, str(tmp_path / "run"), timeout=400, retire=True)
    for r in got:
        for backend, sp in REFUSED:
            clean = r[f"{backend}-{sp}"]
            assert "caught" not in clean and "statuses" not in clean, clean
            assert clean["refused"][:2] == ["abft", 0] and "\n" not in clean["message"], clean
            if backend == "full_dtensor":
                assert clean["message"].startswith("the loss is a DTensor placed (Partial(sum), Replicate())"), clean
                continue
            seen = ("its forward hooks see its output placed (Shard(dim=1))" if sp
                    else "got a gradient placed (Partial(sum))")
            assert "ABFT cannot check tensor-parallel Linear layers." in clean["message"], clean
            assert seen in clean["message"] and "parallelize_module" in clean["message"], clean
        assert "all parameters must be DTensors on the full SPMD mesh" in r["spmd_types"], r["spmd_types"]


def test_an_output_redistributed_before_the_hooks_or_a_gradient_placed_otherwise_is_named():
    """The pure rules behind the refusals above: a Linear's hooked output must be its local GEMM's (or a rowwise
    slice's partial sums all-reduced), and its weight's gradient placed as the weight."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from verified_ckpt.guard.tp import gradient_problem, linear_problem

    assert linear_problem("wq", (Shard(0),), (Replicate(),), 3, (Shard(2),)) is None  # colwise, local output
    assert linear_problem("wo", (Shard(1),), (Shard(-1),), 3, (Partial(),)) is None  # rowwise, the GEMM's own
    assert linear_problem("wo", (Shard(1),), (Shard(-1),), 3, (Replicate(),)) is None  # all-reduced: same gradient
    for w, x, out in [((Shard(1),), (Shard(-1),), (Shard(1),)), ((Shard(0),), (Replicate(),), (Replicate(),))]:
        got = linear_problem("layers.0.attention.wo", w, x, 3, out)
        assert got is not None and "its forward hooks see its output placed" in got and "\n" not in got, got
    assert gradient_problem("w2.weight", (Shard(1),), (Shard(1),)) is None
    got = gradient_problem("w2.weight", (Shard(1),), (Partial(),))
    assert got is not None and "got a gradient placed (Partial(sum))" in got and "parallelize_module" in got
