"""`vckpt list` and `vckpt status` after many scrub passes, against the same run when it was fresh.

    .venv/bin/python tools/bench/bench_scrub_records.py --checkpoints 10 --passes 10000

A run with ``--checkpoints`` small checkpoints is scrubbed ``--passes`` times, one checkpoint per pass, through
``CheckpointManager.verify`` (what ``vckpt serve`` does: each pass appends a verification record, and compaction
drops the superseded ones). ``vckpt list`` and ``vckpt status`` are timed as a fresh process would run them
(a new manager, nothing cached), median of ``--repeats``, before the passes (10 records) and after.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

import torch
from click.testing import CliRunner

from verified_ckpt import CheckpointManager
from verified_ckpt_cli.main import main as vckpt


def timed(run: str, command: str, repeats: int) -> float:
    took = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = CliRunner().invoke(vckpt, [command, run, "--json"])
        took.append(time.perf_counter() - t0)
        assert r.exit_code in (0, 1), r.output
    return statistics.median(took)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--passes", type=int, default=10000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("verified_ckpt").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as root:
        mgr = CheckpointManager(root)
        for s in range(args.checkpoints):
            mgr.save(s, {"w": torch.randn(256)})
        infos = mgr.list()
        mgr.verify(infos)  # one record per checkpoint: the fresh run
        before = {c: timed(root, c, args.repeats) for c in ("list", "status")}
        t0 = time.perf_counter()
        for n in range(args.passes):
            mgr.verify([infos[n % len(infos)]])
        spent = time.perf_counter() - t0
        records = len(os.listdir(os.path.join(root, "records", "verification")))
        after = {c: timed(root, c, args.repeats) for c in ("list", "status")}
    print(f"{args.checkpoints} checkpoints, {args.passes} scrub passes ({spent / args.passes * 1e3:.1f} ms each): "
          f"{records} verification records left")
    for c, fresh in before.items():
        print(f"  vckpt {c:<7} fresh {fresh * 1e3:6.1f} ms   after {after[c] * 1e3:6.1f} ms   "
              f"ratio {after[c] / fresh:.2f} (target <= 2)")


if __name__ == "__main__":
    main()
