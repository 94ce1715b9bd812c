"""``objckpt export``: a checkpoint's tensors as Hugging Face sharded safetensors.

Writes ``model.safetensors`` (one shard) or ``model-0000k-of-0000n.safetensors`` +
``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``),
the layout ``transformers``' ``from_pretrained`` reads.  Keys are the checkpoint's
flat tensor keys, those under ``prefix`` only and with it stripped (a training
state ``{"model": model.state_dict(), "optim": ...}`` exports with
``prefix="model."``); non-tensor values are skipped.

Memory: tensors are read one at a time (a resharding read of the whole tensor:
from a multi-rank checkpoint it is assembled from every rank's pieces, only those
bytes fetched), cast if asked, written and dropped; shard files are written
under a temporary name and renamed, and the index last.

The whole folder ``from_pretrained`` reads (the step's ``config.json`` and
``generation_config.json`` too), or the model in one call:
:mod:`objckpt.integrations.hf_pretrained`.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import MissingKeyError, UnsupportedValueError
from ..storage import ObjectStore
from ..load.session import ReadSession
from .safetensors_io import st_dtype, write_safetensors

#: ``--dtype`` names
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: "str | int") -> int:
    """``"5GB"`` -> 5 * 10**9, ``"500MiB"`` -> 500 * 2**20, ``123`` -> 123 (as transformers reads sizes)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise UnsupportedValueError(f"shard size {text!r} is not a size like 5GB, 500MB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """The dtype ``--dtype`` names (None: keep each tensor's own)."""
    if name is None:
        return None
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UnsupportedValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class ExportOptions:
    """``prefix``: only keys starting with it, stripped; ``dtype``: cast floating-point tensors
    to it; ``max_shard_size``: bytes (or "5GB") per shard file."""

    prefix: str = ""
    dtype: Optional[torch.dtype] = None
    max_shard_size: "int | str" = "5GB"


@dataclass(frozen=True)
class ExportResult:
    """The files written (names inside the directory), tensors and tensor bytes."""

    directory: str
    files: list[str]
    tensors: int
    nbytes: int


def export_safetensors(uri: str, directory: str, opts: ExportOptions = ExportOptions(), *,
                       storage_options: Optional[dict[str, Any]] = None,
                       store: Optional[ObjectStore] = None) -> ExportResult:
    """Export the tensors of checkpoint ``uri`` to ``directory`` in the Hugging Face layout."""
    return export_session(ReadSession.open(uri, storage_options, store), directory, opts)


def export_session(ck: ReadSession, directory: str, opts: ExportOptions) -> ExportResult:
    """:func:`export_safetensors` of a checkpoint already open (its manifest read once)."""
    uri = ck.uri
    limit = parse_size(opts.max_shard_size)
    if limit <= 0:
        raise UnsupportedValueError(f"max shard size must be positive, got {opts.max_shard_size!r}")
    picked: list[tuple[str, str, torch.dtype, tuple[int, ...]]] = []  # (checkpoint key, name, out dtype, shape)
    for key in ck.manifest.tensors:
        if not key.startswith(opts.prefix):
            continue
        name = key[len(opts.prefix):]
        dt = ck.dtype(key)
        out = opts.dtype if opts.dtype is not None and dt.is_floating_point else dt
        st_dtype(out, key)  # refuse what safetensors cannot hold before writing anything
        picked.append((key, name, out, ck.shape(key)))
    if not picked:
        raise MissingKeyError(f"checkpoint {uri!r} has no tensor key starting with {opts.prefix!r} "
                              f"(its keys are e.g. {list(ck.manifest.tensors)[:5]})")
    shards: list[list[tuple[str, str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for p in picked:
        n = _nbytes(p[2], p[3])
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += n
    os.makedirs(directory, exist_ok=True)
    total = len(shards)
    files = [SINGLE_NAME] if total == 1 else [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
    nbytes = 0
    weight_map: dict[str, str] = {}
    for fname, shard in zip(files, shards):
        by_name = {name: (key, dt) for key, name, dt, _ in shard}

        def produce(name: str) -> torch.Tensor:
            key, dt = by_name[name]
            return ck.read(key).to(dt)

        write_safetensors(os.path.join(directory, fname), [(n, dt, s) for _, n, dt, s in shard], produce)
        for _, name, dt, shape in shard:
            weight_map[name] = fname
            nbytes += _nbytes(dt, shape)
    if total > 1:
        index = {"metadata": {"total_size": nbytes}, "weight_map": weight_map}
        tmp = os.path.join(directory, f"{INDEX_NAME}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(directory, INDEX_NAME))
        files = files + [INDEX_NAME]
    # a layout left by an earlier export would shadow this one: from_pretrained looks
    # for model.safetensors and the index by name
    stale = os.path.join(directory, SINGLE_NAME if total > 1 else INDEX_NAME)
    if os.path.exists(stale):
        os.unlink(stale)
    return ExportResult(directory, files, len(picked), nbytes)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n
