"""CLI start-up: ``vckpt --help`` and ``vckpt list RUN`` against a bare ``python -c pass``, as subprocesses.

    .venv/bin/python tools/bench/bench_cli_startup.py --checkpoints 50 --repeats 7

Builds a local run of ``--checkpoints`` small checkpoints in a temporary folder,
then times each command as a fresh process (what a user or a scheduler pays
per call): the interpreter alone, ``--help`` (imports only), and ``list`` (imports,
one listing, every manifest parsed, the table printed). One uncounted round warms
the page cache; the repeats are interleaved, so a busy moment on the host hits
every command alike. Prints the median and the best of ``--repeats`` beside the
targets; the best is the steadier figure on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch

from verified_ckpt import CheckpointManager

VCKPT = [sys.executable, "-m", "verified_ckpt_cli.main"]
TARGETS = {"python -c pass": None, "vckpt --help": 0.5, "vckpt list RUN": 1.0}  # seconds of wall time


def timed(argv: list[str]) -> float:
    """Wall seconds of one process; a failing command is a broken bench, not a slow one."""
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, check=False)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr.decode(errors='replace')}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    logging.getLogger("verified_ckpt").setLevel(logging.ERROR)  # each unguarded save warns; this run is unguarded on purpose
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "run")
        mgr = CheckpointManager(run)
        for step in range(args.checkpoints):
            mgr.save(step, {"w": torch.randn(1000)})
        commands = {"python -c pass": [sys.executable, "-c", "pass"], "vckpt --help": [*VCKPT, "--help"],
                    "vckpt list RUN": [*VCKPT, "list", run]}
        listed = json.loads(subprocess.run([*VCKPT, "list", run, "--json"], capture_output=True, check=True).stdout)
        if len(listed) != args.checkpoints:  # the timed list must really list the whole run
            raise SystemExit(f"vckpt list --json shows {len(listed)} checkpoints, not {args.checkpoints}")
        times: dict[str, list[float]] = {name: [] for name in commands}
        for argv in commands.values():
            timed(argv)  # warm-up: page cache, bytecode caches
        for _ in range(args.repeats):
            for name, argv in commands.items():
                times[name].append(timed(argv))
    print(f"{args.checkpoints} checkpoints on local disk, {os.cpu_count()} CPUs, {args.repeats} interleaved repeats "
          f"(seconds of wall time per process)")
    print(f"  {'command':16s} {'median':>7s} {'best':>7s}  target")
    for name, ts in times.items():
        target = TARGETS[name]
        verdict = "" if target is None else f"<= {target:.1f}  {'ok' if statistics.median(ts) <= target else 'MISSED'}"
        print(f"  {name:16s} {statistics.median(ts):7.3f} {min(ts):7.3f}  {verdict}")


if __name__ == "__main__":
    main()
