"""``vckpt supervise``: run a training job's launch command, read the verdict from its run, and restart it from
the rollback target, kept off the suspect hosts, or stop with the exit-code table's verdict (``supervise.decide``).

The launcher's own restarts (``torchrun --max-restarts``) retry a crash in place, on the same hosts; this loop
sits outside it and is the one that moves a job off a host that an incident names. Hosts still suspect in the run
when it starts (named by an earlier incident and not cleared since: a rollback does not clear a host,
``recovery.health``) are excluded before the first attempt, as a new incident's are before a restart. The command is run as given
(no shell), with ``{exclude}`` in any argument replaced by the comma-separated hosts excluded so far (Slurm's
``--exclude`` form) and ``VCKPT_ATTEMPT`` / ``VCKPT_EXCLUDED_HOSTS`` in its environment. The hook
(``--on-exclude``) is a command template, split as a shell would split it and run without one, before the job is
restarted; it must succeed: a hostfile rewrite, a ``kubectl cordon``, a script that drains Slurm nodes.

Host names are data, never code. They come from records whose reader holds every host to RFC 1123's grammar
(``hosts.host_problem``: no shell metacharacter, no space, no leading ``-``), and the supervisor checks them
again before any reaches a command. In the hook, ``{hosts}`` must be a whole argument and becomes one argument per
host (``kubectl cordon {hosts}`` runs ``kubectl cordon n1 n2``); a template that pastes it into a larger argument
(``sh -c "echo {hosts} >> f"``, a string a shell would parse) is refused before the job first runs. The hook also
gets the hosts, comma separated, in ``VCKPT_EXCLUDE_HOSTS``. ``{exclude}`` in the job's command is a
comma-separated list of such names: it holds no space or metacharacter and cannot start with ``-``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import InvalidConfig
from ..hosts import host_problem
from ..jsonx import short_repr
from .exits import ExitCode
from .supervise import Attempt, Decision, decide

__all__ = ["hook_argv", "hook_template", "supervise"]

HOOK_TIMEOUT_S = 300.0
HOSTS = "{hosts}"


def supervise(command: Sequence[str], run: str, *, max_restarts: int = 3, backoff_s: float = 5.0,
              on_exclude: str | None = None, storage_options: dict[str, Any] | None = None,
              log: Callable[[str], None] = print) -> int:
    """Run ``command`` until it succeeds or a rule stops it; return the exit code to end with.

    Raises:
        InvalidConfig: ``on_exclude`` is not a template the hook can run safely (before anything runs).
    """
    from ..checkpoint.manager import CheckpointManager

    hook = None if on_exclude is None else hook_template(on_exclude)

    def view() -> Any:
        return CheckpointManager(run, storage_options=storage_options).view()

    first = view()
    seen = {i.id for i in first.open_incidents()}  # open before this supervisor: not an attempt's verdict
    attempts: list[Attempt] = []
    excluded = _suspects_at_start(first.exclude_hosts(), hook, log)
    if excluded is None:
        return int(ExitCode.SDC_HOSTS_NAMED)
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
        if fresh and hook is not None and not _hook(hook, fresh, excluded, log):
            return int(decision.code)
        excluded += fresh
        time.sleep(delay)
        delay = min(delay * 2, 300.0)


def _suspects_at_start(hosts: list[str], hook: list[str] | None, log: Callable[[str], None]) -> list[str] | None:
    """The run's suspect hosts, excluded before the first attempt (the hook run for them); ``None``: they cannot be
    (no hook, or it failed), so the job is not started onto them (exit 4, as for a restart)."""
    if not hosts:
        return []
    log(f"hosts {', '.join(hosts)} are still suspect in the run (named by an incident, cleared by no replay or "
        "vckpt clear-host): keeping the job off them")
    if hook is None:
        log("no on_exclude hook can keep the job off them: not starting it; pass --on-exclude, or clear the hosts "
            "once they are checked (vckpt node-health says how)")
        return None
    return hosts if _hook(hook, hosts, [], log) else None


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


def hook_template(template: str) -> list[str]:
    """``--on-exclude``'s arguments, split as a shell splits them, with ``{hosts}`` only as a whole argument.

    Raises:
        InvalidConfig: the template is empty, cannot be split (an unclosed quote), or pastes ``{hosts}`` into a
            larger argument: a host would then be text that the command may parse (``sh -c``), not an argument.
    """
    try:
        argv = shlex.split(template)
    except ValueError as e:
        raise InvalidConfig(f"on_exclude {short_repr(template)} cannot be split into arguments ({e}); quote it as a "
                            "shell would") from None
    if not argv:
        raise InvalidConfig("on_exclude is empty: give the command to run before a restart, with {hosts}")
    pasted = next((a for a in argv if HOSTS in a and a != HOSTS), None)
    if pasted is not None:
        raise InvalidConfig(f"on_exclude: {HOSTS} must be a whole argument (it becomes one argument per host), got "
                            f"{short_repr(pasted)}; no shell may parse a host name - pass the hosts to a script that "
                            'reads them as "$@" (docs/RECOVERY.md)')
    return argv


def hook_argv(template: list[str], hosts: Sequence[str]) -> list[str]:
    """The hook's command for ``hosts``: each whole ``{hosts}`` argument becomes one argument per host."""
    return [out for a in template for out in (list(hosts) if a == HOSTS else [a])]


def _hook(template: list[str], hosts: list[str], excluded: list[str], log: Callable[[str], None]) -> bool:
    bad = next((why for h in hosts if (why := host_problem(h))), None)
    if bad is not None:  # the reader refuses such a record; a second check where a name meets a command
        log(f"not running the on_exclude hook: {bad}; not restarting onto hosts it could not exclude")
        return False
    argv = hook_argv(template, hosts)
    env = {**os.environ, "VCKPT_EXCLUDE_HOSTS": ",".join(hosts), "VCKPT_EXCLUDED_HOSTS": ",".join(excluded + hosts)}
    log(f"excluding {', '.join(hosts)}: {shlex.join(argv)}")
    try:
        done = subprocess.run(argv, env=env, timeout=HOOK_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        log(f"the on_exclude hook failed ({e}): not restarting onto hosts it could not exclude")
        return False
    if done.returncode != 0:
        log(f"the on_exclude hook exited {done.returncode}: not restarting onto hosts it could not exclude")
    return done.returncode == 0

