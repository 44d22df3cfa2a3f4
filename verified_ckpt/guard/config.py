"""What the guard checks and how often."""

from __future__ import annotations

import dataclasses

from ..errors import InvalidConfig
from ..faults import FaultPlan
from .budget import BUDGET

__all__ = ["GuardConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """What the guard checks and how often.

    Args:
        overhead: the share of step time the scheduled checks (consensus rounds and audits) may add on top of the
            per-step ones (0.03: 3 %). The guard measures the step and each check as the run goes and schedules
            them as often as that allows (``guard/budget.py``); a check the budget cannot afford is sampled, never
            dropped. What the per-step checks cost is measured and reported beside it (``SDCGuard.schedule()``).
        consensus_every: ``"budget"`` (the default: as often as ``overhead`` allows, at least every 100 steps), or
            run the weight consensus after the update every N steps (>= 1).
        audit_every: ``"budget"`` (the default: a recompute of a slice of one microbatch per rank, as often as
            ``overhead`` allows, at least every 500 steps), every N steps (>= 1: the whole step, against what
            was recorded), or ``None`` for none.
        abft_every: 1 (the default: ABFT on every step, a per-step check), every N-th step, or ``"budget"``: within
            ``overhead`` with the scheduled checks, on every step if it fits, else on a share of the steps (at
            least one in 10). A step ABFT skips is a step whose transient gradient faults go unseen.
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
        abft_forward: check the forward output of every covered Linear-like layer too, row by row (``Y r`` against
            ``X (Wᵀ r) + b·r``: one more read of its output per forward, the input's products taken in the read the
            weight check makes anyway; its cost is in docs/BENCHMARKS.md). On by default: a wrong forward value
            (a Linear's output, attention's products, which ABFT checks in the forward whatever this says) is
            caught at its step, naming the layer; without it such a one-off fault reaches the gradients whole and
            only a recompute audit of that very step would see it.
        abft_slack: safety factor on the ABFT rounding bounds.
        abft_exclude: ``fnmatch`` patterns of parameter names ABFT leaves out (a weight the model changes where
            ABFT's hooks cannot see it; audits and consensus still cover it).
        oracle_slices: the update oracle (``guard/oracle.py``): every step a peer recomputes one of this many slices
            of each rank's optimizer update, in rotation (8: a persistent fault in one element's update is caught
            within 8 steps, a one-off one at its step with probability 1/8; the cost is in docs/BENCHMARKS.md).
            0: no oracle (a save of state without a replica is then ``unverified``).
        audit_before_save: a save whose step no recompute audit covered runs one first (``SDCGuard.audit_now``:
            one forward-backward of the last step's first microbatch per rank, twice), as it runs a consensus, so
            every kind of check covers each checkpoint's step whatever ``audit_every``; off, a save with no audit
            since the previous checkpoint is ``unverified``.
        arrival_timeout_s: how long a save, consensus or audit waits for every rank to arrive
            before failing with an error naming the missing ranks (a save called on rank 0 only).
        faults: fault-injection specs ``SITE:RANK:STEP[:MODE]`` (testing only).
        replay_max_bytes: the most a replay bundle may hold (the step's weights and buffers, plus the suspects'
            microbatches), written when a gradient check names a rank (DDP, with a ``CheckpointManager``); a step
            whose state exceeds it gets no bundle, with a warning. 0: never write one (docs/RECOVERY.md).
    """

    overhead: float = 0.03
    consensus_every: int | str = BUDGET
    audit_every: int | str | None = BUDGET
    abft_every: int | str = 1
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
    abft_forward: bool = True
    abft_slack: float = 8.0
    abft_exclude: tuple[str, ...] = ()
    oracle_slices: int = 8
    audit_before_save: bool = True
    arrival_timeout_s: float = 300.0
    faults: tuple[str, ...] = ()
    replay_max_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not (isinstance(self.overhead, (int, float)) and 0 < self.overhead <= 1):
            raise InvalidConfig(f"overhead must be in (0, 1] (a share of step time: 0.03 is 3 %), got {self.overhead!r}")
        for name in ("consensus_every", "audit_every", "abft_every"):
            v = getattr(self, name)
            if v == BUDGET or (v is None and name == "audit_every"):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                none = ", None" if name == "audit_every" else ""
                raise InvalidConfig(f"{name} must be 'budget'{none} or an int >= 1, got {v!r}")
        if self.mode not in ("exact", "tolerance"):
            raise InvalidConfig(f"mode must be 'exact' or 'tolerance', got {self.mode!r}")
        if not self.rtol > 0:
            raise InvalidConfig(f"rtol must be > 0, got {self.rtol!r}")
        if not 1 <= self.checksum_lanes <= 16:
            raise InvalidConfig(f"checksum_lanes must be in 1..16, got {self.checksum_lanes!r}")
        if not self.checksum_slack >= 1:
            raise InvalidConfig(f"checksum_slack must be >= 1, got {self.checksum_slack!r}")
        if not self.outlier_factor > 1:
            raise InvalidConfig(f"outlier_factor must be > 1, got {self.outlier_factor!r}")
        if not self.abft_slack >= 1:
            raise InvalidConfig(f"abft_slack must be >= 1, got {self.abft_slack!r}")
        if not isinstance(self.oracle_slices, int) or isinstance(self.oracle_slices, bool) or self.oracle_slices < 0:
            raise InvalidConfig(f"oracle_slices must be an int >= 0 (0: no update oracle), got {self.oracle_slices!r}")
        patterns: object = self.abft_exclude  # a bare string would be taken as one pattern per character
        if not isinstance(patterns, tuple) or not all(isinstance(p, str) for p in patterns):
            raise InvalidConfig(f"abft_exclude must be a tuple of parameter-name patterns, got {self.abft_exclude!r}")
        self._check_io()
        FaultPlan(self.faults)  # raises ValueError naming a bad spec

    def _check_io(self) -> None:
        """What the guard waits for and writes: the arrival bound, the replay bundle bound."""
        if not self.arrival_timeout_s > 0:
            raise InvalidConfig(f"arrival_timeout_s must be > 0, got {self.arrival_timeout_s!r}")
        if not isinstance(self.replay_max_bytes, int) or isinstance(self.replay_max_bytes, bool) or self.replay_max_bytes < 0:
            raise InvalidConfig(f"replay_max_bytes must be an int >= 0 (0: no replay bundles), got {self.replay_max_bytes!r}")
