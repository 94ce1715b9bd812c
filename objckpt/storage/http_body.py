"""A request body made of borrowed buffers, written in slices.

Upload parts are sent straight from tensor memory or staging buffers.  Handing
aiohttp one large buffer makes asyncio copy whatever the socket does not take
at once into a transport buffer as large as the part: on a first save that is
fresh memory, and touching fresh memory is the dominant cost on many VMs.
Writing in slices and waiting for the socket to drain keeps that buffer small
and reused, and several buffers (a part made of many small tensors) need no
joining copy either.  ``len()`` gives botocore the Content-Length.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from aiohttp import payload
from aiohttp.abc import AbstractStreamWriter

SLICE = 256 << 10


class ViewsPayload(payload.Payload):
    def __init__(self, views: Sequence[memoryview]) -> None:
        vs = [v if v.format == "B" else v.cast("B") for v in views if len(v)]
        super().__init__(vs, content_type="application/octet-stream")
        self._views = vs
        self._size = sum(len(v) for v in vs)

    def __len__(self) -> int:
        return self._size

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._views).decode(encoding, errors)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: Optional[int]) -> None:
        left = self._size if content_length is None else min(content_length, self._size)
        for v in self._views:
            for i in range(0, len(v), SLICE):
                if left <= 0:
                    return
                piece = v[i : i + min(SLICE, left)]
                await writer.write(piece)
                left -= len(piece)


def body(views: Sequence[memoryview]) -> Any:
    return ViewsPayload(views)
