"""``objckpt convert | export``: other formats in and out, each run ending in one summary line.

The converters themselves live in :mod:`objckpt.integrations` (imported when
a command runs, so ``objckpt --help`` does not load them).
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from ..errors import UnsupportedFormatError
from .options import add_command, storage_options


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert between DCP / torch.save / safetensors and objckpt, streaming."""
    from ..integrations.convert import convert

    t0 = time.perf_counter()
    r = convert(args.src, args.dst, src_format=args.src_format, dst_format=args.dst_format,
                storage_options=storage_options(args), overwrite=args.overwrite)
    print(f"converted {r.src_format.value} {args.src} -> {r.dst_format.value} {args.dst}: {r.tensors} tensors, "
          f"{r.nbytes / 1e6:.2f} MB in {time.perf_counter() - t0:.2f} s")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a checkpoint's tensors as Hugging Face sharded safetensors into a local directory."""
    if args.format != "safetensors":  # argparse limits the choices; a direct caller gets the same refusal
        raise UnsupportedFormatError(f"export writes safetensors only, not {args.format!r}")
    from ..integrations.hf import ExportOptions, export_safetensors, parse_dtype
    from ..integrations.hf_pretrained import export_pretrained, holds_model_config

    t0 = time.perf_counter()
    opts, json_files = storage_options(args), []
    if holds_model_config(args.uri, storage_options=opts):  # a Trainer step: a folder from_pretrained reads
        folder = export_pretrained(args.uri, args.dir, prefix=args.prefix or "", dtype=parse_dtype(args.dtype),
                                   max_shard_size=args.max_shard_size, storage_options=opts)
        r, json_files = folder.weights, folder.json_files
    else:
        r = export_safetensors(args.uri, args.dir, ExportOptions(args.prefix or "", parse_dtype(args.dtype),
                                                                 args.max_shard_size), storage_options=opts)
    print(f"exported {r.tensors} tensors, {r.nbytes / 1e6:.2f} MB to {args.dir} as {len(r.files)} file(s) "
          f"({', '.join(r.files[:3])}{' ...' if len(r.files) > 3 else ''})"
          + (f" and {', '.join(json_files)}" if json_files else "") + f" in {time.perf_counter() - t0:.2f} s")
    return 0


def add_convert(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(sub, common, "convert", "convert DCP / torch.save / safetensors <-> objckpt, streaming",
                    cmd_convert)
    p.add_argument("src", help="DCP directory (path or fsspec URL), torch.save file, safetensors file or "
                               "directory, or an objckpt checkpoint")
    p.add_argument("dst", help="objckpt URI, or (from objckpt) a DCP directory / safetensors directory")
    p.add_argument("--from", dest="src_format", default="auto", help="auto|objckpt|dcp|torch|safetensors")
    p.add_argument("--to", dest="dst_format", default="auto", help="auto|objckpt|dcp|safetensors")
    p.add_argument("--overwrite", action="store_true", help="replace an existing destination checkpoint")


def add_export(sub: Any, common: argparse.ArgumentParser) -> None:
    p = add_command(sub, common, "export", "export a checkpoint's tensors as Hugging Face sharded safetensors",
                    cmd_export)
    p.add_argument("uri")
    p.add_argument("dir", help="local directory to write model*.safetensors (+ index) into")
    p.add_argument("--format", default="safetensors", choices=["safetensors"])
    p.add_argument("--prefix", default="", help="export keys under this prefix only, stripped (e.g. model.)")
    p.add_argument("--dtype", help="cast floating-point tensors: bf16, fp16 or fp32")
    p.add_argument("--max-shard-size", default="5GB", help="per shard file, e.g. 5GB, 500MB (default 5GB)")
