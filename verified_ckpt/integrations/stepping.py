"""A framework's optimizer step, routed through an SDC guard (the HF and Lightning integrations share it).

Frameworks call ``optimizer.step()`` themselves, after clipping, with no hook that can withhold the
update. So the integrations replace the optimizer object's ``step`` with one that runs the guard's
checks first: ``guard.step()`` then applies the original step only if every check passed. The guard
itself holds a view of the optimizer whose ``step`` is the original, so it never calls itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..guard import SDCGuard

__all__ = ["guarded_steps"]


class _Unguarded:
    """The optimizer as the guard drives it: ``step`` is the original one, every other attribute the optimizer's."""

    def __init__(self, optimizer: Any, step: Callable[..., Any]) -> None:
        self._optimizer, self.step = optimizer, step
        # Named as framework wrappers name what they wrap, so the update oracle finds the torch optimizer beneath
        # (``elementwise_optimizer``); hidden, state without a replica (FSDP2, TP) had no witness and never saved
        # ``restorable``.
        self.optimizer = optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def guarded_steps(optimizer: Any, build: Callable[[Any], SDCGuard]) -> SDCGuard:
    """Make ``optimizer.step(closure=None)`` run the closure (a framework's forward and backward, if it passes
    one), then the guard's checks, then the original step; ``build(unguarded)`` makes the guard."""
    original = optimizer.step
    guard = build(_Unguarded(optimizer, original))

    def step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        result = closure() if closure is not None else None
        guard.step()  # raises SilentCorruptionDetected, the update withheld, when a check fails
        return result

    # update_wrapper keeps the LR scheduler's mark on the step it wrapped (it warns about a replaced step otherwise).
    setattr(optimizer, "step", functools.update_wrapper(step, original))  # noqa: B010 - an instance attribute on purpose
    return guard
