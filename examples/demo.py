"""`make demo`: a silent fault in a 3-rank DDP job, caught, rolled back, and recovered bit for bit.

1. A clean run: 3 gloo ranks, 40 steps, a verified checkpoint every 10 steps.
2. The same job with a transient fault: rank 1's gradients are scaled by 10 at step 23.
   The guard catches it before the update (an outlier triggers a recompute audit, a third
   rank breaks the tie), names rank 1 and its host, rolls back in-process to the newest
   restorable checkpoint, and replays the steps (the fault does not recur).
3. A summary: the incident, the suspect rank and host, the rollback target, `vckpt` views
   (incidents, list, verify, the ledger's summary, and an HTML report of the run's history),
   and the final weights fingerprint beside the clean run's: they are equal.

The store is a local directory (the embedded default); set VCKPT_DEMO_DIR to keep it, or
VCKPT_DEMO_URL to any fsspec URL (`make demo-s3` points it at a SeaweedFS S3 server).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ddp_train

FAULT = "grad:1:23:scale=10"


def vckpt(*args: str) -> None:
    exe = os.path.join(os.path.dirname(sys.executable), "vckpt")
    print(f"\n$ vckpt {' '.join(args)}", flush=True)
    subprocess.run([exe, *args], check=False)


def job(run: str, *extra: str) -> dict:
    args = ddp_train.parse(["--world-size", "3", "--steps", "40", "--save-every", "10", "--audit-every", "5",
                            "--consensus-every", "5", "--run", run, *extra])
    return ddp_train.run_spawned(args)


def main() -> int:
    base = os.environ.get("VCKPT_DEMO_URL") or os.environ.get("VCKPT_DEMO_DIR") or tempfile.mkdtemp(prefix="vckpt-demo-")
    clean_run, faulty_run = f"{base.rstrip('/')}/clean", f"{base.rstrip('/')}/faulty"
    if "://" not in base:
        for d in (clean_run, faulty_run):
            shutil.rmtree(d, ignore_errors=True)

    print("1. clean run: 3 gloo ranks, 40 steps, verified checkpoint every 10 steps", flush=True)
    clean = job(clean_run)
    print(f"   done at step {clean['final_step']}, weights fingerprint {clean['fingerprint']}")

    print(f"\n2. same job with a transient fault injected ({FAULT}), --on-incident rollback", flush=True)
    faulty = job(faulty_run, "--inject", FAULT, "--on-incident", "rollback")
    for inc in faulty["incidents"]:
        print(f"   INCIDENT {inc['kind']} at step {inc['detected_step']}: suspect rank(s) {inc['ranks']} "
              f"on host(s) {', '.join(inc['hosts']) or '?'}; state suspect from step {inc['first_suspect_step']}")
        print(f"     {inc['detail']}")
    for rb in faulty["rollbacks"]:
        print(f"   ROLLBACK at step {rb['from_step']} to the checkpoint of step {rb['to_step']}, then replayed")

    vckpt("incidents", faulty_run)
    vckpt("list", faulty_run)
    vckpt("verify", faulty_run, "--all")
    vckpt("ledger", faulty_run)
    local = "://" not in faulty_run
    report = faulty_run.rstrip("/") + "-report.html" if local else os.path.join(tempfile.gettempdir(), "vckpt-demo-report.html")
    vckpt("report", faulty_run, "--out", report)

    same = faulty["fingerprint"] == clean["fingerprint"]
    print("\n3. final weights fingerprint")
    print(f"   clean run:                       {clean['fingerprint']}")
    print(f"   faulty run after rollback:       {faulty['fingerprint']}")
    print("   bitwise identical: the fault left no trace" if same else "   MISMATCH")
    print(f"\n(run folders under {base})")
    return 0 if same and faulty["incidents"] and faulty["rollbacks"] else 1


if __name__ == "__main__":
    sys.exit(main())
