"""A small deterministic DDP training job guarded by SDCGuard.

    python examples/ddp_train.py --world-size 3 --steps 100 --inject grad:1:40:scale=10 --json
    torchrun --nproc-per-node 3 examples/ddp_train.py --steps 100 --json

    python examples/ddp_train.py --run /tmp/run --save-every 10 --audit-every 5 \
        --inject grad:1:23:scale=10 --on-incident rollback --json

Exit codes: 0 training reached --steps (incidents answered by an in-process
rollback are still listed in the JSON); 4 training stopped on a
silent-corruption incident (the JSON line is still printed, with the hosts to
exclude); 2 bad arguments. With --json the last stdout line is one JSON object:
{"final_step", "completed", "fingerprint", "incidents": [{"kind", "ranks", "hosts",
"first_suspect_step", "detected_step"}], "rollbacks": [{"from_step", "to_step"}]}.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import random
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import models
from verified_ckpt import (
    CheckpointManager,
    CheckpointNotRestorable,
    ExitCode,
    GuardConfig,
    RNGState,
    SDCGuard,
    SilentCorruptionDetected,
    state_fingerprint,
)
from verified_ckpt.recovery import exit_code_for, record_verdict

# The library's exit-code table (verified_ckpt.recovery.exits): 4 hosts named, 5 none named, 6 software.
EXIT_OK, EXIT_USAGE = int(ExitCode.OK), int(ExitCode.USAGE)
IN, HIDDEN, OUT, BATCH = 16, 64, 4, 32


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def make_batch(seed: int, step: int, rank: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic data: the same (seed, step, rank, micro) always gives the same batch."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank * 101 + micro)
    x = torch.randn(BATCH, IN, generator=g)
    y = torch.stack([x[:, :4].sum(1), x[:, 4:8].prod(1), x[:, 8:].abs().mean(1), torch.sin(x[:, 0])], dim=1)
    return x, y


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def bf16_loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The same loss under bf16 autocast; audits recompute it the same way."""
    x, y = batch
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    return torch.nn.functional.mse_loss(out.float(), y)


def every(text: str) -> int | str:
    """A schedule option: a number of steps, or ``budget`` (GuardConfig's default: as often as its overhead allows)."""
    return text if text == "budget" else int(text)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Deterministic DDP training guarded by SDCGuard.")
    ap.add_argument("--world-size", type=int, default=3, help="gloo processes to spawn (ignored under torchrun)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--consensus-every", type=every, default="budget", help="steps, or 'budget' (the default)")
    ap.add_argument("--audit-every", type=every, default="budget",
                    help="steps, or 'budget' (the default); 0 disables scheduled audits")
    ap.add_argument("--accum", type=int, default=1, help="microbatches per step (no_sync for all but the last)")
    ap.add_argument("--clip", type=float, default=0.0, help="gradient clipping norm (0: off)")
    ap.add_argument("--autocast", action="store_true", help="bf16 autocast in the forward pass")
    ap.add_argument("--model", choices=["mlp", "gpt", "bnmlp"], default="mlp",
                    help="mlp (default), gpt (TinyGPT: dropout 0.1, tied head), bnmlp (BatchNorm and dropout)")
    ap.add_argument("--lr-schedule", choices=["step", "warmup-cosine"], default="step")
    ap.add_argument("--inject", action="append", default=[], metavar="SITE:RANK:STEP[:MODE]")
    ap.add_argument("--bad-batch", default=None, metavar="RANK:STEP",
                    help="one rank's batch of one step holds an Inf (a data fault: every host computes the same NaN)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=["exact", "tolerance"], default="exact")
    ap.add_argument("--no-guard", action="store_true", help="plain DDP, for overhead comparisons")
    ap.add_argument("--no-abft", action="store_true", help="switch off the per-step gradient checks (ABFT)")
    # Under torchrun spell it --run-url: torchrun's parser takes a bare --run for its own --run-path (torch 2.13).
    ap.add_argument("--run", "--run-url", dest="run", default=None,
                    help="checkpoint run URL (local folder, s3://...); enables saves")
    ap.add_argument("--save-every", type=int, default=0, help="save a verified checkpoint every K steps")
    ap.add_argument("--resume", action="store_true", help="continue from the rollback target of --run")
    ap.add_argument("--async-save", action="store_true", help="non-blocking saves (upload in the background)")
    ap.add_argument("--on-incident", choices=["stop", "rollback"], default="stop",
                    help="stop (exit with the verdict: 4, 5 or 6) or roll back in-process to the rollback target and continue")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _incident(e: SilentCorruptionDetected) -> dict[str, Any]:
    d = e.incident.to_dict()
    return {"kind": d["kind"], "ranks": d["ranks"], "hosts": d["exclude_hosts"], "first_suspect_step": d["first_suspect_step"],
            "detected_step": d["detected_step"], "detail": d["detail"], "exit_code": int(exit_code_for(e))}


def exit_code(result: dict[str, Any]) -> int:
    """The job's exit code: 0 when it completed, else the last incident's verdict (under torchrun, each rank's
    error file already says it: ``loop`` writes it where the job stops)."""
    if result["completed"]:
        return EXIT_OK
    return int(result["incidents"][-1]["exit_code"]) if result["incidents"] else int(ExitCode.CHECK_FAILED)


def workload(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, Any]:
    """The model, loss function and batch function of ``--model``."""
    if args.model == "mlp":
        return build_model(args.seed), bf16_loss_fn if args.autocast else loss_fn, make_batch
    torch.manual_seed(args.seed)
    if args.model == "gpt":
        def gpt_batch(seed: int, step: int, rank: int, micro: int = 0) -> torch.Tensor:
            g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + rank * 101 + micro)
            return torch.randint(0, 64, (8, 17), generator=g)

        return models.TinyGPT(), _autocast(models.lm_loss) if args.autocast else models.lm_loss, gpt_batch
    return models.BNMLP(), _autocast(loss_fn) if args.autocast else loss_fn, make_batch


def poisoned(batch_of: Any, bad_rank: int, bad_step: int) -> Any:
    """``batch_of`` with an Inf in the first input of rank ``bad_rank``'s batch at step ``bad_step``."""
    def batch(seed: int, step: int, rank: int, micro: int = 0) -> Any:
        b = batch_of(seed, step, rank, micro)
        if (rank, step) == (bad_rank, bad_step) and isinstance(b, tuple):
            x = b[0].clone()
            x.view(-1)[0] = float("inf")
            return (x, *b[1:])
        return b

    return batch


def replay_model() -> tuple[torch.nn.Module, Any]:
    """For ``vckpt replay RUN --incident ID --model examples/ddp_train.py:replay_model``: the default model
    (``--model mlp``, no autocast) and its loss; the bundle supplies the weights."""
    return build_model(0), loss_fn


def _autocast(fn: Any) -> Any:
    def under_bf16(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(model, batch).float()

    return under_bf16


def schedule(opt: torch.optim.Optimizer, args: argparse.Namespace) -> torch.optim.lr_scheduler.LRScheduler:
    if args.lr_schedule == "warmup-cosine":
        warm = max(args.steps // 10, 1)
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(args.steps - warm, 1))))
    return torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.7)


def train(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    random.seed(args.seed * 1_000 + rank)  # every generator the saved RNGState covers is seeded
    np.random.seed(args.seed * 1_000 + rank)
    module, fn, batch_of = workload(args)
    if args.bad_batch:
        batch_of = poisoned(batch_of, *(int(x) for x in args.bad_batch.split(":")))
    model = DDP(module)
    torch.manual_seed(args.seed * 1_000 + rank)  # dropout draws differ per rank, as in real jobs
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = schedule(opt, args)
    cfg = GuardConfig(consensus_every=args.consensus_every, audit_every=args.audit_every or None,
                      mode=args.mode, faults=tuple(args.inject), abft=not args.no_abft)
    guard = None if args.no_guard else SDCGuard(model, opt, fn, cfg)
    mgr = CheckpointManager(args.run, guard=guard) if args.run and guard else None
    state = {"model": model.module, "optim": opt, "sched": sched, "rng": RNGState(), "progress": {"step": 0}}

    def one_step(step: int) -> None:
        if guard is None:
            for m in range(args.accum):
                ctx = model.no_sync() if m < args.accum - 1 else _null()
                with ctx:
                    fn(model, batch_of(args.seed, step, rank, m)).backward()
        else:
            for m in range(args.accum):
                guard.backward(batch_of(args.seed, step, rank, m), step=step, sync=m == args.accum - 1)
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        if guard is None:
            opt.step()
        else:
            guard.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

    step, completed, incidents, rollbacks = loop(args, one_step, state, guard, mgr)
    return {
        "final_step": step - 1,
        "completed": completed,
        "fingerprint": str(state_fingerprint({"model": model.module})),
        "incidents": incidents,
        "rollbacks": rollbacks,
        "audit_pairs": {str(a): t for a, t in enumerate(guard.targets)} if guard else {},
        "nodes": guard.node_of if guard else [],
        "checks": {k: c.to_dict() for k, c in guard.counters().items()} if guard else {},
        "abft_coverage": {"params": guard.abft.param_fraction, "flops": guard.abft.flop_fraction}
        if guard and guard.abft else None,
        "margins": dict(guard.margins) if guard else {},
    }


def loop(args: argparse.Namespace, one_step: Callable[[int], None], state: dict[str, Any], guard: SDCGuard | None,
         mgr: CheckpointManager | None) -> tuple[int, bool, list[dict[str, Any]], list[dict[str, int]]]:
    """Steps 1..--steps (from the rollback target with --resume), saving every --save-every steps; on an
    incident stop, or with --on-incident rollback roll back in-process and carry on. Returns (next step,
    completed, incidents, rollbacks)."""
    incidents: list[dict[str, Any]] = []
    rollbacks: list[dict[str, int]] = []
    step = 1
    if args.resume and mgr is not None:
        step = mgr.resume(state, start=1)  # the rollback target if an incident is open, else the newest restorable
    while step <= args.steps:
        try:
            one_step(step)
            state["progress"]["step"] = step
            if mgr is not None and args.save_every and step % args.save_every == 0:
                mgr.save(step, state, blocking=not getattr(args, "async_save", False))
            step += 1
        except SilentCorruptionDetected as e:
            incidents.append(_incident(e))
            if args.on_incident == "rollback" and mgr is not None:
                try:
                    info = mgr.rollback(state)
                except CheckpointNotRestorable as gone:
                    # Nothing to resume from: that, not the incident, is what a scheduler must act on (exit 7).
                    incidents[-1]["exit_code"] = int(record_verdict(gone))
                    break
                rollbacks.append({"from_step": step, "to_step": info.step})
                step = info.step + 1
                continue
            record_verdict(e)  # the job stops on it: torchelastic's error file (under torchrun) says so
            break
    if mgr is not None:
        mgr.wait()  # a pending background save must commit (or fail loudly) before we report
    completed = step > args.steps
    if guard is not None and completed:
        try:  # the final state is checked like a save would check it
            guard.consensus(args.steps)
        except SilentCorruptionDetected as e:
            incidents.append(_incident(e))
            record_verdict(e)
            completed = False
    return step, completed, incidents, rollbacks


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


Train = Callable[[int, int, argparse.Namespace], dict[str, Any]]


def _spawned(rank: int, world: int, init: str, args: argparse.Namespace, train_fn: Train | None = None) -> None:
    faulthandler.enable(all_threads=True)  # a native abort prints every thread's Python stack
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        result = (train_fn or train)(rank, world, args)
        if rank == 0 and args.result_file:
            with open(args.result_file, "w") as f:
                json.dump(result, f)
        dist.barrier()  # no rank tears its process group down while another still talks to it
    finally:
        dist.destroy_process_group()
    _exit_now(0)


def _exit_now(code: int) -> None:
    """Leave without running interpreter teardown.

    Rarely (about 1 run in 40 here) a gloo rank aborted in a C++ destructor at
    interpreter exit, *after* all its work was done and its group destroyed,
    turning a clean exit code into SIGABRT. Everything this process owes the
    world is written and flushed by now, so skipping teardown loses nothing.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def report(result: dict[str, Any], as_json: bool) -> int:
    if as_json:
        print(json.dumps(result, sort_keys=True))
    else:
        print(f"trained to step {result['final_step']}; weights fingerprint {result['fingerprint']}")
        for rb in result.get("rollbacks", []):
            print(f"rolled back at step {rb['from_step']} to the checkpoint of step {rb['to_step']}")
        for inc in result["incidents"]:
            print(f"INCIDENT {inc['kind']} at step {inc['detected_step']}: suspect ranks {inc['ranks']} "
                  f"(exclude hosts: {', '.join(inc['hosts']) or 'none named'}); "
                  f"suspect from step {inc['first_suspect_step']}")
    return exit_code(result)


def main(argv: list[str] | None = None) -> int:
    return launch(parse(argv), train)


def launch(args: argparse.Namespace, train_fn: Train) -> int:
    """Run ``train_fn`` under torchrun (when launched by it) or on ``args.world_size`` spawned gloo ranks; report.

    A guard option that cannot work is refused here, before any rank starts (exit 2).
    """
    try:
        GuardConfig(consensus_every=args.consensus_every, audit_every=args.audit_every or None, faults=tuple(args.inject))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        try:
            result = train_fn(dist.get_rank(), dist.get_world_size(), args)
            code = exit_code(result)
            if int(os.environ["RANK"]) == 0:
                # Reported before the barrier: once another rank leaves with a failing code, torchrun stops the
                # rest, and rank 0's report, written after, was sometimes lost
                code = report(result, args.json)
                sys.stdout.flush()
            dist.barrier()  # no rank tears its process group down while another still talks to it
        finally:
            dist.destroy_process_group()
        _exit_now(code)
    return report(run_spawned(args, train_fn), args.json)


def run_spawned(args: argparse.Namespace, train_fn: Train | None = None) -> dict[str, Any]:
    """Run ``args.world_size`` gloo ranks on this machine and return rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        args.result_file = os.path.join(tmp, "result.json")
        init = f"file://{os.path.join(tmp, 'store')}"
        # Forked from a server that imported torch (and this script) once, not spawned: a spawned rank spends
        # seconds of CPU importing them again, which on a small machine is most of a short run's time. DDP's
        # constructor imports torch._dynamo (a second more a rank), and the guard and the checkpoint side sit
        # behind verified_ckpt's lazy names.
        mp.set_forkserver_preload(["__main__", "torch", "torch._dynamo", "torch.distributed", "verified_ckpt",
                                   "verified_ckpt.guard", "verified_ckpt.checkpoint"])
        mp.start_processes(_spawned, args=(args.world_size, init, args, train_fn), nprocs=args.world_size, join=True,
                           start_method="forkserver")
        with open(args.result_file) as f:
            return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
