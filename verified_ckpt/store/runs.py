"""Runs as places: one spelling of each run's URL, and the runs found under a prefix (``vckpt serve --discover``)."""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

import fsspec

from ..manifest import SEGMENT
from .backend import Backend, capabilities
from .paths import RUN_META

__all__ = ["canonical_url", "discover_runs"]


def discover_runs(prefix: str, storage_options: dict[str, Any] | None = None, known: Collection[str] = ()) -> list[str]:
    """URLs of the runs in the folders directly under ``prefix`` (any fsspec URL; a folder holding ``run.json``
    or ``checkpoints/``), sorted.

    One listing of ``prefix`` itself (a delimited LIST on S3: a thousand runs in one request, not every object under
    them), then a look into each child folder not in ``known`` (URLs this caller already knows to be runs): a
    service looking every few minutes pays for the runs that are new since its last look, not for all of them.

    Raises:
        InvalidRunURL: the prefix cannot be opened.
        StorageError: the store could not be listed.
    """
    b = Backend(prefix, storage_options)
    base = prefix.rstrip("/")
    with b.io("listing runs"):
        b.fs.invalidate_cache(b.root)
        try:
            children = b.fs.ls(b.root, detail=False)
        except FileNotFoundError:
            return []
        names = sorted({str(c).rstrip("/").split("/")[-1] for c in children} - {""})
        runs = []
        for n in names:
            if not SEGMENT.match(n):
                continue
            url = f"{base}/{n}"
            if url in known or b.fs.exists(b.join(n, RUN_META)) or b.fs.exists(b.join(n, "checkpoints")):
                runs.append(url)
    return runs


def canonical_url(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """One spelling of the place ``url`` names: ``svc/run``, its absolute path and its ``file://`` URL are one run
    (``file:///abs/svc/run``), and so are ``s3://b/p`` and ``s3://b/p/``. A URL fsspec cannot open is its own."""
    try:
        fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        if capabilities(fs).links:
            root = os.path.realpath(root)  # "..", and links to the same folder
        return str(fs.unstrip_protocol(root.rstrip("/") or root))
    except Exception:  # noqa: BLE001 - any URL gets a spelling; opening it fails later, with its own message
        return url
