"""Fuzzing the untrusted inputs: manifests, safetensors shards, state skeletons.

Every malformed input must end in the library's own specific error (a
``ManifestError`` / ``CorruptCheckpoint`` with a one-line message), never an
uncaught KeyError/TypeError/RecursionError/..., never a hang, and never an
allocation sized by a declared value instead of by the bytes really present.
Whatever does parse must be safe for the rest of the library to use.
"""

from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil
import struct
import tempfile
import time
import tracemalloc

import blake3
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import fresh_state, resealed, trained_state
from verified_ckpt import (
    CheckpointManager,
    CheckpointNotRestorable,
    CorruptCheckpoint,
    ManifestError,
    VerifiedCkptError,
    history,
    shards,
    state_fingerprint,
)
from verified_ckpt.flatten import unflatten
from verified_ckpt.skeleton import tensor_refs
from verified_ckpt.crc import Crc64
from verified_ckpt.manifest import MAX_DEPTH, Manifest
from verified_ckpt.shards import parse_header, read_into, tensors_from_buffer, write_shard

pytestmark = pytest.mark.timeout(120)

FAST = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SLOW = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

WHERE = "step-0000000001-fuzzfuzz"
PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
ITEMSIZE = {str(dt).removeprefix("torch."): dt.itemsize for dt in shards.DTYPES.values()}

# ----------------------------------------------------------------- material


@pytest.fixture(scope="module")
def run_template(tmp_path_factory):
    """One real run folder with one checkpoint of a small trained model (copied per example)."""
    root = tmp_path_factory.mktemp("fuzz-run")
    url = os.fspath(root / "run")
    info = CheckpointManager(url).save(1, trained_state())
    folder = os.path.join(url, "checkpoints", info.id)
    manifest = open(os.path.join(folder, "manifest.json"), "rb").read()
    return _Quiet(url=url, id=info.id, folder=folder, manifest=manifest, shards=[s.path for s in info.manifest.shards])


class _Quiet(dict):
    """A dict that hypothesis reports in one short line."""

    def __repr__(self) -> str:
        return f"<run {self['id']}>"


@pytest.fixture(scope="module")
def manifest_doc(run_template):
    raw = run_template["manifest"]
    return _QuietPair((raw, json.loads(raw)))


class _QuietPair(tuple):
    def __repr__(self) -> str:
        return "<manifest>"


def _paths(doc, prefix=()):
    """Every JSON path in ``doc`` (the root included), as tuples of keys/indices."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def _shard_bytes(items=None) -> bytes:
    if items is None:
        g = torch.Generator().manual_seed(0)
        items = {
            "f32": torch.randn(3, 4, generator=g),
            "bf16": torch.randn(5, generator=g).to(torch.bfloat16),
            "i64": torch.arange(4).reshape(2, 2),
            "u8": torch.arange(7, dtype=torch.uint8),
            "flag": torch.tensor([True, False, True]),
            "empty": torch.zeros(0, 3, dtype=torch.float16),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
        }
    f = io.BytesIO()
    write_shard(f, items, {"format": "pt"})
    return f.getvalue()


SHARD = _shard_bytes()
(HLEN,) = struct.unpack("<Q", SHARD[:8])
HEADER = json.loads(SHARD[8 : 8 + HLEN])
DATA = SHARD[8 + HLEN :]


def _frame(header: dict | bytes, data: bytes = DATA) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


# ---------------------------------------------------------------- strategies

NASTY_TEXT = st.sampled_from([
    "", "../x", "/etc/passwd", "s3://b/k", "..\\x", "a/b", "a\n", ".", "..", "manifest.json", "x" * 300,
    "F32", "float32", "bfloat16", "complex128", "__tensor__", "__dict__", "__tuple__", "__float__", "nan",
    "model/emb.weight", "0" * 32, "f" * 64, "restorable", "corrupt", "\ud800", "\u00e9", "shard-00000.safetensors",
])
NASTY_INT = st.sampled_from([0, 1, -1, 7, 2**31, 2**40, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30])
SCALARS = (st.none() | st.booleans() | NASTY_INT | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12) | NASTY_TEXT)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | NASTY_TEXT, inner, max_size=4),
    max_leaves=12,
)


# ------------------------------------------------------------ manifest: oracle


def parse_manifest(data: bytes) -> Manifest | None:
    """Manifest.from_json must return a Manifest that is safe to use, or raise a one-line ManifestError."""
    try:
        m = Manifest.from_json(data, where=WHERE)
    except ManifestError as e:
        msg = str(e)
        assert WHERE in msg and "malformed" in msg and "\n" not in msg, msg
        assert len(msg) < 1000, msg
        return None
    check_usable(m)
    return m


def _sealed(doc: dict) -> dict:
    """``doc`` sealed as a writer would (state fingerprint and digest recomputed), so that the checks of its shape
    and content, not its digest, are what a test of them meets."""
    try:
        return resealed(doc)
    except Exception:  # a document too broken to seal (or to encode): the parser refuses it on its shape
        return doc


def check_usable(m: Manifest) -> None:
    """What the rest of the library assumes about a parsed manifest."""
    assert type(m.step) is int and m.step >= 0
    assert PLAIN.fullmatch(m.checkpoint_id) and m.checkpoint_id not in (".", "..")
    paths = {s.path: s for s in m.shards}
    assert len(paths) == len(m.shards)
    for s in m.shards:
        assert PLAIN.fullmatch(s.path) and s.path != "manifest.json", s.path
        assert type(s.size) is int and s.size >= 0
        assert re.fullmatch(r"[0-9a-f]{64}", s.digest)
        assert all(isinstance(n, str) for n in s.tensors)
    assert len(m.tensors) <= shards.MAX_TENSORS
    for n, t in m.tensors.items():
        assert t.shard in paths and n in paths[t.shard].tensors
        assert t.dtype in ITEMSIZE, t.dtype
        assert all(type(d) is int and d >= 0 for d in t.shape)
        numel = 1
        for d in t.shape:
            numel *= d
        assert numel * ITEMSIZE[t.dtype] <= paths[t.shard].size
        assert re.fullmatch(r"[0-9a-f]{32}", t.fingerprint)
    assert sum(len(s.tensors) for s in m.shards) == len(m.tensors)
    assert all(isinstance(r, str) for r in m.reasons)
    # The code that consumes a manifest runs without surprises.
    again = Manifest.from_json(m.to_json(), where=WHERE)
    assert again == m
    dummies = {n: torch.zeros(0) for n in m.tensors}
    for key, entry in m.state.items():
        assert isinstance(entry["stateful"], bool)
        assert tensor_refs(entry["value"]) <= set(m.tensors)
        unflatten(entry["value"], dummies)
    history.consensus_claim_problems(m.evidence, None)
    for h in m.topology.ranks:
        assert isinstance(h.rank, int) and isinstance(h.host, str) and isinstance(h.device, str)


# ------------------------------------------------------------ manifest: tests


def test_the_real_manifest_parses(manifest_doc):
    raw, doc = manifest_doc
    m = parse_manifest(raw)
    assert m is not None and m.checkpoint_id == doc["checkpoint_id"] and len(m.tensors) == len(doc["tensors"])


@FAST
@given(ops=st.lists(st.tuples(st.sampled_from(["flip", "cut", "insert", "delete"]), st.integers(0, 1 << 20),
                              st.binary(min_size=1, max_size=8)), min_size=1, max_size=4))
def test_manifest_with_mangled_bytes(manifest_doc, ops):
    data = bytearray(manifest_doc[0])
    for op, at, blob in ops:
        at %= len(data) + 1
        if op == "flip" and at < len(data):
            data[at] ^= blob[0] or 1
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = blob
        elif op == "delete":
            del data[at : at + len(blob)]
        if not data:
            break
    parse_manifest(bytes(data))


@settings(FAST, max_examples=400)
@given(data=st.data())
def test_manifest_with_a_field_replaced_deleted_or_added(manifest_doc, data):
    doc = copy.deepcopy(manifest_doc[1])
    paths = _paths(doc)
    path = data.draw(st.sampled_from(paths), label="path")
    op = data.draw(st.sampled_from(["replace", "replace", "copy", "delete", "add"]), label="op")
    if op in ("replace", "copy") or (op == "delete" and not path):
        value = data.draw(JSON if op == "replace" else st.sampled_from(paths).map(lambda p: copy.deepcopy(_get(doc, p))))
        if not path:
            doc = value
        else:
            _get(doc, path[:-1])[path[-1]] = value
    elif op == "delete":
        del _get(doc, path[:-1])[path[-1]]
    else:
        node = _get(doc, path)
        if isinstance(node, dict):
            node[data.draw(st.text(max_size=8) | NASTY_TEXT, label="key")] = data.draw(JSON, label="value")
        elif isinstance(node, list):
            node.insert(data.draw(st.integers(0, len(node))), data.draw(JSON, label="value"))
    parse_manifest(json.dumps(doc).encode())


@FAST
@given(path=NASTY_TEXT | st.text(min_size=1, max_size=20))
def test_a_shard_path_is_accepted_only_as_a_plain_file_name(manifest_doc, path):
    doc = copy.deepcopy(manifest_doc[1])
    old = doc["shards"][0]["path"]
    doc["shards"][0]["path"] = path
    for t in doc["tensors"].values():
        if t["shard"] == old:
            t["shard"] = path
    m = parse_manifest(json.dumps(_sealed(doc)).encode())
    plain = PLAIN.fullmatch(path) is not None and path != "manifest.json" and len(path) <= 200
    assert (m is not None) == plain, path


@FAST
@given(dim=NASTY_INT | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=3),
       where=st.integers(0, 3), dtype=st.sampled_from(["float32", "F32", "bfloat16", "float8_e4m3fn", "int4", 3]))
def test_manifest_shapes_and_dtypes(manifest_doc, dim, where, dtype):
    doc = copy.deepcopy(manifest_doc[1])
    name = sorted(doc["tensors"])[0]
    entry = doc["tensors"][name]
    shape = list(entry["shape"])
    shape.insert(min(where, len(shape)), dim)
    entry["shape"], entry["dtype"] = shape, dtype
    m = parse_manifest(json.dumps(_sealed(doc)).encode())
    if type(dim) is not int or dim < 0 or dtype not in ITEMSIZE:
        assert m is None
    if m is not None:
        assert m.tensors[name].shape == shape


@pytest.mark.parametrize("depth", [10, MAX_DEPTH + 10, 100_000])
def test_deep_nesting_is_a_manifest_error_not_a_recursion_error(manifest_doc, depth):
    assert parse_manifest(b"[" * depth) is None
    assert parse_manifest(b"[" * depth + b"]" * depth) is None  # valid JSON, not a manifest
    doc = copy.deepcopy(manifest_doc[1])
    doc["state"]["data"]["value"]["deep"] = json.loads("[" * min(depth, 900) + "]" * min(depth, 900))
    m = parse_manifest(json.dumps(_sealed(doc)).encode())
    assert (m is not None) == (depth < 90)


@pytest.mark.parametrize("text", [
    b"1" * 5000,  # int longer than Python converts (a ValueError, not a JSONDecodeError)
    b'{"schema_version": NaN}', b"Infinity", b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00", b"\x00", b"",
    b'{"a": "\\ud800"}',
])
def test_odd_json_is_a_manifest_error(text):
    assert parse_manifest(text) is None


@pytest.mark.parametrize("field,value", [
    ("step", "HUGE"), ("step", 1.0), ("step", True), ("schema_version", 1.0), ("schema_version", True),
    ("reasons", [["nested"]]), ("reasons", "text"), ("evidence", {"consensus": [1]}),
    ("evidence", {"consensus": {"unanimous": True, "fingerprints": {"x": "y"}}}), ("topology", {"ranks": 3}),
    ("topology", {"ranks": [{"rank": [0]}]}), ("state_fingerprint", "Z" * 32), ("checkpoint_id", "a\n"),
    ("state", {"m": {"stateful": False, "value": {"__tensor__": "not-a-tensor"}}}),
    ("state", {"m": {"stateful": False, "value": {"__dict__": [[[1], 2]]}}}),
    ("state", {"m": {"stateful": False, "value": {"__float__": "one"}}}),
    ("state", {"m": {"stateful": False, "value": {"__weird__": 1}}}),
    ("state", {"m": {"stateful": "yes", "value": 1}}), ("state", {"a/b": {"stateful": False, "value": 1}}),
])
def test_specific_defects_are_named(manifest_doc, field, value):
    doc = copy.deepcopy(manifest_doc[1])
    doc[field] = value
    data = json.dumps(doc).encode()
    if value == "HUGE":  # an int too long for Python to convert: spliced in as digits
        data = data.replace(b'"HUGE"', b"9" * 5000)
    assert parse_manifest(data) is None


def test_tensor_lists_must_agree_with_shards(manifest_doc):
    doc = copy.deepcopy(manifest_doc[1])
    doc["shards"][0]["tensors"].pop()
    with pytest.raises(ManifestError, match="missing from its shard"):
        Manifest.from_json(json.dumps(doc).encode(), WHERE)
    doc = copy.deepcopy(manifest_doc[1])
    doc["shards"][0]["tensors"].append("ghost")
    with pytest.raises(ManifestError, match="ghost"):
        Manifest.from_json(json.dumps(doc).encode(), WHERE)


def test_an_oversized_manifest_is_refused_before_parsing(monkeypatch, manifest_doc):
    from verified_ckpt import manifest as manifest_mod

    raw = manifest_doc[0]
    monkeypatch.setattr(manifest_mod, "MAX_MANIFEST_BYTES", len(raw) - 1)
    called = []
    monkeypatch.setattr(json, "loads", lambda *a, **k: called.append(1))
    with pytest.raises(ManifestError, match=f"{len(raw)} bytes, more than {len(raw) - 1}"):
        Manifest.from_json(raw, WHERE)
    assert not called


# -------------------------------------------------------------- shards: oracle


def read_shard(data: bytes, where: str = "fuzz/shard-00000.safetensors") -> dict[str, torch.Tensor] | None:
    """parse_header + tensors_from_buffer: consistent tensors, or a one-line CorruptCheckpoint."""
    try:
        header = parse_header(memoryview(data), len(data), where)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        tensors = tensors_from_buffer(buf, header)
    except CorruptCheckpoint as e:
        assert "\n" not in str(e) and len(str(e)) < 1000, str(e)
        return None
    assert set(tensors) == set(header.entries)
    covered = 0
    for name, t in tensors.items():
        e = header.entries[name]
        assert t.dtype == e.dtype and tuple(t.shape) == e.shape
        assert t.numel() * t.element_size() == e.end - e.begin
        raw = data[8 + header.length + e.begin : 8 + header.length + e.end]
        assert bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy()) == raw  # the bytes the header names
        covered += e.end - e.begin
    assert 8 + header.length + covered == len(data)
    return tensors


def test_the_real_shard_reads_back():
    got = read_shard(SHARD)
    assert got is not None and set(got) == set(HEADER) - {"__metadata__"} and got["i64"].tolist() == [[0, 1], [2, 3]]


@FAST
@given(cut=st.integers(0, len(SHARD) - 1))
def test_every_truncation_of_a_shard_is_corrupt(cut):
    assert read_shard(SHARD[:cut]) is None


@FAST
@given(at=st.integers(0, len(SHARD) - 1), mask=st.integers(1, 255))
def test_a_flipped_byte_anywhere(at, mask):
    data = bytearray(SHARD)
    data[at] ^= mask
    got = read_shard(bytes(data))
    if at >= 8 + HLEN:  # in the data: read as is; only fingerprints and digests can tell
        assert got is not None and got != {}
    elif at < 8:  # in the length field: never a valid header
        assert got is None


SHAPES = st.lists(NASTY_INT | st.integers(0, 8) | st.booleans() | st.floats(allow_nan=False) | st.just([2]),
                  max_size=4) | JSON
OFFSETS = st.lists(NASTY_INT | st.integers(0, len(DATA) + 8), max_size=3) | JSON
DTYPES = st.sampled_from(sorted(shards.DTYPES) + ["float32", "F128", "", "f32"]) | JSON


@FAST
@given(data=st.data())
def test_a_mutated_header(data):
    header = copy.deepcopy(HEADER)
    name = data.draw(st.sampled_from(sorted(header)), label="entry")
    op = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry", "delete", "add", "rename"]))
    if op == "dtype":
        header[name]["dtype"] = data.draw(DTYPES)
    elif op == "shape":
        header[name]["shape"] = data.draw(SHAPES)
    elif op == "data_offsets":
        header[name]["data_offsets"] = data.draw(OFFSETS)
    elif op == "entry":
        header[name] = data.draw(JSON)
    elif op == "delete":
        del header[name]
    elif op == "add":
        header[data.draw(NASTY_TEXT | st.text(max_size=5))] = data.draw(JSON)
    else:
        header[data.draw(st.text(max_size=5))] = header.pop(name)
    read_shard(_frame(header))


@FAST
@given(length=st.sampled_from([2**63 - 1, 2**64 - 1, 2**62, shards.MAX_HEADER_BYTES + 1, shards.MAX_HEADER_BYTES])
       | st.integers(HLEN + len(DATA) + 1, HLEN + len(DATA) + 64) | st.integers(0, HLEN - 1))
def test_a_wrong_header_length(length):
    assert read_shard(struct.pack("<Q", length) + SHARD[8:]) is None


@FAST
@given(shape=st.lists(st.integers(0, 2**62), min_size=1, max_size=6), dtype=st.sampled_from(sorted(shards.DTYPES)),
       begin=st.integers(0, 64), extra=st.integers(-3, 3))
def test_declared_sizes_against_actual_bytes(shape, dtype, begin, extra):
    """A header is only believed where the real data section backs it."""
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * shards.DTYPES[dtype].itemsize
    data = bytes(min(max(nbytes + extra, 0), 4096))
    got = read_shard(_frame({"t": {"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + nbytes]}}, data))
    if got is not None:
        assert begin == 0 and nbytes == len(data) and got["t"].shape == tuple(shape)


def test_a_buffer_that_is_not_the_headers_file_is_refused():
    header = parse_header(SHARD, len(SHARD), "fuzz/shard")
    for buf in (torch.zeros(len(SHARD) - 1, dtype=torch.uint8), torch.zeros(len(SHARD), dtype=torch.int16),
                torch.zeros(2, len(SHARD), dtype=torch.uint8)):
        with pytest.raises(CorruptCheckpoint, match="does not match its header"):
            tensors_from_buffer(buf, header)


def test_misaligned_tensors_are_copied_not_refused():
    header = {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}
    data = b"\x07" + struct.pack("<2f", 1.5, -2.0)
    got = read_shard(_frame(header, data))
    assert got["a"].tolist() == [7] and got["b"].tolist() == [1.5, -2.0]


@pytest.mark.parametrize("header,why", [
    (b"[" * 100_000, "JSON objects and arrays"),
    (b'{"a":' + b"[" * 3000 + b"]" * 3000 + b"}", "JSON objects and arrays"),
    (b'{"a":' + b"1" * 5000 + b"}", "not JSON"),
    (b'{"a": NaN}', "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[]", "not a JSON object"),
    (b'{"__metadata__": 0}', "__metadata__"),
    (b'{"__metadata__": {"k": 1}}', "__metadata__"),
    (json.dumps({"a": {"dtype": "U8", "shape": [1] * 2000, "data_offsets": [0, 1]}}).encode(), "invalid shape"),
    (json.dumps({"a": {"dtype": "F32", "shape": [0, 2**61, 2**61], "data_offsets": [0, 0]}}).encode(), "2**62"),
    (json.dumps({"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}}).encode(), "2**62"),
    (json.dumps({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}).encode(), "invalid shape"),
    (json.dumps({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}).encode(), "invalid shape"),
    (json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}).encode(), "do not hold"),
    (json.dumps({"a": {"dtype": "float32", "shape": [1], "data_offsets": [0, 4]}}).encode(), "unknown dtype"),
    (json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}}).encode(), "invalid data_offsets"),
    (json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}).encode(), "invalid data_offsets"),
    (json.dumps({"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                 "b": {"dtype": "U8", "shape": [3], "data_offsets": [1, 4]}}).encode(), "holes or overlaps"),
    (json.dumps({"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}).encode(), "holes or overlaps"),
    (json.dumps({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}).encode(), "entries cover 2"),
    (json.dumps({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4], "extra": 1}}).encode(), "exactly"),
])
def test_specific_header_defects_are_named(header, why):
    with pytest.raises(CorruptCheckpoint, match=re.escape(why)) as e:
        parse_header(_frame(header, b"\0" * 4), 8 + len(header) + 4, "fuzz/shard")
    assert "fuzz/shard" in str(e.value) and len(str(e.value)) < 600


def test_a_hostile_header_is_refused_before_it_is_allocated():
    """Declared sizes never size an allocation: only the bytes really present do."""
    tracemalloc.start()
    try:
        for length in (2**62, 2**63 - 1, shards.MAX_HEADER_BYTES):
            with pytest.raises(CorruptCheckpoint):
                parse_header(struct.pack("<Q", length), 8, "tiny")
        body = json.dumps({"t": {"dtype": "F64", "shape": [2**31, 2**31], "data_offsets": [0, 2**65]}}).encode()
        assert read_shard(_frame(body, b"\0" * 8)) is None
        # A real 1.5 MiB header of empty containers (25x its size once parsed) is refused unparsed.
        nest = b'{"a":[' + b"{}," * 500_000 + b"{}]}"
        framed = memoryview(_frame(nest, b""))
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with pytest.raises(CorruptCheckpoint, match="JSON objects and arrays"):
            parse_header(framed, len(framed), "nest")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < 2 * len(nest), peak - base  # one copy of the header; parsing it would take ~25x


def test_a_shape_of_many_huge_dimensions_is_refused_quickly():
    def refusal_s(shape: list[int]) -> float:
        body = json.dumps({"a": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4]}}).encode()
        t0 = time.perf_counter()
        with pytest.raises(CorruptCheckpoint):
            parse_header(_frame(body, b"\0" * 4), 8 + len(body) + 4, "fuzz/shard")
        return time.perf_counter() - t0

    # Multiplying 100k dims of 2**61 took minutes (quadratic big-int product) before the early exit. The control,
    # a header as long whose dims multiply at once, is measured here, so a busy machine slows both alike.
    control = refusal_s([1] * 100_000)
    took = refusal_s([2**61] * 100_000)
    assert took < 10 * control + 0.5, (took, control)


def test_read_into_refuses_a_short_stream_before_allocating(monkeypatch):
    sizes = []
    real_empty = torch.empty

    def spy(*args, **kwargs):
        sizes.append(args)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", spy)
    with pytest.raises(CorruptCheckpoint, match="file ended after 10 of"):
        read_into(io.BytesIO(b"0123456789"), 2**40)
    with pytest.raises(CorruptCheckpoint, match="longer than the 4 bytes"):
        read_into(io.BytesIO(b"0123456789"), 4)
    with pytest.raises(CorruptCheckpoint):
        read_into(io.BytesIO(b""), -1)
    assert sizes == []
    assert bytes(read_into(io.BytesIO(b"0123456789"), 10).numpy()) == b"0123456789"


# ------------------------------------------------------- skeletons: unflatten


@FAST
@given(value=JSON | st.builds(lambda tag, inner: {tag: inner},
                              st.sampled_from(["__tensor__", "__tuple__", "__dict__", "__float__", "__x__"]), JSON))
def test_unflatten_on_a_hostile_skeleton(value):
    tensors = {"w": torch.ones(2)}
    try:
        unflatten(value, tensors)
        refs = tensor_refs(value)
    except VerifiedCkptError as e:
        assert isinstance(e, CorruptCheckpoint) and "\n" not in str(e)
        with pytest.raises(CorruptCheckpoint):
            tensor_refs(value) if "not among" not in str(e) else unflatten(value, {})
        return
    assert refs <= set(tensors)


def test_unflatten_on_deep_nesting():
    deep: list = []
    for _ in range(50_000):
        deep = [deep]
    with pytest.raises(ManifestError, match="nested deeper"):
        unflatten(deep, {})
    with pytest.raises(ManifestError, match="nested deeper"):
        tensor_refs({"x": deep})


def test_unflatten_still_rebuilds_everything_flatten_writes():
    from verified_ckpt.flatten import flatten

    t = torch.arange(3.0)
    state = {"s": {"t": t, "tup": (1, float("inf"), (2, None)), "keys": {1: "a", (2, 3): t, "__x": -0.0},
                   "l": [t, [float("nan")]]}}
    flat = flatten(state)
    back = unflatten(flat.skeleton["s"]["value"], flat.tensors)
    t = flat.tensors["s/t"]
    assert back["t"] is t and back["keys"][(2, 3)] is t and back["l"][0] is t and back["tup"][:1] == (1,) and back["tup"][2] == (2, None)
    assert back["keys"][1] == "a" and str(back["keys"]["__x"]) == "-0.0" and back["l"][1][0] != back["l"][1][0]


# --------------------------------------------------- end to end: real files


def _copy_run(template: dict, dest: str) -> tuple[str, str]:
    url = os.path.join(dest, "run")
    shutil.copytree(template["url"], url)
    return url, os.path.join(url, "checkpoints", template["id"])


def _restore_must_fail(url: str) -> None:
    target = fresh_state()
    before = state_fingerprint(target)
    with pytest.raises((CorruptCheckpoint, CheckpointNotRestorable)):
        CheckpointManager(url).restore(target, allow_unverified=True)
    assert state_fingerprint(target) == before  # nothing was touched


def _mutate(data: bytes, ops: list) -> bytes:
    out = bytearray(data)
    for op, at, blob in ops:
        at %= len(out) + 1
        if op == "flip" and at < len(out):
            out[at] ^= blob[0] or 0xFF
        elif op == "cut":
            del out[max(at, 1):]
        elif op == "append":
            out += blob
        elif op == "overwrite":
            out[at : at + len(blob)] = blob[: max(0, len(out) - at)]
    return bytes(out)


OPS = st.lists(st.tuples(st.sampled_from(["flip", "flip", "cut", "append", "overwrite"]), st.integers(0, 1 << 16),
                         st.binary(min_size=1, max_size=16)), min_size=1, max_size=3)


@SLOW
@given(ops=OPS)
def test_a_fuzzed_shard_on_disk_is_never_restored_and_fails_verify(run_template, ops):
    with tempfile.TemporaryDirectory() as tmp:
        url, folder = _copy_run(run_template, tmp)
        path = os.path.join(folder, run_template["shards"][0])
        original = open(path, "rb").read()
        fuzzed = _mutate(original, ops)
        if fuzzed == original:
            fuzzed = original[:-1]
        open(path, "wb").write(fuzzed)
        _restore_must_fail(url)
        [r] = CheckpointManager(url).verify()
        assert not r.ok and r.problems and r.problems[0].kind in {"size", "digest"}, r.problems


@SLOW
@given(ops=OPS)
def test_a_fuzzed_shard_with_a_matching_manifest_is_caught_by_header_and_fingerprint_checks(run_template, ops):
    """Worse than bit rot: the manifest's size and digests were rewritten to match the damaged shard."""
    with tempfile.TemporaryDirectory() as tmp:
        url, folder = _copy_run(run_template, tmp)
        name = run_template["shards"][0]
        path = os.path.join(folder, name)
        original = open(path, "rb").read()
        fuzzed = _mutate(original, ops)
        open(path, "wb").write(fuzzed)
        doc = json.loads(run_template["manifest"])
        [entry] = [s for s in doc["shards"] if s["path"] == name]
        crc = Crc64()
        crc.update(fuzzed)  # every digest the manifest keeps, rewritten to match
        entry["size"], entry["digest"], entry["crc64nvme"] = len(fuzzed), blake3.blake3(fuzzed).hexdigest(), crc.hexdigest()
        open(os.path.join(folder, "manifest.json"), "wb").write(json.dumps(_sealed(doc)).encode())
        same = _same_tensors(original, fuzzed)
        if not same:
            _restore_must_fail(url)
        [r] = CheckpointManager(url).verify()
        assert r.ok == same, r.problems
        if not same:
            # (the rewritten manifest itself may no longer add up: a shard too small for its tensors)
            assert {p.kind for p in r.problems} <= {"header", "fingerprint", "nonfinite", "manifest"}, r.problems


def _same_tensors(a: bytes, b: bytes) -> bool:
    """Whether ``b`` holds exactly ``a``'s tensors (a change in header whitespace keeps them)."""
    ta, tb = read_shard(a), read_shard(b)
    if tb is None or set(ta) != set(tb):
        return False
    return all(x.dtype == tb[n].dtype and x.shape == tb[n].shape
               and torch.equal(x.reshape(-1).view(torch.uint8), tb[n].reshape(-1).view(torch.uint8))
               for n, x in ta.items())


def test_a_fuzzed_manifest_on_disk_is_listed_corrupt_and_never_restored(run_template):
    with tempfile.TemporaryDirectory() as tmp:
        url, folder = _copy_run(run_template, tmp)
        doc = json.loads(run_template["manifest"])
        name = sorted(doc["tensors"])[0]
        doc["tensors"][name]["shape"] = [2**40, 2**40]
        open(os.path.join(folder, "manifest.json"), "wb").write(json.dumps(doc).encode())
        mgr = CheckpointManager(url)
        [info] = mgr.list()
        assert info.status.value == "corrupt" and "does not fit" in info.reasons[0]
        _restore_must_fail(url)
        [r] = mgr.verify()
        assert not r.ok and r.problems[0].kind == "manifest"
