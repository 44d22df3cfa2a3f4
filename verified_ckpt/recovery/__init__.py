"""Recovery without a person: verdicts as exit codes (``exits``), whether a host is suspect (``health``), and the
supervisor that restarts a job from its rollback target, off the suspect hosts (``supervise``, ``supervisor``).
Imports no torch: the CLI's ``node-health`` and ``supervise`` start fast."""

from .exits import ExitCode, exit_code_for, exit_on, incident_code, record_verdict, verdict_of
from .health import NodeHealth, node_health
from .supervise import Attempt, Decision, decide
from .supervisor import supervise

__all__ = ["Attempt", "Decision", "ExitCode", "NodeHealth", "decide", "exit_code_for", "exit_on", "incident_code",
           "node_health", "record_verdict", "supervise", "verdict_of"]
