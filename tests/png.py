"""A minimal PNG decoder, so the report's screenshot test can read Chromium's output.

The project deliberately depends on no imaging library, and pulling one in only to read back
one screenshot is not worth it: PNG is zlib-compressed rows, each with a filter byte. This reads
8-bit RGB and RGBA, non-interlaced (what Chromium writes), and raises ValueError on anything else.

Rows that use only None, Sub and Up are undone row by row with whole-row numpy operations (Sub
is a running sum mod 256). Average and Paeth make each byte depend on the decoded byte to its
left as well as the row above, which no whole-row operation expresses; instead of a Python loop
over every byte, such images are decoded along anti-diagonals: every pixel on one diagonal only
needs pixels from earlier diagonals, so each diagonal is one vectorised step (W + H steps).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator

import numpy as np

__all__ = ["read_png"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {2: 3, 6: 4}  # colour type -> samples per pixel


def _chunks(blob: bytes) -> Iterator[tuple[bytes, bytes]]:
    pos = len(_SIGNATURE)
    while pos < len(blob):
        if pos + 12 > len(blob):
            raise ValueError("truncated PNG chunk")
        (length,) = struct.unpack(">I", blob[pos : pos + 4])
        end = pos + 12 + length
        if end > len(blob):
            raise ValueError("truncated PNG chunk")
        kind, body = blob[pos + 4 : pos + 8], blob[pos + 8 : end - 4]
        if zlib.crc32(kind + body) != struct.unpack(">I", blob[end - 4 : end])[0]:
            raise ValueError(f"corrupt {kind!r} chunk (CRC mismatch)")
        yield kind, body
        pos = end


def _rows(filtered: np.ndarray, kinds: np.ndarray) -> np.ndarray:
    out, prev = np.empty_like(filtered), np.zeros_like(filtered[0])
    for r, kind in enumerate(kinds):
        row = filtered[r]
        if kind == 1:
            row = np.cumsum(row, axis=0, dtype=np.uint8)  # uint8 accumulation wraps mod 256, as Sub needs
        elif kind == 2:
            row = row + prev
        out[r] = prev = row
    return out


def _diagonals(filtered: np.ndarray, kinds: np.ndarray) -> np.ndarray:
    h, w, _ = filtered.shape
    # One zero row above and one zero column to the left stand in for the bytes outside the image.
    done = np.zeros((h + 1, w + 1, filtered.shape[2]), np.int16)
    data = filtered.astype(np.int16)
    for d in range(h + w - 1):
        r = np.arange(max(0, d - w + 1), min(h - 1, d) + 1)
        i = d - r
        a, b, c = done[r + 1, i], done[r, i + 1], done[r, i]
        k = kinds[r][:, None]
        p = a + b - c
        pa, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - c)
        paeth = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))
        pred = np.where(k == 0, 0, np.where(k == 1, a, np.where(k == 2, b, np.where(k == 3, (a + b) >> 1, paeth))))
        done[r + 1, i + 1] = (data[r, i] + pred) & 0xFF
    return done[1:, 1:].astype(np.uint8)


def read_png(path: str | os.PathLike[str]) -> np.ndarray:
    """The image at ``path`` as a (height, width, channels) uint8 array; channels is 3 or 4."""
    with open(path, "rb") as f:
        blob = f.read()
    if not blob.startswith(_SIGNATURE):
        raise ValueError("not a PNG file")
    header, idat = None, []
    for kind, body in _chunks(blob):
        if header is None and kind != b"IHDR":
            raise ValueError("PNG does not start with IHDR")
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        elif kind[0:1].isupper() and kind != b"PLTE":  # a critical chunk we cannot honour
            raise ValueError(f"unsupported critical chunk {kind!r}")
    else:
        raise ValueError("PNG has no IEND chunk")
    assert header is not None
    width, height, depth, colour, compression, filter_method, interlace = header
    if depth != 8 or colour not in _CHANNELS or (compression, filter_method, interlace) != (0, 0, 0):
        raise ValueError(f"unsupported PNG: bit depth {depth}, colour type {colour}, interlace {interlace}")
    channels = _CHANNELS[colour]
    try:
        raw = zlib.decompress(b"".join(idat))
    except zlib.error as exc:
        raise ValueError(f"bad PNG image data: {exc}") from exc
    if width == 0 or height == 0 or len(raw) != height * (1 + width * channels):
        raise ValueError("PNG image data does not match its header")
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + width * channels)
    kinds, filtered = rows[:, 0], rows[:, 1:].reshape(height, width, channels)
    if kinds.max() > 4:
        raise ValueError(f"unknown PNG row filter {int(kinds.max())}")
    return _rows(filtered, kinds) if kinds.max() <= 2 else _diagonals(filtered, kinds)
