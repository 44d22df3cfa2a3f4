"""A replay that diagnoses: recompute a recorded failing step on this host and say whose fault it was.

The guard's bundle (``bundle.py``) holds the step's weights, each suspect's microbatches and random states,
what the suspect recorded of its gradient before the reduction, and what a healthy rank recomputed from the same
microbatches and weights at the incident. A replay loads the weights into the user's model on this host,
recomputes each suspect's microbatches exactly as an audit does (``guard.audit.recompute``), and compares:

- the suspect's record equals the healthy reference: every host computes it, so the cause is the software or the
  data and **no host is to blame** (a poisoned batch, a deterministic bug);
- this host's result equals the suspect's record: **reproduced on this host**, a persistent fault where the replay
  runs on the suspect's host: replace the node;
- this host's result equals the reference: **not reproduced**, a transient fault, or another host is at fault;
- neither: **inconclusive**, this host computed a third result (suspect it too).

``mode`` and ``rtol`` are the guard's: exact (bitwise, deterministic kernels, as on CPU) or relative.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from ..batches import decode
from ..bundle import Bundle, BundleSuspect
from ..errors import BundleError, InvalidState
from ..faults import FaultPlan
from ..guard.audit import Recomputed, recompute
from ..guard.stats import Projector
from ..hosts import local_host
from .exits import ExitCode

__all__ = ["Outcome", "Replayed", "judge", "load_model", "replay"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class Outcome(str, enum.Enum):
    REPRODUCED = "reproduced"
    NOT_REPRODUCED = "not-reproduced"
    NO_HOST_TO_BLAME = "no-host-to-blame"
    INCONCLUSIVE = "inconclusive"

    @property
    def code(self) -> ExitCode:
        return {Outcome.REPRODUCED: ExitCode.SDC_HOSTS_NAMED, Outcome.NOT_REPRODUCED: ExitCode.OK,
                Outcome.NO_HOST_TO_BLAME: ExitCode.SOFTWARE, Outcome.INCONCLUSIVE: ExitCode.CHECK_FAILED}[self]


@dataclasses.dataclass(frozen=True)
class Replayed:
    """One suspect's replay on one host."""

    rank: int
    suspect_host: str
    host: str
    outcome: Outcome
    line: str

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "suspect_host": self.suspect_host, "host": self.host, "outcome": self.outcome.value,
                "exit_code": int(self.outcome.code), "line": self.line}


def _close(a: float, b: float, tol: float, scale: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= tol * scale


def same(a: Recomputed, b: Recomputed, mode: str, rtol: float) -> bool:
    """Whether two results of the same microbatches agree: exact lanes where both have them and the mode is
    exact, else the loss and the projections (bitwise in exact mode, relatively in tolerance mode; NaN equals NaN:
    a poisoned batch gives NaN everywhere)."""
    if mode == "exact" and a.lanes is not None and b.lanes is not None:
        return a.lanes == b.lanes and _close(a.loss, b.loss, 0.0, 1.0)
    tol = 0.0 if mode == "exact" else rtol
    finite = [abs(v) for v in b.proj if math.isfinite(v)]
    scale = max(math.sqrt(max(b.sumsq, 0.0)) if math.isfinite(b.sumsq) else 0.0, max(finite, default=0.0), 1e-30)
    return (len(a.proj) == len(b.proj) and _close(a.loss, b.loss, tol, max(abs(b.loss), 1e-12) if math.isfinite(b.loss) else 1.0)
            and all(_close(x, y, tol, scale) for x, y in zip(a.proj, b.proj, strict=True)))


def judge(recorded: Recomputed, reference: Recomputed, replayed: Recomputed, mode: str, rtol: float) -> Outcome:
    """The verdict of one replay (see the module doc). Pure."""
    if same(recorded, reference, mode, rtol):
        return Outcome.NO_HOST_TO_BLAME
    if same(replayed, recorded, mode, rtol):
        return Outcome.REPRODUCED
    if same(replayed, reference, mode, rtol):
        return Outcome.NOT_REPRODUCED
    return Outcome.INCONCLUSIVE


def load_model(spec: str) -> tuple[torch.nn.Module, LossFn]:
    """``FILE.py:FUNC`` or ``package.module:FUNC``: a function returning ``(model, loss_fn)``, the training model
    (unwrapped: no DDP) and its ``loss_fn(model, batch)``.

    The file or module is imported: its top-level code runs in this process, a file's folder first on
    ``sys.path`` (its own imports: ``models.py`` beside it). Name only code you would run.

    Raises:
        InvalidState: the spec, the import or the call fails (the message says which).
    """
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise InvalidState(f"model={spec!r} is not FILE.py:FUNC or package.module:FUNC")
    try:
        if where.endswith(".py"):
            path = os.path.abspath(where)
            sys.path.insert(0, os.path.dirname(path))  # the file's own imports (models.py beside it)
            loaded = importlib.util.spec_from_file_location(f"vckpt_replay_{os.path.basename(path)[:-3]}", path)
            if loaded is None or loaded.loader is None:
                raise ImportError(f"cannot load {where}")
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        got = getattr(module, name)()
    except Exception as e:  # noqa: BLE001 - the user's code: any failure becomes one line
        raise InvalidState(f"model={spec}: {type(e).__name__}: {_first_line(e)}; "
                           "it must name a function returning (model, loss_fn)") from None
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.nn.Module) and callable(got[1])):
        raise InvalidState(f"model={spec} returned {type(got).__name__}, not (torch.nn.Module, loss_fn)")
    return got[0], got[1]


def _load_state(module: torch.nn.Module, bundle: Bundle, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    if list(params) != bundle.params or sorted(buffers) != sorted(bundle.buffers):
        missing = sorted(set(bundle.params) ^ set(params))[:3] or ["(parameter order)"]
        raise InvalidState(f"the model that model= builds is not the one trained: its parameters differ from the bundle's "
                           f"({', '.join(missing)}); build the same architecture")
    # Every tensor checked before any is copied: copy_ would broadcast a smaller one silently.
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = [
        (f"parameter {n}", params[n], tensors[f"param/{i}"]) for i, n in enumerate(bundle.params)]
    pairs += [(f"buffer {n}", buffers[n], tensors[f"buffer/{i}"]) for i, n in enumerate(bundle.buffers)]
    for what, mine, t in pairs:
        if mine.shape != t.shape or mine.dtype != t.dtype:
            raise InvalidState(f"{what} is {tuple(mine.shape)} {mine.dtype} in the model and {tuple(t.shape)} {t.dtype} "
                               "in the bundle; build the same architecture")
    with torch.no_grad():
        for _, mine, t in pairs:
            mine.copy_(t)
    return [params[n] for n in bundle.params]


def _microbatches(bundle: Bundle, s: BundleSuspect, tensors: dict[str, torch.Tensor], device: torch.device) -> list[Any]:
    """The suspect's microbatches on ``device`` with their random states (the bundle has checked the names, the
    structures and the CPU states; a CUDA state is checked here, where the device it is for is known)."""
    out = []
    for j, (spec, leaves, has_cuda) in enumerate(s.microbatches):
        mb = decode([tensors[f"mb/{s.rank}/{j}/{k}"].to(device) for k in range(leaves)], spec)
        cuda = tensors[f"rng/{s.rank}/{j}/cuda"] if has_cuda else None
        if cuda is not None and device.type == "cuda" and cuda.shape != torch.cuda.get_rng_state(device).shape:
            raise BundleError(f"the replay bundle of incident {bundle.incident} is malformed (rng/{s.rank}/{j}/cuda is "
                              f"{tuple(cuda.shape)}, not a random state of {device}); it is never replayed")
        out.append((mb, (tensors[f"rng/{s.rank}/{j}/cpu"], cuda)))
    return out


def replay(bundle: Bundle, tensors: dict[str, torch.Tensor], model: torch.nn.Module, loss_fn: LossFn, *,
           host: str | None = None, faults: tuple[str, ...] = (), ranks: tuple[int, ...] = ()) -> list[Replayed]:
    """Recompute each suspect's step (or those in ``ranks``) with ``model`` on this host and judge it.

    ``faults``: fault specs simulated during the recomputation as the training step saw them (``grad`` on the
    first bucket, ``compute`` on a forward output; the suspect's rank and the incident's step): drills and tests.
    """
    here = host or local_host()
    params = _load_state(model, bundle, tensors)
    device = params[0].device if params else torch.device("cpu")
    plan = FaultPlan(faults)
    r = bundle.recipe
    project = Projector(r.lanes, r.seed, device)
    chosen = [s for s in bundle.suspects if not ranks or s.rank in ranks]
    if not chosen:
        raise InvalidState(f"the bundle's suspects are ranks {[s.rank for s in bundle.suspects]}; pick one of them")
    if plan.has_site("compute") and len(chosen) > 1:
        raise InvalidState("a simulated compute fault replays one suspect at a time: add rank=R")
    out = []
    for s in chosen:
        plan.hook_compute(model, s.rank, lambda: r.step)

        def hit(index: int, flat: torch.Tensor, rank: int = s.rank) -> None:
            if index == 0:  # where the guard's tap applies a ``grad`` fault
                plan.apply("grad", rank, r.step, flat)

        model.train()
        mbs = _microbatches(bundle, s, tensors, device)
        try:
            loss, proj, lanes = recompute(model, params, loss_fn, mbs, r.layout, project, hit)
        except Exception as e:  # noqa: BLE001 - the user's model on data from the store: a refusal, never a traceback
            raise InvalidState(
                f"rank {s.rank}'s microbatches from the bundle do not run through the given model and loss_fn "
                f"({type(e).__name__}: {_first_line(e)}); give the trained model and its loss (if they are, the "
                "bundle's microbatches were altered); nothing was judged") from None
        got = Recomputed(float(loss), proj.tolist(), (int(lanes[0]), int(lanes[1])))
        outcome = judge(s.recorded, s.reference, got, r.mode, r.rtol)
        out.append(Replayed(s.rank, s.host, here, outcome, _line(outcome, s, here, bundle)))
    return out


def _first_line(e: BaseException) -> str:
    try:
        text = str(e).strip()
    except Exception:  # noqa: BLE001 - an exception of the user's code whose message itself fails
        text = ""
    return text.splitlines()[0][:300] if text else "no message"


def _line(outcome: Outcome, s: BundleSuspect, here: str, bundle: Bundle) -> str:
    who = f"rank {s.rank}'s step {bundle.recipe.step} (on {s.host})"
    on = "this host, the one the incident names" if here == s.host else f"this host ({here}), which the incident does not name"
    return {
        Outcome.REPRODUCED: f"reproduced on {on}: {who} computes the same wrong result again, a persistent fault: "
                            "replace the node",
        Outcome.NOT_REPRODUCED: f"not reproduced on {here}: {who} computes what the healthy rank {s.reference_rank} did; "
                                + ("a transient fault on this host" if here == s.host else
                                   f"a transient fault, or the fault is on {s.host}: replay there to tell"),
        Outcome.NO_HOST_TO_BLAME: f"no host to blame: healthy rank {s.reference_rank} computed what {who} recorded, so any "
                                  "host does; the cause is the software or the data",
        Outcome.INCONCLUSIVE: f"inconclusive on {here}: {who} gives neither the suspect's result nor the healthy rank's; "
                              "suspect this host too",
    }[outcome]
