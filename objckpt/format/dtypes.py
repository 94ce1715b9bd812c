"""The dtype table of format v1: manifest names <-> torch dtypes.

Names are stable strings written into manifests; torch's own repr may change
between releases, so the table, not ``str(dtype)``, is the contract.  Bytes are
little-endian, row-major.

``float4_e2m1fn_x2`` is torch's packed fp4: one byte holds two e2m1 values, and a
tensor's shape counts bytes (pairs).  It is stored as those bytes, like any 1-byte
dtype; torch converts it to nothing, so ``cast=True`` never applies to it.
"""
from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedFormatError, UnsupportedValueError

_NAMES: dict[str, str] = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "complex128": "complex128",
    "complex64": "complex64",
    "complex32": "complex32",
    "int64": "int64",
    "int32": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "bool": "bool",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "float8_e4m3fnuz": "float8_e4m3fnuz",
    "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e8m0fnu": "float8_e8m0fnu",
    "float4_e2m1fn_x2": "float4_e2m1fn_x2",
}

#: dtypes torch packs several values into one element of: copied as bytes, never converted
PACKED: frozenset[str] = frozenset({"float4_e2m1fn_x2"})

NAME_TO_DTYPE: dict[str, torch.dtype] = {}
DTYPE_TO_NAME: dict[torch.dtype, str] = {}
for _name, _attr in _NAMES.items():
    _dt = getattr(torch, _attr, None)  # float8 variants are missing in older torch
    if isinstance(_dt, torch.dtype):
        NAME_TO_DTYPE[_name] = _dt
        DTYPE_TO_NAME[_dt] = _name


def dtype_name(dtype: torch.dtype, key: str = "?") -> str:
    try:
        return DTYPE_TO_NAME[dtype]
    except KeyError:
        raise UnsupportedValueError(f"tensor {key!r}: dtype {dtype} is not supported by format v1") from None


def dtype_from_name(name: str, key: str = "?") -> torch.dtype:
    try:
        return NAME_TO_DTYPE[name]
    except KeyError:
        raise UnsupportedFormatError(
            f"tensor {key!r}: dtype {name!r} is unknown to this torch build/objckpt release"
        ) from None


def converts_between_floats(dtype: torch.dtype) -> bool:
    """Whether ``load(..., cast=True)`` may convert to or from ``dtype``: a floating dtype torch converts."""
    return dtype.is_floating_point and DTYPE_TO_NAME.get(dtype) not in PACKED


@functools.lru_cache(maxsize=None)
def itemsize(dtype: torch.dtype) -> int:
    # not torch.empty(()): under torch.use_deterministic_algorithms(True) (Lightning's
    # deterministic=True turns it on) empty() fills, which torch cannot do for packed dtypes
    return int(dtype.itemsize)


def new_empty(shape: "tuple[int, ...] | torch.Size", dtype: torch.dtype) -> torch.Tensor:
    """A fresh CPU tensor for stored bytes to land in.

    Allocated as bytes and viewed: ``torch.empty`` of a packed dtype (``float4_e2m1fn_x2``)
    fails when deterministic algorithms are on, because torch then fills new memory and has no
    fill for such dtypes. Every byte is overwritten by the read anyway.
    """
    shape = tuple(shape)
    n = 1
    for d in shape:
        n *= d
    return torch.empty(n * itemsize(dtype), dtype=torch.uint8).view(dtype).reshape(shape)
