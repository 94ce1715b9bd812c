"""The safetensors file format, read and written one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``)
and the raw little-endian tensor bytes.  The ``safetensors`` package reads through
a memory map and writes from a dict of whole tensors; the converters here need
neither: :class:`SafetensorsFile` reads one tensor with one seek + ``readinto``
(local files or any fsspec URL), and :func:`write_safetensors` writes the header
from shapes alone, then each tensor's bytes as a callback produces them, so memory
stays at one tensor.  Files written here load with ``safetensors.torch.load_file``
and ``transformers``' ``from_pretrained``.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import IO, Any, Callable, Optional, Sequence

import torch

from ..errors import CorruptCheckpointError, NotFoundError, UnsupportedFormatError

#: safetensors dtype names <-> torch dtypes (what the format defines and torch has)
ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz, "C64": torch.complex64,
}
TORCH_TO_ST = {v: k for k, v in ST_DTYPES.items()}
#: a header larger than this is refused before it is read (the format's own reader uses 100 MB)
MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class StEntry:
    """One tensor of a safetensors file: where its bytes are, relative to the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _open(path: str, storage_options: Optional[dict[str, Any]]) -> IO[bytes]:
    if "://" in path:
        import fsspec

        return fsspec.open(path, "rb", **(storage_options or {})).open()  # type: ignore[no-any-return]
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise NotFoundError(f"safetensors file {path!r} does not exist") from None


def _bad(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"safetensors file {path!r}: {what}")


class SafetensorsFile:
    """The header of one safetensors file, and reads of its tensors one at a time."""

    def __init__(self, path: str, storage_options: Optional[dict[str, Any]] = None) -> None:
        self.path = path
        self.storage_options = storage_options
        with _open(path, storage_options) as f:
            head = f.read(8)
            if len(head) != 8:
                raise _bad(path, "shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise _bad(path, f"header length {n} is above {MAX_HEADER} bytes (not a safetensors file?)")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as e:
            raise _bad(path, f"header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise _bad(path, "header is not a JSON object")
        self.data_start = 8 + n
        meta = header.pop("__metadata__", None) or {}
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}
        self.entries: list[StEntry] = []
        for name, ent in header.items():
            ok = isinstance(ent, dict) and isinstance(ent.get("shape"), list)
            ok = ok and isinstance(ent.get("data_offsets"), list) and len(ent["data_offsets"]) == 2
            ok = ok and all(isinstance(d, int) and d >= 0 for d in ent["shape"] + ent["data_offsets"])
            if not ok:
                raise _bad(path, f"tensor {name!r}: entry malformed")
            dt = ST_DTYPES.get(ent.get("dtype"))
            if dt is None:
                raise UnsupportedFormatError(f"safetensors file {path!r}: tensor {name!r} has dtype "
                                             f"{ent.get('dtype')!r}, which objckpt does not read "
                                             f"(known: {sorted(ST_DTYPES)})")
            b, end = ent["data_offsets"]
            if end - b != math.prod(ent["shape"]) * dt.itemsize:
                raise _bad(path, f"tensor {name!r}: {end - b} bytes for shape {ent['shape']} of {ent['dtype']}")
            self.entries.append(StEntry(name, dt, tuple(ent["shape"]), b, end))
        self.entries.sort(key=lambda s: s.begin)
        self._by_name = {s.name: s for s in self.entries}

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name``, read into fresh memory (one seek, one ``readinto``)."""
        e = self._by_name[name]
        buf = torch.empty(e.end - e.begin, dtype=torch.uint8)
        with _open(self.path, self.storage_options) as f:
            f.seek(self.data_start + e.begin)
            got = f.readinto(memoryview(buf.numpy())) if buf.numel() else 0  # type: ignore[attr-defined,arg-type]
        if got != buf.numel():
            raise _bad(self.path, f"truncated: tensor {name!r} needs {buf.numel()} bytes, read {got}")
        return buf.view(e.dtype).reshape(e.shape)


def st_dtype(dtype: torch.dtype, name: str) -> str:
    try:
        return TORCH_TO_ST[dtype]
    except KeyError:
        raise UnsupportedFormatError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store "
                                     f"(it stores {sorted(ST_DTYPES)})") from None


def write_safetensors(path: str, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                      produce: Callable[[str], torch.Tensor], metadata: Optional[dict[str, str]] = None) -> int:
    """Write ``entries`` (name, dtype, shape) to ``path``; ``produce(name)`` gives each tensor
    in turn, and it is dropped once written.  Written to a temporary beside ``path`` and
    renamed into place, so ``path`` is never a partial file.  Returns the file's size."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    pos = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": st_dtype(dtype, name), "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for name, dtype, shape in entries:
                t = produce(name)
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise UnsupportedFormatError(f"tensor {name!r}: produced {t.dtype} {list(t.shape)}, "
                                                 f"expected {dtype} {list(shape)}")
                if t.numel():
                    flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                    f.write(memoryview(flat.numpy()))  # type: ignore[arg-type]
                del t
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return size
