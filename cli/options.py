"""What every ``vckpt`` command shares: ``--storage-option`` pairs, a library error's exit code, and its message
in the CLI's words (the library names its parameters; a command's user typed flags)."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from typing import Any

import click

from verified_ckpt import CheckpointNotRestorable, CorruptCheckpoint, ExitCode, ManifestError, StorageError

__all__ = ["EXIT_CHECK_FAILED", "EXIT_OK", "EXIT_STORAGE", "EXIT_USAGE", "OneLineErrors", "as_flags", "exit_code_for",
           "parse_storage_options"]

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_STORAGE = (int(c) for c in (
    ExitCode.OK, ExitCode.CHECK_FAILED, ExitCode.USAGE, ExitCode.STORE_UNREACHABLE))


# The library's parameters as the commands spell them. Library messages name a parameter with an underscore or
# as ``name=``, so these never match ordinary words.
_FLAGS = [(re.compile(p), f) for p, f in [
    (r"\bgrace_s\b", "--grace"), (r"\bjobs=", "--jobs"), (r"\bfrom_step\b", "--from-step"),
    (r"\bto_step\b", "--to-step"), (r"\breason=", "--reason TEXT"), (r"\bdest=", "--to"),
    (r'\bformat="(\w+)"', r"--format \1"), (r"\bmodel=", "--model "), (r"\brank=R\b", "--rank R"),
    (r"\ballow_unverified=True\b", "--allow-unverified"), (r"\bon_exclude\b", "--on-exclude"),
    (r"\bkeep_last\b", "--keep-last"), (r"field 'ranks'", "--rank"), (r"\branks= ", "--rank "),
    (r"\(runs=\)", "(RUN ...)"), (r"\(discover=\)", "(--discover PREFIX)"),
    (r"\bincident=", "--incident "),
]]


class OneLineErrors(click.Group):
    """The ``vckpt`` group: click's usage errors (a bad flag value, an unknown option) become the one line every
    other error is, ``error: <what>; see `<command> --help```, exit 2, instead of click's three lines."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "vckpt"
            click.echo(f"error: {e.format_message().rstrip('.')}; see `{where} --help`", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def as_flags(message: str) -> str:
    """A library message with its parameter names as the CLI's flags (``grace_s`` -> ``--grace``)."""
    for pattern, flag in _FLAGS:
        message = pattern.sub(flag, message)
    return message


def exit_code_for(err: BaseException) -> int:
    """A command's code for a library error. Unlike a training job's (``recovery.exit_code_for``), a corrupt or
    unrestorable checkpoint is a failed check here (1), not a lost rollback target (7)."""
    if isinstance(err, ManifestError):
        return EXIT_USAGE
    if isinstance(err, (CorruptCheckpoint, CheckpointNotRestorable)):
        return EXIT_CHECK_FAILED
    if isinstance(err, StorageError):
        return EXIT_STORAGE
    return EXIT_USAGE


def parse_storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; dotted keys nest (``client_kwargs.region_name=x``); values parse as JSON when they can."""
    opts: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--storage-option")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = opts
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise click.BadParameter(f"{key!r} conflicts with an earlier option", param_hint="--storage-option")
        node[leaf] = value
    return opts
