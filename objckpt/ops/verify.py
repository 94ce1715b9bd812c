"""What ``objckpt verify`` checks beyond a full read: every chunk's block crcs.

A full read checks each chunk against its whole-chunk crc32c only; the
per-block crcs are used by partial loads.  A damaged block crc therefore
passes full reads and fails a later partial load, far from the damage.  Verify
checks every block crc twice: that the block crcs combine to the chunk crc,
and that each one matches the crc of its block's bytes (as read, and already
checked against the chunk crc).

:func:`verify_checkpoint` runs the whole check on one read session
(:mod:`objckpt.load.session`, the path every reader takes): the manifest with
every chunk listed, then the stored tensors a batch (``memory_bytes``) at a time.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..checksum import block_crcs, combine_blocks
from ..errors import CorruptCheckpointError
from ..format.manifest import Chunk, Manifest, TensorCount
from ..load.session import ReadSession
from ..runtime.memory import Budget


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_checkpoint` checked."""

    tensors: int  # every tensor key, tied ones included (Manifest.tensor_count)
    nbytes: int
    block_crcs: int
    tied: int = 0  # of ``tensors``, those tied to another key (their bytes read and checked once)

    @property
    def count(self) -> TensorCount:
        """``tensors`` and ``tied`` as every command prints them: ``113 tensors (1 tied: stored once)``."""
        return TensorCount(self.tensors, self.tied)


def verify_checkpoint(session: ReadSession, memory_bytes: int,
                      progress: Optional[Callable[[int], None]] = None) -> VerifyReport:
    """Read every stored byte of ``session``'s checkpoint and check every crc32c, block crcs
    included, holding at most ``memory_bytes`` of tensors at a time (a larger tensor alone);
    ``progress(n)`` hears of each batch's bytes."""
    m = session.inspect(True)  # every chunk listed (v2: all rank indexes fetched)
    stored = [k for k in m.tensors if session.stored_key(k) == k]
    sizes = [m.nbytes(k) for k in stored]
    blocks = 0
    for batch in Budget(max(memory_bytes, 1)).batches(sizes):
        keys = [stored[i] for i in batch]
        got = session.read_tree(keys, False)
        part = dataclasses.replace(m, tensors={k: m.tensors[k] for k in keys})
        blocks += verify_block_crcs(part, got.__getitem__)  # a full read checks whole-chunk crcs only
        if progress is not None:
            progress(sum(sizes[i] for i in batch))
    count = m.tensor_count()
    return VerifyReport(count.tensors, m.nbytes(), blocks, count.tied)


def chunk_bytes(t: torch.Tensor, c: Chunk) -> memoryview:
    """The row-major bytes of chunk ``c`` of the whole tensor ``t`` (as the blob stores them)."""
    part = t[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.shape))] if c.shape else t
    flat = part.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def verify_block_crcs(m: Manifest, tensor: Callable[[str], torch.Tensor]) -> int:
    """Check every block crc of every chunk in ``m`` (chunks listed: v2 resolved);
    ``tensor(key)``: the tensor as read.  Returns the number of block crcs checked."""
    checked = 0
    block = m.crc_block
    for key, e in m.tensors.items():
        if e.alias_of is not None:
            continue
        if not any(c.block_crc32c for c in e.chunks):
            continue
        t = tensor(key)
        for c in e.chunks:
            if not c.block_crc32c:
                continue
            where = f"tensor {key!r}: chunk at {list(c.offsets)} of shape {list(c.shape)}"
            if block <= 0 or len(c.block_crc32c) != math.ceil(c.length / block):
                raise CorruptCheckpointError(f"{where}: {len(c.block_crc32c)} block crcs for {c.length} bytes "
                                             f"in blocks of {block}")
            bad = _first_bad_block(c, t, block)
            combined = combine_blocks(c.block_crc32c, c.length, block)
            if combined != c.crc32c:
                raise CorruptCheckpointError(f"{where}: its block crcs combine to 0x{combined:08x}, its crc32c is "
                                             f"0x{c.crc32c:08x}{bad}")
            if bad:
                raise CorruptCheckpointError(f"{where}{bad}")
            checked += len(c.block_crc32c)
    return checked


def _first_bad_block(c: Chunk, t: torch.Tensor, block: int) -> str:
    """``"; block k: stored 0x.., bytes have 0x.."`` for the first block whose crc differs, else ``""``."""
    _, actual = block_crcs(chunk_bytes(t, c), block)
    for k, (stored, got) in enumerate(zip(c.block_crc32c, actual)):
        if stored != got:
            return f"; block {k}: stored crc32c 0x{stored:08x}, its bytes have 0x{got:08x}"
    return ""
