"""The data model: manifests, checkpoint info, records, and their JSON form.

A manifest is written once, last, after every shard it names is stored and
digested: it is the commit marker. Facts learnt later (offline verification,
incidents) are separate append-only records; the status a user sees is
derived from the manifest plus those records (see ``decisions``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from typing import Any

from .errors import ManifestError
from .flatten import canonical_json

SCHEMA_VERSION = 1
MAX_MANIFEST_BYTES = 256 << 20

# Shard file names and checkpoint ids are single flat path segments: nothing
# a manifest says can point outside its checkpoint folder.
SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class Status(str, enum.Enum):
    """What a checkpoint may be used for."""

    RESTORABLE = "restorable"
    UNVERIFIED = "unverified"
    SUSPECT = "suspect"
    CORRUPT = "corrupt"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: list[int]
    shard: str
    fingerprint: str


@dataclasses.dataclass(frozen=True)
class ShardEntry:
    path: str
    size: int
    digest: str  # blake3 hex of the whole file
    tensors: list[str]


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything a checkpoint promises, written once and never changed."""

    run_id: str
    checkpoint_id: str
    step: int
    created_at: str
    topology: dict[str, Any]
    shards: list[ShardEntry]
    tensors: dict[str, TensorEntry]
    state_fingerprint: str
    state: dict[str, Any]
    evidence: dict[str, Any]
    status: Status
    reasons: list[str]
    resumed_from: str | None = None
    schema_version: int = SCHEMA_VERSION

    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def to_json(self) -> bytes:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        return canonical_json(d)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and validate; every defect becomes one :class:`ManifestError` naming ``where``."""

        def bad(why: str) -> ManifestError:
            return ManifestError(
                f"manifest {where} is malformed ({why}); it cannot be trusted - "
                "restore another checkpoint, or delete this one"
            )

        if len(data) > MAX_MANIFEST_BYTES:
            raise bad(f"{len(data)} bytes, more than {MAX_MANIFEST_BYTES}")
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"not valid JSON, truncated? {getattr(e, 'msg', e)}") from None
        if not isinstance(d, dict):
            raise bad("not a JSON object")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise bad(f"schema_version {d.get('schema_version')!r}, this version reads {SCHEMA_VERSION}")
        want = {
            "run_id": str, "checkpoint_id": str, "step": int, "created_at": str, "topology": dict,
            "shards": list, "tensors": dict, "state_fingerprint": str, "state": dict, "evidence": dict,
            "status": str, "reasons": list,
        }
        for key, typ in want.items():
            if key not in d:
                raise bad(f"missing field {key!r}")
            if not isinstance(d[key], typ) or (typ is int and isinstance(d[key], bool)):
                raise bad(f"field {key!r} must be {typ.__name__}")
        if not SEGMENT.match(d["checkpoint_id"]):
            raise bad(f"checkpoint_id {d['checkpoint_id']!r} is not a plain name")
        try:
            status = Status(d["status"])
        except ValueError:
            raise bad(f"unknown status {d['status']!r}") from None
        shards = []
        for s in d["shards"]:
            if not (isinstance(s, dict) and isinstance(s.get("path"), str) and type(s.get("size")) is int
                    and isinstance(s.get("digest"), str) and isinstance(s.get("tensors"), list)):
                raise bad("a shard entry lacks path, size, digest or tensors")
            if not SEGMENT.match(s["path"]) or s["path"] == "manifest.json":
                raise bad(f"shard path {s['path']!r} is not a plain file name inside the checkpoint folder")
            if s["size"] < 0 or not re.fullmatch(r"[0-9a-f]{64}", s["digest"]):
                raise bad(f"shard {s['path']!r} has an invalid size or digest")
            shards.append(ShardEntry(s["path"], s["size"], s["digest"], [str(t) for t in s["tensors"]]))
        if len({s.path for s in shards}) != len(shards):
            raise bad("two shards share a path")
        tensors = {}
        shard_paths = {s.path for s in shards}
        for name, t in d["tensors"].items():
            if not (isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
                    and isinstance(t.get("shard"), str) and isinstance(t.get("fingerprint"), str)):
                raise bad(f"tensor entry {name!r} lacks dtype, shape, shard or fingerprint")
            if t["shard"] not in shard_paths:
                raise bad(f"tensor {name!r} names unknown shard {t['shard']!r}")
            tensors[name] = TensorEntry(t["dtype"], list(t["shape"]), t["shard"], t["fingerprint"])
        resumed = d.get("resumed_from")
        if resumed is not None and not isinstance(resumed, str):
            raise bad("resumed_from must be a string or null")
        return cls(
            run_id=d["run_id"], checkpoint_id=d["checkpoint_id"], step=d["step"], created_at=d["created_at"],
            topology=d["topology"], shards=shards, tensors=tensors, state_fingerprint=d["state_fingerprint"],
            state=d["state"], evidence=d["evidence"], status=status, reasons=[str(r) for r in d["reasons"]],
            resumed_from=resumed,
        )


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint as a user sees it: the manifest plus derived status."""

    id: str
    step: int
    status: Status
    created_at: str
    size_bytes: int
    reasons: list[str]
    manifest: Manifest | None = dataclasses.field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "step": self.step, "status": self.status.value, "created_at": self.created_at,
            "size_bytes": self.size_bytes, "reasons": list(self.reasons),
        }


@dataclasses.dataclass(frozen=True)
class Problem:
    kind: str  # digest | size | header | fingerprint | missing | nonfinite | manifest | read | ledger
    detail: str


@dataclasses.dataclass(frozen=True)
class VerificationResult:
    """The outcome of re-reading one checkpoint offline."""

    id: str
    step: int
    ok: bool
    problems: list[Problem]
    verified_at: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "step": self.step, "ok": self.ok,
            "problems": [f"{p.kind}: {p.detail}" for p in self.problems], "verified_at": self.verified_at,
        }

    def to_record(self) -> dict[str, Any]:
        return {
            "kind": "verification", "checkpoint_id": self.id, "step": self.step, "ok": self.ok,
            "problems": [dataclasses.asdict(p) for p in self.problems], "at": self.verified_at,
        }


@dataclasses.dataclass(frozen=True)
class Incident:
    """A failed check: what failed, when, and which replicas are suspect.

    ``first_suspect_step`` is the step after the last step at which that
    check passed: state from that step on may carry the fault.
    """

    kind: str  # nonfinite_local | nonfinite_averaged | checksum | audit | consensus | manual
    detected_step: int
    first_suspect_step: int
    ranks: list[int]
    hosts: list[dict[str, Any]]  # {"rank", "host", "device"} for each suspect rank
    detail: str
    id: str = ""
    reason: str = ""
    to_step: int | None = None

    @property
    def exclude_hosts(self) -> list[str]:
        """Hosts a scheduler should keep this job off."""
        return sorted({h["host"] for h in self.hosts})

    def summary(self) -> str:
        who = ", ".join(f"rank {h['rank']} on {h['host']} ({h['device']})" for h in self.hosts) or "no replica could be named"
        return (f"{self.kind} check failed at step {self.detected_step}: {self.detail}; suspect: {who}; "
                f"state from step {self.first_suspect_step} on may be corrupt - roll back to an earlier checkpoint")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["exclude_hosts"] = self.exclude_hosts
        return d
