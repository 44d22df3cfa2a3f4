"""Exit-status campaign: do finished runs always exit with the code they mean?

    .venv/bin/python tools/exit_status.py --runs 50

Runs ``--runs`` times each of: the example job stopping on an incident (exit 4
expected), and a ``make demo``-style pair (a clean run, then a faulty run that
rolls back in-process, exit 0 expected), all as separate processes with 3 gloo
ranks. Counts exit codes and any native abort ("terminate called", SIGABRT)
in the output, and prints one line per kind. Exit 1 if any run ended otherwise
than expected.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "ddp_train.py")
COMMON = ["--world-size", "3", "--steps", "30", "--save-every", "10", "--audit-every", "5", "--consensus-every", "5"]
KINDS = {
    "incident stop (exit 4)": (4, ["--inject", "grad:1:13:scale=10"]),
    "demo clean (exit 0)": (0, []),
    "demo rollback (exit 0)": (0, ["--inject", "grad:1:23:scale=10", "--on-incident", "rollback"]),
}


def one(expected: int, extra: list[str]) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, EXAMPLE, *COMMON, "--run", os.path.join(tmp, "run"), "--json", *extra],
                              capture_output=True, text=True, timeout=600, check=False)
    aborted = proc.returncode in (-6, 134) or "terminate called" in proc.stderr
    outcome = "abort" if aborted else "ok" if proc.returncode == expected else f"exit {proc.returncode}"
    return outcome, proc.stderr[-2000:] if outcome != "ok" else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    bad = 0
    for name, (expected, extra) in KINDS.items():
        counts: collections.Counter[str] = collections.Counter()
        for i in range(args.runs):
            outcome, err = one(expected, extra)
            counts[outcome] += 1
            if outcome != "ok":
                bad += 1
                print(f"  {name} run {i + 1}: {outcome}\n{err}", flush=True)
        print(f"{name}: {args.runs} runs, " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
