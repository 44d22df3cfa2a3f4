"""Store benchmarks: fingerprint, verified save and verified restore against plain torch.

Everything is measured side by side in one run on the same state, and the
result is printed as ratios. Run with ``make bench`` or:

    .venv/bin/python tools/bench/bench_store.py --gib 1 --repeats 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

from verified_ckpt import CheckpointManager, tensor_fingerprint


def make_state(gib: float) -> dict[str, torch.Tensor]:
    """A model-like mix: a few large matrices, many medium ones, some small vectors."""
    total = int(gib * (1 << 30)) // 4
    g = torch.Generator().manual_seed(0)
    sizes = [total // 8] * 4 + [total // 64] * 30 + [4096] * 64
    sizes.append(max(total - sum(sizes), 1))
    return {f"layer{i:03d}.weight": torch.randn(n, generator=g) for i, n in enumerate(sizes)}


def timeit(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch folder on the disk to measure (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", dest="json_out", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    scratch = tempfile.mkdtemp(dir=args.dir, prefix="vckpt-bench-")
    state = make_state(args.gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    big = torch.randn(int(args.gib * (1 << 30)) // 4)
    fig: dict[str, float] = {}
    try:
        # -- fingerprint vs sum vs sha256, one large fp32 tensor
        tensor_fingerprint(big)
        fig["torch.sum_s"] = timeit(big.sum, args.repeats)
        fig["fingerprint_s"] = timeit(lambda: tensor_fingerprint(big), args.repeats)
        view = memoryview(big.numpy()).cast("B")
        fig["sha256_s"] = timeit(lambda: hashlib.sha256(view).digest(), max(1, args.repeats - 2))

        # -- save: torch.save vs verified save, alternating so both see the same page-cache state
        pt = os.path.join(scratch, "state.pt")
        run = os.path.join(scratch, "run")
        ts, vs = [], []
        for i in range(args.repeats):
            for which in ("torch", "vckpt") if i % 2 == 0 else ("vckpt", "torch"):
                if which == "vckpt":
                    shutil.rmtree(run, ignore_errors=True)
                elif os.path.exists(pt):
                    os.remove(pt)
                t0 = time.perf_counter()
                if which == "torch":
                    torch.save(state, pt)
                    ts.append(time.perf_counter() - t0)
                else:
                    CheckpointManager(run).save(1, {"model": state})
                    vs.append(time.perf_counter() - t0)
        fig["torch.save_s"] = statistics.median(ts)
        fig["verified_save_s"] = statistics.median(vs)

        # -- restore: torch.load(weights_only) (+ copy into the model) vs verified restore into the model
        into = {k: torch.empty_like(v) for k, v in state.items()}
        mgr = CheckpointManager(run)

        def torch_load():
            return torch.load(pt, weights_only=True)

        def torch_load_copy():
            loaded = torch.load(pt, weights_only=True)
            for k, v in loaded.items():
                into[k].copy_(v)

        def verified_restore():
            mgr.restore({"model": into}, allow_unverified=True)

        lt, lct, vr = [], [], []
        for i in range(args.repeats):
            for fn, acc in ((torch_load, lt), (torch_load_copy, lct), (verified_restore, vr))[:: 1 if i % 2 == 0 else -1]:
                t0 = time.perf_counter()
                fn()
                acc.append(time.perf_counter() - t0)
        fig["torch.load_s"] = statistics.median(lt)
        fig["torch.load+copy_s"] = statistics.median(lct)
        fig["verified_restore_s"] = statistics.median(vr)
        assert all(torch.equal(into[k], state[k]) for k in state)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    ratios = {
        "fingerprint/sum": fig["fingerprint_s"] / fig["torch.sum_s"],
        "sha256/sum": fig["sha256_s"] / fig["torch.sum_s"],
        "save/torch.save": fig["verified_save_s"] / fig["torch.save_s"],
        "restore/torch.load": fig["verified_restore_s"] / fig["torch.load_s"],
        "restore/(torch.load+copy)": fig["verified_restore_s"] / fig["torch.load+copy_s"],
    }
    gib = nbytes / (1 << 30)
    print(f"state {gib:.2f} GiB in {len(state)} tensors, {args.threads} threads, median of {args.repeats}")
    for k, v in fig.items():
        print(f"  {k:<22} {v:8.3f} s   {gib / v:6.2f} GiB/s")
    print("ratios (targets: fingerprint/sum <= 2.0, save <= 1.3, restore <= 1.3)")
    for k, v in ratios.items():
        print(f"  {k:<26} {v:6.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"figures_s": fig, "ratios": ratios, "gib": gib, "threads": args.threads}, f, indent=2)


if __name__ == "__main__":
    main()
