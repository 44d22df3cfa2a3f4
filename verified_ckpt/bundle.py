"""A replay bundle as stored: a signed JSON record and the safetensors object it digests.

The guard's capture (``guard/capture.py``) becomes two objects under ``<run>/replay/``: ``<incident>.safetensors``,
the step's weights and buffers and each suspect's microbatches and random states (tensors named by position, so
no user string becomes a key), then ``<incident>.json``, written last, which names the incident, says what each
suspect recorded and what a healthy rank recomputed, and holds the tensors' size and blake3 digest. The record is
sealed like every record (``signing``), so an altered bundle is refused before anything is loaded, and the
tensors are read only through safetensors: no pickle.

Floats travel as ``float.hex`` strings: exact, and a NaN loss (the incident of a poisoned batch) is valid JSON.
Pure: capture in, record and bytes out, and back; the store does the I/O.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import blake3
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from .errors import BundleError
from .guard.audit import Recomputed
from .guard.capture import Capture, Recipe
from .hosts import host_problem
from .jsonx import JSONBudgetError, Limits, canonical_json, decode_object
from .signing import Signature, Signer

__all__ = ["Bundle", "BundleError", "BundleSuspect", "decode", "encode", "tensors_of"]

VERSION = 1
MAX_RECORD_BYTES = 4 << 20
_LIMITS = Limits(max_bytes=MAX_RECORD_BYTES, max_depth=16)


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


def _unfp(d: Any) -> Recomputed:
    lanes = d["lanes"]
    if lanes is not None and not (isinstance(lanes, list) and len(lanes) == 2 and all(isinstance(x, int) for x in lanes)):
        raise TypeError("lanes")
    return Recomputed(float.fromhex(d["loss"]), [float.fromhex(p) for p in d["proj"]],
                      None if lanes is None else (lanes[0], lanes[1]), float.fromhex(d["sumsq"]))


def _host(name: Any) -> str:
    """A suspect's host, in the one grammar (``hosts.host_problem``): it is printed in the replay's verdict."""
    if host_problem(name):
        raise ValueError("host")
    return str(name)


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
    """The record of incident ``incident``'s bundle, checked: JSON within bounds, its own fields, its signature.

    Raises:
        BundleError: unreadable, of another incident, or its signature is refused (the message says which).
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
        if doc["bundle"] != VERSION or doc["incident"] != incident:
            raise ValueError("version or incident")
        suspects = [BundleSuspect(int(s["rank"]), _host(s["host"]), _unfp(s["recorded"]), int(s["reference_rank"]),
                                  _unfp(s["reference"]), [(m["spec"], int(m["leaves"]), bool(m["cuda"]))
                                                          for m in s["microbatches"]]) for s in doc["suspects"]]
        recipe = Recipe(int(doc["step"]), str(doc["kind"]), {int(i): [int(x) for x in m] for i, m in doc["layout"]},
                        int(doc["lanes"]), int(doc["seed"]), str(doc["mode"]), float.fromhex(doc["rtol"]))
        return Bundle(incident, recipe, [str(n) for n in doc["params"]], [str(n) for n in doc["buffers"]], suspects,
                      int(doc["nbytes"]), str(doc["digest"]), state.value)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
        raise BundleError(f"the replay bundle of incident {incident} is malformed (not written by this version?); "
                          "it is never replayed") from None


def tensors_of(bundle: Bundle, data: bytes) -> dict[str, torch.Tensor]:
    """The bundle's tensors, after checking their size and digest against the record.

    Raises:
        BundleError: the tensors are not the ones the record digests.
    """
    if len(data) != bundle.nbytes or blake3.blake3(data).hexdigest() != bundle.digest:
        raise BundleError(f"the replay bundle of incident {bundle.incident} is damaged or altered (its tensors do not "
                          "match the digest its record holds); it is never replayed")
    try:
        return load_tensors(data)
    except Exception:  # noqa: BLE001 - a digest-matching object safetensors refuses: report it, never crash
        raise BundleError(f"the replay bundle of incident {bundle.incident} holds no readable tensors") from None
