"""A replay bundle as stored: a signed JSON record and the safetensors object it digests.

The guard's capture (``guard/capture.py``) becomes two objects under ``<run>/replay/``: ``<incident>.safetensors``,
the step's weights and buffers and each suspect's microbatches and random states (tensors named by position, so
no user string becomes a key), then ``<incident>.json``, written last, which names the incident, says what each
suspect recorded and what a healthy rank recomputed, and holds the tensors' size and blake3 digest. The record is
sealed like every record (``signing``), so an altered bundle is refused before anything is loaded, and the
tensors are read only through safetensors: no pickle.

Floats travel as ``float.hex`` strings: exact, and a NaN loss (the incident of a poisoned batch) is valid JSON.
Pure: capture in, record and bytes out, and back; the store does the I/O.

A signature proves nothing in an unsigned run, and a digest only that the tensors are the ones the record names,
so the reader takes nothing on trust: every field must be what :func:`encode` writes (its type, its range, no
field missing or extra), the fields must agree with each other (each batch structure with its leaf count, each
result with the number of lanes, the buckets with the parameters, a reference rank that is no suspect), and the
tensors must be exactly the ones the record names, the random states ones torch can take. A bundle that is not
is refused (``BundleError``) before anything is loaded, naming the field, rather than failing mid-replay.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import blake3
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from . import batches
from .errors import BundleError
from .guard.audit import Recomputed
from .guard.capture import Capture, Recipe
from .hosts import host_problem
from .jsonx import JSONBudgetError, Limits, canonical_json, decode_object, short_repr
from .manifest import MAX_STEP
from .signing import Signature, Signer

__all__ = ["Bundle", "BundleError", "BundleSuspect", "decode", "encode", "names_of", "tensors_of"]

VERSION = 1
MAX_RECORD_BYTES = 4 << 20
_LIMITS = Limits(max_bytes=MAX_RECORD_BYTES, max_depth=16)
_FIELDS = frozenset({"bundle", "incident", "step", "kind", "layout", "lanes", "seed", "mode", "rtol", "params", "buffers",
                     "suspects", "nbytes", "digest", "signature"})
_SUSPECT = frozenset({"rank", "host", "recorded", "reference_rank", "reference", "microbatches"})
_MICROBATCH = frozenset({"spec", "leaves", "cuda"})
_RESULT = frozenset({"loss", "proj", "lanes", "sumsq"})
_MAX_RANK = 1 << 31  # as the records' ranks
_MAX_LANES = 16  # GuardConfig.checksum_lanes
_MAX_SEED = 1 << 42  # the projections seed generators with seed * 1_000_003 + rows, which must fit an int64
_MAX_ITEMS = 100_000
_MAX_NAME = 1024
_MODES = ("exact", "tolerance")


class _Malformed(Exception):
    """One field that is not what ``encode`` writes; ``decode`` and ``tensors_of`` name the incident around it."""


@dataclasses.dataclass(frozen=True)
class BundleSuspect:
    rank: int
    host: str
    recorded: Recomputed
    reference_rank: int
    reference: Recomputed
    microbatches: list[tuple[Any, int, bool]]  # (structure, number of leaves, has a CUDA random state)


@dataclasses.dataclass(frozen=True)
class Bundle:
    incident: str
    recipe: Recipe
    params: list[str]
    buffers: list[str]
    suspects: list[BundleSuspect]
    nbytes: int
    digest: str
    signature: str = Signature.UNSIGNED.value


def _fp(r: Recomputed) -> dict[str, Any]:
    return {"loss": float(r.loss).hex(), "proj": [float(p).hex() for p in r.proj],
            "lanes": None if r.lanes is None else [int(r.lanes[0]), int(r.lanes[1])], "sumsq": float(r.sumsq).hex()}


def _fields(d: Any, where: str, names: frozenset[str]) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise _Malformed(f"{where} must be an object, got {short_repr(d)}")
    if set(d) != names:
        odd = sorted(set(d) ^ names)[:3]
        raise _Malformed(f"{where} must hold exactly the fields {sorted(names)}; {', '.join(map(repr, odd))} differ")
    return d


def _int(v: Any, where: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v < hi:
        raise _Malformed(f"{where} must be an int from {lo} to {hi - 1}, got {short_repr(v)}")
    return v


def _text(v: Any, where: str, longest: int = _MAX_NAME) -> str:
    # Printable only: names reach the terminal in the replay's line and its messages (no newline, no escape).
    if not isinstance(v, str) or not 0 < len(v) <= longest or not v.isprintable():
        raise _Malformed(f"{where} must be a printable name of 1 to {longest} characters, got {short_repr(v)}")
    return v


def _list(v: Any, where: str, shortest: int = 0) -> list[Any]:
    if not isinstance(v, list) or not shortest <= len(v) <= _MAX_ITEMS:
        raise _Malformed(f"{where} must be a list of {shortest} to {_MAX_ITEMS} items, got {short_repr(v)}")
    return v


def _hex(v: Any, where: str) -> float:
    try:
        if isinstance(v, str) and len(v) <= 64:
            return float.fromhex(v)
    except (ValueError, OverflowError):
        pass
    raise _Malformed(f"{where} must be a float as float.hex writes it, got {short_repr(v)}")


def _names(v: Any, where: str) -> list[str]:
    names = [_text(n, f"{where}[{i}]") for i, n in enumerate(_list(v, where))]
    if len(set(names)) != len(names):
        raise _Malformed(f"{where} names one entry twice")
    return names


def _unfp(d: Any, where: str, lanes: int) -> Recomputed:
    d = _fields(d, where, _RESULT)
    proj = [_hex(p, f"{where}.proj[{i}]") for i, p in enumerate(_list(d["proj"], f"{where}.proj"))]
    if len(proj) != lanes:
        raise _Malformed(f"{where}.proj holds {len(proj)} projections, and the bundle's lanes say {lanes}")
    exact = d["lanes"]
    if exact is not None:
        if not (isinstance(exact, list) and len(exact) == 2):
            raise _Malformed(f"{where}.lanes must be null or two int64s, got {short_repr(exact)}")
        exact = tuple(_int(x, f"{where}.lanes[{i}]", -(1 << 63), 1 << 63) for i, x in enumerate(exact))
    return Recomputed(_hex(d["loss"], f"{where}.loss"), proj, exact, _hex(d["sumsq"], f"{where}.sumsq"))


def _host(v: Any, where: str) -> str:
    """A suspect's host, in the one grammar (``hosts.host_problem``): it is printed in the replay's verdict."""
    why = host_problem(v)
    if why:
        raise _Malformed(f"{where}: {why}")
    return str(v)


def encode(cap: Capture, incident: str, signer: Signer) -> tuple[bytes, bytes]:
    """(record bytes, tensor bytes) of ``cap`` for incident ``incident``."""
    tensors: dict[str, torch.Tensor] = {}
    for i, t in enumerate(cap.params.values()):
        tensors[f"param/{i}"] = t.contiguous().clone()
    for i, t in enumerate(cap.buffers.values()):
        tensors[f"buffer/{i}"] = t.contiguous().clone()
    suspects = []
    for s in cap.suspects:
        mbs = []
        for j, (spec, leaves, cpu, cuda) in enumerate(s.microbatches):
            for k, leaf in enumerate(leaves):
                tensors[f"mb/{s.rank}/{j}/{k}"] = leaf.contiguous().clone()
            tensors[f"rng/{s.rank}/{j}/cpu"] = cpu.contiguous().clone()
            if cuda is not None:
                tensors[f"rng/{s.rank}/{j}/cuda"] = cuda.contiguous().clone()
            mbs.append({"spec": spec, "leaves": len(leaves), "cuda": cuda is not None})
        suspects.append({"rank": s.rank, "host": s.host, "recorded": _fp(s.recorded), "reference_rank": s.reference_rank,
                         "reference": _fp(s.reference), "microbatches": mbs})
    data = save_tensors(tensors)
    r = cap.recipe
    record = {"bundle": VERSION, "incident": incident, "step": r.step, "kind": r.kind,
              "layout": [[i, m] for i, m in sorted(r.layout.items())], "lanes": r.lanes, "seed": r.seed,
              "mode": r.mode, "rtol": float(r.rtol).hex(), "params": list(cap.params), "buffers": list(cap.buffers),
              "suspects": suspects, "nbytes": len(data), "digest": blake3.blake3(data).hexdigest()}
    return canonical_json(signer.seal(record)), data


def decode(raw: bytes, signer: Signer, incident: str) -> Bundle:
    """The record of incident ``incident``'s bundle, checked: JSON within bounds, its signature, then every field
    and how the fields agree (the module doc).

    Raises:
        BundleError: unreadable, of another incident, its signature refused, or malformed (the message names the
            field).
    """
    try:
        doc = decode_object(raw, _LIMITS)
    except JSONBudgetError as e:
        raise BundleError(f"the replay bundle of incident {incident} is not a readable record ({e}); it is never "
                          "replayed") from None
    state = signer.check(doc)
    if not state.trusted:
        raise BundleError(signer.why(state, f"the replay bundle of incident {incident}") + "; it is never replayed")
    try:
        return _parse(doc, incident, state)
    except _Malformed as e:
        raise BundleError(f"the replay bundle of incident {incident} is malformed ({e}); it is never replayed") from None


def _parse(doc: dict[str, Any], incident: str, state: Signature) -> Bundle:
    d = _fields(doc, "the record", _FIELDS)
    if type(d["bundle"]) is not int or d["bundle"] != VERSION or d["incident"] != incident:
        raise _Malformed(f"it is bundle {short_repr(d['bundle'])} of incident {short_repr(d['incident'])}, not bundle "
                         f"{VERSION} of incident {incident}")
    lanes = _int(d["lanes"], "lanes", 1, _MAX_LANES + 1)
    params, buffers = _names(d["params"], "params"), _names(d["buffers"], "buffers")
    if not params:
        raise _Malformed("params names no parameter")
    rtol = _hex(d["rtol"], "rtol")
    if d["mode"] not in _MODES or not (math.isfinite(rtol) and rtol > 0):
        raise _Malformed(f"mode must be one of {list(_MODES)} and rtol a finite float > 0, got {short_repr(d['mode'])} "
                         f"and {rtol!r}")
    recipe = Recipe(_int(d["step"], "step", 0, MAX_STEP + 1), _text(d["kind"], "kind", 64), _buckets(d["layout"], len(params)),
                    lanes, _int(d["seed"], "seed", -_MAX_SEED, _MAX_SEED), d["mode"], rtol)
    suspects = [_suspect(s, f"suspects[{i}]", lanes) for i, s in enumerate(_list(d["suspects"], "suspects", 1))]
    ranks = [s.rank for s in suspects]
    if len(set(ranks)) != len(ranks):
        raise _Malformed(f"suspects name rank {max(ranks, key=ranks.count)} twice")
    for i, s in enumerate(suspects):
        if s.reference_rank in ranks:
            raise _Malformed(f"suspects[{i}].reference_rank {s.reference_rank} is a suspect, not the healthy rank that "
                             "recomputed its step")
    digest = d["digest"]
    if not (isinstance(digest, str) and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest)):
        raise _Malformed(f"digest must be a blake3 hex digest, got {short_repr(digest)}")
    return Bundle(incident, recipe, params, buffers, suspects, _int(d["nbytes"], "nbytes", 1, 1 << 50), digest, state.value)


def _buckets(v: Any, nparams: int) -> dict[int, list[int]]:
    """The reduction's buckets: distinct indices, each a non-empty list of parameter positions, no position twice."""
    out: dict[int, list[int]] = {}
    seen: set[int] = set()
    for i, pair in enumerate(_list(v, "layout", 1)):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise _Malformed(f"layout[{i}] must be [bucket, [parameter positions]], got {short_repr(pair)}")
        index = _int(pair[0], f"layout[{i}][0]", 0, nparams)
        members = [_int(m, f"layout[{i}][1][{j}]", 0, nparams) for j, m in enumerate(_list(pair[1], f"layout[{i}][1]", 1))]
        if index in out or seen & set(members) or len(set(members)) != len(members):
            raise _Malformed(f"layout[{i}] repeats a bucket or a parameter position")
        seen.update(members)
        out[index] = members
    return out


def _suspect(v: Any, where: str, lanes: int) -> BundleSuspect:
    s = _fields(v, where, _SUSPECT)
    rank = _int(s["rank"], f"{where}.rank", 0, _MAX_RANK)
    reference_rank = _int(s["reference_rank"], f"{where}.reference_rank", 0, _MAX_RANK)
    mbs = []
    for j, raw in enumerate(_list(s["microbatches"], f"{where}.microbatches", 1)):
        at = f"{where}.microbatches[{j}]"
        m = _fields(raw, at, _MICROBATCH)
        try:
            count = batches.leaves(m["spec"])
        except ValueError as e:
            raise _Malformed(f"{at}.spec: {e}") from None
        if count != _int(m["leaves"], f"{at}.leaves", 0, _MAX_ITEMS + 1) or not isinstance(m["cuda"], bool):
            raise _Malformed(f"{at} has {short_repr(m['leaves'])} leaves where its spec takes {count} tensors, or a cuda "
                             f"flag {short_repr(m['cuda'])} that is not true or false")
        mbs.append((m["spec"], count, m["cuda"]))
    return BundleSuspect(rank, _host(s["host"], f"{where}.host"), _unfp(s["recorded"], f"{where}.recorded", lanes),
                         reference_rank, _unfp(s["reference"], f"{where}.reference", lanes), mbs)


def tensors_of(bundle: Bundle, data: bytes) -> dict[str, torch.Tensor]:
    """The bundle's tensors, after checking their size and digest against the record, then that they are exactly
    the ones the record names and that each random state is one torch can take.

    Raises:
        BundleError: the tensors are not the ones the record digests, or not the ones it names.
    """
    if len(data) != bundle.nbytes or blake3.blake3(data).hexdigest() != bundle.digest:
        raise BundleError(f"the replay bundle of incident {bundle.incident} is damaged or altered (its tensors do not "
                          "match the digest its record holds); it is never replayed")
    try:
        tensors = load_tensors(data)
    except Exception:  # noqa: BLE001 - a digest-matching object safetensors refuses: report it, never crash
        raise BundleError(f"the replay bundle of incident {bundle.incident} holds no readable tensors") from None
    try:
        _match(bundle, tensors)
    except _Malformed as e:
        raise BundleError(f"the replay bundle of incident {bundle.incident} is malformed ({e}); it is never "
                          "replayed") from None
    return tensors


def names_of(bundle: Bundle) -> set[str]:
    """The names of the tensors ``encode`` stores for what ``bundle``'s record says."""
    names = {f"param/{i}" for i in range(len(bundle.params))} | {f"buffer/{i}" for i in range(len(bundle.buffers))}
    for s in bundle.suspects:
        for j, (_, leaves, cuda) in enumerate(s.microbatches):
            names.update(f"mb/{s.rank}/{j}/{k}" for k in range(leaves))
            names.update([f"rng/{s.rank}/{j}/cpu"] + ([f"rng/{s.rank}/{j}/cuda"] if cuda else []))
    return names


def _match(bundle: Bundle, tensors: dict[str, torch.Tensor]) -> None:
    want = names_of(bundle)
    if set(tensors) != want:
        lacks, extra = sorted(want - set(tensors))[:3], sorted(set(tensors) - want)[:3]
        raise _Malformed(f"its tensors {'lack ' + ', '.join(lacks) if lacks else 'hold ' + ', '.join(extra)}, which "
                         f"its record {'names' if lacks else 'does not name'}")
    cpu = torch.get_rng_state()
    for name in sorted(n for n in want if n.startswith("rng/")):
        t = tensors[name]
        if t.dtype != torch.uint8 or t.dim() != 1 or (name.endswith("/cpu") and t.shape != cpu.shape):
            raise _Malformed(f"{name} is {tuple(t.shape)} {t.dtype}, not a random state")
        if name.endswith("/cpu"):
            try:  # torch checks the state's own fields too: on a scratch generator, never this process's
                torch.Generator().set_state(t)
            except RuntimeError as e:
                raise _Malformed(f"{name} is not a random state torch can take ({e})") from None
