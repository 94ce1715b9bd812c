"""A read-only store: files received from peers, held in memory, over a node's folder.

A rank restoring from peers (:mod:`objckpt.tier.restore`) receives the files its
load reads and its node's folder lacks straight into host memory
(:func:`objckpt.tier.peers.fetch`).  The ordinary load then reads through an
:class:`OverlayStore`: a key received is served from memory, any other from the
folder's store.  Nothing is written before the load, the bytes are checked against
their crc32c by the load as any read is (hashed piece by piece right after each
copy, while the piece is in the CPU's cache, as the local store does), and the
memory goes when the store does.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..errors import CorruptCheckpointError, ObjckptError
from ..runtime import loop as _runtime
from ..storage.base import ObjectInfo, ObjectStore
from ..storage.local import TALLY_PIECE

#: copies at least this large leave the event loop's thread
_THREAD_BYTES = 1 << 20


class ReadOnlyStoreError(ObjckptError, PermissionError):
    """A write to the overlay a restore reads through (it is never written)."""


def _copy(dst: memoryview, src: torch.Tensor, tally: Any = None) -> None:
    """``src`` (uint8, contiguous) into ``dst``, in pieces, each hashed into ``tally`` right after."""
    d = dst.cast("B") if dst.format != "B" else dst
    for at in range(0, len(d), TALLY_PIECE):
        piece = d[at: at + TALLY_PIECE]
        torch.frombuffer(piece, dtype=torch.uint8).copy_(src[at: at + len(piece)])
        if tally is not None:
            tally.feed(piece)


class OverlayStore(ObjectStore):
    """Keys of ``files`` (uint8 tensors, whole files) from memory, every other key from ``base``."""

    def __init__(self, base: ObjectStore, files: dict[str, torch.Tensor]) -> None:
        self.base = base
        self.files = files
        self.concurrency = base.concurrency
        self.min_part_size, self.max_part_size, self.max_parts = base.min_part_size, base.max_part_size, base.max_parts

    def _span(self, key: str, offset: int, length: int) -> torch.Tensor:
        data = self.files[key]
        if offset < 0 or offset + length > data.numel():
            raise CorruptCheckpointError(f"object {key!r} (received from a peer) is truncated: wanted bytes "
                                         f"{offset}..{offset + length}, it holds {data.numel()}")
        return data[offset: offset + length]

    async def get(self, key: str) -> bytes:
        if key in self.files:
            return self.files[key].numpy().tobytes()
        return await self.base.get(key)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        if key in self.files:
            data = self.files[key]
            return data[offset: min(offset + length, data.numel())].numpy().tobytes()
        return await self.base.get_range(key, offset, length)

    async def _into(self, key: str, offset: int, outs: Sequence[memoryview], tally: Any) -> None:
        total = sum(len(o) for o in outs)
        src = self._span(key, offset, total)

        def copy() -> None:
            at = 0
            for o in outs:
                _copy(o, src[at: at + len(o)], tally)
                at += len(o)

        if total >= _THREAD_BYTES:
            await _runtime.in_thread(copy)
        else:
            copy()

    async def get_range_into(self, key: str, offset: int, out: memoryview) -> None:
        if key in self.files:
            await self._into(key, offset, [out], None)
        else:
            await self.base.get_range_into(key, offset, out)

    async def get_range_scatter(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        if key in self.files:
            await self._into(key, offset, outs, None)
        else:
            await self.base.get_range_scatter(key, offset, outs)

    async def get_range_tallied(self, key: str, offset: int, outs: Sequence[memoryview], tally: Any) -> None:
        """As the local store's: each piece hashed right after it landed (see :mod:`objckpt.load.ranged_get`)."""
        if key in self.files:
            await self._into(key, offset, outs, tally)
            return
        tallied = getattr(self.base, "get_range_tallied", None)
        if tallied is not None:
            await tallied(key, offset, outs, tally)
            return
        await self.base.get_range_scatter(key, offset, outs)
        for o in outs:
            tally.feed(o.cast("B") if o.format != "B" else o)

    async def head(self, key: str) -> Optional[ObjectInfo]:
        if key in self.files:
            return ObjectInfo(key, self.files[key].numel())
        return await self.base.head(key)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        below = [o for o in await self.base.list(prefix) if o.key not in self.files]
        return sorted(below + [ObjectInfo(k, v.numel()) for k, v in self.files.items() if k.startswith(prefix)],
                      key=lambda o: o.key)

    async def put(self, key: str, data: memoryview | bytes, *, if_absent: bool = False) -> None:
        raise ReadOnlyStoreError(f"cannot write {key!r}: a restore reads through a read-only overlay")

    async def delete(self, keys: Sequence[str]) -> None:
        raise ReadOnlyStoreError(f"cannot delete {list(keys)[:3]!r}: a restore reads through a read-only overlay")

    def describe(self) -> str:
        return f"{self.base.describe()} + {len(self.files)} file(s) received from peers"
