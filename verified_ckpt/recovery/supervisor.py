"""``vckpt supervise``: run a training job's launch command, read the verdict from its run, and restart it from
the rollback target, kept off the suspect hosts, or stop with the exit-code table's verdict (``supervise.decide``).

The launcher's own restarts (``torchrun --max-restarts``) retry a crash in place, on the same hosts; this loop
sits outside it and is the one that moves a job off a host that an incident names. The command is run as given
(no shell), with ``{exclude}`` in any argument replaced by the comma-separated hosts excluded so far (Slurm's
``--exclude`` form) and ``VCKPT_ATTEMPT`` / ``VCKPT_EXCLUDED_HOSTS`` in its environment. The hook
(``--on-exclude``) is a command template run with ``{hosts}`` replaced by the hosts to exclude, space separated:
a Slurm ``scontrol``, a hostfile rewrite, a ``kubectl cordon``. It must succeed before the job is restarted.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from .supervise import Attempt, Decision, decide

__all__ = ["supervise"]

HOOK_TIMEOUT_S = 300.0


def supervise(command: Sequence[str], run: str, *, max_restarts: int = 3, backoff_s: float = 5.0,
              on_exclude: str | None = None, storage_options: dict[str, Any] | None = None,
              log: Callable[[str], None] = print) -> int:
    """Run ``command`` until it succeeds or a rule stops it; return the exit code to end with."""
    from ..checkpoint.manager import CheckpointManager

    def view() -> Any:
        return CheckpointManager(run, storage_options=storage_options).view()

    seen = {i.id for i in view().open_incidents()}  # open before this supervisor: not an attempt's verdict
    attempts: list[Attempt] = []
    excluded: list[str] = []
    delay = backoff_s
    while True:
        argv = [a.replace("{exclude}", ",".join(excluded)) for a in command]
        env = {**os.environ, "VCKPT_ATTEMPT": str(len(attempts)), "VCKPT_EXCLUDED_HOSTS": ",".join(excluded)}
        log(f"attempt {len(attempts)}: {shlex.join(argv)}")
        code = _run(argv, env)
        now = view()
        new = [i for i in now.open_incidents() if i.id not in seen]
        seen |= {i.id for i in new}
        target, _ = now.rollback_target()
        attempts.append(Attempt(code, new, None if target is None else target.step))
        decision = decide(attempts, max_restarts=max_restarts, can_exclude=on_exclude is not None)
        log(f"attempt {len(attempts) - 1} exited {code}: {decision.action} (exit {int(decision.code)}): "
            f"{decision.reason}")
        _record(run, len(attempts) - 1, code, decision, storage_options, log)
        if decision.action != "restart":
            return int(decision.code)
        fresh = [h for h in decision.exclude if h not in excluded]
        if fresh and on_exclude is not None and not _hook(on_exclude, fresh, log):
            return int(decision.code)
        excluded += fresh
        time.sleep(delay)
        delay = min(delay * 2, 300.0)


def _record(run: str, attempt: int, code: int, decision: Decision, storage_options: dict[str, Any] | None,
            log: Callable[[str], None]) -> None:
    """The decision, in the run (the report's recovery table); a store that refuses it is logged, not fatal: the
    job's recovery matters more than its story."""
    from ..checkpoint.supervision import record_decision
    from ..errors import VerifiedCkptError

    try:
        record_decision(run, attempt=attempt, exit_code=code, action=decision.action, code=int(decision.code),
                        exclude=decision.exclude, reason=decision.reason, storage_options=storage_options)
    except VerifiedCkptError as e:
        log(f"could not record the decision in the run: {e}")


def _run(argv: list[str], env: dict[str, str]) -> int:
    try:
        child = subprocess.Popen(argv, env=env)
    except OSError as e:
        raise SystemExit(f"vckpt supervise: cannot start {argv[0]!r}: {e.strerror}") from None
    try:
        return child.wait()
    except BaseException:  # a signal to the supervisor ends the job too, within a bound
        child.terminate()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        raise


def _hook(template: str, hosts: list[str], log: Callable[[str], None]) -> bool:
    argv = [a.replace("{hosts}", " ".join(hosts)) for a in shlex.split(template)]
    log(f"excluding {', '.join(hosts)}: {shlex.join(argv)}")
    try:
        done = subprocess.run(argv, timeout=HOOK_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        log(f"the on_exclude hook failed ({e}): not restarting onto hosts it could not exclude")
        return False
    if done.returncode != 0:
        log(f"the on_exclude hook exited {done.returncode}: not restarting onto hosts it could not exclude")
    return done.returncode == 0

