"""A 3-rank job under real ``torchrun`` on loopback, run by ``vckpt supervise``, against the same job run clean.

The supervised job's first attempt computes a wrong gradient on rank 1 at step 7 (the guard's own injection);
the supervisor reads the verdict from the run (exit 4, this host named), hands the host to its hook, restarts
the job, which resumes from the rollback target (step 6) with nothing injected, and the job finishes. Checked:
the hook received this host, the supervisor exited 0 after one restart, and the final weights fingerprint equals
the clean run's. Kept out of the test suite for its time here (three torchrun launches); prints one JSON line
and exits 1 when an expectation fails.

    .venv/bin/python tools/supervise_check.py
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(run: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
            "--master-port", str(port), os.path.join(ROOT, "examples", "ddp_train.py"), "--steps", "9",
            "--save-every", "3", "--run-url", run, "--resume", "--json", *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fingerprint(stdout: str) -> str | None:
    lines = [x for x in stdout.strip().splitlines() if x.startswith("{")]
    return json.loads(lines[-1])["fingerprint"] if lines else None


def main() -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        clean = subprocess.run(launch(os.path.join(tmp, "clean"), free_port()), capture_output=True, text=True,
                               timeout=300, env=env, check=False)
        run, hosts = os.path.join(tmp, "supervised"), os.path.join(tmp, "hosts")
        # The first attempt injects; the restart (VCKPT_ATTEMPT 1) resumes clean. Each attempt gets a fresh port.
        script = ('if [ "$VCKPT_ATTEMPT" = 0 ]; then set -- --inject grad:1:7:scale=10; fi; '
                  f'exec {" ".join(launch(run, 0))} "$@"')
        wrapper = os.path.join(tmp, "job.sh")
        with open(wrapper, "w") as f:
            f.write(script.replace("--master-port 0", "--master-port $(" + sys.executable + " -c 'import socket; "
                                   "s=socket.socket(); s.bind((\"127.0.0.1\", 0)); print(s.getsockname()[1])')"))
        hook = f"{sys.executable} -c \"import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + '\\n')\" " \
               f"{hosts} {{hosts}}"
        done = subprocess.run([sys.executable, "-m", "verified_ckpt_cli.main", "supervise", "--run", run, "--backoff",
                               "0", "--on-exclude", hook, "--", "sh", wrapper], capture_output=True, text=True,
                              timeout=600, env=env, check=False)
        excluded: list[str] = []
        if os.path.exists(hosts):
            with open(hosts) as f:
                excluded = f.read().split()
    got = {"clean": fingerprint(clean.stdout), "supervised": fingerprint(done.stdout), "exit": done.returncode,
           "excluded": excluded, "decisions": [x for x in done.stderr.splitlines() if x.startswith("vckpt supervise:")]}
    ok = (done.returncode == 0 and got["clean"] is not None and got["clean"] == got["supervised"]
          and excluded == [socket.gethostname()] and sum("restart (exit 4)" in d for d in got["decisions"]) == 1)
    print(json.dumps({"ok": ok, **got}))
    if not ok:
        print(clean.stderr[-2000:], done.stderr[-4000:], file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
