"""``vckpt``: inspect, verify and recover verified checkpoints from a shell.

Exit codes, the library's table (``verified_ckpt.exitcodes``, docs/CLI.md): 0 ok, 1 a check failed, 2 usage,
3 store unreachable, 4/5/6 an open SDC incident (hosts named / none named / software), 7 no rollback target.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from typing import TYPE_CHECKING, Any

import click

from verified_ckpt import (
    CheckpointNotRestorable,
    InvalidConfig,
    InvalidState,
    ManifestError,
    Status,
    StorageError,
    evidence_basis,
    render_html,
)

from .command import run_command
from .options import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, OneLineErrors, as_flags, parse_storage_options
from .output import Output, escape, human_size, status_text
from .recovery import register

if TYPE_CHECKING:  # imported by the command that runs: --help needs no run machinery (tests/test_cli_startup.py)
    from verified_ckpt import CheckpointManager

SIGNATURE_TEXT = {
    "valid": "[green]valid[/] (HMAC-SHA256, key configured)",
    "unsigned": "[yellow]unsigned[/] (no signing key configured; see docs/SECURITY.md)",
    "unchecked": "[yellow]signed, not checked[/] (set VCKPT_SIGNING_KEY to check it)",
    "missing": "[bold red]MISSING[/] (a key is configured but the manifest is unsigned)",
    "invalid": "[bold red]INVALID[/] (edited after signing, or another key)",
}


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="verified-ckpt")
def main() -> None:
    """Inspect, verify and recover verified checkpoints. RUN is any fsspec URL."""


@main.command("list")
@run_command
@click.option("--restorable", is_flag=True, help="Only checkpoints that may be restored.")
def list_cmd(mgr: CheckpointManager, out: Output, restorable: bool) -> int:
    """List committed checkpoints, oldest first."""
    view = mgr.view()
    infos = view.infos
    if not infos:
        mgr.require_run()
    _warn_unreadable(out, view.unreadable)
    if restorable:
        infos = [i for i in infos if i.status is Status.RESTORABLE]
    rows = [i.to_dict() for i in infos]

    def human(console: Any) -> None:
        if not rows:
            console.print("no checkpoints" + (" are restorable" if restorable else ""))
            return
        console.print(out.table(f"checkpoints in {mgr.url}", ["step", "status", "size", "created_at", "id"],
                                [[r["step"], r["status"], human_size(r["size_bytes"]),
                                  r["created_at"][:19].replace("T", " "), r["id"]]
                                 for r in rows]))
        for r in rows:
            if r["status"] != "restorable" and r["reasons"]:
                console.print(f"  {r['id']}: {escape(r['reasons'][-1])}")

    out.emit(rows, human)
    return EXIT_OK


@main.command("show")
@run_command
@click.argument("step")
def show_cmd(mgr: CheckpointManager, out: Output, step: str) -> int:
    """Show a checkpoint's manifest and derived status. STEP is a step number or a checkpoint id."""
    info = mgr.get(int(step) if step.isdigit() else step)
    if info.manifest is None:
        raise ManifestError(info.reasons[0])
    m = info.manifest.to_dict()
    data = {"manifest": m, "status": info.status.value, "reasons": info.reasons, "signature": info.signature}

    def human(console: Any) -> None:
        console.print(f"[bold]{info.id}[/]  step {info.step}  status {status_text(info.status.value)}")
        console.print(f"  signature: {SIGNATURE_TEXT.get(info.signature, info.signature)}")
        for r in info.reasons:
            console.print(f"  reason: {escape(r)}")
        console.print(f"  run {m['run_id']}  created {m['created_at']}  size {human_size(info.size_bytes)}")
        console.print(f"  state fingerprint {m['state_fingerprint']}  world size {m['topology'].get('world_size')}")
        console.print(f"  evidence basis: {escape(evidence_basis(m['evidence']))}")
        for fault_class, how in (m["evidence"] or {}).get("checked_by_class", {}).items():
            console.print(f"  checked since the previous checkpoint, {escape(fault_class)}: {escape(how)}")
        console.print(f"  evidence: {json.dumps(m['evidence'], sort_keys=True) if m['evidence'] else 'none'}")
        console.print(out.table(None, ["shard", "size", "blake3", "tensors"],
                                [[s["path"], human_size(s["size"]), s["digest"][:16] + "…", len(s["tensors"])]
                                 for s in m["shards"]]))

    out.emit(data, human)
    return EXIT_OK


@main.command("verify")
@run_command
@click.option("--step", type=int, default=None, help="Only this step.")
@click.option("--all", "every", is_flag=True, help="Every checkpoint (the default without --step).")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True, help="Checkpoints verified at once.")
@click.option("--depth", type=click.Choice(["read", "head"]), default="read", show_default=True,
              help="read: every byte, digests and fingerprints; head: each shard's size and the checksum the store "
                   "keeps (S3's CRC-64/NVME), from its metadata alone, no byte read.")
@click.option("--dask", "dask_at", default=None, metavar="ADDRESS|local",
              help="Read on a Dask cluster (a scheduler address, or 'local' for a LocalCluster of --jobs workers); this "
                   "process records the results. Needs the dask extra.")
def verify_cmd(mgr: CheckpointManager, out: Output, step: int | None, every: bool, jobs: int, depth: str,
               dask_at: str | None) -> int:
    """Re-read checkpoints, recompute digests and fingerprints, cross-check the ledger, and record the result
    (--depth head: check what the store keeps of each shard instead, reading no byte)."""
    if every and step is not None:
        raise click.UsageError("give --step N or --all, not both")
    if depth == "head":
        results = mgr.verify(step, jobs=jobs, depth="head")
    else:
        from verified_ckpt import dask_client

        cluster = dask_client(dask_at, jobs) if dask_at else contextlib.nullcontext()
        with cluster as client, out.progress(mgr.total_bytes(step), "verifying") as advance:
            results = mgr.verify(step, jobs=jobs, progress=advance, cluster=client)
    rows = [{**r.to_dict(), "depth": r.depth, **({"coverage": r.coverage} if r.coverage else {})} for r in results]

    def human(console: Any) -> None:
        for r in rows:
            mark = "[green]ok[/]" if r["ok"] else "[bold red]FAILED[/]"
            console.print(f"{mark}  step {r['step']}  {r['id']}" + (f"  ({escape(r['coverage'])})" if "coverage" in r else ""))
            for p in r["problems"]:
                console.print(f"      {escape(str(p))}")
        bad = sum(not r["ok"] for r in rows)
        sized = [n for r in rows if (n := size_alone(r.get("coverage")))]
        # A head check that compared sizes alone cannot see a same-size change: the summary says so, not only the
        # coverage beside each line, lest "0 failed" read as more than was checked.
        console.print(f"{len(rows)} checked, {bad} failed" + (
            f"; {sum(sized)} shard(s) of {len(sized)} checkpoint(s) checked by their size alone (the store keeps no "
            "checksum for them): a same-size change there is seen only by a read (`vckpt verify`)" if sized else ""))

    out.emit(rows, human)
    return EXIT_CHECK_FAILED if any(not r["ok"] for r in rows) else EXIT_OK


def size_alone(coverage: str | None) -> int:
    """How many shards a head check's ``coverage`` (``verification.head_all``'s words) says it checked by size alone."""
    found = re.search(r"the size alone of (\d+)", coverage or "")
    return int(found.group(1)) if found else 0


@main.command("ledger")
@run_command
def ledger_cmd(mgr: CheckpointManager, out: Output) -> int:
    """Summarise the run's check history: counts, last unanimous consensus, divergences, audits."""
    summary = mgr.ledger_summary()

    def human(console: Any) -> None:
        span = summary["steps"]
        console.print(f"{summary['rows']} events" + (f", steps {span[0]}..{span[1]}" if span else ""))
        console.print(out.table("checks", ["kind", "checks", "failed"],
                                [[k, c["checks"], c["failed"]] for k, c in summary["counts"].items()]))
        for c in summary["coverage"][-1:]:
            console.print(f"ABFT coverage (step {c['step']}): {c['params']:.0%} of parameters, "
                          f"{c['flops']:.0%} of backward FLOPs")
        for p in summary.get("schedule", [])[-1:]:
            console.print(f"budget schedule (step {p['step']}): consensus every {p['consensus_every'] or '-'}, audit every "
                          f"{p['audit_every'] or '-'} steps, ABFT on {p['abft_share']:.0%} of steps, expected overhead "
                          f"{p['overhead']:.1%}")
        last = summary["last_unanimous_consensus"]
        console.print(f"last unanimous consensus: {'step ' + str(last) if last is not None else 'none'}")
        if summary["divergence"]:
            console.print(out.table("divergence points", ["step", "check", "ranks"],
                                    [[d["step"], d["kind"], ",".join(map(str, d["ranks"])) or "unnamed"]
                                     for d in summary["divergence"]]))
        else:
            console.print("no divergence recorded")
        audits = summary["audits"]
        shown = audits[-20:]
        console.print(out.table(f"audits ({len(audits)}, last {len(shown)} shown)", ["step", "audited ranks", "result"],
                                [[a["step"], ",".join(map(str, a["audited_ranks"])),
                                  "disputed " + ",".join(map(str, a["disputed_ranks"])) if a["failed"] else "agreed"]
                                 for a in shown]))

    out.emit(summary, human)
    return EXIT_OK


@main.command("report")
@run_command
@click.option("--out", "dest", required=True, help="HTML file to write.")
def report_cmd(mgr: CheckpointManager, out: Output, dest: str) -> int:
    """Write a self-contained HTML picture of the run: timeline, checkpoints, incidents, rollback target."""
    data = mgr.history_report()
    page = render_html(data)
    try:
        with open(dest, "w", encoding="utf-8") as f:
            f.write(page)
    except (IsADirectoryError, NotADirectoryError, FileNotFoundError) as e:
        raise InvalidState(f"cannot write {dest!r}: {e.strerror}; choose a file path in an existing folder") from None
    except OSError as e:  # permissions, a full disk, I/O errors: the destination, not the command, failed
        raise StorageError(f"cannot write {dest!r}: {e.strerror}; free some space or choose a writable path") from None
    summary = {"out": dest, "checkpoints": len(data["checkpoints"]), "incidents": len(data["incidents"]),
               "steps": len(data["steps"]["step"]), "rollback_target": data["rollback_target"]}
    out.emit(summary, lambda c: c.print(f"wrote {dest}: {summary['steps']} steps, {summary['checkpoints']} checkpoints, "
                                        f"{summary['incidents']} incidents"))
    return EXIT_OK


@main.command("flag")
@run_command
@click.option("--from-step", type=int, required=True, help="First suspect step.")
@click.option("--to-step", type=int, default=None, help="Last suspect step (default: open-ended).")
@click.option("--rank", "ranks", type=int, multiple=True, help="Suspect rank (repeatable).")
@click.option("--reason", required=True, help="Why these steps are flagged.")
def flag_cmd(mgr: CheckpointManager, out: Output, *, from_step: int, to_step: int | None, ranks: tuple[int, ...],
             reason: str) -> int:
    """Flag an incident by hand: checkpoints in the interval become suspect."""
    inc = mgr.flag(from_step, to_step=to_step, ranks=ranks, reason=reason)
    flagged = mgr.view().flagged_by(inc)

    def human(console: Any) -> None:
        span = f"{from_step}..{to_step}" if to_step is not None else f"{from_step}.."
        console.print(f"flagged steps {span} as incident {inc.id}; {len(flagged)} checkpoint(s) now suspect")

    out.emit({**inc.to_row(), "suspect_checkpoints": [i.id for i in flagged]}, human)
    return EXIT_OK


def _warn_unreadable(out: Output, unreadable: list[str]) -> None:
    """Records that could not be read are never dropped silently (docs/SECURITY.md)."""
    for why in unreadable:
        out.err.print(f"[yellow]warning:[/] {escape(why)}; it is ignored (no signing key is configured) - "
                      "inspect or remove it", markup=True, highlight=False)


@main.command("incidents")
@run_command
def incidents_cmd(mgr: CheckpointManager, out: Output) -> int:
    """List incidents and the hosts to exclude from scheduling."""
    mgr.require_run()
    view = mgr.view()
    rows = [dict(r.to_row(), answered=a) for r, a in zip(view.incidents, view.answered(), strict=True)]
    _warn_unreadable(out, view.unreadable)

    def human(console: Any) -> None:
        if not rows:
            console.print("no incidents")
            return
        console.print(out.table(f"incidents in {mgr.url}", ["id", "kind", "detected", "suspect from", "ranks", "hosts",
                                                             "answered", "reason"],
                                [[r["id"], r["kind"], r["detected_step"], r["first_suspect_step"],
                                  ",".join(map(str, r["ranks"])) or "-", ",".join(r["hosts"]) or "-",
                                  "yes" if r["answered"] else "no", r["reason"]] for r in rows]))
        for r in rows:
            if r["signature"] in ("missing", "invalid"):
                console.print(f"[bold red]incident {escape(str(r['id']))}: signature {r['signature']}[/] - not trusted "
                              "(edited, or unreadable where a signed record belongs); it covers the whole run until it is "
                              "removed (docs/SECURITY.md)")
        hosts = view.exclude_hosts()  # the suspect hosts: what `vckpt status`, node-health and the service say
        if view.health().hosts_unknown:  # an untrusted incident could have named any host: never "none"
            console.print(f"exclude from scheduling: {' '.join(hosts) + ' and ' if hosts else ''}unknown (an open "
                          "incident cannot be trusted and could have named any host)")
        elif hosts:
            console.print("exclude from scheduling: " + " ".join(hosts))
        else:  # a rollback answers incidents for checkpoints; only a replay or clear-host clears a host
            console.print("exclude from scheduling: none (no incident names a host that was not cleared since)")

    out.emit(rows, human)
    return EXIT_OK


@main.command("rollback")
@run_command
@click.option("--dry-run", is_flag=True, help="Only choose; record nothing.")
def rollback_cmd(mgr: CheckpointManager, out: Output, dry_run: bool) -> int:
    """Choose the newest restorable checkpoint before every flagged interval and record the rollback."""
    try:
        target, skipped = mgr.record_rollback(dry_run=dry_run)
    except CheckpointNotRestorable as e:
        out.emit({"id": None, "step": None, "error": str(e)}, lambda c: None)
        raise
    data = {"id": target.id, "step": target.step, "recorded": not dry_run,
            "skipped": [{"id": cid, "step": st, "why": why} for cid, st, why in skipped]}

    def human(console: Any) -> None:
        console.print(f"roll back to [bold]{target.id}[/] (step {target.step})"
                      + ("" if dry_run else "; rollback recorded, checkpoints saved from now on form a new lineage"))
        for cid, st, why in skipped:
            console.print(f"  skipped {cid} (step {st}): {escape(why)}")
        console.print(f"resume the job with CheckpointManager.resume(state) (examples: --resume), or export with "
                      f"`vckpt export {mgr.url} --step {target.step} --to DIR`")

    out.emit(data, human)
    return EXIT_OK


@main.command("status")
@run_command
def status_cmd(mgr: CheckpointManager, out: Output) -> int:
    """One line of health for schedulers: open incidents, hosts to exclude, rollback target, newest restorable.

    Exit 0 when no incident is open; with open incidents, 4 when they name hosts (exclude them, restart with
    resume()), 5 when they name none, 6 for software divergence (no host to blame); 1 when checkpoints exist
    but none is restorable.
    """
    mgr.require_run()
    view = mgr.view()
    health = view.health()
    _warn_unreadable(out, view.unreadable)
    out.emit(health.to_dict(), lambda console: console.print(health.line(), markup=False))
    return health.code


@main.command("export")
@run_command
@click.option("--step", type=int, default=None, help="Step to export (default: the rollback target).")
@click.option("--to", "dest", required=True, help="Local folder to write to (new or empty).")
@click.option("--format", "fmt", type=click.Choice(["native", "hf"]), default="native", show_default=True,
              help="native: safetensors shards + manifest; hf: model.safetensors + config.json for from_pretrained.")
@click.option("--allow-unverified", is_flag=True, help="Also accept an unverified checkpoint (never suspect or corrupt).")
def export_cmd(mgr: CheckpointManager, out: Output, step: int | None, dest: str, fmt: str, allow_unverified: bool) -> int:
    """Export a verified checkpoint to a local folder, every byte verified on the way out (`restore` is an alias)."""
    with out.progress(mgr.total_bytes(step) if step is not None else 0, "exporting"):
        info = mgr.export(dest, step=step, allow_unverified=allow_unverified, format=fmt)
    data = {"id": info.id, "step": info.step, "status": info.status.value, "to": dest, "format": fmt}
    out.emit(data, lambda c: c.print(f"exported {info.id} (step {info.step}, {info.status.value}) to {dest} as {fmt}"))
    return EXIT_OK


main.add_command(export_cmd, "restore")  # the name earlier versions used


@main.command("gc")
@run_command
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@click.option("--grace", type=float, default=3600.0, show_default=True, help="Only objects older than this many seconds.")
def gc_cmd(mgr: CheckpointManager, out: Output, dry_run: bool, grace: float) -> int:
    """Remove orphaned shards and temporary objects (never anything a manifest references)."""
    notes: list[str] = []
    removed = mgr.gc(grace_s=grace, dry_run=dry_run, on_note=notes.append)
    for n in notes:
        out.err.print(f"[yellow]warning:[/] {escape(n)}")
    verb = "would remove" if dry_run else "removed"
    out.emit({"removed": removed, "dry_run": dry_run, "notes": notes},
             lambda c: c.print(f"{verb} {len(removed)} object(s)" + "".join(f"\n  {p}" for p in removed)))
    return EXIT_OK



@main.command("serve")
@click.argument("runs", nargs=-1)
@click.option("--discover", multiple=True, metavar="PREFIX", help="Also watch every run directly under PREFIX (repeatable).")
@click.option("--storage-option", "-o", "storage_options", multiple=True, metavar="KEY=VALUE",
              help="fsspec storage option for every run (repeatable).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; not loopback needs a token.")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535))
@click.option("--poll", "poll_s", default=10.0, show_default=True, type=float, help="Seconds between looks at each run.")
@click.option("--scrub-interval", "scrub_s", default=86400.0, show_default=True, type=float,
              help="Re-read every checkpoint this often (seconds).")
@click.option("--head-interval", "head_s", default=3600.0, show_default=True, type=float,
              help="Between re-reads, check every checkpoint's shards against what the store keeps of them (size and "
                   "S3's CRC-64/NVME, no byte read) this often (seconds; 0: never).")
@click.option("--bandwidth", "bytes_per_s", default=0.0, show_default=True, type=float,
              help="Cap on bytes read per second across all runs (0: none).")
@click.option("--request-timeout", "request_s", default=10.0, show_default=True, type=float,
              help="Close a connection that has not sent a whole request within this many seconds.")
@click.option("--concurrency", default=2, show_default=True, type=click.IntRange(min=1),
              help="Runs read at the same time (each two checkpoints at a time); with --dask local, the workers.")
@click.option("--dask", "dask_at", default=None, metavar="ADDRESS|local",
              help="Read on a Dask cluster (a scheduler address, or 'local' for a LocalCluster); the service records "
                   "the results. Needs the dask extra.")
def serve_cmd(runs: tuple[str, ...], discover: tuple[str, ...], storage_options: tuple[str, ...], host: str, port: int,
              poll_s: float, scrub_s: float, head_s: float, bytes_per_s: float, request_s: float, concurrency: int,
              dask_at: str | None) -> None:
    """Watch RUNS: verify each new commit independently, scrub old checkpoints, serve health over HTTP.

    JSON API under /api, Prometheus metrics at /metrics, /healthz, /readyz and a dashboard at /.
    The write endpoints (flag, rollback) need the bearer token from VCKPT_SERVICE_TOKEN or
    VCKPT_SERVICE_TOKEN_FILE. Details: docs/SERVICE.md. Exit 2 on a configuration it refuses.
    """
    from verified_ckpt.service import ServiceConfig, ServiceError, missing_extra, serve

    err = Output(False).err
    try:
        cfg = ServiceConfig(runs=runs, discover=discover, storage_options=parse_storage_options(storage_options) or None,
                            host=host, port=port, poll_s=poll_s, scrub_interval_s=scrub_s, head_interval_s=head_s,
                            bytes_per_s=bytes_per_s, request_timeout_s=request_s, concurrency=concurrency, dask=dask_at)
        missing_extra()
    except ServiceError as e:
        err.print(f"[red]error:[/] {escape(as_flags(str(e)))}", markup=True, highlight=False)
        sys.exit(EXIT_USAGE)
    try:
        serve(cfg, log_to_stderr=True)
    except InvalidConfig as e:  # the Dask cluster it was told to read on cannot be reached, or Dask is missing
        err.print(f"[red]error:[/] {escape(as_flags(str(e)))}", markup=True, highlight=False)
        sys.exit(EXIT_USAGE)


register(main)

if __name__ == "__main__":
    main()
