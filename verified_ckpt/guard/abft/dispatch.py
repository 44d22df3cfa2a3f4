"""What ABFT's hooks cost the host around their own work, calibrated once per process.

The budget times each of ABFT's hooks from its first line to its return (:func:`timed`). What happens around
that is as real and was untimed, so the estimate read it as training's time (the step without the guard looked
slower, the guard cheaper): autograd's C++ calling back into Python for each tensor hook, a module call leaving
its fast path for its hooks, the view node each tapped input adds, the wrapper's own call; and for the product
checks' ``TorchFunctionMode``, the packing and dispatch of every torch call it intercepts. A two-layer Hugging
Face Llama makes 92 hook calls and 92 interceptions a step, each hook call 11-16 µs inside its step of which the
hook's own timer sees 5-6 (docs/BENCHMARKS.md, "The estimate's dispatch costs").

:func:`costs` measures both once per process on a tiny ``nn.Linear`` (about 14 ms, at the guard's construction),
and the stopwatch charges each hook call and interception counted in a step at that rate (``budget.Stopwatch.take``).
The figures are host time on this machine at the time of the calibration: what a hook's dispatch costs does not
depend on the tensors' sizes, so the tiny layer stands for any. A hook among a model's other work runs colder than
in the calibration's loop: the charge is a floor of what dispatch costs, 3-5 µs of the 5-10 µs measured there.

Inside a real step they cost more than that floor: a hook's body leaves the caches to the checks' tensors, and the
training's next kernels run colder (a two-layer Hugging Face Llama's own forward, backward and update ran 30 %
slower with the hooks on, 2.25 ms a step, of which the floor charged a fifth; docs/BENCHMARKS.md, "Where the
estimate's last gap is"). No clock inside the step can tell that time from training's. :func:`in_situ` measures it
once per process on the training's own model and batch: a few forward-backward replays without ABFT's hooks (the
model as it runs without the guard) alternated with replays with them (:class:`Installed`, :class:`Sides`: under
DDP and in one process with no other module hook in either; under FSDP2 with FSDP's and a plan's own, on every rank
at once); what the hooked replays took beyond the plain ones and beyond what the hooks' own timers saw is charged
per hook call and interception from then on (:class:`Calibration`), scaled from the floor's two rates, where it
stands out of the replays' own spread (:func:`charged`: a large model's pass on a CPU moves by more from run to run
than its hooks cost around their bodies, and there the floor stands).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ..budget import Stopwatch
from ..nocast import own_precision
from .flops import QUIET

__all__ = ["SETTLED", "Calibration", "Installed", "Sides", "charged", "costs", "device_sync", "empty_hooks", "in_situ",
           "least_extra", "timed", "timer"]

log = logging.getLogger("verified_ckpt")

_NOTHING = contextlib.nullcontext()
_ROUNDS = 9  # calibration rounds a side (the fastest of each is kept: an interruption only adds time)
_CALLS = 8  # forwards and backwards, or intercepted calls, per round
_PAIRS = 3  # in-situ replay pairs (plain, hooked): at least this many for a figure (the median is kept)
_MOST = 12  # and at most this many,
_SHORT = 0.5  # more than _PAIRS only while the replays have taken less than this many seconds;
_LONG = 10.0  # and one pair only (no figure: the start-up rates stand) where it took longer than this
# The replays run after this many steps passed. A run's first steps are not its steady state (coverage's probe, lazy
# set-ups, the first consensus and audit; the budget's averages take a fifth of each new step), and a run that ends
# within them (a smoke test, a fault caught early) gained nothing from replays that cost as many forward-backwards as
# its steps: a 4-rank torchtitan-plan test spent 17.5 % of its CPU samples in them, at the second step of every run
# (docs/BENCHMARKS.md, issue 51's thirteenth turn). Not later: the estimate a short run reads (a GPU check's 16 steps on
# a lent device) would keep the start-up rate, which sees no device time.
SETTLED = 5


def timed(watch: Stopwatch, fn: Callable[..., Any], counted: bool = True, backward: bool = False) -> Callable[..., Any]:
    """``fn``, the checks' own work: timed as ABFT's, and not counted as the backward's FLOPs (coverage's
    denominator). ``counted``: ``fn`` is a hook that autograd or a module call dispatches (not a function the
    checks call themselves), whose dispatch the stopwatch charges at :func:`costs`' rate. ``backward``: a hook
    the backward calls, whose arithmetic leaves a caller's autocast (``nocast``; a forward hook reads autocast's
    state and casts as it would). One plain closure: the hooks wrap a callback per forward, and
    ``functools.wraps`` cost more."""
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            with QUIET, own_precision() if backward else _NOTHING:
                return fn(*args, **kwargs)
        finally:
            watch.abft += time.perf_counter() - t0
            watch.hooks += counted

    return run


def timer(watch: Stopwatch) -> Callable[..., Callable[..., Any]]:
    """What wraps each of ABFT's hooks for ``watch`` (:func:`timed`), the stopwatch given this process's dispatch
    costs to charge them at."""
    watch.dispatch = costs()
    return functools.partial(timed, watch)


@functools.cache
def costs() -> tuple[float, float]:
    """Seconds per hook call beyond what :func:`timed` times, and per torch call a ``TorchFunctionMode``
    intercepts; measured once per process. ``(0.0, 0.0)`` where the calibration cannot run here (a mode of the
    caller's own is active, say): the estimate then counts the hooks' bodies only, as it did before."""
    try:
        # The Linear's initialisation draws from the CPU generator: training's random state is put back after
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), torch.autocast("cpu", enabled=False):
            return _per_hook(), _per_interception()
    except Exception:  # noqa: BLE001 - an estimate's refinement must never stop a guard from starting
        return 0.0, 0.0


def empty_hooks(module: torch.nn.Module, watch: Stopwatch) -> tuple[RemovableHandle, RemovableHandle]:
    """ABFT's four hook calls a forward and backward of a Linear-like ``module``, their bodies empty and
    :func:`timed` by ``watch``: a pre-hook tapping the input through a view with a tensor hook, a forward hook
    registering one on the output. What the calibration times, and ``tools/bench/dispatch_check.py`` inside a real
    model. Returns the two module hooks' handles."""
    grad_hook = timed(watch, lambda g: None)

    def pre(_m: torch.nn.Module, args: Any) -> Any:
        tapped = args[0].view_as(args[0])
        tapped.register_hook(grad_hook)
        return (tapped,)

    def post(_m: torch.nn.Module, _args: Any, out: torch.Tensor) -> None:
        out.register_hook(grad_hook)

    return module.register_forward_pre_hook(timed(watch, pre)), module.register_forward_hook(timed(watch, post))


def _per_hook() -> float:
    """A Linear's four hooks as ABFT installs them (:func:`empty_hooks`): a round's time with them, less what their
    stopwatch timed, against a round's without, per hook call (:func:`least_extra`)."""
    lin = torch.nn.Linear(4, 4)
    x = torch.ones(2, 4, requires_grad=True)
    watch = Stopwatch()

    def once() -> float:
        t0 = time.perf_counter()
        for _ in range(_CALLS):
            lin(x).sum().backward()
        return time.perf_counter() - t0

    once()  # the first backward's own set-up, in neither figure
    hooks = empty_hooks(lin, watch)
    plain, hooked = [], []
    try:
        for _ in range(_ROUNDS):  # alternated: a slower stretch of the machine falls on both sides
            for h in hooks:
                h.remove()
            plain.append(once())
            hooks = empty_hooks(lin, watch)
            before = watch.abft
            hooked.append(once() - (watch.abft - before))
    finally:
        for h in hooks:
            h.remove()
    return least_extra(plain, hooked, 4 * _CALLS)


def least_extra(plain: Sequence[float], hooked: Sequence[float], calls: int) -> float:
    """Seconds per call that the ``hooked`` rounds took beyond the ``plain`` ones, from each side's fastest round: an
    interruption (another process on the core, a page fault) only ever adds time, so the least of each side is the
    round it spared. The median of per-pair differences was not: on a loaded host, where other ranks start up on the
    same cores, it read anything from 0 to 49 µs a hook call from one launch to the next (docs/BENCHMARKS.md, issue
    51's ninth turn)."""
    return max((min(hooked) - min(plain)) / calls, 0.0)


class _Passing(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _per_interception() -> float:
    """One torch call inside a mode that passes every call through, less the same call outside it."""
    a = torch.ones(4)

    def once(mode: TorchFunctionMode | None) -> float:
        t0 = time.perf_counter()
        with mode if mode is not None else contextlib.nullcontext():
            for _ in range(_CALLS):
                torch.add(a, a)
        return time.perf_counter() - t0

    mode = _Passing()
    plain, hooked = [], []
    for _ in range(_ROUNDS):
        plain.append(once(None))
        hooked.append(once(mode))
    return least_extra(plain, hooked, _CALLS)


class Installed:
    """The module hooks registered on ``module``'s modules inside a ``with Installed(module) as hooks:`` block (ABFT's
    construction), so that :meth:`only` can run the module with those alone, or with none: every other module hook
    (a user's, a test's fault) taken off meanwhile, and every hook put back in its place after. ABFT's tensor hooks
    are registered by its forward hooks, per call."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.added: set[tuple[int, int]] = set()
        self._before: set[tuple[int, int]] = set()

    def _dicts(self) -> Iterator[dict[int, Any]]:
        for m in self.module.modules():
            yield from (m._forward_pre_hooks, m._forward_hooks, m._backward_pre_hooks, m._backward_hooks)

    def __enter__(self) -> Installed:
        self._before = {(id(d), k) for d in self._dicts() for k in d}
        return self

    def __exit__(self, *exc: object) -> None:
        self.added = {(id(d), k) for d in self._dicts() for k in d if (id(d), k) not in self._before}

    @contextlib.contextmanager
    def only(self, own: bool) -> Iterator[None]:
        """The modules with these hooks alone (``own``), or with no hook: the model as it runs without the guard
        (a module with no hook takes its call's fast path). Nobody else's hook sees the passes run inside: a hook
        that counts its module's calls, one a step, still counts the steps."""
        with self._keeping(lambda key: own and key in self.added):
            yield

    @contextlib.contextmanager
    def without(self) -> Iterator[None]:
        """The modules with every hook but these: where the model cannot run without its framework's own module
        hooks (FSDP2 gathers its parameters in one, a tensor-parallel plan redistributes in others)."""
        with self._keeping(lambda key: key not in self.added):
            yield

    def alone(self) -> Sides:
        """A replay pair's two sides where the model runs without anyone's module hooks (DDP, one process)."""
        return Sides(lambda: self.only(own=False), lambda: self.only(own=True))

    @contextlib.contextmanager
    def _keeping(self, keep: Callable[[tuple[int, int]], bool]) -> Iterator[None]:
        kept = [(d, list(d.items())) for d in self._dicts() if d]
        for d, _ in kept:
            for k in [k for k in d if not keep((id(d), k))]:
                del d[k]
        try:
            yield
        finally:
            for d, items in kept:  # every hook back, in its order among the others'
                d.clear()
                d.update(items)


@dataclasses.dataclass(frozen=True)
class Sides:
    """How a replay pair runs the model: ``plain()`` as it runs without the guard's checks, ``hooked()`` with
    ABFT's hooks (context managers, entered around one pass each)."""

    plain: Callable[[], contextlib.AbstractContextManager[Any]]
    hooked: Callable[[], contextlib.AbstractContextManager[Any]]


def _alone(seconds: float) -> float:
    return seconds


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for ``device``'s queued work before a replay's clock reads (nothing on a CPU)."""
    if device.type == "cuda":
        return functools.partial(torch.cuda.synchronize, device)
    return lambda: None


def in_situ(run: Callable[[], None], sides: Sides, watch: Stopwatch, sync: Callable[[], None],
            agree: Callable[[float], float] = _alone) -> tuple[float, float] | None:
    """The rates to charge ABFT's hook calls and interceptions at, measured inside the training's own step: ``run()``
    is one of its forward-backward passes (the caller puts back what it changes), run on each of ``sides``,
    alternated, in :data:`_PAIRS` pairs or more while they are short (:data:`_SHORT`); ``sync()`` waits for the
    device. Where the passes run collectives (FSDP2), every rank must run as many: ``agree(seconds)`` turns this
    rank's time so far into the one every rank decides on (the slowest rank's). ``watch``'s figures are left as they
    were. The rates are :func:`charged`'s; ``None``: the start-up rates stand."""
    kept = (watch.abft, watch.hooks, watch.intercepted)

    def clock() -> float:
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        return time.perf_counter() - t0

    untimed: list[float] = []
    calls, start = (0, 0), time.perf_counter()
    try:
        while len(untimed) < _MOST:  # alternated: a slower stretch of the machine falls on both sides of a pair
            spent = agree(time.perf_counter() - start)
            if untimed and (spent > _LONG or (len(untimed) >= _PAIRS and spent > _SHORT)):
                break
            with sides.plain():
                plain = clock()
            watch.abft, watch.hooks, watch.intercepted = 0.0, 0, 0
            with sides.hooked():
                hooked = clock()
            untimed.append(hooked - plain - watch.abft)
            calls = (watch.hooks, watch.intercepted)
    finally:
        watch.abft, watch.hooks, watch.intercepted = kept
    return charged(untimed, calls, watch.dispatch)


def charged(untimed: Sequence[float], calls: tuple[int, int], floor: tuple[float, float]) -> tuple[float, float] | None:
    """The rates per hook call and per interception from what each replay pair measured beyond the hooks' timed
    bodies (``untimed``, seconds, for ``calls`` hook calls and interceptions a pass): the median, per call, at the
    start-up rates' ratio (``floor``), never below them. ``None`` (the floor stands) where the median does not stand
    out of the pairs' own spread: fewer than :data:`_PAIRS` pairs, or a median within three standard errors of
    zero. A large model's pass moves by more from one run to the next than its hooks cost around their bodies, and a
    difference of two noisy times, floored at the start-up rate, would only ever err upwards."""
    n = len(untimed)
    if not sum(calls) or n < _PAIRS:
        return None
    mid = statistics.median(untimed)
    spread = 1.4826 * statistics.median(abs(u - mid) for u in untimed)  # the median absolute deviation, as a sigma
    if mid <= 3 * 1.2533 * spread / math.sqrt(n):  # the median's standard error, 1.2533 sigma / sqrt(n)
        return None
    a, b = floor
    at_floor = calls[0] * a + calls[1] * b
    if at_floor <= 0:
        per = mid / sum(calls)
        return per, per
    scale = max(mid / at_floor, 1.0)
    return a * scale, b * scale


SPREAD = "the start-up rate: replays of this model's step could not tell more from their own spread"
OUT_OF_STEP = ("SDCGuard: this rank's replay of its step (measuring once what ABFT's hooks cost in place) raised while "
               "its peers run the replay's collectives: it stops here, as a failed audit does, rather than go on out "
               "of step with them")
MEASURED = "measured in place, in replays of this model's step"


class Calibration:
    """When a layout measures ABFT's hooks in place (:func:`in_situ`), and what it charges after: once per process,
    after the :data:`SETTLED`-th step that passed while ABFT checks the next (until then the start-up rates
    stand)."""

    def __init__(self) -> None:
        self.passed = 0  # steps passed in this process
        self.done = False
        self.measured = False  # whether the replays' rate stands (else the start-up rate's)

    def due(self, checks: Any) -> bool:
        """A step passed (``checks``: the layout's ``GradientChecks``, or None): whether to measure now."""
        self.passed += 1
        if checks is None or self.done or self.passed < SETTLED or not checks.on or checks.probing:
            return False
        self.done = True
        return True

    def settle(self, checks: Any, watch: Stopwatch, measure: Callable[[], tuple[float, float] | None], rank: int,
               failed: str | None) -> None:
        """Charge ``watch``'s hook calls what ``measure()`` (the layout's replays) found, or keep the start-up rates
        (``failed``: why, where the replays raised); rank 0 logs which. ``checks`` forget what the replays recorded.

        ``failed`` None: the replays run collectives (FSDP2's, and a plan's redistributions), one sequence of them
        on every rank, as an audit's recomputation is, and an error in them is raised as an audit's is, with a
        note: a rank that went on after its own replay failed would leave its peers inside the rest of
        that replay, and its next step's collectives would pair with theirs (a layer's parameter all-gather
        answering another layer's, of the same size), training on values that no check sees as wrong."""
        rates, why = None, SPREAD
        try:
            rates = measure()
        except Exception as e:
            if failed is None:
                log.error("%s (%s: %s)", OUT_OF_STEP, type(e).__name__, e)
                if hasattr(e, "add_note"):  # Python 3.11 and later; the log line says it on 3.10
                    e.add_note(OUT_OF_STEP)
                raise
            log.debug("ABFT's in-place dispatch calibration did not run: %s", e)  # an estimate's refinement only
            why = failed
        finally:
            checks.reset()  # the replays' records are not a step's
        if rates is not None:
            watch.dispatch = rates
            self.measured, why = True, MEASURED
        if rank == 0:
            log.info("SDCGuard: ABFT's hooks charged %.1f us a call around their own work (%s)",
                     watch.dispatch[0] * 1e6, why)
