"""What every ``vckpt`` command shares: ``--storage-option`` pairs, and a library error's exit code."""

from __future__ import annotations

import json
from typing import Any

import click

from verified_ckpt import CheckpointNotRestorable, CorruptCheckpoint, ExitCode, ManifestError, StorageError

__all__ = ["EXIT_CHECK_FAILED", "EXIT_OK", "EXIT_STORAGE", "EXIT_USAGE", "exit_code_for", "parse_storage_options"]

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_STORAGE = (int(c) for c in (
    ExitCode.OK, ExitCode.CHECK_FAILED, ExitCode.USAGE, ExitCode.STORE_UNREACHABLE))


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
