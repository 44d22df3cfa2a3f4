"""Reading a replay bundle back (``bundle.py``): the record first, bounded and checked, then only the tensors it
digests."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import BundleError, InvalidState, ManifestError
from ..jsonx import short_repr
from ..manifest import SEGMENT
from ..signing import Signer
from ..store import RunStore

if TYPE_CHECKING:
    import torch

    from ..bundle import Bundle

__all__ = ["read_bundle", "replay_bundle"]


def replay_bundle(url: str, incident: str, storage_options: dict[str, Any] | None = None,
                  signing_key: bytes | None = None) -> tuple[Bundle, dict[str, torch.Tensor]]:
    """What the guard captured for a replay of ``incident`` of the run at ``url`` (``vckpt replay``), checked with
    the run's signing key (default: ``VCKPT_SIGNING_KEY``, as every reader); ``BundleError`` if none or refused."""
    signer = Signer.from_env() if signing_key is None else Signer.of(signing_key)
    return read_bundle(RunStore(url, storage_options), signer, incident)


def read_bundle(store: RunStore, signer: Signer, incident: str) -> tuple[Bundle, dict[str, torch.Tensor]]:
    """Incident ``incident``'s bundle and its tensors.

    Raises:
        InvalidState: ``incident`` is not an incident id (a caller's mistake: nothing is read).
        BundleError: there is none, or it is damaged, altered, malformed or unreadable (nothing is loaded then).
        StorageError: the store cannot be read.
    """
    if not isinstance(incident, str) or not SEGMENT.match(incident):
        raise InvalidState(f"incident={short_repr(incident)} is not an incident id (letters, digits, '.', '_' and '-'); "
                           "`vckpt status RUN --json` lists the run's incidents")
    from .. import bundle  # torch: only a replay gets here

    try:
        raw = store.replays.read(incident, "json", bundle.MAX_RECORD_BYTES)
    except ManifestError as e:
        raise BundleError(str(e)) from None
    if raw is None:
        raise BundleError(f"incident {incident} has no replay bundle: the guard writes one when a gradient check names "
                          "a rank under DDP with a CheckpointManager (see `vckpt status` for the run's incidents)")
    got = bundle.decode(raw, signer, incident)
    try:
        data = store.replays.read(incident, "safetensors", got.nbytes)
    except ManifestError as e:
        raise BundleError(str(e)) from None
    if data is None:
        raise BundleError(f"the replay bundle of incident {incident} has lost its tensors; it cannot be replayed")
    return got, bundle.tensors_of(got, data)
