"""``vckpt replay``: recompute a recorded failing step on this host and say whose fault it was.

Exit codes (the table's): 0 not reproduced (a transient fault, or another host's), 4 reproduced on this host,
6 no host to blame (software or data), 1 inconclusive, 2 usage (no bundle for that incident, an incident id that is
not one, a model that is not the trained one or that cannot take the bundle's data), 3 the store cannot be read.
A refusal is not a verdict: it is one line, ``error: no verdict: ...``, on stderr and nothing on stdout (with
``--json`` too), exit 1 for a bundle refused (altered, damaged or malformed: 1 is a failed check) and 2 or 3 as
above; a verdict is printed on stdout.

"Not reproduced" on the host the incident names is the evidence that clears it: the replay records it in the run (a
clearance, signed in a signed run), and ``vckpt node-health`` stops naming the host for that incident. A drill
(``--inject``) records nothing, and nor does a replay on another host. A record the store refuses costs one line on
stderr, never the verdict's code.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import click

from verified_ckpt import VerifiedCkptError

from .options import EXIT_CHECK_FAILED, EXIT_USAGE, as_flags, exit_code_for, parse_storage_options

__all__ = ["replay_cmd"]


@click.command("replay")
@click.argument("run")
@click.option("--incident", "incident", required=True, help="The incident id (`vckpt status RUN --json`).")
@click.option("--model", "model_spec", required=True, metavar="FILE.py:FUNC|MODULE:FUNC",
              help="A function returning (model, loss_fn): the trained architecture, unwrapped, and its loss. The "
                   "file or module is imported: its top-level code runs, a file's folder first on sys.path.")
@click.option("--host", default=None, help="The name to report this host by (default: this machine's name).")
@click.option("--rank", "ranks", type=int, multiple=True, help="Replay only this suspect rank (repeatable).")
@click.option("--inject", "faults", multiple=True, metavar="SITE:RANK:STEP[:MODE]",
              help="Simulate a fault during the recomputation (drills and tests: a persistent fault on this host).")
@click.option("--storage-option", "-o", "storage_options", multiple=True, metavar="KEY=VALUE",
              help="fsspec storage option (repeatable); AWS_* environment variables also apply.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def replay_cmd(run: str, incident: str, model_spec: str, host: str | None, ranks: tuple[int, ...],
               faults: tuple[str, ...], storage_options: tuple[str, ...], as_json: bool) -> None:
    """Replay INCIDENT's failing step of RUN on this host: reproduced (exit 4), not reproduced (0), or no host to
    blame (6). Run it on the suspect host and on a healthy one before replacing a node (docs/RECOVERY.md)."""
    from verified_ckpt import BundleError, CheckpointManager, replay_bundle
    from verified_ckpt.recovery import HOST_GRAMMAR, host_problem
    from verified_ckpt.recovery.replay import load_model, replay

    if host is not None and (why := host_problem(host)):
        raise click.BadParameter(f"{why} ({HOST_GRAMMAR})", param_hint="--host")
    try:
        options = parse_storage_options(storage_options)
        CheckpointManager(run, storage_options=options).require_run()
        bundle, tensors = replay_bundle(run, incident, options)
        model, loss_fn = load_model(model_spec)
        results = replay(bundle, tensors, model, loss_fn, host=host, faults=faults, ranks=ranks)
    except BundleError as e:
        _refuse(e, EXIT_USAGE if "has no replay bundle" in str(e) else EXIT_CHECK_FAILED)
    except VerifiedCkptError as e:
        _refuse(e, exit_code_for(e))
    except ValueError as e:  # an --inject spec
        _refuse(e, EXIT_USAGE)
    cleared = set() if faults else _record(run, incident, results, options)
    if as_json:
        click.echo(json.dumps({"incident": incident, "step": bundle.recipe.step, "kind": bundle.recipe.kind,
                               "bundle_bytes": bundle.nbytes, "signature": bundle.signature,
                               "replays": [r.to_dict() | {"cleared": r.rank in cleared} for r in results]}))
    else:
        for r in results:
            done = f"; {r.host} is cleared of incident {incident} on the record" if r.rank in cleared else ""
            click.echo(f"incident {incident}, step {bundle.recipe.step} ({bundle.recipe.kind}): {r.line}{done}")
    sys.exit(max((int(r.outcome.code) for r in results), key=_severity))


def _record(run: str, incident: str, results: list[Any], options: dict[str, Any]) -> set[int]:
    """Record each "not reproduced" on the host the incident names as its clearance; the ranks whose host it cleared."""
    from verified_ckpt.recovery import Outcome, record_replay

    out = set()
    for r in results:
        if r.outcome is not Outcome.NOT_REPRODUCED or r.host != r.suspect_host:
            continue  # only a replay on the suspect's own host is evidence for that host
        try:
            if record_replay(run, r.host, incident, line=r.line, storage_options=options) is not None:
                out.add(r.rank)
        except VerifiedCkptError as e:  # the verdict stands; the host stays suspect until a record says otherwise
            click.echo(f"warning: the verdict was not recorded ({as_flags(str(e))}); {r.host} stays suspect until "
                       "it is: run the replay again, or vckpt clear-host RUN HOST --reason ...", err=True)
    return out


def _refuse(err: Exception, code: int) -> NoReturn:
    """A replay that gives no verdict says so, in one line on stderr, whatever its code (1 is also a verdict's)."""
    click.echo(f"error: no verdict: {as_flags(str(err))}", err=True)
    sys.exit(code)


def _severity(code: int) -> int:
    """Several suspects: the verdict that asks the most (reproduced, then no host, then inconclusive, then none)."""
    return {4: 3, 6: 2, 1: 1, 0: 0}[code]
