"""`make demo-recovery`: recovery without a person, on this machine.

1. A 3-rank DDP job under real `torchrun` (loopback), run by `vckpt supervise`. Its first attempt computes a
   wrong gradient on rank 1 at step 7 (the guard's own injection): caught before the update, the job stops with
   the verdict (torchrun's summary shows it), and the supervisor reads it from the run: exit 4, this host named.
2. The supervisor hands the host to its `--on-exclude` hook (here it only prints it; on Slurm it would extend
   `--exclude`, on Kubernetes cordon the node) and restarts the job, which resumes from the rollback target.
3. `vckpt status` and `vckpt node-health` before and after; `vckpt replay` of the incident on this host, once as
   it is (the fault was transient: not reproduced) and once with the fault simulated (reproduced: replace the node).
4. The final weights fingerprint beside the same job run clean: they are equal.

Set VCKPT_DEMO_DIR to keep the runs.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
VCKPT = os.path.join(os.path.dirname(PY), "vckpt")
FAULT = "grad:1:7:scale=10"
ARGS = "--steps 9 --save-every 3 --resume --json"


def show(*cmd: str) -> subprocess.CompletedProcess[str]:
    print(f"\n$ {' '.join(cmd).replace(VCKPT, 'vckpt')}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    print((done.stdout + done.stderr).rstrip(), flush=True)
    print(f"(exit {done.returncode})", flush=True)
    return done


def main() -> int:
    keep = os.environ.get("VCKPT_DEMO_DIR")
    root = keep or tempfile.mkdtemp(prefix="vckpt-recovery-")
    os.makedirs(root, exist_ok=True)
    run, clean = os.path.join(root, "supervised"), os.path.join(root, "clean")
    for path in (run, clean):
        shutil.rmtree(path, ignore_errors=True)
    port = f"$({PY} -c 'import socket; s=socket.socket(); s.bind((\"127.0.0.1\", 0)); print(s.getsockname()[1])')"
    job = (f'if [ "$VCKPT_ATTEMPT" = 0 ]; then set -- --inject {FAULT}; fi; exec {PY} -m torch.distributed.run '
           f'--nproc-per-node 3 --master-addr 127.0.0.1 --master-port {port} {HERE}/ddp_train.py --run-url {run} '
           f'{ARGS} "$@"')
    hook = "echo 'on-exclude hook: keep the job off' {hosts}"
    print("== a supervised 3-rank torchrun job; attempt 0 computes a wrong gradient on rank 1 at step 7", flush=True)
    sup = show(VCKPT, "supervise", "--run", run, "--backoff", "1", "--on-exclude", hook, "--", "sh", "-c", job)
    print("\n== what the run says now", flush=True)
    show(VCKPT, "status", run)
    show(VCKPT, "node-health", run)
    incident = json.loads(subprocess.run([VCKPT, "incidents", run, "--json"], capture_output=True, text=True,
                                         check=False).stdout or "[]")
    if incident:
        ident = incident[-1]["id"]
        print(f"\n== replaying incident {ident} on {socket.gethostname()}", flush=True)
        model = f"{HERE}/ddp_train.py:replay_model"
        show(VCKPT, "replay", run, "--incident", ident, "--model", model)
        show(VCKPT, "replay", run, "--incident", ident, "--model", model, "--inject", FAULT)
    print("\n== the same job, clean", flush=True)
    ref = subprocess.run([PY, f"{HERE}/ddp_train.py", "--world-size", "3", "--run", clean, *ARGS.split()],
                         capture_output=True, text=True, check=False)
    lines = [x for x in sup.stdout.splitlines() if x.startswith("{")]
    got = json.loads(lines[-1])["fingerprint"] if lines else None
    want = json.loads(ref.stdout.strip().splitlines()[-1])["fingerprint"] if ref.returncode == 0 else None
    print(f"supervised job's final weights {got}\nclean job's final weights      {want}\n"
          f"{'EQUAL: recovered bit for bit, no one woken' if got and got == want else 'DIFFERENT'}", flush=True)
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if sup.returncode == 0 and got and got == want else 1


if __name__ == "__main__":
    sys.exit(main())
