"""The training-loop checks: :class:`SDCGuard` drives them, one module per check decides.

``nonfinite``, ``checksum``, ``audit`` and ``consensus`` each return a
:class:`~verified_ckpt.guard.stats.Verdict` and record nothing; ``tap`` takes
the per-bucket statistics inside DDP's communication hook; ``judge`` counts the
verdicts and turns failed ones into incidents; ``sdcguard`` holds the loop.
"""

from .config import GuardConfig
from .sdcguard import SDCGuard

__all__ = ["GuardConfig", "SDCGuard"]
