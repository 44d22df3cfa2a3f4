"""The shared frame of the commands that open one run: its options, and a library error as one line and an exit code."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import click

from verified_ckpt import VerifiedCkptError

from .options import EXIT_OK, as_flags, exit_code_for, parse_storage_options
from .output import Output, escape

__all__ = ["dask_client", "run_command"]


def run_command(fn: Callable[..., int | None]) -> Callable[..., None]:
    """Shared options and error handling: a library error becomes one line on stderr and an exit code."""

    @click.argument("run")
    @click.option("--storage-option", "-o", "storage_options", multiple=True, metavar="KEY=VALUE",
                  help="fsspec storage option (repeatable); AWS_* environment variables also apply.")
    @click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
    @functools.wraps(fn)
    def wrapper(run: str, storage_options: tuple[str, ...], as_json: bool, **kwargs: Any) -> None:
        from verified_ckpt import CheckpointManager  # the catalog, fsspec: only once a command runs
        out = Output(as_json)
        try:
            mgr = CheckpointManager(run, storage_options=parse_storage_options(storage_options))
            code = fn(mgr, out, **kwargs) or EXIT_OK
        except VerifiedCkptError as e:
            # Messages quote lists and paths such as "[0, 1]": escape them so rich shows them verbatim.
            out.err.print(f"[red]error:[/] {escape(as_flags(str(e)))}", markup=True, highlight=False)
            code = exit_code_for(e)
        sys.exit(code)

    return wrapper


@contextlib.contextmanager
def dask_client(address: str | None, workers: int) -> Iterator[Any]:
    """A Dask client for ``--dask``: to the scheduler at ``address``, or to a ``LocalCluster`` of ``workers`` worker
    processes started here (and closed on leaving) for ``local``; ``None`` without ``--dask``."""
    if address is None:
        yield None
        return
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise click.UsageError("--dask needs Dask distributed: pip install -e \".[dask]\"") from None
    if address == "local":
        with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,  # type: ignore[no-untyped-call]
                          dashboard_address=None) as cluster, Client(cluster) as client:  # type: ignore[no-untyped-call]
            yield client
        return
    try:
        client = Client(address, timeout=30)  # type: ignore[no-untyped-call]
    except OSError as e:
        raise click.UsageError(f"cannot reach the Dask scheduler at {address!r} ({e}); check the address") from None
    with client:
        yield client
