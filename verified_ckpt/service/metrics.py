"""The service's Prometheus metrics, one registry, labelled by run (its key, ``service.run_key``: the name the
dashboard and the API give it; ``vckpt_run_info`` maps it to the run's URL).

Counters count what this process did since it started (Prometheus handles
restarts); gauges are re-derived from the run's own records on every pass,
so they are right after a restart too.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge

from .. import Status

__all__ = ["Metrics"]


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.checkpoints = Gauge("vckpt_checkpoints", "Committed checkpoints by derived status", ["run", "status"],
                                 registry=r)
        self.verified_bytes = Counter("vckpt_verified_bytes", "Bytes re-read and checked by this service", ["run"],
                                      registry=r)
        self.verified = Counter("vckpt_verified_checkpoints", "Checkpoints re-read and checked by this service", ["run"],
                                registry=r)
        self.failures = Counter("vckpt_verification_failures", "Verifications that found a problem", ["run"], registry=r)
        self.newest_age = Gauge("vckpt_newest_verified_age_seconds",
                                "Age of the newest checkpoint a verification service has verified (-1: none)", ["run"],
                                registry=r)
        self.scrub_lag = Gauge("vckpt_scrub_lag_seconds", "How long the most overdue scrub has waited past its time",
                               ["run"], registry=r)
        self.open_incidents = Gauge("vckpt_open_incidents", "Incidents no rollback has answered", ["run"], registry=r)
        self.store_errors = Counter("vckpt_store_errors", "Passes over a run that failed to read its store", ["run"],
                                    registry=r)
        self.run_up = Gauge("vckpt_run_up", "1 when the last pass over the run succeeded, else 0", ["run"], registry=r)
        self.suspect_host = Gauge("vckpt_suspect_host", "1 for each host an open incident of the run names",
                                  ["run", "host"], registry=r)
        self.run_info = Gauge("vckpt_run_info", "1 for each watched run: its key (the run label) and its URL",
                              ["run", "url"], registry=r)
        self._suspects: dict[str, set[str]] = {}  # by run, under _lock: every watcher thread updates its own run's
        self._lock = threading.Lock()

    def suspects(self, run: str, hosts: list[str]) -> None:
        """One series per host the run's open incidents name; a host no longer named loses its series."""
        with self._lock:  # remove() of a series another thread already removed would raise
            for gone in self._suspects.get(run, set()) - set(hosts):
                self.suspect_host.remove(run, gone)
            for host in hosts:
                self.suspect_host.labels(run, host).set(1)
            self._suspects[run] = set(hosts)

    def statuses(self, run: str, counts: dict[Status, int]) -> None:
        for status in Status:
            self.checkpoints.labels(run, status.value).set(counts.get(status, 0))
