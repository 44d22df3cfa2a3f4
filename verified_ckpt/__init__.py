"""verified-ckpt: checkpoints that large PyTorch training runs can trust.

The whole public API is re-exported here; every other module is internal.
"""

from .errors import (
    CheckpointNotFound,
    CheckpointNotRestorable,
    CorruptCheckpoint,
    InvalidRunURL,
    InvalidState,
    GuardUsageError,
    ManifestError,
    LedgerNotFound,
    RunNotFound,
    SilentCorruptionDetected,
    StorageError,
    UnsafePath,
    VerifiedCkptError,
)
from .fingerprint import Fingerprint, state_fingerprint, tensor_fingerprint
from .guard import GuardConfig, SDCGuard
from .manager import CheckpointManager
from .manifest import CheckpointInfo, Incident, Manifest, Status, VerificationResult
from .rng import RNGState

__all__ = [
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFound",
    "CheckpointNotRestorable",
    "CorruptCheckpoint",
    "Fingerprint",
    "GuardConfig",
    "GuardUsageError",
    "Incident",
    "InvalidRunURL",
    "InvalidState",
    "Manifest",
    "ManifestError",
    "RNGState",
    "LedgerNotFound",
    "RunNotFound",
    "SDCGuard",
    "SilentCorruptionDetected",
    "Status",
    "StorageError",
    "UnsafePath",
    "VerificationResult",
    "VerifiedCkptError",
    "state_fingerprint",
    "tensor_fingerprint",
]
__version__ = "0.1.0"
