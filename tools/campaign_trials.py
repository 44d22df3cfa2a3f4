"""The fault campaign's pure parts: the fault model a plan draws from, each trial's outcome against its clean twin,
and the table with 95 % intervals. No torch, no processes: ``campaign.py`` runs the trials, ``campaign_job.py`` is
one trial's training.

The fault model (``KINDS``), after what hardware studies report (NVIDIA's "Anatomy of SDC", DSN 2026: most bit-flip
events are not single-bit, corrupted addresses repeat 32 lanes apart, stuck-at faults are a large share; LLM-PRISM:
gradual drift, not only spikes):

* ``x10``: one element x10, once;
* ``bitflip``: one bit of one element, once (any bit of the element's width, 16 for a 16-bit group's forward output,
  else 32: low mantissa bits are often masked, and that is an outcome);
* ``multibit``: 2 to 4 bits of one element, once;
* ``burst``: the same bit in 32 consecutive or 32-strided elements, once;
* ``stuck``: one output lane of a Linear (a GEMM) forced to a value at every step from a point on;
* ``drift``: one element multiplied by 1 + 1e-3 or 1 + 1e-2 at every step from a point on.

Each is applied at one of the sites (``SITES``): a parameter's local gradient before the reduction, the forward
output of a Linear, the attention, a LayerNorm or the GELU (inside the layer, before the guard's hooks see it), the
all-reduce's result, one element's optimizer update, AdamW's ``exp_avg``/``exp_avg_sq``, a weight at rest after the
update; on one rank, or on every rank alike (``rank == "*"``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from typing import Any

KINDS = ("x10", "bitflip", "multibit", "burst", "stuck", "drift")
SITES = ("grad", "forward", "allreduce", "update", "state", "weights")
PERSISTENT = {"stuck", "drift"}
EVERY_RANK_SHARE = 0.15  # of trials whose fault hits every rank alike (a faulty reduction, a bad kernel everywhere)
PLAIN = 2  # runs of each group's training without the guard, for its cost
SEEDS = 5  # data and initialisation seeds: a trial's twin has its seed, the seed spread is over all five
OUTCOMES = ("caught at the step", "caught later", "false alarm", "configuration", "replicas differ", "masked",
            "harmless", "silent degradation", "divergence")

# The TinyGPT the campaign trains (examples/models.py, d=128, 2 blocks): where each site can hit.
LINEARS = ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.0", "blocks.0.mlp.2",
           "blocks.1.attn.qkv", "blocks.1.attn.proj", "blocks.1.mlp.0", "blocks.1.mlp.2"]
FORWARD = [*LINEARS, "blocks.0.attn", "blocks.1.attn", "blocks.0.ln1", "blocks.1.ln2", "ln", "blocks.0.mlp.1",
           "blocks.1.mlp.1"]
PARAMS = [f"{m}.{w}" for m in LINEARS for w in ("weight", "bias")] + [
    "tok.weight", "pos.weight", "blocks.0.ln1.weight", "blocks.1.ln2.bias", "ln.weight"]


def group_config(group: str) -> dict[str, Any]:
    """The settings a group of trials runs with: the default ``GuardConfig()`` in fp32 unless the group says."""
    cfg: dict[str, Any] = {"fmt": "fp32", "overhead": None, "abft_every": None, "accum": 1, "abft_forward": False}
    for part in group.split(","):
        key, _, value = part.partition("=")
        if key == "fmt":
            cfg["fmt"] = value
        elif key == "overhead":
            cfg["overhead"] = float(value)
        elif key == "abft":
            cfg["abft_every"] = value
        elif key == "accum":
            cfg["accum"] = int(value)
        elif key == "abft_forward":
            cfg["abft_forward"] = value == "1"
    return cfg


# Autocast runs LayerNorm in fp32, and the Linears, the attention and the GELU in the group's 16-bit format
# (tests/test_fault_bits.py holds this against the model). The parameters, so their gradients, updates and
# optimizer state, are fp32 in every group.
FP32_UNDER_AUTOCAST = {"blocks.0.ln1", "blocks.1.ln2", "ln"}


def element_bits(fmt: str, site: str, target: str) -> int:
    """How many bits an element of the fault's target has: 16 for a forward output that a 16-bit group's autocast
    computes in 16 bits, else 32. A bit flip is drawn below it: a bit beyond it would change nothing."""
    return 16 if fmt in ("bf16", "fp16") and site == "forward" and target not in FP32_UNDER_AUTOCAST else 32


def draw(rng: random.Random, kind: str, world: int, steps: int, fmt: str = "fp32") -> dict[str, Any]:
    """One fault of ``kind``: its site, target, rank, step and corruption (a ``verified_ckpt.faults`` mode); its bits
    within the target's element in a group trained in ``fmt`` (``element_bits``)."""
    site = "forward" if kind == "stuck" else rng.choice(SITES)
    target = rng.choice(LINEARS if kind == "stuck" else FORWARD if site == "forward" else PARAMS)
    if site == "state":
        target = rng.choice(["exp_avg", "exp_avg_sq"]) + ":" + rng.choice(PARAMS)
    width = element_bits(fmt, site, target)  # 32 draws what the campaign always drew: fp32 plans are unchanged
    at = rng.randrange(1 << 20)
    if kind == "x10":
        mode = "elem=10"
    elif kind == "bitflip":
        mode = f"bitflip={rng.randrange(width)}"
    elif kind == "multibit":
        mode = "bits=" + "+".join(str(b) for b in sorted(rng.sample(range(width), rng.randint(2, 4))))
    elif kind == "burst":
        mode = f"burst={rng.randrange(width)}" + rng.choice(["", "/32"])
    elif kind == "stuck":
        mode = f"stuck={rng.choice([0.0, 1.0, -1.0, 100.0]):g}"
    else:
        mode = f"elem={1 + rng.choice([1e-3, 1e-2]):g}"
    rank: int | str = "*" if rng.random() < EVERY_RANK_SHARE else rng.randrange(world)
    return {"kind": kind, "site": site, "target": target, "rank": rank, "step": rng.randint(4, steps // 2),
            "persistent": kind in PERSISTENT, "mode": f"{mode}@{at}"}


def plan(groups: dict[str, int], *, world: int, steps: int, seed: int, kinds: Sequence[str] = KINDS,
         head_to_head: int = 0) -> list[dict[str, Any]]:
    """Every trial of a campaign, the same for the same arguments: ``groups`` maps a group (``group_config``) to
    its trials per kind; each group gets a clean twin per seed and ``PLAIN`` runs without the guard.
    ``head_to_head`` adds the competitor's case: a one-off x10 transient in a hidden layer's forward output at
    step 4, and the same fault persistent."""
    out: list[dict[str, Any]] = []
    for group, per_kind in groups.items():
        rng = random.Random(f"{seed}/{group}")
        out += [{"id": f"{group}/{kind}/{s}", "group": group, "seed": s, "kind": kind, "steps": steps}
                for kind in ("clean", "plain") for s in range(SEEDS if kind == "clean" else PLAIN)]
        for kind in kinds:
            for i in range(per_kind):
                out.append({"id": f"{group}/{kind}/{i:04d}", "group": group, "seed": rng.randrange(SEEDS),
                            "steps": steps, **draw(rng, kind, world, steps, group_config(group)["fmt"])})
        if head_to_head and (group == next(iter(groups)) or group_config(group)["abft_forward"]):
            for i in range(head_to_head if group == next(iter(groups)) else per_kind):
                for persistent in (False, True):
                    name = "h2h-persistent" if persistent else "h2h-transient"
                    out.append({"id": f"{group}/{name}/{i:04d}", "group": group, "seed": rng.randrange(SEEDS),
                                "steps": steps, "kind": name, "site": "forward", "persistent": persistent,
                                "target": rng.choice(["blocks.0.mlp.0", "blocks.1.mlp.0", "blocks.0.mlp.1"]),
                                "rank": rng.randrange(world), "step": 4, "mode": f"elem=10@{rng.randrange(1 << 20)}"})
    return out


def fault_ranks(trial: dict[str, Any], world: int) -> list[int]:
    return list(range(world)) if trial["rank"] == "*" else [int(trial["rank"])]


def twins(results: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The clean runs by group and seed (``group/seed``), with each group's seed spread of final losses."""
    by: dict[str, dict[str, Any]] = {}
    spread: dict[str, list[float]] = {}
    for r in results:
        if r["kind"] == "clean" and r.get("loss") is not None:
            by[f"{r['group']}/{r['seed']}"] = r
            spread.setdefault(r["group"], []).append(r["loss"])
    for r in by.values():
        losses = spread[r["group"]]
        r["spread"] = max(losses) - min(losses)
    return by


def outcome(r: dict[str, Any], twin: dict[str, Any] | None, world: int) -> dict[str, Any]:
    """What became of one trial: its outcome class, latency, whether the right ranks were named and the update
    withheld. Without its twin (not run yet) an uncaught trial's outcome is ``None``."""
    out: dict[str, Any] = {"outcome": None, "latency": None, "named": None, "withheld": None}
    caught = r.get("caught")
    if caught is not None:
        if caught == "configuration":
            out["outcome"] = "configuration"
            return out
        if r["detected_step"] < r["step"]:
            out["outcome"] = "false alarm"
            return out
        latency = r["detected_step"] - r["step"]
        # A fault after the update (optimizer state, a weight at rest) is first used at the next step.
        used = 1 if r["site"] in ("state", "weights") else 0
        # Right: the faulty rank; for a fault on every rank alike, no rank (the same failure everywhere is no host's
        # fault to see) or all of them.
        right = [[int(r["rank"])]] if r["rank"] != "*" else [[], list(range(world))]
        out.update(outcome="caught at the step" if latency <= used else "caught later", latency=latency,
                   named=sorted(r["ranks"]) in right, withheld=latency <= used)
        return out
    if twin is None:
        return out
    loss, ref = r.get("loss"), twin["loss"]
    if loss is None or not math.isfinite(loss) or loss > ref + max(1.0, 10 * twin["spread"]):
        out["outcome"] = "divergence"
    elif len(set(r["weights"])) > 1:  # uncaught within the trial, but the next consensus will see it
        out["outcome"] = "replicas differ"
    elif r["weights"] == twin["weights"]:
        out["outcome"] = "masked"
    elif loss > ref + twin["spread"]:
        out["outcome"] = "silent degradation"
    else:
        out["outcome"] = "harmless"
    return out


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of ``k`` successes in ``n`` trials (95 % by default)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def zero_rate_bound(n: int, confidence: float = 0.95) -> float:
    """The one-sided upper bound on a per-trial rate when none of ``n`` trials showed it (exact binomial)."""
    return 1.0 - (1.0 - confidence) ** (1.0 / n) if n else 1.0


def percentile(values: Sequence[int], q: float) -> int | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
