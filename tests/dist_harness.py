"""Run a function on W real gloo ranks, PyTorch MultiProcessTestCase style, on a pool of warm processes.

Each call gets a fresh FileStore-backed process group, one thread per rank,
and a timeout; each rank's return value (JSON-able) or traceback comes back
to the parent, so a failing rank reads like a normal pytest failure.

Spawning W processes and importing torch in each costs 4-6 s on this
machine, more than most of these tests take, so the ranks of one world size
are kept as a pool between calls. Each call still gets its own process group
(destroyed afterwards). A call that fails, times out or kills a rank retires
the pool, so no half-torn state leaks into the next test; calls that must see
a SIGKILL (``killed=``) always run on fresh processes. Rank functions must not
leave global patches behind (restore them in ``finally``).

Ranks fork from a forkserver that has imported torch and verified_ckpt once: a spawned rank spent about 4
CPU-seconds importing them, and on this 2-core machine that was 40 % of the multi-rank tests' CPU time
(test_guard_models + test_rollback_dist: 113 CPU-s spawned, 65 forked). A forked rank inherits the server's
environment, not the caller's, so each call ships the caller's ``os.environ`` (a test's ``monkeypatch.setenv``
reaches its ranks as it did under spawn).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any


def _run_one(fn: Callable[..., Any], rank: int, world: int, init: str, args: tuple, final_barrier: bool,
             env: dict[str, str]) -> dict[str, Any]:
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        payload = {"ok": True, "result": fn(rank, world, *args)}
        if final_barrier:
            dist.barrier()  # no rank tears its process group down while another still talks to it
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        payload = {"ok": False, "traceback": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return payload


def _worker(conn: multiprocessing.connection.Connection, rank: int) -> None:
    import torch

    torch.set_num_threads(1)
    while True:
        task = conn.recv()
        if task is None:
            return
        fn, world, init, args, env = task
        conn.send(json.dumps(_run_one(fn, rank, world, init, args, True, env)))


def _entry(fn: Callable[..., Any], rank: int, world: int, init: str, out: str, args: tuple, final_barrier: bool,
           env: dict[str, str]) -> None:
    import torch

    torch.set_num_threads(1)
    payload = _run_one(fn, rank, world, init, args, final_barrier, env)
    with open(out, "w") as f:
        json.dump(payload, f)


# What every rank would otherwise import on its own, once per process: torch._dynamo is imported on the first call
# of any function torch wraps in ``_disable_dynamo`` (FSDP2's and DTensor's), and the guard, the checkpoint side and
# their libraries behind ``verified_ckpt``'s lazy names. Imported by each rank of a 4-rank torchtitan-plan test they
# were 22 % of its CPU time (torch._dynamo alone 15 %), paid again at each launch that retires its pool. Lightning and
# what ``torch.compile(backend="aot_eager")`` imports on its first call (1.9 and 1.3 CPU-s a rank here) are imported
# by ranks that never share a pool (tensor parallel retires it; a killed rank's launch is fresh): the Lightning 2x2
# test's 12 ranks spent 25 of its 71-82 CPU-s on them, once per worker here (docs/BENCHMARKS.md, issue 51's
# fourteenth turn).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.checkpoint", "verified_ckpt", "verified_ckpt.guard", "verified_ckpt.checkpoint", "zarr",
           "awscrt.checksums", "dist_harness", "lightning.pytorch", "torch._dynamo.backends.common",
           "torch._inductor.pattern_matcher"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _Pool:
    def __init__(self, world: int) -> None:
        ctx = _context()
        self.world = world
        pipes = [ctx.Pipe() for _ in range(world)]
        self.conns = [parent for parent, _ in pipes]
        self.procs = [ctx.Process(target=_worker, args=(child, r), daemon=True) for r, (_, child) in enumerate(pipes)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory() as tmp:
            init = f"file://{os.path.join(tmp, 'store')}"
            for conn in self.conns:
                conn.send((fn, self.world, init, args, dict(os.environ)))
            deadline = time.monotonic() + timeout
            payloads: list[dict[str, Any] | None] = [None] * self.world
            while any(p is None for p in payloads):
                waiting = [c for c, p in zip(self.conns, payloads) if p is None]
                ready = multiprocessing.connection.wait(waiting, timeout=max(deadline - time.monotonic(), 0))
                if not ready:
                    hung = [r for r, p in enumerate(payloads) if p is None]
                    raise TimeoutError(f"ranks {hung} still running after {timeout}s (a collective mismatch?)")
                for c in ready:
                    r = self.conns.index(c)
                    try:
                        payloads[r] = json.loads(c.recv())
                    except EOFError:
                        raise AssertionError(f"rank {r} died without a result (exit code {self.procs[r].exitcode})") from None
        return payloads  # type: ignore[return-value]

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join()


_POOLS: dict[int, _Pool] = {}


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 90.0,
              killed: frozenset[int] = frozenset(), retire: bool = False) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    Ranks in ``killed`` must die by SIGKILL (their result is None); then no final barrier runs. ``retire``: the
    pool is not reused after this call. A call that runs tensor parallel needs it: DTensor caches sharding plans
    by mesh, and an equal mesh in the next call's process group would reuse plans naming the process groups
    destroyed after this one ("Could not resolve the process group"). A job inits once, so only warm pools meet it.
    """
    with cores(world):
        return _run_ranks(fn, world, args, timeout, killed, retire)


@contextlib.contextmanager
def cores(world: int) -> Iterator[None]:
    """Share the host's cores between the suite's workers (``make test`` runs two): a job of six or more ranks runs
    while no other multi-rank job does, smaller ones run side by side. Gloo ranks that wait for cores held by the
    other worker's ranks make every collective crawl: a 6- or 8-rank job beside another ran 2-3x slower and slowed
    its neighbour as much. A turnstile lets a waiting large job in before new small ones (the suite's timeouts
    bound every wait). Outside xdist there is no other worker: nothing to share."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    folder = os.path.join(tempfile.gettempdir(), f"vckpt-cores-{run}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "turnstile"), "a+") as turnstile, open(os.path.join(folder, "ranks"), "a+") as held:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if world >= 6:
            fcntl.flock(held, fcntl.LOCK_EX)  # the turnstile stays closed until this job is done
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(held, fcntl.LOCK_SH)
        yield


def _run_ranks(fn: Callable[..., Any], world: int, args: tuple, timeout: float, killed: frozenset[int],
               retire: bool) -> list[Any]:
    if killed:
        return _run_fresh(fn, world, args, timeout, killed)
    pool = _POOLS.pop(world, None) or _Pool(world)
    try:
        payloads = pool.run(fn, args, timeout)
    except BaseException:
        pool.close()
        raise
    failed = [(r, p) for r, p in enumerate(payloads) if not p["ok"]]
    retire = retire or bool(failed)
    if retire:
        pool.close()
    if failed:
        r, p = failed[0]
        raise AssertionError(f"rank {r} failed:\n{p['traceback']}")
    if not retire:
        _POOLS[world] = pool
    return [p["result"] for p in payloads]


def _run_fresh(fn: Callable[..., Any], world: int, args: tuple, timeout: float, killed: frozenset[int]) -> list[Any]:
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init, outs[r], args, not killed, dict(os.environ)))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout}s (a collective mismatch?)")
        results = []
        for r, path in enumerate(outs):
            if r in killed:
                if procs[r].exitcode != -9:
                    raise AssertionError(f"rank {r} should have died by SIGKILL, exit code {procs[r].exitcode}")
                results.append(None)
                continue
            if not os.path.exists(path) and killed and procs[r].exitcode == -signal.SIGABRT:
                # A survivor of a killed peer stops either way: its next collective raises (what the scenarios
                # return), or gloo's transport thread, finding the peer's socket reset mid-transfer, throws where
                # nothing catches and aborts the process (seen once in a full suite on a loaded machine).
                results.append({"peer died": "SIGABRT"})
                continue
            if not os.path.exists(path):
                raise AssertionError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
            with open(path) as f:
                payload = json.load(f)
            if not payload["ok"]:
                raise AssertionError(f"rank {r} failed:\n{payload['traceback']}")
            results.append(payload["result"])
        return results
