"""What a stored tensor may be: its dtype, spelt the two ways it is written down, and bounds on its shape.

Manifests spell a dtype as torch does (``"float32"``, ``"bfloat16"``);
safetensors headers use the format's own codes (``"F32"``, ``"BF16"``). This
table is the one owner of both spellings and of each dtype's size. Plain data,
so readers of manifests need no torch.
"""

from __future__ import annotations

__all__ = ["CODES", "ITEMSIZE", "MAX_ELEMENTS", "MAX_NDIM", "MAX_TENSORS", "bounded_numel", "dtype_name"]

MAX_TENSORS = 1_000_000  # tensors per checkpoint or shard
MAX_NDIM = 1024  # dimensions per tensor (a sanity bound: real tensors have a handful)
MAX_ELEMENTS = 1 << 62  # elements per tensor: sizes and strides must fit int64

# torch name -> (safetensors code, bytes per element)
_TABLE: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8), "float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1),
    "uint64": ("U64", 8), "uint32": ("U32", 4), "uint16": ("U16", 2), "uint8": ("U8", 1),
    "bool": ("BOOL", 1), "complex64": ("C64", 8),
    "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1),
    "float8_e4m3fnuz": ("F8_E4M3FNUZ", 1), "float8_e5m2fnuz": ("F8_E5M2FNUZ", 1),
}

#: torch name -> safetensors code
CODES: dict[str, str] = {name: code for name, (code, _) in _TABLE.items()}
#: torch name -> bytes per element
ITEMSIZE: dict[str, int] = {name: size for name, (_, size) in _TABLE.items()}


def dtype_name(dtype: object) -> str:
    """The manifest spelling of a ``torch.dtype`` (``torch.float32`` -> ``"float32"``)."""
    return str(dtype).removeprefix("torch.")


def bounded_numel(shape: list[int], limit: int | None = None) -> int | None:
    """Elements of ``shape``, or ``None`` when the non-zero dimensions multiply past ``limit`` (2**62).

    Stops as soon as the bound is passed, so a hostile shape of thousands of
    huge dimensions costs microseconds, not big-integer arithmetic.
    """
    limit = MAX_ELEMENTS if limit is None else limit
    n, zero = 1, False
    for d in shape:
        if d == 0:
            zero = True
        else:
            n *= d
            if n > limit:
                return None
    return 0 if zero else n
