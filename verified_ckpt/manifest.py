"""The data model: manifests, checkpoint info, records, and their JSON form.

A manifest is written once, last, after every shard it names is stored and
digested: it is the commit marker. Facts learnt later (offline verification,
incidents) are separate append-only records; the status a user sees is
derived from the manifest plus those records (see ``decisions``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

import blake3

from .crc import is_hex
from .errors import ManifestError
from .evidence import evidence_problem
from .fingerprint import Fingerprint, combine
from .hosts import Topology
from .jsonx import JSONBudgetError, Limits, canonical_json, decode_object, short_repr
from .layout import LayoutEntry, parse_layout
from .skeleton import MAX_DEPTH as MAX_SKELETON_DEPTH
from .skeleton import skeleton_problem, tensor_refs
from .status import MAX_STEP, Status
from .tensorspec import ITEMSIZE, MAX_NDIM, MAX_TENSORS, bounded_numel

__all__ = [
    "DIGEST_FIELD", "MAX_MANIFEST_BYTES", "MAX_STEP", "SEGMENT", "CheckpointInfo", "Manifest", "ShardEntry", "Status",
    "TensorEntry", "body_digest", "state_fingerprint_of",
]

# Version 2 carries ``manifest_digest``. Version 1 (written before it) is still read, with no digest: a version-2
# manifest cannot become one by a flipped byte (2 -> 1 is two bits, and the digest field would have to go too).
SCHEMA_VERSION = 2
_UNDIGESTED_VERSION = 1
DIGEST_FIELD = "manifest_digest"
MAX_MANIFEST_BYTES = 64 << 20  # about 250,000 tensors; real manifests use ~250 bytes per tensor
# Shard file names and checkpoint ids are single flat path segments: nothing
# a manifest says can point outside its checkpoint folder.
# (\Z, not $: "$" would also accept a name followed by a newline.)
SEGMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z")
MANIFEST_NAME = "manifest.json"  # the commit marker in a checkpoint's folder, written last
# Deepest JSON nesting a manifest may have: a state skeleton plus the manifest's own levels.
MAX_DEPTH = MAX_SKELETON_DEPTH + 4
_MAX_BYTES = 1 << 62  # no size, and no tensor, is larger
_HEX32 = re.compile(r"[0-9a-f]{32}\Z")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


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
    # CRC-64/NVME of the whole file, 16 hex digits (``crc.py``): what an object store keeps beside it. Written by
    # saves since issue 40; ``None`` in older manifests, which verify as they always did.
    crc64nvme: str | None = None


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything a checkpoint promises, written once and never changed."""

    run_id: str
    checkpoint_id: str
    step: int
    created_at: str
    topology: Topology
    shards: list[ShardEntry]
    tensors: dict[str, TensorEntry]
    state_fingerprint: str
    state: dict[str, Any]
    evidence: dict[str, Any]
    status: Status
    reasons: list[str]
    resumed_from: str | None = None
    schema_version: int = SCHEMA_VERSION
    # Sharded tensors (FSDP2/HSDP): logical name -> global shape and the stored chunks that tile it.
    # Written only when non-empty, so replicated (DDP) manifests are what they always were.
    layout: dict[str, LayoutEntry] = dataclasses.field(default_factory=dict)
    # Floating tensors that are not training state (a callback's best score): NaN/Inf in them is no finding.
    # Written only when non-empty; a manifest without it counts every tensor as training state.
    bookkeeping: list[str] = dataclasses.field(default_factory=list)

    @property
    def size_bytes(self) -> int:
        return sum(s.size for s in self.shards)

    def spec(self, name: str) -> tuple[str, list[int]] | None:
        """The dtype and (global) shape of the logical tensor ``name``, stored whole or in chunks."""
        if name in self.tensors:
            return self.tensors[name].dtype, self.tensors[name].shape
        if name in self.layout:
            return self.layout[name].dtype, self.layout[name].shape
        return None

    def for_rank(self, rank: int) -> Manifest:
        """This manifest as rank ``rank`` restores it: each per-rank entry holds that rank's own value.

        A job restored on fewer or more ranks than saved takes rank ``rank % saved ranks``'s value.
        """
        if not any(e.get("per_rank") for e in self.state.values()):
            return self
        state = {k: {"stateful": e["stateful"], "value": e["value"][str(rank % len(e["value"]))]}
                 if e.get("per_rank") else e for k, e in self.state.items()}
        return dataclasses.replace(self, state=state)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["topology"] = self.topology.to_dict()
        d["status"] = self.status.value
        if not self.layout:
            del d["layout"]
        if not self.bookkeeping:
            del d["bookkeeping"]
        for shard in d["shards"]:  # an older manifest's shards stay as they were, byte for byte
            if shard.get("crc64nvme") is None:
                del shard["crc64nvme"]
        if self.schema_version != _UNDIGESTED_VERSION:
            d[DIGEST_FIELD] = body_digest(d)
        return d

    def to_json(self) -> bytes:
        return canonical_json(self.to_dict())

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """:meth:`decode_json` then :meth:`from_dict`."""
        return cls.from_dict(cls.decode_json(data, where), where)

    @staticmethod
    def decode_json(data: bytes, where: str) -> dict[str, Any]:
        """The manifest's JSON object, decoded within the size and nesting limits.

        Callers that also need the raw object (to check its signature) decode
        once and pass it to :meth:`from_dict`.

        Raises:
            ManifestError: not bytes, too large, not JSON, too deep, or not an object.
        """
        try:
            # Real manifests hold one JSON array or object per 70-110 bytes; 24 leaves room and keeps a
            # hostile one of nested empty containers near 5x its size in memory once parsed.
            return decode_object(data, Limits(max_bytes=MAX_MANIFEST_BYTES, max_depth=MAX_DEPTH, bytes_per_container=24))
        except JSONBudgetError as e:
            raise _malformed(where, str(e)) from None

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> Manifest:
        """Validate a decoded manifest; every defect becomes one :class:`ManifestError` naming ``where``.

        A manifest that parses is safe for the rest of the library to use as is:
        every field has its type, every name is a plain path segment, shards and
        tensors agree with each other, shapes fit their shards, the state skeleton
        is one :func:`~verified_ckpt.flatten.unflatten` can rebuild, and nothing is
        nested deeper than :data:`MAX_DEPTH`. Cheap: one pass over the parsed JSON.
        Never raises anything but :class:`ManifestError`, whatever ``data`` holds.
        """

        def bad(why: str) -> ManifestError:
            return _malformed(where, why)

        status = _check_fields(d, bad)
        shards = _shards(d["shards"], bad)
        tensors = _tensors(d["tensors"], {sh.path: sh for sh in shards}, bad)
        layout = parse_layout(d.get("layout", {}), tensors, bad)
        _check_state(d["state"], tensors, layout.keys(), bad)
        kept = d.get("bookkeeping", [])
        if not (isinstance(kept, list) and all(isinstance(n, str) and n in tensors for n in kept)
                and len(set(kept)) == len(kept)):
            raise bad("bookkeeping must list distinct names of the manifest's tensors")
        # Last, on a document whose shape is known: the specific defects above name themselves first.
        _check_digest(d, bad)
        if str(state_fingerprint_of(tensors, d["state"])) != d["state_fingerprint"]:
            raise bad("its state_fingerprint does not match its tensor table and state skeleton")
        return cls(
            run_id=d["run_id"], checkpoint_id=d["checkpoint_id"], step=d["step"], created_at=d["created_at"],
            topology=Topology.from_dict(d["topology"]), shards=shards, tensors=tensors, state_fingerprint=d["state_fingerprint"],
            state=d["state"], evidence=d["evidence"], status=status, reasons=list(d["reasons"]),
            resumed_from=d.get("resumed_from"), schema_version=d["schema_version"], layout=layout,
            bookkeeping=list(kept),
        )


def body_digest(doc: Mapping[str, Any]) -> str:
    """The blake3 (hex) of a manifest document's canonical JSON, its digest and signature left out.

    The signature seals the digest, so it cannot be inside it; everything a reader uses is.

    Raises:
        ValueError: a string canonical JSON cannot encode (a lone surrogate).
    """
    body = {k: v for k, v in doc.items() if k not in (DIGEST_FIELD, "signature")}
    return blake3.blake3(canonical_json(body)).hexdigest()


def state_fingerprint_of(tensors: Mapping[str, TensorEntry], state: Mapping[str, Any]) -> Fingerprint:
    """The ``state_fingerprint`` a manifest records for its tensor table and state skeleton: what a save writes and
    every parse recomputes.

    Per-rank entries (``"per_rank": true``) differ between ranks by design, so the fingerprint every rank's live
    state reproduces leaves them and the tensors they name out; those tensors keep their own fingerprints.
    """
    own = set().union(*(tensor_refs(v) for e in state.values() if e.get("per_rank") for v in e["value"].values()))
    shared = {k: e for k, e in state.items() if not e.get("per_rank")}
    return combine([(n, e.dtype, e.shape, e.fingerprint) for n, e in tensors.items() if n not in own],
                   canonical_json(shared))


_Bad = Callable[[str], ManifestError]


def _check_fields(d: dict[str, Any], bad: _Bad) -> Status:
    """The top-level fields: present, typed, in range; returns the status."""
    if type(d.get("schema_version")) is not int or d["schema_version"] not in (_UNDIGESTED_VERSION, SCHEMA_VERSION):
        raise bad(f"schema_version {short_repr(d.get('schema_version'))}, this version reads "
                  f"{_UNDIGESTED_VERSION} and {SCHEMA_VERSION}")
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
    if not 0 <= d["step"] <= MAX_STEP:
        raise bad(f"step {short_repr(d['step'])} is not between 0 and {MAX_STEP}")
    if not SEGMENT.match(d["checkpoint_id"]):
        raise bad(f"checkpoint_id {short_repr(d['checkpoint_id'])} is not a plain name")
    if not _HEX32.match(d["state_fingerprint"]):
        raise bad("state_fingerprint is not 32 lowercase hex digits")
    try:
        status = Status(d["status"])
    except ValueError:
        raise bad(f"unknown status {short_repr(d['status'])}") from None
    if not all(isinstance(r, str) for r in d["reasons"]):
        raise bad("reasons must be strings")
    resumed = d.get("resumed_from")
    if resumed is not None and not isinstance(resumed, str):
        raise bad("resumed_from must be a string or null")
    why = _topology_problem(d["topology"]) or evidence_problem(d["evidence"])
    if why:
        raise bad(why)
    return status


def _check_digest(d: dict[str, Any], bad: _Bad) -> None:
    """The manifest's digest matches its body: no field was changed since the save, key or no key."""
    recorded = d.get(DIGEST_FIELD)
    if d["schema_version"] == _UNDIGESTED_VERSION:
        if DIGEST_FIELD in d:  # a version-2 manifest whose version was changed: its digest says what it was
            raise bad(f"schema_version {_UNDIGESTED_VERSION} has no {DIGEST_FIELD}, but this manifest holds one")
        return
    if not (isinstance(recorded, str) and _HEX64.match(recorded)):
        raise bad(f"{DIGEST_FIELD} is missing or not 64 lowercase hex digits")
    try:
        digest = body_digest(d)
    except ValueError:  # a lone surrogate the decoder let through: no writer of this library wrote it
        raise bad("it holds a string that canonical JSON cannot encode") from None
    if digest != recorded:
        raise bad(f"its {DIGEST_FIELD} does not match its content: it was changed or damaged after the save")


def _shards(raw: list[Any], bad: _Bad) -> list[ShardEntry]:
    shards: list[ShardEntry] = []
    paths: set[str] = set()
    for s in raw:
        if not (isinstance(s, dict) and isinstance(s.get("path"), str) and type(s.get("size")) is int
                and isinstance(s.get("digest"), str) and isinstance(s.get("tensors"), list)):
            raise bad("a shard entry lacks path, size, digest or tensors")
        path = s["path"]
        if not SEGMENT.match(path) or path == MANIFEST_NAME:
            raise bad(f"shard path {short_repr(path)} is not a plain file name inside the checkpoint folder")
        if not 8 <= s["size"] <= _MAX_BYTES or not _HEX64.match(s["digest"]):
            raise bad(f"shard {path!r} has an invalid size or digest")
        names = s["tensors"]
        if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise bad(f"shard {path!r} must list distinct tensor names (strings)")
        if path in paths:
            raise bad("two shards share a path")
        crc = s.get("crc64nvme")
        if crc is not None and not is_hex(crc):
            raise bad(f"shard {path!r} has an invalid crc64nvme (16 lowercase hex digits)")
        paths.add(path)
        shards.append(ShardEntry(path, s["size"], s["digest"], list(names), crc))
    return shards


def _tensors(raw: dict[str, Any], by_path: dict[str, ShardEntry], bad: _Bad) -> dict[str, TensorEntry]:
    """Every tensor entry, checked against the shards: each fits its shard and is listed by it alone."""
    if len(raw) > MAX_TENSORS:
        raise bad(f"{len(raw)} tensors, more than {MAX_TENSORS}")
    tensors: dict[str, TensorEntry] = {}
    held = dict.fromkeys(by_path, 0)  # data bytes the manifest's shapes put in each shard
    for name, t in raw.items():
        what = f"tensor {short_repr(name)}"
        if not (isinstance(t, dict) and isinstance(t.get("dtype"), str) and isinstance(t.get("shape"), list)
                and isinstance(t.get("shard"), str) and isinstance(t.get("fingerprint"), str)):
            raise bad(f"{what} lacks dtype, shape, shard or fingerprint")
        if t["shard"] not in by_path:
            raise bad(f"{what} names unknown shard {short_repr(t['shard'])}")
        itemsize = ITEMSIZE.get(t["dtype"])
        if itemsize is None:
            raise bad(f"{what} has unknown dtype {short_repr(t['dtype'])}")
        shape = t["shape"]
        if len(shape) > MAX_NDIM or not all(type(n) is int and n >= 0 for n in shape):
            raise bad(f"{what} has an invalid shape {short_repr(shape)}")
        numel = bounded_numel(shape, _MAX_BYTES)  # elements; the same bound as shards.parse_header
        held[t["shard"]] += (numel or 0) * itemsize
        if numel is None or held[t["shard"]] > by_path[t["shard"]].size - 8:
            raise bad(f"{what} of shape {short_repr(shape)} does not fit in shard {t['shard']!r}")
        if not _HEX32.match(t["fingerprint"]):
            raise bad(f"{what} has a fingerprint that is not 32 lowercase hex digits")
        tensors[name] = TensorEntry(t["dtype"], list(shape), t["shard"], t["fingerprint"])
    # Every tensor is listed by the shard it names, and by no other (names are distinct per shard).
    listed = 0
    for s in by_path.values():
        for n in s.tensors:
            if n not in tensors or tensors[n].shard != s.path:
                raise bad(f"shard {s.path!r} lists tensor {short_repr(n)}, which the manifest puts elsewhere")
        listed += len(s.tensors)
    if listed != len(tensors):
        raise bad("a tensor is missing from its shard's list")
    return tensors


def _check_state(state: dict[str, Any], tensors: Mapping[str, TensorEntry], sharded: Collection[str], bad: _Bad) -> None:
    """Every state entry is a skeleton ``unflatten`` can rebuild from tensors the manifest holds (whole or in chunks),
    every byte string from a whole 1-D uint8 tensor."""
    for key, entry in state.items():
        if not key or "/" in key:
            raise bad(f"state key {short_repr(key)} is not a plain name")
        if not (isinstance(entry, dict) and set(entry) in ({"stateful", "value"}, {"stateful", "value", "per_rank"},
                                                           {"stateful", "value", "parts"})
                and isinstance(entry["stateful"], bool) and entry.get("per_rank", True) is True
                and entry.get("parts", True) is True and (entry["stateful"] or "parts" not in entry)):
            raise bad(f"state entry {short_repr(key)} must have exactly stateful (bool), value and maybe per_rank "
                      "(true) or, when stateful, parts (true)")
        if entry.get("parts") and not isinstance(entry["value"], dict):
            raise bad(f"state entry {short_repr(key)} is held in parts but is not a mapping")
        values = [entry["value"]]
        if entry.get("per_rank"):  # one value per rank that saved, "0" .. "W-1"
            ranks = entry["value"]
            if not (isinstance(ranks, dict) and ranks and set(ranks) == {str(r) for r in range(len(ranks))}):
                raise bad(f"per-rank state entry {short_repr(key)} must map ranks 0..W-1 to values")
            values = list(ranks.values())
        refs: set[str] = set()
        blobs: set[str] = set()
        why = next((w for v in values if (w := skeleton_problem(v, refs, blobs))), None)
        if why:
            raise bad(f"state entry {short_repr(key)}: {why}")
        missing = sorted(n for n in refs if n not in tensors and n not in sharded)
        if missing:
            raise bad(f"state entry {short_repr(key)} refers to tensor {short_repr(missing[0])}, which no shard holds")
        odd = sorted(n for n in blobs if n not in tensors or tensors[n].dtype != "uint8" or len(tensors[n].shape) != 1)
        if odd:
            raise bad(f"state entry {short_repr(key)}: byte string {short_repr(odd[0])} is not a whole 1-D uint8 tensor")


def _malformed(where: str, why: str) -> ManifestError:
    return ManifestError(f"manifest {where} is malformed ({why}); it cannot be trusted - "
                         "restore another checkpoint, or delete this one")


def _topology_problem(topo: dict[str, Any]) -> str | None:
    world = topo.get("world_size")
    if world is not None and (type(world) is not int or world < 0):
        return "topology world_size must be an int >= 0"
    ranks = topo.get("ranks", [])
    if not isinstance(ranks, list):
        return "topology ranks must be a list"
    for r in ranks:
        if not (isinstance(r, dict) and type(r.get("rank")) is int
                and all(isinstance(r.get(k, ""), str) for k in ("host", "device"))):
            return "a topology rank must have an int rank and string host and device"
    return None


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
    signature: str = "unsigned"  # signing.Signature value of the manifest

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "step": self.step, "status": self.status.value, "created_at": self.created_at,
            "size_bytes": self.size_bytes, "reasons": list(self.reasons), "signature": self.signature,
        }
