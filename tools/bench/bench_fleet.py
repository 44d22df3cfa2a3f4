"""Verification at fleet scale: a store of many runs of a few small checkpoints each, local and on S3 (SeaweedFS on
loopback), and the passes a fleet runs over it, each timed:

* discovery (``discover_runs``): the first look under the prefix, and the next one, which knows the runs;
* the cheap pass: every checkpoint checked against what the store keeps of its shards (``verify(depth="head")``),
  no byte read;
* the read pass: every checkpoint read and checked, here (one process) and on a Dask ``LocalCluster`` of 1 and 2
  worker processes (``verify(cluster=...)``), whose results must equal the local pass's.

One run of 5 checkpoints is saved, then copied under ``--runs`` names (the checkpoints are what is read; their ids
repeat across runs, which nothing here depends on).

    .venv/bin/python tools/bench/bench_fleet.py --runs 1000 --store local
    .venv/bin/python tools/bench/bench_fleet.py --runs 1000 --store s3

``--wide N`` instead times the head check of one checkpoint of ``N`` shards (a large model's checkpoint is thousands
of shards) with 1, 4, 16 and 64 requests in flight: the per-request rate the cost model in docs/SERVICE.md scales.

    .venv/bin/python tools/bench/bench_fleet.py --wide 2000 --store s3
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..")]

import torch  # noqa: E402

from verified_ckpt import CheckpointManager, discover_runs  # noqa: E402
from verified_ckpt.crc import Crc64, to_base64  # noqa: E402


def template(root: str, checkpoints: int, numel: int) -> str:
    url = os.path.join(root, "template")
    mgr = CheckpointManager(url)
    for step in range(1, checkpoints + 1):
        mgr.save(step, {"w": torch.arange(numel, dtype=torch.float32) * step})
    mgr.verify()  # the template's own records: copies start verified once, as a scrubbed fleet is
    return url


def crc_base64(data: bytes) -> str:
    c = Crc64()
    c.update(data)
    return to_base64(c.hexdigest())


def passes(prefix: str, runs: list[str], opts: dict[str, Any] | None, workers: tuple[int, ...]) -> dict[str, Any]:
    from distributed import Client, LocalCluster

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    found = discover_runs(prefix, opts)
    out["discovery_first_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = discover_runs(prefix, opts, known=set(found))
    out["discovery_known_s"] = time.perf_counter() - t0
    assert sorted(found) == sorted(again) == sorted(runs), sorted(set(found) ^ set(runs))
    mgrs = [CheckpointManager(u, storage_options=opts) for u in runs]
    shards = sum(len(i.manifest.shards) for m in mgrs[:1] for i in m.list()) * len(runs)
    nbytes = sum(i.size_bytes for i in mgrs[0].list()) * len(runs)
    out |= {"runs": len(runs), "shards": shards, "bytes": nbytes}
    t0 = time.perf_counter()
    head_results = [r for m in mgrs for r in m.verify(depth="head", jobs=4)]
    out["head_pass_s"] = time.perf_counter() - t0
    heads = [r.ok for r in head_results]
    out["head_coverage"] = sorted({r.coverage for r in head_results})
    t0 = time.perf_counter()
    local = [(r.step, r.ok, [p.kind for p in r.problems]) for m in mgrs for r in m.verify(jobs=4)]
    out["read_pass_local_s"] = time.perf_counter() - t0
    out["all_ok"] = all(heads) and all(ok for _, ok, _ in local)
    for n in workers:
        with LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None,
                          silence_logs=40) as cluster, Client(cluster) as client:
            t0 = time.perf_counter()
            # The runs side by side (a thread each waits on its run's tasks), so the cluster has work queued.
            with concurrent.futures.ThreadPoolExecutor(4 * n) as pool:
                per_run = list(pool.map(lambda m, c=client: m.verify(jobs=5, cluster=c), mgrs))
            got = [(r.step, r.ok, [p.kind for p in r.problems]) for results in per_run for r in results]
            out[f"read_pass_dask_{n}_s"] = time.perf_counter() - t0
            out[f"dask_{n}_equals_local"] = got == local
    return out


def wide(url: str, opts: dict[str, Any] | None, shards: int) -> dict[str, Any]:
    """One checkpoint of ``shards`` shards (a tensor each, 64 bytes), head-checked at several concurrencies."""
    mgr = CheckpointManager(url, storage_options=opts, shard_bytes=64)
    t0 = time.perf_counter()
    mgr.save(1, {f"t{i:05d}": torch.full((16,), float(i)) for i in range(shards)})
    out: dict[str, Any] = {"shards": len(mgr.list()[0].manifest.shards), "made_s": time.perf_counter() - t0}
    for jobs in (1, 4, 16, 64):
        t0 = time.perf_counter()
        (res,) = mgr.verify(depth="head", jobs=jobs)
        out[f"head_jobs_{jobs}_s"] = time.perf_counter() - t0
        out[f"head_jobs_{jobs}_ok"] = res.ok
    out["head_coverage"] = res.coverage
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--checkpoints", type=int, default=5)
    ap.add_argument("--numel", type=int, default=4096, help="float32 elements per checkpoint (one small shard)")
    ap.add_argument("--store", choices=["local", "s3"], default="local")
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--wide", type=int, default=0, help="time the head check of one checkpoint of this many shards")
    args = ap.parse_args()
    workers = tuple(int(x) for x in args.workers.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        src = template(tmp, args.checkpoints, args.numel)
        names = [f"run{i:05d}" for i in range(args.runs)]
        if args.wide and args.store == "local":
            res = wide(os.path.join(tmp, "wide"), None, args.wide)
        elif args.wide:
            import seaweed

            handle = seaweed.start(os.path.join(tmp, "weed"))
            try:
                res = wide("s3://wide/run", handle.storage_options(), args.wide)
            finally:
                seaweed.stop(handle)
        elif args.store == "local":
            prefix = os.path.join(tmp, "fleet")
            for n in names:
                shutil.copytree(src, os.path.join(prefix, n))
            opts = None
            made = time.perf_counter() - t0
            res = passes(prefix, [os.path.join(prefix, n) for n in names], opts, workers)
        else:
            import s3fs
            import seaweed

            handle = seaweed.start(os.path.join(tmp, "weed"))
            try:
                opts = handle.storage_options()
                fs = s3fs.S3FileSystem(**opts)
                # The template in a bucket of its own: a filer-backed store keeps emptied folders, so one deleted
                # under the prefix would still be a folder there.
                fs.mkdir("fleet")
                fs.mkdir("template")
                fs.put(src, "template/run", recursive=True)
                fs.invalidate_cache()
                objects = fs.find("template/run")
                shards = {p: fs.cat(p) for p in objects if p.endswith(".safetensors")}
                crcs = {p: crc_base64(b) for p, b in shards.items()}
                for n in names:
                    for path in objects:
                        dest = path.replace("template/run", f"fleet/{n}", 1)
                        if path in shards:  # uploaded with its CRC, as a save uploads it: a copy would carry none
                            fs.pipe(dest, shards[path], ChecksumAlgorithm="CRC64NVME", ChecksumCRC64NVME=crcs[path])
                        else:  # a server-side copy
                            fs.copy(path, dest)
                fs.invalidate_cache()
                made = time.perf_counter() - t0
                res = passes("s3://fleet", [f"s3://fleet/{n}" for n in names], opts, workers)
            finally:
                seaweed.stop(handle)
    if args.wide:
        print(json.dumps(res | {"store": args.store}, indent=1))
        return
    res |= {"store": args.store, "made_s": made, "checkpoints_per_run": args.checkpoints, "numel": args.numel}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
