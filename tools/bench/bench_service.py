"""`vckpt serve` at scale: 20 runs holding 1,000 checkpoints, against `vckpt verify --all` on the same data.

Measures, side by side on one machine:
* scrub throughput: the service verifying every checkpoint once (from /healthz answering, after its
  start-up, to the last one recorded) against `CheckpointManager.verify()` of every run in this process
  (what `vckpt verify --all` does, without its start-up), interleaved on fresh copies, median of repeats;
* the API's list endpoints (`/api/runs`, `/api/runs/{key}/checkpoints`), median and worst of 30;
* the service's resident memory once everything is verified (VmRSS and VmHWM);
* the bandwidth cap: a second service with `--bandwidth` on a fresh copy, achieved rate / cap.

    .venv/bin/python tools/bench/bench_service.py --runs 20 --per-run 50 --kib 256
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import torch

from verified_ckpt import CheckpointManager
from verified_ckpt.service import run_key


def make_runs(root: str, runs: int, per_run: int, kib: int) -> list[str]:
    urls = []
    for r in range(runs):
        url = os.path.join(root, f"run{r:02d}")
        mgr = CheckpointManager(url)
        for s in range(per_run):
            mgr.save(s, {"w": torch.randn(kib * 256)})
        urls.append(url)
    return urls


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(urls: list[str], p: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "verified_ckpt_cli.main", "serve", *urls, "--port", str(p), "--poll", "5",
           "--scrub-interval", "1e9", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def all_verified(client: httpx.Client) -> bool:
    try:
        runs = client.get("/api/runs").json()
    except httpx.TransportError:
        return False
    return bool(runs) and all(r["scrub"]["never_verified"] == 0 and r["scrub"]["reading"] is None
                              and r["passes"] > 0 for r in runs)


def wait(client: httpx.Client, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds from the service answering /healthz (after its start-up) to every checkpoint verified once."""
    t0 = time.monotonic()
    while True:
        try:
            if client.get("/healthz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() - t0 > timeout:
            raise SystemExit("the service did not start")
        time.sleep(0.05)
    t0 = time.monotonic()
    while not all_verified(client):
        if proc.poll() is not None:
            raise SystemExit(f"service exited: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        if time.monotonic() - t0 > timeout:
            raise SystemExit("timed out")
        time.sleep(0.25)  # asking costs the service CPU: not too often
    return time.monotonic() - t0


def memory(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) // 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--per-run", type=int, default=50)
    ap.add_argument("--kib", type=int, default=256, help="size of each checkpoint")
    ap.add_argument("--cap-mib", type=float, default=20.0, help="bandwidth cap of the second service (MiB/s)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved service / verify --all timings")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="vckpt-bench-service-")
    try:
        t0 = time.monotonic()
        urls = make_runs(os.path.join(root, "a"), args.runs, args.per_run, args.kib)
        shutil.copytree(os.path.join(root, "a"), os.path.join(root, "b"))
        total = sum(CheckpointManager(u).total_bytes() for u in urls)
        print(f"{args.runs} runs, {args.runs * args.per_run} checkpoints, {total / 2**20:.0f} MiB "
              f"(made in {time.monotonic() - t0:.0f} s)")
        ratios = []
        for rep in range(args.repeats):  # interleaved: each repeat times both on fresh unverified copies
            # `vckpt verify --all` on every run, on a copy so the service below starts from unverified runs.
            for d in ("c", "d"):
                shutil.rmtree(os.path.join(root, d), ignore_errors=True)
                shutil.copytree(os.path.join(root, "a"), os.path.join(root, d))
            t0 = time.monotonic()
            for u in urls:
                CheckpointManager(u.replace(os.path.join(root, "a"), os.path.join(root, "c"))).verify()
            cli_s = time.monotonic() - t0
            if rep < args.repeats - 1:
                p = port()
                proc = start([u.replace(os.path.join(root, "a"), os.path.join(root, "d")) for u in urls], p, [])
                try:
                    svc_s = wait(httpx.Client(base_url=f"http://127.0.0.1:{p}", timeout=10), proc, 900)
                finally:
                    proc.terminate()
                    proc.wait(10)
                ratios.append(cli_s / svc_s)
                print(f"repeat {rep + 1}: verify --all {cli_s:.2f} s, service {svc_s:.2f} s, ratio {cli_s / svc_s:.2f}")
        p = port()
        proc = start(urls, p, [])
        client = httpx.Client(base_url=f"http://127.0.0.1:{p}", timeout=10)
        try:
            svc_s = wait(client, proc, 900)
            ratios.append(cli_s / svc_s)
            print(f"repeat {args.repeats}: verify --all {cli_s:.2f} s, service {svc_s:.2f} s, ratio {cli_s / svc_s:.2f}")
            lat_runs, lat_cks = [], []
            for i in range(30):
                t = time.perf_counter()
                client.get("/api/runs").raise_for_status()
                lat_runs.append(time.perf_counter() - t)
                t = time.perf_counter()
                client.get(f"/api/runs/{run_key(urls[i % len(urls)])}/checkpoints").raise_for_status()
                lat_cks.append(time.perf_counter() - t)
            mem = memory(proc.pid)
        finally:
            proc.terminate()
            proc.wait(10)
        print(f"verify --all of every run: {cli_s:.2f} s ({total / cli_s / 2**20:.0f} MiB/s)")
        print(f"service, every checkpoint once: {svc_s:.2f} s ({total / svc_s / 2**20:.0f} MiB/s, from /healthz answering); "
              f"throughput ratio service / verify --all = {cli_s / svc_s:.2f}; median of {len(ratios)} repeats "
              f"{statistics.median(ratios):.2f} (target >= 0.8)")
        print(f"/api/runs: median {statistics.median(lat_runs) * 1e3:.1f} ms, worst {max(lat_runs) * 1e3:.1f} ms; "
              f"/api/runs/KEY/checkpoints: median {statistics.median(lat_cks) * 1e3:.1f} ms, "
              f"worst {max(lat_cks) * 1e3:.1f} ms (target < 200)")
        print(f"service memory after verifying everything: VmRSS {mem.get('VmRSS')} MiB, VmHWM {mem.get('VmHWM')} MiB")
        burls = [u.replace(os.path.join(root, "a"), os.path.join(root, "b")) for u in urls]
        cap = args.cap_mib * 2**20
        p = port()
        proc = start(burls, p, ["--bandwidth", str(cap)])
        client = httpx.Client(base_url=f"http://127.0.0.1:{p}", timeout=10)
        try:
            t_capped = wait(client, proc, 900)
        finally:
            proc.terminate()
            proc.wait(10)
        # The first second's burst is free (token bucket): the paced part is total - cap.
        print(f"capped at {args.cap_mib:.0f} MiB/s: {t_capped:.2f} s for {total / 2**20:.0f} MiB = "
              f"{total / t_capped / 2**20:.1f} MiB/s; achieved / cap = {total / t_capped / cap:.2f} "
              f"(paced part: {(total - cap) / max(t_capped - 0.0, 1e-9) / cap:.2f}; target within 10%)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
