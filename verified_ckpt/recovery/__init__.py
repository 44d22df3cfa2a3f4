"""Recovery without a person: verdicts as exit codes (``exits``; torchelastic's error file: ``errorfile``),
whether a host is suspect (``health``), and the supervisor that restarts a job from its rollback target, off the
suspect hosts (``supervise``, ``supervisor``), the replay that tells a faulty host from a transient fault
(``replay``), and the one rule of where a job restarts after an incident (``restart``). A suspect host is cleared
only on the record (``clear_host``, ``record_replay``: ``checkpoint/clearance``), never by a rollback. Imports no
torch until a replay is asked for: the CLI's ``node-health`` and ``supervise`` start fast. ``host_problem`` and
``local_host`` are the one grammar of a host name and this machine's name in it (``verified_ckpt.hosts``), for the
tools that take a host."""

from typing import Any

from ..hosts import GRAMMAR as HOST_GRAMMAR
from ..hosts import host_problem, local_host
from .exits import ExitCode, exit_code_for, exit_on, incident_code, record_verdict, verdict_of
from .health import NodeHealth, node_health, suspect_hosts
from .supervise import Attempt, Decision, decide
from .supervisor import supervise

__all__ = ["HOST_GRAMMAR", "Attempt", "Decision", "ExitCode", "NodeHealth", "Outcome", "Replayed", "clear_host",
           "decide", "exit_code_for", "exit_on", "host_problem", "incident_code", "load_model", "local_host",
           "node_health", "record_replay", "record_verdict", "replay", "supervise", "suspect_hosts", "verdict_of"]


def __getattr__(name: str) -> Any:
    if name in ("Outcome", "Replayed", "load_model", "replay"):
        from . import replay as module

        return getattr(module, name)
    if name in ("clear_host", "record_replay"):  # they write the run: the checkpoint layer's catalog
        from ..checkpoint import clearance

        return getattr(clearance, name)
    raise AttributeError(f"module 'verified_ckpt.recovery' has no attribute {name!r}")
