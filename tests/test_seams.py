"""The integrations are built on the manager's public API only: no private attribute of ``CheckpointManager`` is
reached, and none of the manager's internal modules is imported (the public two-phase save and checked open,
``begin_save`` and ``open``, are what a framework's own save and load path uses)."""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "verified_ckpt"
# The manager's own parts: what it delegates to, never what an integration calls.
INTERNAL = {"saving", "recovery", "catalog", "reading", "loading", "opening", "session", "journal", "housekeeping",
            "lease", "stages", "verification", "fitting"}


def manager_privates() -> set[str]:
    tree = ast.parse((PKG / "checkpoint" / "manager.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointManager"]
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("_")
             and not n.name.endswith("__")}
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and node.attr.startswith("_"):
            names.add(node.attr)
    return names


def breaches(path: pathlib.Path, private: set[str]) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in private:
            out.append(f"{path.name}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if "checkpoint" in parts and parts[-1] in INTERNAL:
                out.append(f"{path.name}:{node.lineno}: imports checkpoint.{parts[-1]}")
            if parts[-1] == "checkpoint" and any(a.name in INTERNAL for a in node.names):
                out.append(f"{path.name}:{node.lineno}: imports an internal module of checkpoint")
    return out


def test_the_manager_has_private_parts_to_protect():
    assert {"_store", "_catalog", "_recovery", "_begin"} <= manager_privates()


@pytest.mark.parametrize("module", sorted(p.name for p in (PKG / "integrations").glob("*.py")))
def test_each_integration_uses_only_the_public_manager_api(module):
    assert breaches(PKG / "integrations" / module, manager_privates()) == []


def test_the_check_finds_a_reach_into_the_manager(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from ..checkpoint.saving import Saver\n\ndef f(manager):\n    return manager._catalog.view()\n")
    assert len(breaches(bad, manager_privates())) == 2


# ------------------------------------------------------------------ errors at the seams
def test_every_config_object_refuses_a_bad_value_as_invalid_config():
    from verified_ckpt import CheckpointManager, GuardConfig, InvalidConfig, VerifiedCkptError
    from verified_ckpt.service import ServiceConfig

    for make, needle in [(lambda: GuardConfig(overhead=2.0), "overhead must be"),
                         (lambda: CheckpointManager("memory://seams/x", keep_last=0), "keep_last must be"),
                         (lambda: ServiceConfig(runs=("r",), poll_s=0), "poll_s must be > 0")]:
        with pytest.raises(InvalidConfig, match=needle) as e:
            make()
        assert isinstance(e.value, ValueError) and isinstance(e.value, VerifiedCkptError)


def test_library_messages_name_parameters_and_the_cli_says_flags(tmp_path):
    from click.testing import CliRunner

    from verified_ckpt import CheckpointManager, InvalidState
    from verified_ckpt_cli.main import main as vckpt

    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    import torch

    mgr.save(1, {"w": torch.ones(2)})
    with pytest.raises(InvalidState, match="grace_s must be a number of seconds >= 0") as e:
        mgr.gc(grace_s=-1)
    assert "--" not in str(e.value)
    with pytest.raises(InvalidState, match="to_step 1 is before from_step 3"):
        mgr.flag(3, to_step=1, reason="x")
    got = CliRunner().invoke(vckpt, ["gc", run, "--grace", "-1"])
    assert got.exit_code == 2 and "--grace must be a number of seconds >= 0" in got.stderr and "grace_s" not in got.stderr
    got = CliRunner().invoke(vckpt, ["flag", run, "--from-step", "3", "--to-step", "1", "--reason", "x"])
    assert got.exit_code == 2 and "--to-step 1 is before --from-step 3" in got.stderr


def test_a_flag_naming_a_rank_the_run_never_had_is_refused_and_nan_is_no_grace(tmp_path):
    from click.testing import CliRunner

    import torch
    from verified_ckpt import CheckpointManager
    from verified_ckpt_cli.main import main as vckpt

    run = str(tmp_path / "run")
    CheckpointManager(run).save(1, {"w": torch.ones(2)})  # one rank
    got = CliRunner().invoke(vckpt, ["flag", run, "--from-step", "1", "--rank", "99", "--reason", "x"])
    assert got.exit_code == 2 and "--rank [99] are not ranks of this run: its checkpoints were saved by ranks 0" in got.stderr
    assert CheckpointManager(run).incidents() == []
    got = CliRunner().invoke(vckpt, ["flag", run, "--from-step", "1", "--rank", "-1", "--reason", "x"])
    assert got.exit_code == 2 and "ranks=" not in got.stderr and "field" not in got.stderr
    got = CliRunner().invoke(vckpt, ["gc", run, "--grace", "nan"])
    assert got.exit_code == 2 and "--grace must be a number of seconds >= 0, got nan" in got.stderr


@pytest.mark.parametrize("args,needle", [
    (["verify", "{run}", "--jobs", "0"], "Invalid value for '--jobs'"), (["gc", "{run}", "--grace", "abc"], "'--grace'"),
    (["export", "{run}", "--to", "x", "--format", "xx"], "'--format'"), (["list"], "Missing argument 'RUN'"),
    (["--bogus"], "No such option '--bogus'"), (["supervise", "--max-restarts", "-1", "--run", "{run}", "--", "true"],
                                                "'--max-restarts'"),
])
def test_usage_errors_are_one_line_naming_the_flag_and_the_help(tmp_path, args, needle):
    from click.testing import CliRunner

    from verified_ckpt_cli.main import main as vckpt

    run = str(tmp_path / "run")
    got = CliRunner().invoke(vckpt, [a.format(run=run) for a in args])
    lines = got.stderr.strip().splitlines()
    assert got.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], got.stderr
    assert "--help`" in lines[0] and "Traceback" not in got.stderr and got.stdout == ""
