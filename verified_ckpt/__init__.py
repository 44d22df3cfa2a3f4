"""verified-ckpt: checkpoints that large PyTorch training runs can trust.

The whole public API is re-exported here; every other module is internal.
"""

from .errors import (
    CheckpointNotFound,
    CheckpointNotRestorable,
    CorruptCheckpoint,
    InvalidRunURL,
    InvalidState,
    ManifestError,
    RunNotFound,
    StorageError,
    VerifiedCkptError,
)
from .fingerprint import Fingerprint, state_fingerprint, tensor_fingerprint
from .manager import CheckpointManager
from .manifest import CheckpointInfo, Manifest, Status, VerificationResult
from .rng import RNGState

__all__ = [
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFound",
    "CheckpointNotRestorable",
    "CorruptCheckpoint",
    "Fingerprint",
    "InvalidRunURL",
    "InvalidState",
    "Manifest",
    "ManifestError",
    "RNGState",
    "RunNotFound",
    "Status",
    "StorageError",
    "VerificationResult",
    "VerifiedCkptError",
    "state_fingerprint",
    "tensor_fingerprint",
]
__version__ = "0.1.0"
