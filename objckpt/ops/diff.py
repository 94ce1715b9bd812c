"""``objckpt.diff(a, b)``: what differs between two checkpoints, fetching as little as it can.

Why by crc: two checkpoints saved with the same layout cut every tensor into the
same chunks, and each chunk carries the crc32c of its bytes, so comparing the
two manifests decides most tensors without reading a byte of them (a crc32c
collision between different bytes is a 1 in 2**32 chance per chunk).  When the
two sides are chunked differently (another world size, another part size) the
crcs cover different bytes; then both tensors are read, at most
``memory_bytes`` per side at a time, and compared bit for bit (so NaNs with the
same bits are equal).  The report says which way each tensor was decided.

Non-tensor values (``step``, hyper-parameters) are compared by their stored JSON.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..format.manifest import Manifest, TensorCount, TensorEntry
from ..format.tree import iter_leaves
from ..load.session import ReadSession, stored_key
from ..runtime.memory import DIFF_MEMORY_BYTES, Budget
from ..storage import ObjectStore

#: bytes of tensors read from each side at once when bytes must be compared
MEMORY_BYTES = DIFF_MEMORY_BYTES


@dataclass
class DiffReport:
    """The differences between checkpoints ``a`` and ``b`` (keys are flat keys)."""

    a: str
    b: str
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    #: "key: float32 [4, 3] vs float16 [4, 3]" (tensor in one, value in the other counts too)
    mismatched: list[str] = field(default_factory=list)
    #: tensors with the same dtype and shape whose values differ
    differing: list[str] = field(default_factory=list)
    #: non-tensor values that differ
    values_differing: list[str] = field(default_factory=list)
    #: every compared tensor -> "crc" (decided from the manifests) or "bytes" (read and compared)
    decided: dict[str, str] = field(default_factory=dict)
    #: bytes read to compare tensors (both sides)
    bytes_read: int = 0
    #: the tensors of each side, counted as every command counts them (Manifest.tensor_count)
    a_tensors: TensorCount = TensorCount(0)
    b_tensors: TensorCount = TensorCount(0)

    @property
    def equal(self) -> bool:
        return not (self.only_a or self.only_b or self.mismatched or self.differing or self.values_differing)


def _stored(m: Manifest, key: str) -> TensorEntry:
    return m.tensors[stored_key(m, key)]


def _by_crc(ea: TensorEntry, eb: TensorEntry) -> Optional[bool]:
    """True/False (values equal/differ) when both are chunked identically, else None."""
    ca = {(c.offsets, c.shape): c.crc32c for c in ea.chunks}
    cb = {(c.offsets, c.shape): c.crc32c for c in eb.chunks}
    if set(ca) != set(cb) or len(ca) != len(ea.chunks) or len(cb) != len(eb.chunks):
        return None
    return all(ca[k] == cb[k] for k in ca)


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.numel() == 0:
        return True
    return bool(torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8)))


def diff_manifests(ma: Manifest, mb: Manifest, report: DiffReport) -> list[str]:
    """Fill ``report`` from the two manifests (chunks resolved); return the keys whose
    bytes must still be compared."""
    la, lb = dict(iter_leaves(ma.tree)), dict(iter_leaves(mb.tree))
    report.only_a = [k for k in la if k not in lb]
    report.only_b = [k for k in lb if k not in la]
    to_read: list[str] = []
    for k in la:
        if k not in lb:
            continue
        ta, tb = k in ma.tensors, k in mb.tensors
        if ta != tb:
            report.mismatched.append(f"{k}: {'tensor' if ta else 'value'} vs {'tensor' if tb else 'value'}")
            continue
        if not ta:
            if json.dumps(la[k], sort_keys=True) != json.dumps(lb[k], sort_keys=True):
                report.values_differing.append(k)
            continue
        ea, eb = _stored(ma, k), _stored(mb, k)
        if ea.dtype != eb.dtype or ea.shape != eb.shape:
            report.mismatched.append(f"{k}: {ea.dtype} {list(ea.shape)} vs {eb.dtype} {list(eb.shape)}")
            continue
        same = _by_crc(ea, eb) if ea.numel else True
        if same is None:
            to_read.append(k)
            continue
        report.decided[k] = "crc"
        if not same:
            report.differing.append(k)
    return to_read


def diff(a: str, b: str, *, storage_options: Optional[dict[str, Any]] = None,
         b_storage_options: Optional[dict[str, Any]] = None, memory_bytes: int = MEMORY_BYTES,
         progress: Optional[Callable[[int, int], None]] = None, a_store: Optional[ObjectStore] = None,
         b_store: Optional[ObjectStore] = None) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (see the module docstring).

    ``storage_options`` open ``a`` (and ``b`` unless ``b_storage_options``).
    ``progress(n, total)`` hears of the bytes read when tensors are compared byte by byte."""
    sa = ReadSession(a, storage_options, a_store)
    sb = ReadSession(b, b_storage_options if b_storage_options is not None else storage_options, b_store)
    ma = sa.inspect(True)
    mb = sb.inspect(True)
    report = DiffReport(a, b, a_tensors=ma.tensor_count(), b_tensors=mb.tensor_count())
    to_read = diff_manifests(ma, mb, report)
    sizes = [sum(c.length for c in _stored(ma, k).chunks) for k in to_read]
    for batch in Budget(max(memory_bytes, 1)).batches(sizes):
        wanted = [to_read[i] for i in batch]
        got_a = sa.read_tree(wanted, False)
        got_b = sb.read_tree(wanted, False)
        n = 2 * sum(sizes[i] for i in batch)
        report.bytes_read += n
        for k in wanted:
            report.decided[k] = "bytes"
            if not _same_bits(got_a[k], got_b[k]):
                report.differing.append(k)
        if progress is not None:
            progress(n, 2 * sum(sizes))
    return report
