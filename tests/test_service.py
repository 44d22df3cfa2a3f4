"""`vckpt serve` as a real process on loopback, checked with a real HTTP client (httpx) and Prometheus' own parser."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import fsspec
import httpx
import numpy as np
import pytest
import torch
from helpers import flip_byte, free_port
from prometheus_client.parser import text_string_to_metric_families

from verified_ckpt import CheckpointManager
from verified_ckpt.service import run_key

pytestmark = pytest.mark.timeout(120)
TOKEN = "s3cret-token-for-tests"


@contextlib.contextmanager
def service(*runs: str, env: dict | None = None, extra: tuple[str, ...] = (), scrub: float = 2.0):
    port = free_port()
    cmd = [sys.executable, "-m", "verified_ckpt_cli.main", "serve", *runs, "--port", str(port), "--poll", "0.2",
           "--scrub-interval", str(scrub), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "VCKPT_SERVICE_TOKEN": TOKEN, **(env or {})})
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5)
    try:
        # Ready after its first pass over the runs: under the suite's load that can take most of a minute.
        until(lambda: _ready(client), what="the service to be ready", proc=proc, timeout=90.0)
        yield client, proc
    finally:
        client.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


def _ready(client: httpx.Client) -> bool:
    try:
        return client.get("/readyz").status_code == 200
    except httpx.TransportError:
        return False


def until(check, *, what: str, timeout: float = 30.0, proc: subprocess.Popen | None = None):
    """Poll ``check`` (observable state, not a timer) until it returns a truthy value, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the service exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def save(url: str, step: int, n: int = 1000) -> str:
    torch.manual_seed(step)
    return CheckpointManager(url).save(step, {"w": torch.randn(n), "b": torch.randn(8)}).id


def checkpoints(client: httpx.Client, url: str) -> dict[str, dict]:
    r = client.get(f"/api/runs/{run_key(url)}/checkpoints")
    return {c["id"]: c for c in r.json()} if r.status_code == 200 else {}


def by_service(c: dict) -> bool:
    return any((v.get("verifier") or {}).get("service") for v in c["verifications"])


def train(run: str) -> None:
    """A real 2-rank guarded training job that saves restorable checkpoints at steps 5, 10 and 15."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "examples/ddp_train.py", "--world-size", "2", "--steps", "15", "--audit-every", "5",
           "--consensus-every", "5", "--save-every", "5", "--run", run, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=root, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.timeout(360)  # 48 s alone, 110 s beside two CPU-bound processes: a no-hang bound, not a speed
def test_a_training_jobs_commits_are_verified_and_a_flipped_byte_makes_one_corrupt_and_moves_the_target(tmp_path):
    run, other = str(tmp_path / "run"), str(tmp_path / "other")
    save(other, 1)
    with service(run, other) as (client, _):
        train(run)  # commits while the service runs
        got = until(lambda: (c := checkpoints(client, run)) and len(c) == 3 and all(by_service(x) for x in c.values())
                    and c, what="the job's three commits to be verified by the service")
        assert {c["status"] for c in got.values()} == {"restorable"}
        verifier = next(v["verifier"] for c in got.values() for v in c["verifications"] if v.get("verifier"))
        assert verifier["service"] == "vckpt serve" and verifier["host"] and verifier["version"]
        newest = max(got.values(), key=lambda c: c["step"])
        assert client.get(f"/api/runs/{run_key(run)}").json()["rollback_target"]["step"] == 15
        shard = next(p for p in (tmp_path / "run" / "checkpoints" / newest["id"]).iterdir() if p.suffix == ".safetensors")
        flip_byte(fsspec.filesystem("file"), str(shard), shard.stat().st_size - 3)
        until(lambda: checkpoints(client, run)[newest["id"]]["status"] == "corrupt", what="the scrub to find the flip")
        assert client.get(f"/api/runs/{run_key(run)}").json()["rollback_target"]["step"] == 10
        listed = json.loads(subprocess.run([sys.executable, "-m", "verified_ckpt_cli.main", "list", run, "--json"],
                                           capture_output=True, text=True, check=True).stdout)
        assert {c["id"]: c["status"] for c in listed}[newest["id"]] == "corrupt"
        # /metrics, parsed by prometheus_client's own parser, counts what `vckpt list` shows.
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        counts = {s.labels["status"]: s.value for s in families["vckpt_checkpoints"].samples
                  if s.labels["run"] == run_key(run)}
        want: dict[str, int] = {}
        for c in listed:
            want[c["status"]] = want.get(c["status"], 0) + 1
        assert {k: v for k, v in counts.items() if v} == want == {"restorable": 2, "corrupt": 1}
        failures = [s.value for s in families["vckpt_verification_failures"].samples
                    if s.name.endswith("_total") and s.labels["run"] == run_key(run)]
        assert failures == [1.0]
        assert client.get("/healthz").text == "ok"
        page = client.get("/").text
        assert run in page and other in page and "corrupt 1" in page and "restorable 2" in page
        img = screenshot(str(client.base_url) + "/", tmp_path)
        for colour in ((0xC6, 0x28, 0x28), (0x2E, 0x7D, 0x32)):  # the corrupt and restorable badges
            assert np.all(img == np.array(colour, np.uint8), axis=2).sum() >= 100, colour


def screenshot(url: str, tmp_path) -> np.ndarray:
    """The page at ``url`` as headless Chromium paints it (RGB)."""
    import shutil

    from png import read_png

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        if os.environ.get("VCKPT_REQUIRE_CHROMIUM") == "1":
            pytest.fail("chromium not installed, and VCKPT_REQUIRE_CHROMIUM=1 forbids skipping")
        pytest.skip("chromium not installed (apt-get install chromium)")
    shot = tmp_path / "dashboard.png"
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1300,800",
           "--force-device-scale-factor=1", "--force-color-profile=srgb", f"--user-data-dir={tmp_path / 'profile'}",
           "--no-first-run", f"--screenshot={shot}", url]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert shot.exists(), f"no screenshot (rc {done.returncode}): {done.stderr[-2000:]}"
    return read_png(shot)[:, :, :3]


def test_writes_need_the_token_and_a_non_loopback_bind_needs_one(tmp_path):
    run = str(tmp_path / "run")
    save(run, 1)
    with service(run) as (client, _):
        url = f"/api/runs/{run_key(run)}/flag"
        body = {"from_step": 1, "reason": "suspected host"}
        assert client.post(url, json=body).status_code == 401
        assert client.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = client.post(url, json=body, headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and ok.json()["kind"] == "manual"
        assert client.get(f"/api/runs/{run_key(run)}").json()["open_incidents"] == 1
        assert client.post(f"/api/runs/{run_key(run)}/rollback").status_code == 401
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCKPT_SERVICE_TOKEN")}
    done = subprocess.run([sys.executable, "-m", "verified_ckpt_cli.main", "serve", run, "--host", "0.0.0.0",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 2 and "needs a token" in done.stderr and "Traceback" not in done.stderr


def test_a_hostile_manifest_in_one_run_leaves_the_service_serving_the_others(tmp_path):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    save(good, 1)
    cid = save(bad, 1)
    (tmp_path / "bad" / "checkpoints" / cid / "manifest.json").write_bytes(b"[" * 100_000)
    os.mkfifo(tmp_path / "bad" / "checkpoints" / "step-0000000009-deadbeef")
    with service(good, bad, str(tmp_path / "typo")) as (client, proc):
        until(lambda: all(by_service(c) for c in checkpoints(client, good).values()), what="the good run verified")
        runs = {r["url"]: r for r in client.get("/api/runs").json()}
        assert runs[good]["error"] is None and runs[good]["checkpoints"] == {"unverified": 1}
        assert runs[bad]["checkpoints"].get("corrupt", 0) >= 1 or runs[bad]["error"]
        assert runs[str(tmp_path / "typo")]["error"] == "nothing is stored at this URL yet"
        assert client.get("/").status_code == 200 and proc.poll() is None


def test_sigkill_mid_scrub_marks_nothing_unread_as_verified_and_a_restart_resumes(tmp_path):
    run = str(tmp_path / "run")
    # 1 MB each; capped at 256 KiB/s each takes 4 s after the first: the kill lands mid-pass however busy the machine
    ids = [save(run, s, n=250_000) for s in range(1, 5)]

    def recorded() -> set[str]:
        view = CheckpointManager(run).view()
        return {cid for cid, rs in view.verifications.items() if any((r.verifier or {}).get("service") for r in rs)}

    with service(run, extra=("--bandwidth", str(1 << 18))) as (client, proc):
        until(recorded, what="a first verification recorded in the run")  # the run's records, not the API
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    view = CheckpointManager(run).view()
    done = {cid for cid, rs in view.verifications.items() if any((r.verifier or {}).get("service") for r in rs)}
    assert done and done < set(ids), "killed mid-pass: some checkpoints verified, not all"
    assert all(r.ok for rs in view.verifications.values() for r in rs)  # no half-read checkpoint was judged
    with service(run, scrub=3600) as (client, _):  # no scrub falls due during the test: a re-read is a resume bug
        until(lambda: (c := checkpoints(client, run)) and all(by_service(x) for x in c.values()),
              what="the restarted service to verify the rest")
        again = CheckpointManager(run).view().verifications
        assert all(len(again[cid]) == 1 for cid in done)  # what was verified before the kill is not re-read at once


def test_an_s3_run_is_verified_and_a_store_outage_shows_as_an_error_then_recovers(tmp_path):
    import s3fs
    import seaweed
    from test_s3 import restarted, stoppable_server

    handle, opts = stoppable_server(tmp_path, "svc")
    url, local = "s3://svc/runs/exp", str(tmp_path / "local")
    save(local, 1)
    CheckpointManager(url, storage_options=opts).save(1, {"w": torch.randn(64)})
    flat = {"key": opts["key"], "secret": opts["secret"], "client_kwargs.endpoint_url": opts["client_kwargs"]["endpoint_url"],
            "client_kwargs.region_name": opts["client_kwargs"]["region_name"], "config_kwargs.connect_timeout": 1,
            "config_kwargs.read_timeout": 2, "config_kwargs.retries.max_attempts": 2}
    extra = tuple(a for k, v in flat.items() for a in ("-o", f"{k}={v}"))
    try:
        with service(url, local, extra=extra) as (client, _):
            until(lambda: (c := checkpoints(client, url)) and all(by_service(x) for x in c.values()),
                  what="the S3 checkpoint verified by the service")
            seaweed.stop(handle)
            down = until(lambda: (r := client.get(f"/api/runs/{run_key(url)}").json())["error"] and r,
                         what="the outage to show on the S3 run")
            assert "store" in down["error"]
            assert client.get(f"/api/runs/{run_key(local)}").json()["error"] is None  # the other run is unaffected
            families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
            assert any(s.value >= 1 for s in families["vckpt_store_errors"].samples
                       if s.name.endswith("_total") and s.labels["run"] == run_key(url))
            with restarted(handle) as again:
                s3fs.S3FileSystem.clear_instance_cache()
                CheckpointManager(url, storage_options={**again.storage_options(), "config_kwargs": {
                    "retries": {"max_attempts": 2}}}).save(2, {"w": torch.randn(64)})
                try:
                    until(lambda: (c := checkpoints(client, url)) and len(c) == 2 and all(by_service(x) for x in c.values()),
                          what="the service to recover and verify the new commit", timeout=60)
                except AssertionError:
                    raise AssertionError(str(client.get(f"/api/runs/{run_key(url)}").json())) from None
                assert client.get(f"/api/runs/{run_key(url)}").json()["error"] is None
    finally:
        seaweed.stop(handle)


def test_discovered_runs_are_watched_including_new_ones_and_two_services_share_a_run(tmp_path):
    root = tmp_path / "runs"
    a = save(str(root / "a"), 1)
    with service("--discover", str(root)) as (one, _), service(str(root / "a")) as (two, _):
        save(str(root / "b"), 1)  # appears after the start
        until(lambda: {r["url"] for r in one.get("/api/runs").json()} == {str(root / "a"), str(root / "b")},
              what="both runs discovered")
        for client in (one, two):
            until(lambda c=client: (x := checkpoints(c, str(root / "a"))) and by_service(x[a]), what="run a verified")
    view = CheckpointManager(str(root / "a")).view()
    assert view.unreadable == [] and all(r.ok for r in view.verifications[a])  # two writers, no damaged records


def test_one_run_spelt_three_ways_is_one_run_and_the_log_and_dashboard_say_what_changed_and_why(tmp_path):
    run = str(tmp_path / "svc" / "run")
    cid = save(run, 1)
    relative = os.path.relpath(run)
    assert run_key(run) == run_key(relative) == run_key(f"file://{run}") == run_key(run + "/")
    with service(relative, run, f"file://{run}") as (client, proc):
        assert len(client.get("/api/runs").json()) == 1
        until(lambda: by_service(checkpoints(client, run)[cid]), what="the checkpoint verified")
        shard = next(p for p in (tmp_path / "svc" / "run" / "checkpoints" / cid).iterdir() if p.suffix == ".safetensors")
        flip_byte(fsspec.filesystem("file"), str(shard), shard.stat().st_size - 3)
        client.post(f"/api/runs/{run_key(run)}/flag", json={"from_step": 1, "reason": "check"},
                    headers={"Authorization": f"Bearer {TOKEN}"})  # a write, then a pass: the change shows
        until(lambda: checkpoints(client, run)[cid]["status"] != "unverified", what="the status to change")
        page = client.get("/").text
        [change] = [line for line in page.split("<li") if 'data-testid="change"' in line]
        assert run_key(run) in change and cid in change and "unverified" in change  # the run's one name
        assert "flagged interval" in change or "digest" in change  # why, not only what
        # One name for the run everywhere: readable (its folder, then a hash of its canonical URL), in the API, on
        # the dashboard (with its URL beside it) and as the run label of every metric.
        [api] = client.get("/api/runs").json()
        key = api["key"]
        assert key == run_key(run) and re.fullmatch(r"run-[0-9a-f]{12}", key), key
        assert f'<a href="/runs/{key}/report">{key}</a>' in page and relative in page
        families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        assert {s.labels["run"] for f in families.values() for s in f.samples if "run" in s.labels} == {key}
        assert [s.labels["url"] for s in families["vckpt_run_info"].samples] == [relative]  # as first given
        proc.terminate()
        proc.wait(10)
        log = proc.stderr.read()
    assert "vckpt serve on http://127.0.0.1:" in log and "watching 1 run(s)" in log
    assert f"checkpoint {cid} (step 1) unverified ->" in log and "pass 1: verified 1 checkpoint(s)" in log


def healthz_latencies(probe: httpx.Client, n: int) -> list[float]:
    """Seconds each of ``n`` ``/healthz`` requests took, one after the other."""
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert probe.get("/healthz").text == "ok"
        took.append(time.perf_counter() - t0)
    return took


def hostile_ledger(run: str) -> None:
    """A ledger of chunks of constants claiming a million rows (96 KiB on disk; 1.1 GB once decoded, before)."""
    import zarr

    from verified_ckpt.history import KINDS, VERDICTS, Columns
    from verified_ckpt.ledger import CHUNK_ROWS

    group = zarr.open_group(os.path.join(run, "ledger.zarr"), mode="w", zarr_format=3)
    rows, sample = 64 * CHUNK_ROWS, Columns.of([])
    for name in ("step", "kind", "rank", "verdict", "lanes", "loss", "grad_norm", "time"):
        shape, chunks = ((rows, 2), (CHUNK_ROWS, 2)) if name == "lanes" else ((rows,), (CHUNK_ROWS,))
        arr = group.create_array(name, shape=shape, chunks=chunks, dtype=getattr(sample, name).dtype, fill_value=0)
        arr[:] = np.zeros(shape, dtype=arr.dtype)
    group.attrs.update({"schema": 1, "kinds": KINDS, "verdicts": VERDICTS, "rows": rows})


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def test_a_hostile_run_neither_stalls_nor_swells_the_service_and_the_others_are_scrubbed(tmp_path):
    import concurrent.futures

    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    cid = save(good, 1)
    save(bad, 1)
    hostile_ledger(bad)
    with service(good, bad) as (client, proc):
        until(lambda: by_service(checkpoints(client, good)[cid]), what="the good run verified")
        page = until(lambda: (p := client.get(f"/runs/{run_key(bad)}/report")).status_code == 200 and p,
                     what="the hostile run's report page built")
        assert page.status_code == 200 and "cannot be built" in page.text and "stored bytes" in page.text
        with concurrent.futures.ThreadPoolExecutor(10) as pool, httpx.Client(base_url=str(client.base_url)) as probe:
            control = healthz_latencies(probe, 5)  # the same service on the same (maybe busy) machine, at rest
            reports = [pool.submit(httpx.get, f"{client.base_url}/runs/{run_key(bad)}/report", timeout=30)
                       for _ in range(10)]
            took = healthz_latencies(probe, 5)
            assert all(r.result().status_code == 200 for r in reports)
        # The report is what the watcher built (no request reads the store: pinned without timing by
        # test_reads_answer_from_what_the_watcher_published_and_never_from_the_store), so ten of them hardly slow
        # /healthz down; the bound is relative to the control, so a busy machine slows both alike.
        assert statistics.median(took) < 10 * statistics.median(control) + 0.25, (took, control)
        save(good, 2)  # the good run goes on being verified
        until(lambda: (c := checkpoints(client, good)) and len(c) == 2 and all(by_service(x) for x in c.values()),
              what="the good run's new commit verified")
        # A shard truncated under the service: a finding on that checkpoint, not a dead process.
        [info] = [i for i in CheckpointManager(good).list() if i.step == 2]
        os.truncate(os.path.join(good, "checkpoints", info.id, info.manifest.shards[0].path), 10)
        client.post(f"/api/runs/{run_key(good)}/flag", json={"from_step": 99, "reason": "nudge a pass"},
                    headers={"Authorization": f"Bearer {TOKEN}"})
        assert client.get("/healthz").text == "ok" and proc.poll() is None
        peak = peak_rss_mib(proc.pid)
    assert peak < 700, f"peak resident {peak:.0f} MiB"  # before: 3.5 GB on the same hostile ledger


BAD_BODIES = [({"from_step": 5, "ranks": [-1]}, "ranks"), ({"from_step": 5, "ranks": [99999999999]}, "ranks"),
              ({"from_step": 2**70}, "step"), ({"from_step": 1, "ranks": "x"}, "ranks"),
              ({"from_step": 1, "ranks": [1e10]}, "ranks"), ({"from_step": 1, "ranks": {"a": 1}}, "ranks"),
              ({"from_step": 1, "to_step": 1.5}, "to_step"), ({"from_step": 1, "reason": "r" * (65 << 10)}, "body"),
              ({"from_step": 1e400}, "from_step"), ({"from_step": 1, "reason": "\ud800"}, "JSON"),
              ({"reason": "x"}, "from_step")]


def test_every_flag_body_the_reader_would_refuse_is_a_422_naming_the_field_and_nothing_is_written(tmp_path):
    run = str(tmp_path / "run")
    save(run, 1)
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    with service(run) as (client, _):
        url = f"/api/runs/{run_key(run)}/flag"
        for body, field in BAD_BODIES:
            text = json.dumps(body).replace("Infinity", "1e400")  # 1e400 as the client sent it
            r = client.post(url, content=text.encode("utf-8", "surrogatepass"), headers=auth)
            assert r.status_code in (413, 422), (body, r.status_code, r.text)
            assert field in r.json()["error"] or r.status_code == 413, (body, r.json())
        deep = b'{"from_step": 1, "ranks": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
        assert client.post(url, content=deep, headers=auth).status_code == 422
        big = client.post(url, content=b"{" + b" " * (256 << 20) + b"}", headers=auth)
        assert big.status_code == 413
        assert client.get(f"/api/runs/{run_key(run)}").json()["open_incidents"] == 0
    assert CheckpointManager(run).incidents() == []


def test_an_idle_connection_is_closed_and_a_short_token_does_not_guard_a_public_bind(tmp_path):
    import socket

    run = str(tmp_path / "run")
    save(run, 1)
    with service(run, extra=("--request-timeout", "1")) as (client, _):
        port = int(str(client.base_url).rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # connects, then says nothing
            assert s.recv(1) == b""  # closed by the server (--request-timeout), not held forever
    env = {**os.environ, "VCKPT_SERVICE_TOKEN": "x"}
    done = subprocess.run([sys.executable, "-m", "verified_ckpt_cli.main", "serve", run, "--host", "0.0.0.0",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=60, env=env, check=False)
    assert done.returncode == 2 and "at least 32 characters" in done.stderr and "Traceback" not in done.stderr


def test_concurrent_flags_and_a_rollback_are_each_answered_and_health_answers_meanwhile(tmp_path):
    import concurrent.futures

    run = str(tmp_path / "run")
    for s in range(1, 31):
        save(run, s)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with service(run) as (client, _):
        until(lambda: len(checkpoints(client, run)) == 30, what="the run listed")
        base = str(client.base_url)
        with concurrent.futures.ThreadPoolExecutor(6) as pool, httpx.Client(base_url=base) as probe:
            writes = [pool.submit(httpx.post, f"{base}/api/runs/{run_key(run)}/flag", headers=auth, timeout=60,
                                  json={"from_step": 5 + i, "reason": f"suspect {i}"}) for i in range(5)]
            writes.append(pool.submit(httpx.post, f"{base}/api/runs/{run_key(run)}/rollback", headers=auth, timeout=60))
            while not all(w.done() for w in writes):
                assert probe.get("/healthz").text == "ok"  # a stalled loop fails here (the client's 5 s bound)
            codes = [w.result().status_code for w in writes]
        assert codes[:5] == [200] * 5 and codes[5] in (200, 409), codes  # nothing restorable: 409, said
    assert len(CheckpointManager(run).incidents()) == 5


def watcher_of(run: str):
    """A real watcher over ``run`` in this process, as ``vckpt serve`` makes one (no scrub falls due in a test)."""
    from verified_ckpt.service.metrics import Metrics
    from verified_ckpt.service.scrub import Slots, Throttle
    from verified_ckpt.service.watch import Watcher, verifier_identity

    return Watcher(run_key(run), run, None, Metrics(), Throttle(0), poll_s=0.2, scrub_interval_s=3600,
                   verifier=verifier_identity(), slots=Slots.of(2))


class HeldListing:
    """Holds the first listing of the run made on the thread named ``thread`` between the listing and whatever the
    thread does with it next (its publish), until ``go`` is set."""

    def __init__(self, mgr: CheckpointManager, thread: str) -> None:
        self.listed, self.go, real = threading.Event(), threading.Event(), mgr.view

        def view():
            got = real()
            if threading.current_thread().name == thread and not self.listed.is_set():
                self.listed.set()
                assert self.go.wait(30), "never released"
            return got

        mgr.view = view


def in_thread(name: str, fn, *args) -> tuple[threading.Thread, list]:
    errors: list = []

    def body() -> None:
        try:
            fn(*args)
        except BaseException as e:  # handed to the test
            errors.append(e)

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    return t, errors


@pytest.mark.parametrize("held", ["watcher", "worker"])
def test_a_view_listed_before_another_writers_publish_never_replaces_it_and_no_change_is_lost(tmp_path, held):
    from verified_ckpt.service.app import _write

    run = str(tmp_path / "run")
    save(run, 1)
    w = watcher_of(run)
    w.one_pass()  # verifies the checkpoint, so the next passes have nothing to read: only their views are published
    assert w.state.summary()["open_incidents"] == 0 and w.state.passes == 1

    def flag(step: int) -> None:  # the API's worker thread: record the flag, then republish the run's view
        _write(w, True, json.dumps({"from_step": step, "reason": f"flag {step}"}).encode())

    hold = HeldListing(w._mgr, held)
    if held == "watcher":  # the loop lists, the API flags and republishes, then the loop publishes what it listed
        t, errors = in_thread("watcher", w.one_pass)
        assert hold.listed.wait(30)
        flag(1)
        want = 1
    else:  # the API's refresh lists, a second flag and a whole pass publish, then the refresh publishes
        t, errors = in_thread("worker", flag, 1)
        assert hold.listed.wait(30)
        CheckpointManager(run).flag(2, reason="flag 2")
        w.one_pass()
        want = 2
    assert w.state.summary()["open_incidents"] == want
    hold.go.set()
    t.join(30)
    assert not t.is_alive() and not errors, errors
    state = w.state
    assert state.summary()["open_incidents"] == want, "an older listing replaced the view"
    assert state.passes == 2  # both passes counted
    assert w.metrics.registry.get_sample_value("vckpt_open_incidents", {"run": w.key}) == want  # metrics match
    assert [(c["from"], c["to"]) for c in state.changes] == [("unverified", "suspect")]  # once, never undone
    assert f"flag {want}" in (state.report or "")  # the report on show is the newest page too


@contextlib.contextmanager
def served(*watchers):
    """The service's real app over ``watchers`` on a real uvicorn server in this process (no watcher loop runs:
    the test publishes), and an httpx client of it."""
    import uvicorn

    from verified_ckpt.service.app import build_app
    from verified_ckpt.service.watch import Watchers

    registry = Watchers()
    for w in watchers:
        registry.add(w)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(registry, watchers[0].metrics, TOKEN), host="127.0.0.1",
                                           port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    until(lambda: server.started, what="the server to start")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)


def test_health_and_reads_answer_while_a_write_is_held_on_its_worker_thread(tmp_path):
    run = str(tmp_path / "run")
    save(run, 1)
    w = watcher_of(run)
    w.one_pass()
    held, go, real = threading.Event(), threading.Event(), w.refresh

    def refresh() -> None:  # the write's second half (republishing the view), held until the test lets it go
        held.set()
        assert go.wait(30), "never released"
        real()

    w.refresh = refresh
    with served(w) as client:
        answers: list = []
        t, errors = in_thread("client", lambda: answers.append(client.post(
            f"/api/runs/{w.key}/flag", json={"from_step": 1, "reason": "held"}, headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60)))
        try:
            assert held.wait(30)  # the flag is recorded; its worker thread now holds before republishing
            # Were the write on the event loop, nothing would answer until it is let go (the client gives up at 5 s).
            assert client.get("/healthz").text == "ok"
            assert client.get(f"/api/runs/{w.key}").json()["open_incidents"] == 0  # what was published, not the store
        finally:
            go.set()
            t.join(30)
        assert not errors and answers[0].status_code == 200, (errors, answers)
        assert client.get(f"/api/runs/{w.key}").json()["open_incidents"] == 1  # republished by the write


def test_reads_answer_from_what_the_watcher_published_and_never_from_the_store(tmp_path):
    import concurrent.futures
    import shutil

    run = str(tmp_path / "run")
    cid = save(run, 1)
    w = watcher_of(run)
    w.one_pass()  # lists, verifies and builds the report page
    built = w.state.report
    assert built and cid in built
    shutil.rmtree(run)  # a request that read the store now would find no run at all
    with served(w) as client, concurrent.futures.ThreadPoolExecutor(10) as pool:
        pages = [pool.submit(client.get, f"/runs/{w.key}/report") for _ in range(10)]
        assert all(p.result().status_code == 200 and p.result().text == built for p in pages)
        assert [c["id"] for c in client.get(f"/api/runs/{w.key}/checkpoints").json()] == [cid]
        assert client.get(f"/api/runs/{w.key}").json()["checkpoints"] == {"unverified": 1}
        assert f'<a href="/runs/{w.key}/report">{w.key}</a>' in client.get("/").text


def test_the_api_and_the_dashboard_answer_a_page_at_a_time(tmp_path, monkeypatch):
    """Thousands of runs or checkpoints come a page at a time: ``offset``/``limit`` with ``X-Total-Count``, bad
    values refused with 400; the dashboard shows a page of runs, the least healthy first, and links the next."""
    from verified_ckpt.service import app

    runs = [str(tmp_path / f"run{i}") for i in range(3)]
    for i, run in enumerate(runs):
        for step in range(1, 4):
            save(run, step)
        if i == 2:
            CheckpointManager(run).flag(1, reason="a fault")  # an open incident: the least healthy
    watchers = [watcher_of(r) for r in runs]
    for w in watchers:
        w.one_pass()
    monkeypatch.setattr(app, "DASHBOARD_PAGE", 2)
    with served(*watchers) as client:
        got = client.get("/api/runs", params={"limit": 2})
        assert got.status_code == 200 and got.headers["x-total-count"] == "3" and len(got.json()) == 2
        rest = client.get("/api/runs", params={"offset": 2, "limit": 2}).json()
        assert [r["key"] for r in got.json() + rest] == [w.key for w in watchers]
        page = client.get(f"/api/runs/{watchers[0].key}/checkpoints", params={"offset": 1, "limit": 1})
        assert page.headers["x-total-count"] == "3" and [c["step"] for c in page.json()] == [2]
        for bad in ({"limit": 0}, {"limit": 10**6}, {"offset": -1}, {"offset": "x"}):
            assert client.get("/api/runs", params=bad).status_code == 400
        first = client.get("/").text
        assert "page 1 of 2 (3 runs" in first and 'href="/?page=2"' in first
        assert first.index(f'run-{watchers[2].key}') < first.index('<h2>')  # the run with an incident comes first
        second = client.get("/", params={"page": 2}).text
        assert second.count('data-testid="run-') == 1 and 'href="/?page=1"' in second
        assert client.get("/", params={"page": "0"}).status_code == 400
