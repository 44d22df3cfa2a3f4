"""The fault campaign at scale: thousands of independent trials on a Dask cluster, resumable, with outcome classes
against clean twins and 95 % intervals (``docs/FAULTS.md``, "Detection figures").

    .venv/bin/python tools/campaign.py --results campaign.jsonl                       # LocalCluster, the full plan
    .venv/bin/python tools/campaign.py --results campaign.jsonl --limit 200           # a part; run again to go on
    .venv/bin/python tools/campaign.py --results campaign.jsonl --dask tcp://sched:8786 --repo /shared/verified-ckpt
    .venv/bin/python tools/campaign.py --results campaign.jsonl --report              # the table, no trial run

The plan (``campaign_trials.plan``) is fixed by ``--seed``, ``--group`` and ``--steps``: the same arguments give the
same trials, each reproducible from its seeds. Trials run in chunks, one chunk a Dask task (a job of ``--world``
gloo ranks, ``campaign_job.py``); this process is the only writer of ``--results``, one JSON line per trial, appended
and flushed as each chunk completes. A restarted campaign skips the trials already there, so a kill at any point
loses at most the chunks in flight and counts nothing twice. A worker lost mid-chunk is retried by Dask.

Workers elsewhere (``--dask ADDRESS``) need this repository at ``--repo`` and its environment; each chunk runs
``python campaign_job.py`` there as a process (a Dask worker's own process may not start children).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from campaign_trials import KINDS, plan  # noqa: E402

GROUPS = {"default": 100, "fmt=bf16": 30, "overhead=0.01": 30, "overhead=0.10": 30, "abft=budget": 30, "fmt=fp16": 30,
          "accum=2": 30, "abft_forward=1": 30}


def run_chunk(trials: list[dict[str, Any]], world: int, repo: str, timeout_s: float) -> list[dict[str, Any]]:
    """A Dask task: ``trials`` as one job of ``world`` ranks, in a process of its own; their results."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "trials.json"), os.path.join(tmp, "out.json")
        with open(src, "w") as f:
            json.dump(trials, f)
        job = subprocess.run([sys.executable, os.path.join(repo, "tools", "campaign_job.py"), "--trials", src, "--out",
                              out, "--world", str(world)], check=False, capture_output=True, text=True,
                             timeout=timeout_s)
        if job.returncode != 0:
            raise RuntimeError(f"campaign job exited {job.returncode}: {job.stderr[-600:]}")
        with open(out) as f:
            return list(json.load(f))


class ResultsError(ValueError):
    """A results file this tool did not write (a trial whose id is no string): one line naming the line, exit 2."""


def done(path: str) -> dict[str, dict[str, Any]]:
    """The trials already in the results file, by id (a torn last line, from a kill mid-write, is not a trial).

    Raises:
        ResultsError: a trial's id is not a string (a hand-edited or foreign file).
    """
    got: dict[str, dict[str, Any]] = {}
    if not os.path.exists(path):
        return got
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and "id" in r:
                if not isinstance(r["id"], str):
                    raise ResultsError(f"{path} line {n}: a trial id must be a string, got {type(r['id']).__name__} "
                                       "(this tool writes strings); fix or remove that line")
                got.setdefault(r["id"], r)
    return got


def repair(path: str) -> None:
    """Cut a torn last line (a kill mid-write) so the next append starts a line of its own."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def chunks(items: list[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def run(args: argparse.Namespace, trials: list[dict[str, Any]]) -> None:
    from distributed import as_completed
    from rich.progress import Progress

    repair(args.results)
    have = done(args.results)
    todo = [t for t in trials if t["id"] not in have]
    # Twins first: every trial's outcome needs its twin, and a part that stops early should leave them done.
    todo.sort(key=lambda t: t["kind"] not in ("clean", "plain"))
    if args.limit is not None:
        todo = todo[:args.limit]
    print(f"{len(trials)} trials planned, {len(have)} done, {len(todo)} to run now", flush=True)
    if not todo:
        return
    import dask

    from verified_ckpt.checkpoint.fleet import connect

    written = 0
    dask.config.set({"distributed.scheduler.allowed-failures": 2})  # a worker lost twice fails its chunk, not the run
    with connect(args.dask or "local", args.workers) as client:
        futures = [client.submit(run_chunk, c, args.world, args.repo, args.chunk_timeout, key=f"campaign-{c[0]['id']}",
                                 retries=1, pure=False) for c in chunks(todo, args.chunk)]
        with Progress() as bar, open(args.results, "a") as out:
            task = bar.add_task("trials", total=len(todo))
            for fut, result in as_completed(futures, with_results=True, raise_errors=False):  # type: ignore[no-untyped-call]
                if fut.status == "error":
                    bar.console.print(f"a chunk failed after its retry ({fut.exception()}); its trials run next time")
                    continue
                for r in result:
                    out.write(json.dumps(r) + "\n")
                    out.flush()
                    written += 1
                    if args.kill_after == written:  # the test's chosen point: a SIGKILL between two appends
                        os.fsync(out.fileno())
                        os.kill(os.getpid(), signal.SIGKILL)
                os.fsync(out.fileno())
                bar.advance(task, len(result))


def reproduce(args: argparse.Namespace, have: dict[str, dict[str, Any]], n: int) -> None:
    """Run ``n`` recorded trials again (a seeded sample) and say which results repeat: the training and the fault are
    fixed by the seeds; a budgeted check's step is not, since the budget schedules from measured costs."""
    import random

    sample = random.Random(args.seed).sample(sorted(have), min(n, len(have)))
    fields = ("caught", "ranks", "detected_step", "loss", "weights")
    again = run_chunk([{k: have[i][k] for k in PLANNED if k in have[i]} for i in sample], args.world, args.repo,
                      args.chunk_timeout)
    same: Counter[str] = Counter()
    for r in again:
        old = have[r["id"]]
        for f in fields:
            same[f] += old.get(f) == r.get(f)
        if any(old.get(f) != r.get(f) for f in fields):
            print(f"  {r['id']}: " + ", ".join(f"{f} {old.get(f)} -> {r.get(f)}" for f in fields
                                               if old.get(f) != r.get(f)))
    print(f"reproduced {len(again)} trials: " + ", ".join(f"{f} equal in {same[f]}" for f in fields))


PLANNED = ("id", "group", "seed", "kind", "steps", "site", "target", "rank", "step", "persistent", "mode")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", required=True, help="the JSON-lines file trials are appended to (and resumed from)")
    ap.add_argument("--group", action="append", metavar="NAME:N",
                    help="a group of trials and its trials per kind (default: " +
                    ", ".join(f"{g}:{n}" for g, n in GROUPS.items()) + ")")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--head-to-head", type=int, default=100, help="trials of each of the competitor's two cases")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=8, help="trials per Dask task (one job of --world ranks)")
    ap.add_argument("--chunk-timeout", type=float, default=1800.0)
    ap.add_argument("--limit", type=int, default=None, help="run at most this many pending trials, then stop")
    ap.add_argument("--dask", default=None, help="a Dask scheduler's address (default: a LocalCluster here)")
    ap.add_argument("--workers", type=int, default=1, help="LocalCluster workers (each job is --world processes)")
    ap.add_argument("--repo", default=os.path.dirname(HERE), help="this repository's path on the workers")
    ap.add_argument("--report", action="store_true", help="print the table from --results and run nothing")
    ap.add_argument("--json", dest="json_out", default=None, help="with --report: write the summary here")
    ap.add_argument("--reproduce", type=int, default=0, metavar="N",
                    help="with --report: run N recorded trials again here and compare their results")
    ap.add_argument("--kill-after", type=int, default=None, help=argparse.SUPPRESS)  # tests: SIGKILL after N appends
    args = ap.parse_args()
    groups = {g.rsplit(":", 1)[0]: int(g.rsplit(":", 1)[1]) for g in args.group} if args.group else GROUPS
    trials = plan(groups, world=args.world, steps=args.steps, seed=args.seed, kinds=args.kinds.split(","),
                  head_to_head=args.head_to_head)
    try:
        done(args.results)  # a file this tool cannot read is refused before any trial runs
    except ResultsError as e:
        ap.exit(2, f"campaign.py: {e}\n")
    if not args.report:
        run(args, trials)
    from campaign_report import report

    have = done(args.results)
    if args.reproduce:
        reproduce(args, have, args.reproduce)
    summary = report([have[t["id"]] for t in trials if t["id"] in have], args.world)
    print(summary["markdown"])
    counts = Counter(t["id"] in have for t in trials)
    print(f"\n{counts[True]} of {len(trials)} planned trials have results")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
