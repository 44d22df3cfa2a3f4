"""Crash-point campaign for records: kill `vckpt verify`, `vckpt flag` and `vckpt serve` at every write of a record.

    .venv/bin/python tools/crash_campaign.py --kills 20 --json /tmp/crash.json

A signed run (``VCKPT_SIGNING_KEY``) of five restorable checkpoints is made once by a 3-rank guarded job. For
each command, a first run counts the write-side events on the run's records (``tools/crashpoint.py``: a file
opened for writing, a write, an fsync, a rename into place); then, on a fresh copy of the run each time, the
command is SIGKILLed at event 1, 2, ... (``--kills`` in all, cycling through the events, and through several
flag requests for ``flag``). After each kill, with the key still set:

* *locked*: the run is locked if ``vckpt status`` reports an open incident that no flag put there (an untrusted
  incident: a damaged record read as one) or cannot read a record;
* *half-written*: any record listed that does not parse;
* *wrong target*: ``vckpt rollback --dry-run`` does not choose the newest restorable checkpoint.

Every count must be 0. The figures go in docs/SECURITY.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KEY = "crash-campaign-signing-key-0123456789abcdef"


def make_run(run: str, checkpoints: int = 5) -> None:
    """Restorable checkpoints at steps 4, 8, ... from a 3-rank guarded job, every record signed."""
    cmd = [sys.executable, os.path.join(ROOT, "examples", "ddp_train.py"), "--world-size", "3", "--steps",
           str(4 * checkpoints), "--save-every", "4", "--audit-every", "4", "--consensus-every", "4", "--run", run, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env(), check=False)
    if done.returncode != 0:
        raise SystemExit(f"making the run failed: {done.stderr[-2000:]}")


def env() -> dict[str, str]:
    return {**os.environ, "VCKPT_SIGNING_KEY": KEY, "OMP_NUM_THREADS": "1"}


def command(name: str, run: str, variant: int, port: int) -> list[str]:
    if name == "verify":
        return ["verify", run, "--all"]
    if name == "flag":
        return ["flag", run, "--from-step", str(21 + variant), "--reason", f"crash campaign {variant}"]
    return ["serve", run, "--port", str(port), "--poll", "0.1", "--scrub-interval", "3600"]


def run_once(name: str, run: str, kill_at: int, variant: int = 0) -> tuple[int, str]:
    """Run the command with its kill point armed; (return code, stderr). ``serve`` is stopped after its first
    pass (when it has not died first)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, os.path.join(HERE, "crashpoint.py"), str(kill_at), run, "--", "vckpt",
           *command(name, run, variant, port)]
    if name != "serve":
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env(), check=False)
        return done.returncode, done.stderr
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env())
    verified = os.path.join(run, "records", "verification")
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:  # its pass: a verification record per checkpoint
        if os.path.isdir(verified) and len([n for n in os.listdir(verified) if n.endswith(".json")]) >= 2 * len(
                os.listdir(os.path.join(run, "checkpoints"))):
            break
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


def judge(run: str, flagged: bool) -> dict[str, Any]:
    """What a reader sees after the kill (the key still set): locked, half-written, the rollback target."""
    sys.path.insert(0, ROOT)
    from verified_ckpt import CheckpointManager
    from verified_ckpt.records import KINDS
    from verified_ckpt.store import RunStore

    mgr = CheckpointManager(run, signing_key=KEY.encode())
    view = mgr.view()
    untrusted = [i for i in view.incidents if not i.trusted]
    unexpected = [i for i in view.incidents if i.trusted and not (flagged and i.kind == "manual")]
    store = RunStore(run)
    half = [s.name for k in KINDS for s in store.records.listing(k) if s.problem is not None]
    target, _ = view.rollback_target()
    newest = max(i.step for i in view.infos)
    wrong = target is None or (target.step != newest and not (flagged and view.incidents))
    return {"locked": bool(untrusted or view.unreadable or unexpected), "half_written": len(half),
            "wrong_target": bool(wrong), "target": target.step if target else None}


def campaign(kills: int, base: str, work: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("verify", "flag", "serve"):
        probe = os.path.join(work, f"{name}-count")
        shutil.copytree(base, probe)
        _, err = run_once(name, probe, 0)
        events = int(next((line.split()[-1] for line in err.splitlines() if line.startswith("crashpoint events:")), "0"))
        if name == "serve":  # stopped by SIGTERM after its pass: count what its pass wrote instead
            events = max(events, 4 * 5)
        rows = []
        for k in range(kills):
            point, variant = k % max(events, 1) + 1, k // max(events, 1)
            trial = os.path.join(work, f"{name}-{k}")
            shutil.copytree(base, trial)
            rc, _ = run_once(name, trial, point, variant)
            rows.append({"kill_at": point, "rc": rc, **judge(trial, name == "flag")})
            shutil.rmtree(trial)
        out[name] = {"events": events, "kills": len(rows), "killed": sum(r["rc"] == -signal.SIGKILL for r in rows),
                     "locked": sum(r["locked"] for r in rows), "half_written": sum(r["half_written"] for r in rows),
                     "wrong_target": sum(r["wrong_target"] for r in rows), "rows": rows}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        base = os.path.join(work, "base")
        make_run(base)
        out = campaign(args.kills, base, work)
    for name, r in out.items():
        print(f"{name:<7} {r['events']:>3} write events, {r['kills']} kills ({r['killed']} by SIGKILL): locked "
              f"{r['locked']}, half-written listed {r['half_written']}, wrong rollback target {r['wrong_target']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
