"""The ``objckpt convert`` and ``objckpt export`` commands: run, then print one summary line."""
from __future__ import annotations

import time
from typing import Any, Optional

from .convert import convert
from .hf import ExportOptions, export_safetensors, parse_dtype


def convert_command(src: str, dst: str, src_format: str, dst_format: str,
                    storage_options: Optional[dict[str, Any]], overwrite: bool) -> int:
    t0 = time.perf_counter()
    r = convert(src, dst, src_format=src_format, dst_format=dst_format, storage_options=storage_options,
                overwrite=overwrite)
    print(f"converted {r.src_format.value} {src} -> {r.dst_format.value} {dst}: {r.tensors} tensors, "
          f"{r.nbytes / 1e6:.2f} MB in {time.perf_counter() - t0:.2f} s")
    return 0


def export_command(uri: str, directory: str, fmt: str, prefix: str, dtype: Optional[str], max_shard_size: str,
                   storage_options: Optional[dict[str, Any]]) -> int:
    if fmt != "safetensors":  # argparse limits the choices; a direct caller gets the same refusal
        from ..errors import UnsupportedFormatError

        raise UnsupportedFormatError(f"export writes safetensors only, not {fmt!r}")
    t0 = time.perf_counter()
    r = export_safetensors(uri, directory, ExportOptions(prefix or "", parse_dtype(dtype), max_shard_size),
                           storage_options=storage_options)
    print(f"exported {r.tensors} tensors, {r.nbytes / 1e6:.2f} MB to {directory} as {len(r.files)} file(s) "
          f"({', '.join(r.files[:3])}{' ...' if len(r.files) > 3 else ''}) in {time.perf_counter() - t0:.2f} s")
    return 0
