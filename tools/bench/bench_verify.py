"""Offline verification throughput: ``verify --all`` of a 50-checkpoint run against a plain read of the same bytes.

    .venv/bin/python tools/bench/bench_verify.py --checkpoints 50 --mib 16 --repeats 3

The plain read opens every shard file of the run and reads it whole into one
reused buffer (no parsing, no hashing), the floor for any verifier. Both run on
a warm page cache, variants interleaved, median of ``--repeats``. Also prints
peak resident memory growth during a verify against the bytes the run holds.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch

from verified_ckpt import CheckpointManager


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def plain_read(paths: list[str], buf: bytearray) -> int:
    total = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=50)
    ap.add_argument("--mib", type=int, default=16, help="size of each checkpoint")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run = os.path.join(tmp, "run")
        mgr = CheckpointManager(run, shard_bytes=4 << 20)
        n = args.mib * (1 << 20) // 4 // 4
        for step in range(args.checkpoints):
            mgr.save(step, {f"w{i}": torch.randn(n) for i in range(4)})
        paths = sorted(glob.glob(os.path.join(run, "checkpoints", "*", "shard-*.safetensors")))
        nbytes = sum(os.path.getsize(p) for p in paths)
        buf = bytearray(8 << 20)
        plain_read(paths, buf)  # warm the page cache
        times: dict[str, list[float]] = {"plain read": [], "verify --jobs 1": [], "verify --jobs 4": []}
        peak_growth = 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            plain_read(paths, buf)
            times["plain read"].append(time.perf_counter() - t0)
            for jobs in (1, 4):
                base, peak, running = rss(), [0], [True]

                def sample(peak: list[int] = peak, running: list[bool] = running) -> None:
                    while running[0]:
                        peak[0] = max(peak[0], rss())
                        time.sleep(0.005)

                th = threading.Thread(target=sample)
                th.start()
                t0 = time.perf_counter()
                results = mgr.verify(jobs=jobs)
                times[f"verify --jobs {jobs}"].append(time.perf_counter() - t0)
                running[0] = False
                th.join()
                peak_growth = max(peak_growth, peak[0] - base)
                assert len(results) == args.checkpoints and all(r.ok for r in results)
    mib = nbytes / (1 << 20)
    print(f"{args.checkpoints} checkpoints, {mib:.0f} MiB in {len(paths)} shards, local disk (warm cache), "
          f"median of {args.repeats}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, t in med.items():
        print(f"  {k:18s} {t:7.3f} s  {mib / t:8.1f} MiB/s")
    for jobs in (1, 4):
        print(f"  throughput ratio verify --jobs {jobs} / plain read   {med['plain read'] / med[f'verify --jobs {jobs}']:5.2f}")
    print(f"  peak resident growth during verify   {peak_growth / (1 << 20):.0f} MiB (run holds {mib:.0f} MiB)")


if __name__ == "__main__":
    main()
