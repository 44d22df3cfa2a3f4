"""S3 benchmarks on a real SeaweedFS server on loopback (started and stopped here).

    .venv/bin/python tools/bench/bench_s3.py --mib 512 --repeats 3

1. Upload throughput: a verified save (safetensors shards, blake3, fingerprints,
   manifest; parallel multipart uploads) against boto3 ``upload_file`` of the
   same bytes (one file of the same total size) to the same server.
2. The blocking time of a non-blocking save against a blocking save's time.
Needs boto3 for the baseline only (`make bench` installs it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import boto3
import s3fs
import seaweed
import torch

from verified_ckpt import CheckpointManager


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shard-mib", type=int, default=64, help="shard size (the manager's default: 64)")
    ap.add_argument("--workers", type=int, default=8, help="io_workers (the manager's default: 8)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    n = args.mib * (1 << 20) // 4
    state = {f"layer{i:02d}": torch.randn(n // 16, generator=g) for i in range(16)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    with tempfile.TemporaryDirectory() as tmp:
        handle = seaweed.start(tmp)
        try:
            opts = handle.storage_options()
            s3fs.S3FileSystem(**opts).mkdir("bench")
            blob = os.path.join(tmp, "blob.bin")
            with open(blob, "wb") as f:
                for t in state.values():
                    f.write(t.numpy().tobytes())
            client = boto3.client("s3", endpoint_url=handle.endpoint_url, aws_access_key_id=handle.access_key,
                                  aws_secret_access_key=handle.secret_key, region_name=handle.region)
            mgr = CheckpointManager("s3://bench/run", storage_options=opts, shard_bytes=args.shard_mib << 20,
                                    io_workers=args.workers)
            boto_t, save_t, async_block_t = [], [], []
            for i in range(args.repeats):
                t0 = time.perf_counter()
                client.upload_file(blob, "bench", f"boto/blob-{i}.bin")
                boto_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                mgr.save(i, state)
                save_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                mgr.save(100 + i, state, blocking=False)
                async_block_t.append(time.perf_counter() - t0)
                mgr.wait()
        finally:
            seaweed.stop(handle)
    print("async blocking times:", " ".join(f"{t:.3f}" for t in async_block_t))
    boto, save, block = statistics.median(boto_t), statistics.median(save_t), statistics.median(async_block_t)
    mib = nbytes / (1 << 20)
    print(f"SeaweedFS on loopback, {mib:.0f} MiB state in 16 tensors, shards of {args.shard_mib} MiB, "
          f"median of {args.repeats}")
    print(f"  boto3 upload_file          {boto:7.3f} s  {mib / boto:7.1f} MiB/s")
    print(f"  verified save (blocking)   {save:7.3f} s  {mib / save:7.1f} MiB/s")
    print(f"  async save, blocking part  {block:7.3f} s")
    print(f"  upload throughput ratio (verified save / boto3)   {boto / save:5.2f}   (target >= 0.8)")
    print(f"  async blocking time / sync save time              {block / save:5.2f}   (target <= 0.2)")


if __name__ == "__main__":
    main()
