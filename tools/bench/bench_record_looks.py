"""What one look at a run costs a long-lived reader (``vckpt serve``) as its records pile up.

A run with one checkpoint and N verification records (what N scrubs leave). A fresh reader reads and parses
every record; a reader that looked before reads only the listing (records are written once, under unique
names, and re-read only when their listed size or stamp changes).

    .venv/bin/python tools/bench/bench_record_looks.py --records 2000
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time

import torch

from verified_ckpt import CheckpointManager, VerificationResult
from verified_ckpt.records import encoded
from verified_ckpt.store import RunStore, utc_now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    logging.getLogger("verified_ckpt").setLevel(logging.ERROR)  # its unguarded save's warning is not the point
    with tempfile.TemporaryDirectory() as root:
        info = CheckpointManager(root).save(1, {"w": torch.ones(4)})
        store = RunStore(root)
        for _ in range(args.records):
            store.records.append("verification", encoded("verification", VerificationResult(info.id, 1, True, [], utc_now(),
                                                                                          None).to_record()))
        fresh, again = [], []
        for _ in range(args.repeats):
            mgr = CheckpointManager(root)
            t0 = time.perf_counter()
            view = mgr.view()
            fresh.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mgr.view()
            again.append(time.perf_counter() - t0)
        assert len(view.verifications[info.id]) == args.records
        f, a = statistics.median(fresh), statistics.median(again)
        print(f"{args.records} records: a fresh reader's look {f * 1e3:.0f} ms, the same reader's next look "
              f"{a * 1e3:.0f} ms ({f / a:.0f}x less)")


if __name__ == "__main__":
    main()
