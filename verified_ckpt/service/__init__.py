"""``vckpt serve``: a long-running verifier that re-checks checkpoints independently and serves health.

One thread per watched run (``watch``) re-reads new commits and scrubs old
checkpoints at a capped byte rate (``scrub``); the HTTP side (``app``) serves
the JSON API, Prometheus metrics (``metrics``), health and a dashboard from
what the watchers last saw. Everything it learns is written to the runs' own
records, so it keeps no state of its own that a restart could lose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import ipaddress
import logging
import os
import re
import threading
from typing import Any

from ..errors import InvalidConfig

__all__ = ["ServiceConfig", "ServiceError", "missing_extra", "run_key", "serve"]

log = logging.getLogger("verified_ckpt.service")
MAX_KEY_FOLDER = 40  # characters of the folder name in a run's key
MIN_TOKEN = 32  # characters of a token that guards a non-loopback bind (a guessable one guards nothing)


class ServiceError(InvalidConfig):
    """A configuration the service refuses to start with (the message says what to change)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """How ``vckpt serve`` runs.

    Args:
        runs: run URLs to watch.
        discover: prefixes (any fsspec URL) whose child folders holding a run are watched too, including
            runs that appear later.
        storage_options: fsspec options for every run.
        host, port: where to listen; the default is loopback only.
        token: bearer token for the write endpoints (``flag``, ``rollback``); required for a
            non-loopback bind. ``None`` reads ``VCKPT_SERVICE_TOKEN`` or the file ``VCKPT_SERVICE_TOKEN_FILE``.
        poll_s: how often each run is looked at for new commits.
        scrub_interval_s: re-read each checkpoint this often.
        head_interval_s: between reads, check each checkpoint's shards against what the store keeps of them (size
            and S3's CRC-64/NVME, no byte read) this often; 0: never.
        bytes_per_s: cap on the bytes read per second across all runs (0: none).
        dask: read on a Dask cluster: a scheduler's address, or ``"local"`` for a ``LocalCluster`` of ``concurrency``
            worker processes (``checkpoint.fleet``); the service stays the only writer of records. ``None``: here.
        concurrency: runs verified at the same time (each reads two checkpoints at a time).
        request_timeout_s: a connection that has not sent a whole request this long after it opened (or after its
            last response) is closed: an idle or trickling client cannot hold a connection forever.
    """

    runs: tuple[str, ...] = ()
    discover: tuple[str, ...] = ()  # prefixes whose child folders are runs; looked at again every 10 polls
    storage_options: dict[str, Any] | None = None
    host: str = "127.0.0.1"
    port: int = 8765
    token: str | None = None
    poll_s: float = 10.0
    scrub_interval_s: float = 24 * 3600.0
    head_interval_s: float = 3600.0
    bytes_per_s: float = 0.0
    dask: str | None = None
    concurrency: int = 2
    request_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.runs and not self.discover:
            raise ServiceError("give at least one run URL to watch (runs=), or a prefix to discover runs under (discover=)")
        for name in ("poll_s", "scrub_interval_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ServiceError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ServiceError(f"concurrency must be an int >= 1, got {self.concurrency!r}")
        if self.head_interval_s < 0:
            raise ServiceError(f"head_interval_s must be >= 0 (0: no head checks), got {self.head_interval_s!r}")
        if self.bytes_per_s < 0:
            raise ServiceError(f"bytes_per_s must be >= 0, got {self.bytes_per_s!r}")
        token = self.resolved_token()
        if not _loopback(self.host) and (not token or len(token) < MIN_TOKEN):
            raise ServiceError(f"binding {self.host} (not loopback) needs a token of at least {MIN_TOKEN} characters"
                               f"{' (this one has ' + str(len(token)) + ')' if token else ''}: set VCKPT_SERVICE_TOKEN "
                               "or VCKPT_SERVICE_TOKEN_FILE (e.g. `openssl rand -hex 24`), or bind 127.0.0.1")

    def resolved_token(self) -> str | None:
        if self.token:
            return self.token
        if os.environ.get("VCKPT_SERVICE_TOKEN"):
            return os.environ["VCKPT_SERVICE_TOKEN"]
        path = os.environ.get("VCKPT_SERVICE_TOKEN_FILE")
        if path:
            try:
                with open(path) as f:
                    token = f.read().strip()
            except OSError as e:
                raise ServiceError(f"cannot read the token file {path}: {e.strerror}") from None
            return token or None
        return None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_key(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """A run's one name in the service: in its API paths (``/api/runs/KEY``), on the dashboard, and as the ``run``
    label of every metric. Readable (the run's folder name), unique (a hash of its canonical URL follows it) and
    stable (a function of the URL alone: the same across restarts and services, and however the URL is spelt: a
    relative path, its absolute path, its ``file://`` URL, a trailing slash): ``exp42-3f9a0c1d2b4e``."""
    from ..store import canonical_url

    canonical = canonical_url(url, storage_options)
    folder = canonical.rstrip("/").rsplit("/", 1)[-1].split("@")[-1]  # never the user:password@ of a bare bucket
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", folder).strip(".-")[:MAX_KEY_FOLDER] or "run"
    return f"{readable}-{hashlib.blake2b(canonical.encode(), digest_size=6).hexdigest()}"


def _protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol, with a deadline from the moment a connection opens: uvicorn times out only the idle
    time after a response, so a connection that never sends a request (or trickles one) would be held forever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Deadline(H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            self.loop.call_later(timeout_s, self._expire)

        def _expire(self) -> None:
            serving = self.cycle is not None and not self.cycle.response_complete
            if not serving and not self.transport.is_closing():
                self.transport.close()

    return Deadline


def missing_extra() -> None:
    """Raise :class:`ServiceError` naming the install line when the ``service`` extra is missing."""
    import importlib

    try:
        for module in ("starlette", "uvicorn", "prometheus_client"):
            importlib.import_module(module)
    except ImportError as e:
        raise ServiceError(f"vckpt serve needs {e.name}: pip install -e '.[service]'") from None


def _log_to_stderr() -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _warm_up() -> None:
    """Pay start-up costs before serving: importing torch (2 s on a small host, which watcher threads would
    otherwise pay under the GIL in their first pass), and one parallel tensor op on the main thread, after
    which each new reader thread's OpenMP team starts at 0.3 ms instead of 2 ms (measured)."""
    import torch

    from ..checkpoint import reading, verification  # noqa: F401 - imported for their start-up cost

    torch.zeros(64, 1024, dtype=torch.int64).sum(dim=1)


def serve(cfg: ServiceConfig, *, ready: threading.Event | None = None, log_to_stderr: bool = False) -> None:
    """Watch ``cfg.runs`` and serve HTTP until interrupted (SIGINT/SIGTERM). ``log_to_stderr``: what the service
    does goes to stderr (``vckpt serve``): its address at start, each pass that read something, each status change.
    With ``cfg.dask``, the cluster is connected (or the local one started) first, and closed when serving ends."""
    from ..checkpoint import fleet

    if log_to_stderr:
        _log_to_stderr()
    _warm_up()
    with contextlib.ExitStack() as resources:
        cluster = resources.enter_context(fleet.connect(cfg.dask, cfg.concurrency)) if cfg.dask else None
        _serve(cfg, cluster, ready)


def _serve(cfg: ServiceConfig, cluster: Any, ready: threading.Event | None) -> None:
    import uvicorn

    from .. import VerifiedCkptError, discover_runs
    from ..history import redact_url
    from .app import build_app
    from .metrics import Metrics
    from .scrub import Slots, Throttle
    from .watch import Watcher, Watchers, verifier_identity

    metrics, throttle, who = Metrics(), Throttle(cfg.bytes_per_s), verifier_identity()
    slots = Slots.of(cfg.concurrency)
    watchers = Watchers()  # added to by the discovery thread, read by the event loop
    threads: list[threading.Thread] = []  # appended by whoever adds a run; joined at exit from a copy
    stop = threading.Event()

    def watch(urls: list[str]) -> None:
        for u in urls:
            w = Watcher(run_key(u, cfg.storage_options), u, cfg.storage_options, metrics, throttle, poll_s=cfg.poll_s,
                        scrub_interval_s=cfg.scrub_interval_s, verifier=who, slots=slots,
                        head_interval_s=cfg.head_interval_s, cluster=cluster)
            if watchers.add(w):
                log.info("watching run %s: %s", w.key, redact_url(u))
                metrics.run_info.labels(w.key, redact_url(u)).set(1)
                threads.append(threading.Thread(target=w.run, name=f"vckpt-watch-{w.key}", daemon=True))
                threads[-1].start()

    def discover() -> None:
        while not stop.is_set():
            for prefix in cfg.discover:
                try:
                    watch(discover_runs(prefix, cfg.storage_options, known={w.url for w in watchers.all()}))
                except VerifiedCkptError as e:  # an unreachable prefix: try again at the next look
                    log.warning("discovering runs under %s: %s", prefix, e)
            stop.wait(cfg.poll_s * 10)

    watch(list(cfg.runs))
    if cfg.discover:
        threading.Thread(target=discover, name="vckpt-discover", daemon=True).start()
    server = uvicorn.Server(uvicorn.Config(build_app(watchers, metrics, cfg.resolved_token()), host=cfg.host,
                                           port=cfg.port, log_level="warning", lifespan="off",
                                           http=_protocol(cfg.request_timeout_s),
                                           timeout_keep_alive=max(1, int(cfg.request_timeout_s))))
    log.info("vckpt serve on http://%s:%d: dashboard /, API /api/runs, metrics /metrics, health /healthz; watching %d "
             "run(s)%s; a pass every %gs, a scrub of each checkpoint every %gs", cfg.host, cfg.port, len(watchers.all()),
             f" and runs under {', '.join(cfg.discover)}" if cfg.discover else "", cfg.poll_s, cfg.scrub_interval_s)
    try:
        server.run()
    finally:
        stop.set()
        for w in watchers.all():
            w.stop.set()
        for t in list(threads):
            t.join(timeout=5)
