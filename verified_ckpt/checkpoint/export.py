"""Exports: a verified checkpoint copied out of the run into a local folder.

Every shard is verified before a byte of it is written, and a failed export
removes what it wrote. ``native`` writes the shards and then the manifest, so
a folder holding a manifest holds a checkpoint that was verified on the way
out. ``hf`` writes what Hugging Face's ``save_pretrained`` would: the model's
own key names in ``model.safetensors``, a tensor shared by several names (tied
embeddings) once, under its first name in the model's ``state_dict`` order,
as ``save_pretrained`` keeps the input embedding and drops the tied
``lm_head.weight``; and the model's ``config.json`` when the checkpoint holds it.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import CorruptCheckpoint, InvalidState
from ..manifest import MANIFEST_NAME, Manifest
from ..shards import write_shard
from ..skeleton import TENSOR, escape
from ..store import ExportFolder
from .reading import EXPORT, RESTORE, Reader

__all__ = ["CONFIG_ENTRY", "EXPORTERS", "MODEL_ENTRY", "export_hf", "export_native"]

MODEL_ENTRY = "model"  # the state entry ``hf`` exports: the name the integrations save the model under
CONFIG_ENTRY = "hf_config"  # the model's config.json as text, saved by the integrations


def export_native(reader: Reader, m: Manifest, dest: str) -> None:
    """Write ``m``'s shards (verified) and then its manifest into the new or empty folder ``dest``.

    Raises:
        InvalidState: ``dest`` exists and is not an empty folder.
        StorageError: ``dest`` cannot be written.
        CorruptCheckpoint: a shard failed its checks; nothing usable is left in ``dest``.
    """
    folder = ExportFolder(dest)
    _, problems = reader.read(m, EXPORT, on_verified=lambda entry, buf: folder.write(entry.path, buf.numpy().data))
    if problems:
        folder.discard()
        raise _failed(m, problems[0].kind, problems[0].detail)
    folder.write(MANIFEST_NAME, m.to_json())


def export_hf(reader: Reader, m: Manifest, dest: str) -> None:
    """Write ``m``'s model as ``model.safetensors`` (+ ``config.json``) into the new or empty folder ``dest``.

    Raises:
        InvalidState: no ``model`` entry of whole tensors (a sharded save: restore it and call save_pretrained),
            or ``dest`` is not a new or empty folder.
        CorruptCheckpoint: a shard failed its checks; nothing was written.
    """
    names = _model_tensors(m)
    folder = ExportFolder(dest)
    try:
        loaded, problems = reader.read(m, RESTORE, names=set(names.values()))  # digests, headers, fingerprints
        if problems:
            raise _failed(m, problems[0].kind, problems[0].detail)
        tensors = {key: loaded[ref] for key, ref in names.items()}
        folder.write("model.safetensors", lambda f: write_shard(f, tensors, {"format": "pt"}).size)  # HF checks "format"
        config = m.state.get(CONFIG_ENTRY, {}).get("value")
        if isinstance(config, str):
            folder.write("config.json", config.encode())
    except BaseException:
        folder.discard()
        raise


def _model_tensors(m: Manifest) -> dict[str, str]:
    """The model's state_dict keys and the stored tensor each holds, tied names dropped after the first."""
    entry = m.state.get(MODEL_ENTRY)
    value = entry.get("value") if isinstance(entry, dict) else None
    if not isinstance(value, dict):
        raise InvalidState(f"checkpoint {m.checkpoint_id} has no {MODEL_ENTRY!r} entry holding a state_dict, which "
                           "format=\"hf\" exports (the name the HF and Lightning integrations use); use format=\"native\"")
    by_ref: dict[str, str] = {}
    for key, v in value.items():
        ref = v.get(TENSOR) if isinstance(v, dict) and len(v) == 1 else None
        if not isinstance(ref, str):
            continue  # not a tensor (a module's extra state): save_pretrained writes tensors only
        if ref not in m.tensors:
            raise InvalidState(f"checkpoint {m.checkpoint_id} stores {key!r} sharded (an FSDP2 save); format=\"hf\" "
                               "needs whole tensors - restore it into the model and call save_pretrained")
        # A shared tensor is stored under the name it had first in the state_dict; the manifest's keys are sorted.
        if ref not in by_ref or ref == f"{MODEL_ENTRY}/{escape(key)}":
            by_ref[ref] = key
    return {key: ref for ref, key in by_ref.items()}


def _failed(m: Manifest, kind: str, detail: str) -> CorruptCheckpoint:
    return CorruptCheckpoint(f"checkpoint {m.checkpoint_id} failed its {kind} check: {detail}; nothing usable was "
                             "exported - pick another step")


EXPORTERS: dict[str, Callable[[Reader, Manifest, str], None]] = {"native": export_native, "hf": export_hf}
