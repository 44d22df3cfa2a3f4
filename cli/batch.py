"""``vckpt batch-manifest`` and ``vckpt batch-record``: a deep scrub at rest by S3 Batch Operations ("Compute
checksum"), which the user starts (credentials, an IAM role, the cost: docs/SERVICE.md): its manifest out, its
completion report back in as verification records."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from .command import run_command
from .options import EXIT_CHECK_FAILED, EXIT_OK
from .output import Output, escape

if TYPE_CHECKING:
    from verified_ckpt import CheckpointManager

__all__ = ["batch_manifest_cmd", "batch_record_cmd"]


@click.command("batch-manifest")
@run_command
@click.option("--step", type=int, default=None, help="Only the checkpoints of this step (default: all).")
def batch_manifest_cmd(mgr: CheckpointManager, out: Output, step: int | None) -> int:
    """Print the S3 Batch Operations CSV manifest (bucket,key) of every shard, for a "Compute checksum" job with
    CRC64NVME and FULL_OBJECT (an S3 run only; exit 2 otherwise)."""
    text = mgr.batch().manifest(step)
    out.emit({"manifest_csv": text, "objects": text.count("\n")}, lambda console: click.echo(text, nl=False))
    return EXIT_OK


@click.command("batch-record")
@run_command
@click.argument("reports", nargs=-1, required=True)
def batch_record_cmd(mgr: CheckpointManager, out: Output, reports: tuple[str, ...]) -> int:
    """Join REPORTS, the completion report CSV files of a "Compute checksum" job (paths, fsspec URLs or globs), back
    into verification records: a checksum recomputed at rest that is not the manifest's makes its checkpoint corrupt
    (exit 1)."""
    batch = mgr.batch()
    results, malformed = batch.record(batch.read_reports(reports))
    rows = [{**r.to_dict(), "depth": r.depth, "coverage": r.coverage} for r in results]

    def human(console: Any) -> None:
        for r in rows:
            mark = "[green]ok[/]" if r["ok"] else "[bold red]FAILED[/]"
            console.print(f"{mark}  step {r['step']}  {r['id']}  ({escape(str(r['coverage']))})")
            for p in r["problems"]:
                console.print(f"      {escape(str(p))}")
        console.print(f"{len(rows)} checkpoint(s) recorded, {sum(not r['ok'] for r in rows)} failed"
                      + (f"; {malformed} malformed report row(s) left out" if malformed else ""))

    out.emit({"results": rows, "malformed_rows": malformed}, human)
    return EXIT_CHECK_FAILED if any(not r["ok"] for r in rows) else EXIT_OK
