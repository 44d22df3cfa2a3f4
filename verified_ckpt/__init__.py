"""verified-ckpt: checkpoints that large PyTorch training runs can trust.

The whole public API is re-exported here; every other module is internal.
Names are resolved on first use (PEP 562), so a tool that only lists or
inspects runs (the ``vckpt`` CLI) never pays for importing torch.

The modules, in layers from the lowest (each imports only lower layers: docs/DESIGN.md's module table, held by the
import-linter contracts in pyproject.toml):

1. ``crc``, ``dtensors``, ``errors``, ``faults``, ``fingerprint``, ``jsonx``, ``rng``, ``stage_state``, ``status``,
   ``tensorspec``
2. ``batches``, ``evidence``, ``hosts``, ``layout``, ``report``, ``shards``, ``signing``, ``skeleton``
3. ``flatten``, ``manifest``
4. ``lanes``, ``record_fields``
5. ``records``
6. ``decisions``, ``exitcodes``, ``history``, ``store``
7. ``comm``, ``health``, ``ledger``
8. ``guard``, ``sharding``
9. ``bundle``
10. ``checkpoint``, ``recovery``
11. ``integrations``, ``service``
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    BundleError,
    CheckpointNotFound,
    CheckpointNotRestorable,
    CorruptCheckpoint,
    GuardConfigurationError,
    GuardUsageError,
    InvalidConfig,
    InvalidRunURL,
    InvalidState,
    LedgerNotFound,
    ManifestError,
    RanksDidNotArrive,
    RunNotFound,
    SilentCorruptionDetected,
    StorageError,
    UnsafePath,
    VerifiedCkptError,
)

if TYPE_CHECKING:
    from .checkpoint import CheckpointManager, OpenCheckpoint, RankReport, RunView, SaveSession, dask_client, replay_bundle
    from .comm import Communicator
    from .evidence import evidence_basis
    from .fingerprint import Fingerprint
    from .guard import GuardConfig, SDCGuard
    from .health import RunHealth
    from .lanes import state_fingerprint, tensor_fingerprint
    from .manifest import CheckpointInfo, Manifest
    from .records import Host, Incident, Problem, Rollback, VerificationResult
    from .recovery import ExitCode, exit_code_for, exit_on
    from .report import render_html
    from .rng import RNGState
    from .stage_state import StageState
    from .status import HEALTH_COLOURS, PALETTE, Status
    from .store import discover_runs

_LAZY = {
    "CheckpointManager": "checkpoint", "RunView": "checkpoint", "Communicator": "comm", "Fingerprint": "fingerprint",
    "GuardConfig": "guard", "SDCGuard": "guard", "state_fingerprint": "lanes", "tensor_fingerprint": "lanes",
    "CheckpointInfo": "manifest", "Manifest": "manifest", "Host": "records", "Incident": "records",
    "Problem": "records", "Rollback": "records", "VerificationResult": "records", "render_html": "report",
    "RNGState": "rng", "Status": "status", "discover_runs": "store", "ExitCode": "recovery",
    "exit_code_for": "recovery", "exit_on": "recovery", "replay_bundle": "checkpoint", "OpenCheckpoint": "checkpoint",
    "RankReport": "checkpoint", "SaveSession": "checkpoint", "PALETTE": "status", "HEALTH_COLOURS": "status",
    "RunHealth": "health", "evidence_basis": "evidence", "StageState": "stage_state", "dask_client": "checkpoint",
}

__all__ = [
    "HEALTH_COLOURS",
    "PALETTE",
    "BundleError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFound",
    "CheckpointNotRestorable",
    "Communicator",
    "CorruptCheckpoint",
    "ExitCode",
    "Fingerprint",
    "GuardConfig",
    "GuardConfigurationError",
    "GuardUsageError",
    "Host",
    "Incident",
    "InvalidConfig",
    "InvalidRunURL",
    "InvalidState",
    "LedgerNotFound",
    "Manifest",
    "ManifestError",
    "OpenCheckpoint",
    "Problem",
    "RNGState",
    "RankReport",
    "RanksDidNotArrive",
    "Rollback",
    "RunHealth",
    "RunNotFound",
    "RunView",
    "SDCGuard",
    "SaveSession",
    "SilentCorruptionDetected",
    "StageState",
    "Status",
    "StorageError",
    "UnsafePath",
    "VerificationResult",
    "VerifiedCkptError",
    "dask_client",
    "discover_runs",
    "evidence_basis",
    "exit_code_for",
    "exit_on",
    "render_html",
    "replay_bundle",
    "state_fingerprint",
    "tensor_fingerprint",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'verified_ckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
