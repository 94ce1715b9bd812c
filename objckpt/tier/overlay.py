"""A read-only store: bytes received from peers, held in memory, over a node's folder.

A rank restoring from peers (:mod:`objckpt.tier.peer_restore`) receives what its
load reads and its node's folder lacks straight into memory
(:func:`objckpt.tier.peers.fetch`): metadata and partly read blobs as whole files
in new memory, and each chunk the load reads whole into host memory straight into
the destination tensor itself.  The ordinary load then reads through an
:class:`OverlayStore`: a key received is served from memory, any other from the
folder's store.  A read whose destination is where its bytes were received costs
no copy, only the crc32c check the load makes of every byte (hashed piece by piece,
as the local store does); any other is copied from where the bytes are, piece by
piece, each piece hashed right after its copy while it is in the CPU's cache.
Bytes of a requested span that were not received (the gaps a merged request
spans between two chunks) read as zeros: the reader drops them, and a chunk that
really lacked its bytes fails its crc32c check.  Nothing is written; the memory
goes when the store does.
"""
from __future__ import annotations

import bisect
from typing import Any, Optional, Sequence

import torch

from ..errors import NotFoundError, ObjckptError
from ..runtime import loop as _runtime
from ..storage.base import ObjectInfo, ObjectStore
from ..storage.local import TALLY_PIECE

#: copies at least this large leave the event loop's thread
_THREAD_BYTES = 1 << 20

Segment = tuple[int, torch.Tensor]  # (offset in the file, its bytes: a contiguous uint8 tensor)


class ReadOnlyStoreError(ObjckptError, PermissionError):
    """A write to the overlay a restore reads through (it is never written)."""


def _address(view: memoryview) -> int:
    return torch.frombuffer(view, dtype=torch.uint8).data_ptr() if len(view) else 0


def _fill(dst: memoryview, src: Optional[torch.Tensor], tally: Any) -> None:
    """``src`` (None: zeros) into ``dst``, in pieces, each hashed into ``tally`` right after;
    no copy where ``src`` already is ``dst``."""
    same = src is not None and len(dst) and src.data_ptr() == _address(dst)
    for at in range(0, len(dst), TALLY_PIECE):
        piece = dst[at: at + TALLY_PIECE]
        if not same:
            out = torch.frombuffer(piece, dtype=torch.uint8)
            if src is None:
                out.zero_()
            else:
                out.copy_(src[at: at + len(piece)])
        if tally is not None:
            tally.feed(piece)


class OverlayStore(ObjectStore):
    """Keys of ``segments`` from memory (each a list of (offset, bytes) pieces), every other key
    from ``base`` except those of ``hidden`` (files found damaged in the folder: absent here)."""

    def __init__(self, base: ObjectStore, segments: dict[str, list[Segment]],
                 hidden: frozenset[str] = frozenset()) -> None:
        self.base = base
        self.hidden = frozenset(k for k in hidden if k not in segments)
        self.segments = {k: sorted(v, key=lambda s: s[0]) for k, v in segments.items()}
        self._starts = {k: [o for o, _t in v] for k, v in self.segments.items()}
        self.concurrency = base.concurrency
        self.min_part_size, self.max_part_size, self.max_parts = base.min_part_size, base.max_part_size, base.max_parts

    def size(self, key: str) -> int:
        """The end of the last piece held (a whole file: its size)."""
        return max((o + t.numel() for o, t in self.segments[key]), default=0)

    def _parts(self, key: str, offset: int, length: int) -> list[tuple[int, int, Optional[torch.Tensor]]]:
        """(offset, length, bytes or None for a gap) covering ``offset .. offset + length``."""
        segs, starts = self.segments[key], self._starts[key]
        out: list[tuple[int, int, Optional[torch.Tensor]]] = []
        pos, end = offset, offset + length
        i = max(bisect.bisect_right(starts, pos) - 1, 0)
        while pos < end:
            while i < len(segs) and segs[i][0] + segs[i][1].numel() <= pos:
                i += 1
            if i < len(segs) and segs[i][0] <= pos:
                o, t = segs[i]
                n = min(end, o + t.numel()) - pos
                out.append((pos, n, t[pos - o: pos - o + n]))
            else:
                n = (min(end, segs[i][0]) if i < len(segs) else end) - pos
                out.append((pos, n, None))
            pos += n
        return out

    async def _into(self, key: str, offset: int, outs: Sequence[memoryview], tally: Any) -> None:
        views = [o.cast("B") if o.format != "B" else o for o in outs]
        total = sum(len(v) for v in views)

        def copy() -> None:
            at = offset
            for v in views:
                for pos, n, src in self._parts(key, at, len(v)):
                    _fill(v[pos - at: pos - at + n], src, tally)
                at += len(v)

        if total >= _THREAD_BYTES:
            await _runtime.in_thread(copy)
        else:
            copy()

    async def get(self, key: str) -> bytes:
        if key in self.segments:
            buf = bytearray(self.size(key))
            await self._into(key, 0, [memoryview(buf)], None)
            return bytes(buf)
        self._visible(key)
        return await self.base.get(key)

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        if key in self.segments:
            buf = bytearray(max(0, min(offset + length, self.size(key)) - offset))
            await self._into(key, offset, [memoryview(buf)], None)
            return bytes(buf)
        self._visible(key)
        return await self.base.get_range(key, offset, length)

    async def get_range_into(self, key: str, offset: int, out: memoryview) -> None:
        if key in self.segments:
            await self._into(key, offset, [out], None)
        else:
            self._visible(key)
            await self.base.get_range_into(key, offset, out)

    async def get_range_scatter(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        if key in self.segments:
            await self._into(key, offset, outs, None)
        else:
            self._visible(key)
            await self.base.get_range_scatter(key, offset, outs)

    async def get_range_tallied(self, key: str, offset: int, outs: Sequence[memoryview], tally: Any) -> None:
        """As the local store's: each piece hashed right after it landed (see :mod:`objckpt.load.ranged_get`)."""
        if key in self.segments:
            await self._into(key, offset, outs, tally)
            return
        self._visible(key)
        tallied = getattr(self.base, "get_range_tallied", None)
        if tallied is not None:
            await tallied(key, offset, outs, tally)
            return
        await self.base.get_range_scatter(key, offset, outs)
        for o in outs:
            tally.feed(o.cast("B") if o.format != "B" else o)

    async def head(self, key: str) -> Optional[ObjectInfo]:
        if key in self.segments:
            return ObjectInfo(key, self.size(key))
        if key in self.hidden:
            return None
        return await self.base.head(key)

    def _visible(self, key: str) -> None:
        if key in self.hidden:
            raise NotFoundError(f"{key!r} is damaged in the node's folder and was not received from a peer")

    async def list(self, prefix: str) -> list[ObjectInfo]:
        below = [o for o in await self.base.list(prefix) if o.key not in self.segments and o.key not in self.hidden]
        return sorted(below + [ObjectInfo(k, self.size(k)) for k in self.segments if k.startswith(prefix)],
                      key=lambda o: o.key)

    async def put(self, key: str, data: memoryview | bytes, *, if_absent: bool = False) -> None:
        raise ReadOnlyStoreError(f"cannot write {key!r}: a restore reads through a read-only overlay")

    async def delete(self, keys: Sequence[str]) -> None:
        raise ReadOnlyStoreError(f"cannot delete {list(keys)[:3]!r}: a restore reads through a read-only overlay")

    def describe(self) -> str:
        return f"{self.base.describe()} + {len(self.segments)} file(s) received from peers"

