"""Hostile and broken stores: records that cannot be read, restores that do not fit, FIFOs, huge manifests,
garbage ledgers, and outages. Nothing hangs, crashes, blows up memory, or changes what it should not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from click.testing import CliRunner

from helpers import fresh_state, trained_state
from verified_ckpt import (
    CheckpointManager,
    CheckpointNotRestorable,
    InvalidState,
    RNGState,
    Status,
    StorageError,
    state_fingerprint,
)
from verified_ckpt_cli.main import main as vckpt

pytestmark = pytest.mark.timeout(120)
KEY = "k" * 32


def signed_run(url: str, monkeypatch) -> tuple[CheckpointManager, list[str]]:
    monkeypatch.setenv("VCKPT_SIGNING_KEY", KEY)
    mgr = CheckpointManager(url)
    ids = [mgr.save(s, {"w": torch.full((4,), float(s))}).id for s in (1, 2, 3)]
    return mgr, ids


def incident_files(url: str) -> list[str]:
    d = os.path.join(url, "records", "incident")
    return [os.path.join(d, f) for f in sorted(os.listdir(d))]


# --------------------------------------------------------------------- records that cannot be read

TAMPER = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "padded past 1 MiB": lambda raw: raw + b" " * (1 << 20),
    "wrapped in a list": lambda raw: b"[" + raw + b"]",
    "re-typed ranks": lambda raw: json.dumps({**json.loads(raw), "ranks": 7}).encode(),
    "re-typed at": lambda raw: json.dumps({**json.loads(raw), "at": 5}).encode(),
    "renamed": None,  # moved to a name this library never writes
}


@pytest.mark.parametrize("how", list(TAMPER))
def test_a_tampered_signed_incident_keeps_every_checkpoint_it_covered_non_restorable(local_url, monkeypatch, how):
    mgr, ids = signed_run(local_url, monkeypatch)
    mgr.flag(2, reason="bad node")
    assert [i.status for i in mgr.list()] == [Status.UNVERIFIED, Status.SUSPECT, Status.SUSPECT]
    [path] = incident_files(local_url)
    if TAMPER[how] is None:
        os.rename(path, path.replace(".json", ".bak"))
    else:
        raw = open(path, "rb").read()
        open(path, "wb").write(TAMPER[how](raw))
    statuses = [i.status for i in mgr.list()]
    assert statuses == [Status.SUSPECT] * 3  # the unreadable record covers the whole run
    r = CliRunner().invoke(vckpt, ["incidents", local_url, "--json"])
    assert r.exit_code == 0 and [row["signature"] for row in json.loads(r.stdout)] == ["invalid"]
    assert "not trusted" in CliRunner().invoke(vckpt, ["incidents", local_url]).stdout
    with pytest.raises(CheckpointNotRestorable, match="no restorable checkpoint to roll back to.*(could not be read|invalid signature)"):
        mgr.record_rollback()
    assert CliRunner().invoke(vckpt, ["rollback", local_url]).exit_code == 1


def test_without_a_key_an_unreadable_record_is_reported_and_changes_no_status(local_url):
    mgr = CheckpointManager(local_url)
    mgr.save(1, {"w": torch.ones(2)})
    mgr.flag(1, reason="bad node")
    [path] = incident_files(local_url)
    open(path, "wb").write(b'{"kind": "manual", "first_suspect_step": "oops"')
    assert [i.status for i in mgr.list()] == [Status.UNVERIFIED]
    r = CliRunner().invoke(vckpt, ["list", local_url])
    assert r.exit_code == 0 and "could not be read" in r.stderr
    status = json.loads(CliRunner().invoke(vckpt, ["status", local_url, "--json"]).stdout)
    assert len(status["unreadable_records"]) == 1


# ------------------------------------------------------------------------ all-or-nothing restores


def snapshot(state: dict) -> str:
    return str(state_fingerprint({k: v for k, v in state.items() if k != "rng"}))


MISFITS = {
    "extra layer": lambda s: {**s, "model": _extra_layer(s["model"])},
    "missing layer": lambda s: {**s, "model": _drop_layer(s["model"])},
    "float64 model": lambda s: {**s, "model": s["model"].double()},
    "bf16 model": lambda s: {**s, "model": s["model"].to(torch.bfloat16)},
    "subset optimizer": lambda s: {**s, "optim": torch.optim.AdamW(list(s["model"].parameters())[:2], lr=1e-2)},
    "tensor where a module was saved": lambda s: {**s, "model": torch.zeros(3)},
    "module where plain data was saved": lambda s: {**s, "data": torch.nn.Linear(2, 2)},
}


def _extra_layer(model: torch.nn.Module) -> torch.nn.Module:
    model.extra = torch.nn.Linear(3, 3)
    return model


def _drop_layer(model: torch.nn.Module) -> torch.nn.Module:
    del model.mid
    return model


@pytest.mark.parametrize("case", list(MISFITS))
def test_a_restore_that_does_not_fit_names_the_differences_and_touches_nothing(local_url, case):
    mgr = CheckpointManager(local_url)
    mgr.save(3, trained_state())
    into = MISFITS[case](fresh_state())
    before = snapshot(into)
    with pytest.raises(InvalidState, match="does not fit") as e:
        mgr.restore(into, allow_unverified=True)
    assert "\n" not in str(e.value)
    assert snapshot(into) == before


class Exploding(RNGState):
    """A Stateful whose load_state_dict raises after others were loaded."""

    def load_state_dict(self, sd) -> None:
        raise RuntimeError("cannot load this")


def test_a_load_state_dict_that_raises_puts_back_everything_already_applied(local_url):
    mgr = CheckpointManager(local_url)
    saved = trained_state()
    mgr.save(3, saved)
    into = fresh_state()
    into["rng"] = Exploding()
    into["model"].mid.weight.data.fill_(7.0)
    before, optim_before = snapshot(into), str(into["optim"].state_dict())
    with pytest.raises(InvalidState, match="state\\['rng'\\]: loading it raised RuntimeError: cannot load this"):
        mgr.restore(into, allow_unverified=True)
    assert snapshot(into) == before and str(into["optim"].state_dict()) == optim_before


class _Inference(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with torch.inference_mode():
            self.lin = torch.nn.Linear(3, 3)


class _Expanded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.zeros(3).expand(2, 3))


class _HalfThenRaise(torch.nn.Linear):
    """A model class with its own load_state_dict, which loads the weight and then raises."""

    def __init__(self) -> None:
        super().__init__(3, 3)

    def load_state_dict(self, sd, strict=True, assign=False):
        with torch.no_grad():
            self.weight.copy_(sd["weight"])
        raise RuntimeError("half loaded")


class _Hooked(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(3, 3)

        def refuse(*_):
            raise ValueError("a load hook refused")

        self.register_load_state_dict_pre_hook(refuse)


class _Refusing(RNGState):
    def load_state_dict(self, sd) -> None:
        raise OSError("a stateful object refused")


# What fails to load, at which object: each built fresh for the restore (the failing object takes the place of
# a healthy one of the same shape, saved from the healthy kind).
FAILING_LOADS = {
    "inference-mode parameters": (lambda: _Plain(), _Inference, "inference tensor"),
    "an expanded buffer": (lambda: _Buffered(), _Expanded, "share memory"),
    "an overridden load_state_dict": (lambda: torch.nn.Linear(3, 3), _HalfThenRaise, "half loaded"),
    "a load hook": (lambda: torch.nn.Linear(3, 3), _Hooked, "a load hook refused"),
    "a meta-device module": (lambda: torch.nn.Linear(3, 3), lambda: torch.nn.Linear(3, 3, device="meta"),
                             "meta device"),
    "a stateful object": (RNGState, _Refusing, "a stateful object refused"),
    "an inference tensor": (lambda: torch.zeros(3), lambda: _inference_tensor(), "inference tensor"),
}


class _Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)


class _Buffered(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("b", torch.zeros(2, 3))


def _inference_tensor() -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(3)


def _objects(failing: str | None, at: int, seed: float) -> dict:
    """A module, a tensor, a dict and another module (the red team's order), with the failing kind at ``at``."""
    torch.manual_seed(int(seed))
    objects = {"first": torch.nn.Linear(3, 3), "t": torch.full((3,), seed), "d": {"n": seed, "x": torch.ones(2) * seed},
               "last": torch.nn.Linear(3, 3)}
    if failing is not None:
        healthy, broken, _ = FAILING_LOADS[failing]
        name = list(objects)[at]
        objects[name] = broken() if seed < 0 else healthy()
        if seed >= 0 and isinstance(objects[name], torch.nn.Module):
            for p in objects[name].state_dict().values():
                p.fill_(seed)
    return objects


def _values(objects: dict) -> dict:
    def plain(v):
        if isinstance(v, torch.nn.Module):
            return {k: t.detach().clone() for k, t in v.state_dict().items() if not t.is_meta}
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return {k: plain(v) for k, v in objects.items() if not isinstance(v, RNGState)}  # RNG state is the process's


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("failing", list(FAILING_LOADS))
def test_a_load_that_fails_at_any_object_leaves_every_object_as_it_was_and_names_it(tmp_path, failing):
    """Whatever fails to load (torch modules included), wherever it stands among the objects, nothing is left
    changed and the error is the library's, naming the object."""
    _, broken, needle = FAILING_LOADS[failing]
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    positions = [0, 1, 3] if isinstance(broken(), torch.nn.Module) else [1] if failing == "an inference tensor" else [3]
    for at in positions:
        name = ["first", "t", "d", "last"][at]
        mgr.save(at + 1, _objects(failing, at, 5.0))
        into = _objects(failing, at, -1.0)
        before = _values(into)
        with pytest.raises(InvalidState, match=f"state\\[{name!r}\\].*{needle}") as e:
            mgr.restore(into, step=at + 1, allow_unverified=True)
        assert "\n" not in str(e.value)
        assert _same(_values(into), before), f"{failing} at {name}: an object changed"


def test_an_io_failure_part_way_through_a_restore_touches_nothing(local_url, monkeypatch):
    mgr = CheckpointManager(local_url, shard_bytes=512, io_workers=1)
    mgr.save(3, trained_state())
    into = fresh_state()
    before = snapshot(into)
    from verified_ckpt import store as store_mod

    real, calls = store_mod.RunStore.read_shard, {"n": 0}

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise StorageError("injected: the disk went away")
        return real(self, *a, **k)

    monkeypatch.setattr(store_mod.RunStore, "read_shard", failing)
    with pytest.raises(StorageError, match="injected"):
        mgr.restore(into, allow_unverified=True)
    assert calls["n"] >= 3 and snapshot(into) == before
    assert mgr.list()[0].status is Status.UNVERIFIED  # an outage says nothing about the checkpoint


# ------------------------------------------------------------------------------------------ FIFOs

FIFO_AT = {
    "manifest": lambda run, cid: os.path.join(run, "checkpoints", cid, "manifest.json"),
    "record": lambda run, cid: os.path.join(run, "records", "incident", "2026-01-01T000000.000000Z0000-abc.json"),
    "ledger document": lambda run, cid: os.path.join(run, "ledger.zarr", "zarr.json"),
    "shard": lambda run, cid: os.path.join(run, "checkpoints", cid, "shard-00000.safetensors"),
    "run.json": lambda run, cid: os.path.join(run, "run.json"),
}
COMMANDS = [["list"], ["show", "1"], ["verify"], ["incidents"], ["ledger"], ["rollback", "--dry-run"], ["status"],
            ["gc", "--dry-run"], ["report", "--out", "REPORT"], ["restore", "--to", "DEST", "--allow-unverified"]]


def _make_run(run: str) -> str:
    mgr = CheckpointManager(run)
    info = mgr.save(1, {"w": torch.ones(4)})
    from verified_ckpt.history import Event
    from verified_ckpt.ledger import Ledger
    from verified_ckpt.store import RunStore

    ledger = Ledger(RunStore(run))
    ledger.append([Event(1, "save", -1, "pass")])
    ledger.flush()
    os.makedirs(os.path.join(run, "records", "incident"), exist_ok=True)
    return info.id


@pytest.mark.parametrize("where", list(FIFO_AT))
def test_a_fifo_in_the_run_hangs_no_command(tmp_path, where):
    run = str(tmp_path / "run")
    cid = _make_run(run)
    path = FIFO_AT[where](run, cid)
    if os.path.exists(path):
        os.remove(path)
    os.mkfifo(path)
    for args in COMMANDS:
        args = [a.replace("REPORT", str(tmp_path / "r.html")).replace("DEST", str(tmp_path / f"x{time.time_ns()}"))
                for a in args]
        t0 = time.monotonic()
        r = CliRunner().invoke(vckpt, [args[0], run, *args[1:]])
        assert time.monotonic() - t0 < 5, (where, args)
        assert r.exception is None or isinstance(r.exception, SystemExit), (where, args, r.exception)
        assert r.exit_code in (0, 1, 2, 3), (where, args, r.exit_code, r.output)
    t0 = time.monotonic()
    try:
        CheckpointManager(run).rollback({"w": torch.zeros(4)})
    except Exception as e:  # noqa: BLE001 - any one-line library error is fine; a hang is not
        assert "\n" not in str(e)
    assert time.monotonic() - t0 < 5


def test_a_fifo_shard_fails_the_verify_of_that_checkpoint_only(tmp_path):
    run = str(tmp_path / "run")
    cid = _make_run(run)
    shard = FIFO_AT["shard"](run, cid)
    os.remove(shard)
    os.mkfifo(shard)
    r = CliRunner().invoke(vckpt, ["verify", run, "--json"])
    [row] = json.loads(r.stdout)
    assert r.exit_code == 1 and not row["ok"] and "not a regular file" in row["problems"][0]


# ------------------------------------------------------------------------------------------ memory


def test_a_64_mib_manifest_of_nested_containers_is_refused_in_bounded_memory(tmp_path):
    run = str(tmp_path / "run")
    CheckpointManager(run).save(1, {"w": torch.ones(2)})
    for i in range(3):  # parsed concurrently, unless the budget holds them back
        d = os.path.join(run, "checkpoints", f"step-000000000{i + 2}-hostile{i}")
        os.makedirs(d)
        with open(os.path.join(d, "manifest.json"), "wb") as f:
            f.write(b'{"a":' + b"[]," * ((64 << 20) // 3 - 10) + b"[]}")
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the (large) pytest parent across fork and exec.
    code = ("import sys; from verified_ckpt_cli.main import main\n"
            "try:\n    main(['list', sys.argv[1], '--json'])\nexcept SystemExit as e:\n"
            "    hwm = [l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
            "    print(hwm, e.code)")
    out = subprocess.run([sys.executable, "-c", code, run], capture_output=True, text=True, timeout=60, check=False)
    peak_kib, code = out.stdout.strip().splitlines()[-1].split()
    assert code == "0", out.stderr[-2000:]
    rows = json.loads(out.stdout.strip().splitlines()[0])
    assert [r["status"] for r in rows].count("corrupt") == 3 and "JSON objects and arrays" in str(rows)
    assert int(peak_kib) < 512 * 1024, f"peak resident {int(peak_kib) // 1024} MiB"


# ---------------------------------------------------------------------------- ledger content errors


def test_a_garbage_ledger_is_a_layout_error_and_verify_still_checks_every_checkpoint(tmp_path):
    run = str(tmp_path / "run")
    _make_run(run)
    chunk_dir = os.path.join(run, "ledger.zarr", "step", "c")
    for folder, _, files in os.walk(chunk_dir):
        for f in files:
            open(os.path.join(folder, f), "wb").write(os.urandom(64))
    r = CliRunner().invoke(vckpt, ["ledger", run])
    assert r.exit_code == 1 and "cannot be decoded" in r.stderr and "reachable" not in r.stderr
    meta = os.path.join(run, "ledger.zarr", "kind", "zarr.json")
    doc = json.load(open(meta))
    doc["codecs"] = [{"name": "no-such-codec"}]
    json.dump(doc, open(meta, "w"))
    r = CliRunner().invoke(vckpt, ["verify", run, "--json"])
    rows = json.loads(r.stdout)
    assert r.exit_code == 0 and all(row["ok"] for row in rows)  # no consensus claim to cross-check: bytes were fine
    assert CliRunner().invoke(vckpt, ["ledger", run]).exit_code == 1


# --------------------------------------------------------------------------------- CLI fuzzing


def _record_variants() -> list[tuple[str, bytes]]:
    base = {"id": "abc123", "kind": "manual", "source": "manual", "at": "2026-01-01T00:00:00+00:00",
            "first_suspect_step": 1, "to_step": None, "detected_step": 1, "ranks": [0],
            "hosts": [{"rank": 0, "host": "h", "device": "cpu"}], "detail": "d", "reason": "r", "signature": None}
    bad_values = [None, True, -1, 2**64, 2**63, -(2**63), 1.5, "x", "", [], [1, 2], {}, {"a": 1}, "\ud800", "9" * 5000,
                  [[[[[]]]]], [None], "a" * 70000, "../../etc/passwd", {"__tensor__": "x"}, [{"rank": "0"}]]
    out = []
    for kind, fields in (("incident", base), ("rollback", {"at": "t", "to_checkpoint_id": "c", "to_step": 1, "answers": []}),
                         ("verification", {"kind": "verification", "checkpoint_id": "c", "step": 1, "ok": True,
                                           "problems": [], "at": "t"}),
                         ("supervision", {"at": "t", "attempt": 0, "exit_code": 1, "action": "restart", "code": 4,
                                          "exclude": ["h"], "reason": "r"})):
        for field in list(fields):
            for v in bad_values:
                try:
                    out.append((kind, json.dumps({**fields, field: v}).encode()))
                except (UnicodeEncodeError, ValueError):
                    continue
            out.append((kind, json.dumps({k: w for k, w in fields.items() if k != field}).encode()))
        for v in bad_values:  # inside nested entries: hosts, problems, answers
            nested = {"incident": ("hosts", [{"rank": v, "host": "h", "device": "d"}, {"rank": 0, "host": v, "device": "d"}]),
                      "verification": ("problems", [{"kind": v, "detail": "x"}, {"kind": "digest", "detail": v}]),
                      "rollback": ("answers", [[v], [v, "abc"]]), "supervision": ("exclude", [[v], [v, "h"]])}[kind]
            for entry in nested[1]:
                try:
                    out.append((kind, json.dumps({**fields, nested[0]: [entry] if kind not in ("rollback", "supervision")
                                                  else entry}).encode()))
                except (UnicodeEncodeError, ValueError):
                    continue
        raw = json.dumps(fields).encode()
        out += [(kind, raw[:n]) for n in (0, 1, len(raw) // 2, len(raw) - 1)]
        out += [(kind, b"\xff\xfe" + raw), (kind, b"[" * 5000), (kind, b"NaN"), (kind, b'"a string"'), (kind, b"{}" * 3),
                (kind, b"1e999"), (kind, raw.replace(b":", b":\x00", 1))]
    return out


def test_no_command_prints_a_traceback_for_hundreds_of_hostile_records(tmp_path):
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run)
    mgr.save(1, {"w": torch.ones(2)})
    variants = _record_variants()
    assert len(variants) >= 500
    d = {k: os.path.join(run, "records", k) for k in ("incident", "rollback", "verification", "supervision")}
    for p in d.values():
        os.makedirs(p, exist_ok=True)
    runner = CliRunner()
    for i, (kind, raw) in enumerate(variants):
        path = os.path.join(d[kind], f"2026-01-01T000000.{i:06d}Z0000-fuzz.json")
        open(path, "wb").write(raw)
        for args in (["list"], ["incidents"], ["status"], ["rollback", "--dry-run"]) if kind != "supervision" else (
                ["status"], ["report", "--out", os.path.join(run, "r.html")]):  # the report is what reads decisions
            r = runner.invoke(vckpt, [args[0], run, *args[1:], *(["--json"] if args[0] != "report" else [])])
            assert r.exception is None or isinstance(r.exception, SystemExit), (raw[:200], args, repr(r.exception))
            assert r.exit_code in range(8), (raw[:200], args, r.exit_code)  # the documented codes
        os.remove(path)


def test_ledger_variants_never_crash_a_command(tmp_path):
    run = str(tmp_path / "run")
    _make_run(run)
    root = os.path.join(run, "ledger.zarr")
    docs = [os.path.join(folder, f) for folder, _, fs in os.walk(root) for f in fs]
    originals = {p: open(p, "rb").read() for p in docs}
    mutations = [b"", b"{", b"[]", b"null", b'{"zarr_format": 3}', os.urandom(40), b'{"attributes": {"rows": 1e300}}',
                 b'{"zarr_format": 3, "node_type": "array", "shape": [99999999999]}']
    runner = CliRunner()
    checked = 0
    for p in docs:
        for m in mutations:
            open(p, "wb").write(m)
            for args in (["ledger"], ["report", "--out", str(tmp_path / "r.html")]):
                r = runner.invoke(vckpt, [args[0], run, *args[1:]])
                assert r.exception is None or isinstance(r.exception, SystemExit), (p, m, args, repr(r.exception))
                assert r.exit_code in (0, 1, 2), (p, m, args, r.exit_code, r.output)
                checked += 1
            open(p, "wb").write(originals[p])
    assert checked >= 100


def test_the_real_binary_prints_one_line_for_a_hostile_record(tmp_path):
    run = str(tmp_path / "run")
    CheckpointManager(run).save(1, {"w": torch.ones(2)})
    os.makedirs(os.path.join(run, "records", "incident"))
    open(os.path.join(run, "records", "incident", "2026-x.json"), "wb").write(b'{"ranks": "7", "at": 5')
    exe = os.path.join(os.path.dirname(sys.executable), "vckpt")
    for cmd in ("list", "incidents", "status", "rollback"):
        p = subprocess.run([exe, cmd, run], capture_output=True, text=True, timeout=30, check=False)
        assert "Traceback" not in p.stderr and p.returncode in range(8), (cmd, p.stderr)


def test_export_destination_errors_are_one_line(tmp_path):
    run = str(tmp_path / "run")
    CheckpointManager(run).save(1, {"w": torch.ones(2)})
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep").write_text("y")
    cases = {str(a_file): 2, str(busy): 2, str(a_file / "under-a-file"): 3, "/proc/vckpt-export": 3}
    for dest, code in cases.items():
        r = CliRunner().invoke(vckpt, ["restore", run, "--to", dest, "--allow-unverified"])
        assert r.exit_code == code, (dest, r.output)
        assert r.exception is None or isinstance(r.exception, SystemExit)
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:"), r.stderr
    assert (busy / "keep").read_text() == "y"
