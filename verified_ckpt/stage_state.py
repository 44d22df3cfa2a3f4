"""A pipeline stage's part of the whole training state, named as the whole model names it.

Under pipeline parallel each stage holds some of the model's layers and an optimizer over them. Saved as
``{"model": StageState(stage_module, optimizer)}`` on every rank, the checkpoint holds one entry: the union of
the stages' parts, each parameter and its optimizer state under the parameter's fully qualified name (the
model's own, which a split that keeps names, as torchtitan's does, leaves unchanged). A restore gives each
rank the part its own object names, so a job restores onto another number of stages, or one process holding the
whole model, as well as onto the stages it was saved from.

The names and the optimizer's state come from ``torch.distributed.checkpoint.state_dict`` (its flattened
optimizer state dict: one key per parameter and state, ``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``), the
same view DCP checkpoints use; FSDP2's DTensors stay sharded. Like DCP's, reading the state of an optimizer that
has not stepped first gives it zero state (a step with zero gradients and a learning rate of 0), which the
restore then overwrites.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StageState"]


class StageState:
    """One rank's part of the model and its optimizer, keyed by the whole model's parameter names (module doc).

    Args:
        module: the stage's module (``fully_shard``-ed or plain), or the whole model in one process.
        optimizer: the optimizer over ``module``'s parameters, or ``None`` for the model alone.
    """

    held_in_parts = True  # the ranks hold different parts: the checkpoint holds their union, each rank restores its own

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.module, self.optimizer = module, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        out: dict[str, Any] = {"model": get_model_state_dict(self.module)}
        if self.optimizer is not None:
            out["optim"] = get_optimizer_state_dict(self.module, self.optimizer, options=_flat())
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.module, sd["model"])
        if self.optimizer is not None:
            set_optimizer_state_dict(self.module, self.optimizer, sd["optim"], options=_flat())


def _flat() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)
