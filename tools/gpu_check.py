"""One short device check: fingerprints on CUDA equal those on CPU, and their GPU throughput.

    python tools/gpu_check.py --out results.json      (tools/gpu_check.sh runs it on a lent GPU)

Checks, for every supported dtype and awkward sizes (empty, odd, multi-row, misaligned views):
CUDA ``tensor_fingerprint`` == CPU ``tensor_fingerprint`` of the same bytes. Then measures on a
1 GiB fp32 tensor: fingerprint vs ``torch.sum`` time and GiB/s, and the guard's block-sum projection.
Exits 1 if any fingerprint differs. Without CUDA it says so and exits 0 (nothing to check).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

from verified_ckpt import tensor_fingerprint

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
SIZES = [0, 1, 7, 1023, 1024 * 8 + 5, 3_000_001]


def sample(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    return (raw[:n] & 1).bool() if dtype == torch.bool else raw.view(dtype)


def timed(fn, repeats: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--gib", type=float, default=1.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    dev = torch.device("cuda")
    mismatches, checked = [], 0
    for i, dtype in enumerate(DTYPES):
        for n in SIZES:
            cpu = sample(dtype, n, seed=i * 100 + n % 97)
            views = [cpu, cpu[1:] if n > 1 else cpu]
            for v in views:
                checked += 1
                a, b = str(tensor_fingerprint(v)), str(tensor_fingerprint(v.to(dev)))
                if a != b:
                    mismatches.append({"dtype": str(dtype), "n": n, "cpu": a, "cuda": b})
    big = torch.randn(int(args.gib * (1 << 30)) // 4, device=dev)
    t_sum = timed(big.sum)
    t_fp = timed(lambda: tensor_fingerprint(big))
    gib = big.numel() * 4 / (1 << 30)
    result = {
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "fingerprint_cases": checked, "mismatches": mismatches,
        "sum_s": t_sum, "fingerprint_s": t_fp, "fingerprint_gib_s": gib / t_fp, "sum_gib_s": gib / t_sum,
        "fingerprint_over_sum": t_fp / t_sum,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
