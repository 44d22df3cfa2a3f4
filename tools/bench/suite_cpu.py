"""Where a command's CPU time goes, by the kind of process that spent it: every process on the machine sampled from
``/proc`` while the command runs (its user and system time at its last sample), grouped by what it is. Written for the
test suite, whose time on this 2-core machine is bound by its CPU (issue 51's fourteenth turn): the busy CPU seconds
of ``/proc/stat`` around the command, then each kind's seconds and share.

A process that lives less than a sampling period is missed, and one killed between two samples loses what it spent
after the last: the kinds' sum falls a little short of the busy total (the rest is the kernel and such misses).

    .venv/bin/python tools/bench/suite_cpu.py -- .venv/bin/python -m pytest -q -n 2 --dist loadfile \\
        --no-loadscope-reorder -p no:cacheprovider
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import time

TICK = os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class Proc:
    cmd: str
    ppid: int
    cpu: float = 0.0  # user and system seconds at its last sample


# (kind, a pattern of its own command line, one of its grandparent's or None), the first rule both match wins: a
# harness rank is a forkserver's child like any forked rank, and only its grandparent (a pytest process) tells it
KINDS: list[tuple[str, str, str | None]] = [
    ("this sampler", r"suite_cpu\.py", None),
    ("ranks of tests/dist_harness.py (forked from a pytest process's forkserver)", r"forkserver",
     r"exec\(eval\(sys\.stdin|-m pytest"),
    ("other forkservers and their ranks (tools/ranks.py, examples' local launches)", r"forkserver", None),
    ("the pytest-xdist workers (in-process tests)", r"exec\(eval\(sys\.stdin", None),
    ("torchrun agents", r"torch\.distributed\.run", None),
    ("the CLI and vckpt serve", r"verified_ckpt_cli|vckpt ", None),
    ("Triton interpreter children", r"interpreted\(", None),
    ("Dask workers", r"dask|spawn_main", None),
    ("SeaweedFS, Chromium, prometheus", r"weed|chrom|prometheus", None),
    ("pytest's main process", r"-m pytest", None),
    ("other Python children (torchrun-launched ranks, stories, crash points, scripts)", r"python|\.py", None),
]


def _busy() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v[i] for i in (0, 1, 2, 5, 6, 7)) / TICK  # user, nice, system, irq, softirq, steal


def _sample(seen: dict[tuple[int, int], Proc]) -> None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            key = (int(pid), int(rest[19]))  # the pid and its start time: a reused pid is another process
            entry = seen.get(key)
            if entry is None:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                entry = seen[key] = Proc(cmd, int(rest[1]))
            entry.cpu = (int(rest[11]) + int(rest[12])) / TICK
        except (OSError, IndexError, ValueError):
            continue  # gone between the listing and the read


def kind_of(cmd: str, grandparent: str) -> str:
    for kind, own, above in KINDS:
        if re.search(own, cmd) and (above is None or re.search(above, grandparent)):
            return kind
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=float, default=0.2, help="seconds between samples")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    seen: dict[tuple[int, int], Proc] = {}
    _sample(seen)
    before = {k: v.cpu for k, v in seen.items()}  # processes already running: only what they spend from now counts
    busy0, t0 = _busy(), time.monotonic()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        _sample(seen)
        time.sleep(args.every)
    wall, busy = time.monotonic() - t0, _busy() - busy0
    by_pid = {pid: v for (pid, _), v in seen.items()}
    spent: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for key, p in seen.items():
        parent = by_pid.get(p.ppid)
        grandparent = by_pid.get(parent.ppid) if parent else None
        kind = kind_of(p.cmd, grandparent.cmd if grandparent else "")
        spent[kind] += p.cpu - before.get(key, 0.0)
        count[kind] += 1
    print(f"exit {proc.returncode}, {wall:.0f} s, {busy:.0f} busy CPU-s ({busy / wall:.2f} cores); by kind:")
    print("| kind | processes | CPU-s | share |\n|---|---|---|---|")
    total = sum(spent.values()) or 1.0  # nothing sampled: a command that ended before the first sample
    for kind, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {count[kind]} | {seconds:.1f} | {seconds / total:.0%} |")


if __name__ == "__main__":
    main()
