"""The shared frame of the commands that open one run: its options, and a library error as one line and an exit code."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from verified_ckpt import VerifiedCkptError

from .options import EXIT_OK, as_flags, exit_code_for, parse_storage_options
from .output import Output, escape

__all__ = ["run_command"]


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
