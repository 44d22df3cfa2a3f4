"""The training-loop checks: :class:`SDCGuard` drives them, a layout says how the model's gradients are reduced,
and one module per check decides.

- The loop: ``sdcguard`` (begin, backward, step, consensus, written once), ``config``, ``judge`` (verdicts
  counted, failed ones turned into incidents; coverage reported), ``schedule`` and ``budget`` (how often each
  check runs within the user's overhead budget).
- Layouts: ``replicated`` (DDP, or one process), ``fsdp`` and ``sharded`` (FSDP2, HSDP, with tensor
  parallel), ``pipeline`` (``torch.distributed.pipelining`` stages), ``boxes`` (consensus per held piece).
- Checks, each returning a :class:`~verified_ckpt.guard.stats.Verdict` and recording nothing:
  ``nonfinite``, ``checksum`` (of the all-reduce, from ``tap``'s per-bucket statistics), ``abft`` (per-step
  verification of gradient computation), ``audit`` (cross-rank recompute with a third-rank tiebreak),
  ``consensus``, ``oracle`` (a peer recomputes a slice of each rank's optimizer update; ``replicas``: its DDP form,
  the replicas' own updates compared), ``chain`` (every rank's state between its update and its next use; which copy
  changed at rest, for the consensus). ``witnesses``: the chain, the oracle and the scaler composed around each update.
- ``protocol``: the ``Layout`` protocol every layout satisfies; ``parts``: what a layout is built from
  (``GuardParts``, ``StepState``), never the guard itself.
- ``capture``: what a replay needs, taken when a gradient check fails before the update; ``aside``: passes
  that are not the step's own (a warm-up, an audit's recomputation, the in-place replays) leave nothing behind.
- ``steprow``: the step's one gathered row, named segments joined and split back by name; ``stats`` (per-bucket
  and per-step statistics, ``Verdict``), ``tp`` (the tensor-parallel plans ABFT can check),
  ``recompute`` (the witness's side of the oracle), ``scaling`` (fp16 with a gradient scaler), ``nocast`` (the
  checks' own sums kept out of a caller's autocast in the backward).
"""

from .config import GuardConfig
from .sdcguard import SDCGuard

__all__ = ["GuardConfig", "SDCGuard"]
