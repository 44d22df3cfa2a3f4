"""``vckpt node-health``, ``vckpt clear-host`` and ``vckpt supervise``: what a cluster's health tooling, the
operator who checked a node, and a job's wrapper call.

``node-health`` follows a Node-Problem-Detector custom plugin's convention: exit 0 healthy, 1 problem, anything
else unknown (here 2 for a usage error, 3 for a store that cannot be read, 8 for an open incident that cannot be
trusted and so could have named this host), with one line on stdout. A host stays suspect until evidence clears it:
a replay on it that does not reproduce the step (``vckpt replay`` records it), or ``clear-host``, an operator's
word with a reason, recorded (signed in a signed run). A rollback never does.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from verified_ckpt import VerifiedCkptError
from verified_ckpt.recovery import HOST_GRAMMAR, host_problem, local_host, node_health, supervise

from .options import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, as_flags, exit_code_for, parse_storage_options

__all__ = ["clear_host_cmd", "node_health_cmd", "register", "supervise_cmd"]

STORAGE_HELP = "fsspec storage option (repeatable); AWS_* environment variables also apply."


@click.command("node-health")
@click.argument("runs", nargs=-1, required=True)
@click.option("--host", default=None, help="The host to ask about (default: this machine's name).")
@click.option("--storage-option", "-o", "storage_options", multiple=True, metavar="KEY=VALUE", help=STORAGE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def node_health_cmd(runs: tuple[str, ...], host: str | None, storage_options: tuple[str, ...], as_json: bool) -> None:
    """Whether HOST is suspect in any of RUNS (exit 0 healthy, 1 suspect, 8 unknown: an incident cannot be trusted
    and could have named it).

    For a Node-Problem-Detector custom plugin, a Slurm prolog or epilog, or a Kubernetes readiness command. A host
    an incident names stays suspect until evidence clears it: a replay on it that does not reproduce the step
    (``vckpt replay``), or an operator's ``vckpt clear-host``. A rollback answers the incident for checkpoints only.
    """
    from verified_ckpt import CheckpointManager

    if host is not None and (why := host_problem(host)):
        raise click.BadParameter(f"{why} ({HOST_GRAMMAR})", param_hint="--host")
    name = host or local_host()
    pairs, cleared = [], {}
    try:
        options = parse_storage_options(storage_options)
        for url in runs:
            mgr = CheckpointManager(url, storage_options=options)
            mgr.require_run()
            view = mgr.view()
            pairs.append((url, view.incidents))
            cleared[url] = view.clearances
    except VerifiedCkptError as e:
        click.echo(f"{name}: unknown - {e}", err=True)
        code = exit_code_for(e)
        sys.exit(EXIT_USAGE if code == EXIT_CHECK_FAILED else code)  # 1 would read as "suspect" to the plugin
    health = node_health(name, pairs, cleared)
    click.echo(json.dumps(health.to_dict()) if as_json else health.line())
    sys.exit(health.code)


@click.command("clear-host")
@click.argument("run")
@click.argument("host")
@click.option("--reason", required=True, help="How the host was checked (recorded with the clearance).")
@click.option("--storage-option", "-o", "storage_options", multiple=True, metavar="KEY=VALUE", help=STORAGE_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def clear_host_cmd(run: str, host: str, reason: str, storage_options: tuple[str, ...], as_json: bool) -> None:
    """Clear HOST of every incident of RUN that still names it, on the record, once a person has checked it (exit 0;
    also when nothing names it: nothing is recorded).

    Recorded as a clearance with the reason (signed with VCKPT_SIGNING_KEY in a signed run; without the key there it
    is refused, exit 2, as it would clear nothing). ``vckpt node-health``, ``vckpt status`` and the service then
    stop naming the host for those incidents; a later incident names it again.
    """
    from verified_ckpt.recovery import clear_host

    if why := host_problem(host):
        raise click.BadParameter(f"{why} ({HOST_GRAMMAR})", param_hint="HOST")
    try:
        cleared, incidents = clear_host(run, host, reason=reason, storage_options=parse_storage_options(storage_options))
    except VerifiedCkptError as e:
        click.echo(f"error: {as_flags(str(e))}", err=True)
        sys.exit(exit_code_for(e))
    ids = [i.id for i in incidents]
    if as_json:
        click.echo(json.dumps({"run": run, "host": host, "recorded": cleared is not None, "incidents": ids,
                               "at": None if cleared is None else cleared.at}))
    elif cleared is None:
        click.echo(f"{host}: no incident of {run} names it that nothing cleared it of; nothing recorded")
    else:
        click.echo(f"{host}: cleared of {len(ids)} incident(s) of {run} ({', '.join(ids)}), recorded with the "
                   "reason; vckpt node-health reads the clearance")
    sys.exit(EXIT_OK)


@click.command("supervise", context_settings={"allow_interspersed_args": False})
@click.option("--run", "run_url", required=True, help="The run the job saves to (its verdicts are read there).")
@click.option("--max-restarts", type=click.IntRange(0, 100), default=3, show_default=True,
              help="Restarts allowed in all.")
@click.option("--backoff", type=click.FloatRange(0, 3600), default=5.0, show_default=True,
              help="Seconds before the first restart, doubled for each next one (at most 300).")
@click.option("--on-exclude", default=None, metavar="COMMAND",
              help="Run before a restart with {hosts} replaced by the hosts to keep the job off; it must succeed.")
@click.option("--storage-option", "-o", "storage_options", multiple=True, metavar="KEY=VALUE", help=STORAGE_HELP)
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def supervise_cmd(run_url: str, max_restarts: int, backoff: float, on_exclude: str | None,
                  storage_options: tuple[str, ...], command: tuple[str, ...]) -> None:
    """Run COMMAND (after ``--``) and, after a silent-data-corruption verdict, restart it from the rollback target,
    kept off the suspect hosts; stop with the exit-code table's verdict when restarting cannot help.

    {exclude} in COMMAND becomes the hosts excluded so far, comma separated (Slurm's --exclude form); the job
    also sees VCKPT_ATTEMPT and VCKPT_EXCLUDED_HOSTS. The job should resume with ``CheckpointManager.resume()``.
    """
    def log(message: str) -> None:
        click.echo(f"vckpt supervise: {as_flags(message)}", err=True)

    options: dict[str, Any] | None = None
    try:
        options = parse_storage_options(storage_options) or None
        code = supervise(list(command), run_url, max_restarts=max_restarts, backoff_s=backoff, on_exclude=on_exclude,
                         storage_options=options, log=log)
    except VerifiedCkptError as e:
        click.echo(f"error: {as_flags(str(e))}", err=True)
        sys.exit(exit_code_for(e))
    sys.exit(code)


def register(group: click.Group) -> None:
    """Add this module's commands to the ``vckpt`` group."""
    from .batch import batch_manifest_cmd, batch_record_cmd
    from .replay import replay_cmd

    group.add_command(batch_manifest_cmd)
    group.add_command(batch_record_cmd)
    group.add_command(node_health_cmd)
    group.add_command(clear_host_cmd)
    group.add_command(supervise_cmd)
    group.add_command(replay_cmd)
