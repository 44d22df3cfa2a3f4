"""What the guard checks and how often."""

from __future__ import annotations

import dataclasses

from ..faults import FaultPlan

__all__ = ["GuardConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """What the guard checks and how often.

    Args:
        consensus_every: run the weight consensus after the update every N steps (>= 1).
        audit_every: run a recompute audit every N steps (>= 1), or ``None`` for none.
        mode: ``"exact"`` compares audits bitwise (deterministic kernels, as on CPU);
            ``"tolerance"`` compares relatively (nondeterministic GPU kernels).
        rtol: relative tolerance of audits in tolerance mode.
        checksum_lanes: random projections per all-reduce checksum (every element has its own random
            weight in each, so one lane already moves for any single wrong element; more lanes guard
            against several wrong elements cancelling, at one pass over the bucket each).
        checksum_slack: safety factor on the rounding bound of the checksum.
        outlier_factor: a rank whose gradient norm is this many times above or below
            the median of the others is audited at once.
        fixed_order_reduce: average gradients by all-gather and a sum in rank order instead of
            the backend's all-reduce, so the result never depends on DDP's bucket layout. Costs
            about W/2 times the all-reduce traffic; not needed for bitwise resume, which
            :meth:`SDCGuard.prepare_resume` handles with one warm-up iteration.
        seed: seed of the checksum projections (identical on every rank).
        ledger_rank_rows: up to this world size the ledger gets one row per rank per step;
            above it, one job-wide row per step (mean loss, largest local gradient norm)
            plus rows for the ranks a failed check names, so the ledger grows with steps, not ranks.
        check_nonfinite: NaN/Inf checks of local and averaged gradients every step.
        check_checksum: the all-reduce checksum every step.
        abft: per-step verification of the gradients Linear-like layers (``nn.Linear``, Hugging Face's
            ``Conv1D``) and ``nn.Embedding`` compute: weight, bias and input gradients.
        abft_slack: safety factor on the ABFT rounding bounds.
        abft_exclude: ``fnmatch`` patterns of parameter names ABFT leaves out (a weight the model changes where
            ABFT's hooks cannot see it; audits and consensus still cover it).
        audit_before_save: a save that would be ``unverified`` only for lack of a recompute audit since the
            previous restorable checkpoint runs one first (``SDCGuard.audit_now``: one forward-backward of the
            last step's first microbatch per rank, twice), so saves are ``restorable`` whatever ``audit_every``.
        arrival_timeout_s: how long a save, consensus or audit waits for every rank to arrive
            before failing with an error naming the missing ranks (a save called on rank 0 only).
        faults: fault-injection specs ``SITE:RANK:STEP[:MODE]`` (testing only).
    """

    consensus_every: int = 100
    audit_every: int | None = 500
    mode: str = "exact"
    rtol: float = 1e-4
    checksum_lanes: int = 1
    checksum_slack: float = 6.0
    outlier_factor: float = 4.0
    fixed_order_reduce: bool = False
    seed: int = 0
    ledger_rank_rows: int = 64
    check_nonfinite: bool = True
    check_checksum: bool = True
    abft: bool = True
    abft_slack: float = 8.0
    abft_exclude: tuple[str, ...] = ()
    audit_before_save: bool = True
    arrival_timeout_s: float = 300.0
    faults: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.consensus_every, int) or self.consensus_every < 1:
            raise ValueError(f"consensus_every must be >= 1, got {self.consensus_every!r}")
        if self.audit_every is not None and (not isinstance(self.audit_every, int) or self.audit_every < 1):
            raise ValueError(f"audit_every must be >= 1 or None, got {self.audit_every!r}")
        if self.mode not in ("exact", "tolerance"):
            raise ValueError(f"mode must be 'exact' or 'tolerance', got {self.mode!r}")
        if not self.rtol > 0:
            raise ValueError(f"rtol must be > 0, got {self.rtol!r}")
        if not 1 <= self.checksum_lanes <= 16:
            raise ValueError(f"checksum_lanes must be in 1..16, got {self.checksum_lanes!r}")
        if not self.checksum_slack >= 1:
            raise ValueError(f"checksum_slack must be >= 1, got {self.checksum_slack!r}")
        if not self.outlier_factor > 1:
            raise ValueError(f"outlier_factor must be > 1, got {self.outlier_factor!r}")
        if not self.abft_slack >= 1:
            raise ValueError(f"abft_slack must be >= 1, got {self.abft_slack!r}")
        patterns: object = self.abft_exclude  # a bare string would be taken as one pattern per character
        if not isinstance(patterns, tuple) or not all(isinstance(p, str) for p in patterns):
            raise ValueError(f"abft_exclude must be a tuple of parameter-name patterns, got {self.abft_exclude!r}")
        if not self.arrival_timeout_s > 0:
            raise ValueError(f"arrival_timeout_s must be > 0, got {self.arrival_timeout_s!r}")
        FaultPlan(self.faults)  # raises ValueError naming a bad spec
