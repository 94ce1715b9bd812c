"""A request body made of borrowed buffers: written in slices, and readable as a file.

Upload parts are sent straight from tensor memory or staging buffers.  Handing
aiohttp one large buffer makes asyncio copy whatever the socket does not take
at once into a transport buffer as large as the part: on a first save that is
fresh memory, and touching fresh memory is the dominant cost on many VMs.
Writing in slices and waiting for the socket to drain keeps that buffer small
and reused, and several buffers (a part made of many small tensors) need no
joining copy either.  ``len()`` gives botocore the Content-Length.

The same object is also a seekable binary file (``read``, ``readinto``,
``seek``, ``tell``), because botocore hands the body to others before aiohttp
sends it:

* with ``awscrt`` installed (``boto3[crt]``, common in AWS images) botocore
  signs through the CRT, which wraps any body that has ``seek`` as an input
  stream and anything else as ``BytesIO(body)``, which fails for an object
  that is not bytes;
* botocore resends a request after a region redirect (``S3RegionRedirectorv2``)
  or a retry only after ``seek(0)``; a body without it is "unseekable" and the
  request fails ("Need to rewind the stream");
* checksum and payload-hash code read file-like bodies in chunks and seek back;
* being file-like, the body is sent with ``Expect: 100-continue`` (botocore does
  so for every file body, as boto3's uploads do): a refusal, such as a bucket in
  another region, comes back before the part is sent, not after.

Reading copies only what the reader asks for (the CRT reads into its own
buffer through ``readinto``); sending never depends on the read position:
every :meth:`write` sends all of the views, so a body that a signer read to
its end, or one sent before, goes out whole again.
"""
from __future__ import annotations

import bisect
import io
from typing import Any, Optional, Sequence

from aiohttp import payload
from aiohttp.abc import AbstractStreamWriter

SLICE = 256 << 10


class ViewsPayload(payload.Payload):
    """``views`` as one request body (see the module docstring).  Not an
    ``io.IOBase``: aiobotocore would wrap one in its own payload and lose the
    sliced writes; the file methods are duck-typed, as botocore and awscrt use them."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        vs = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views if len(v)]
        super().__init__(vs, content_type="application/octet-stream")
        self._views = vs
        self._total = sum(len(v) for v in vs)  # aiohttp's _size is Optional; this one is not
        self._size = self._total
        self._starts: list[int] = []  # offset of each view in the body, for seek/read
        at = 0
        for v in vs:
            self._starts.append(at)
            at += len(v)
        self._pos = 0

    def __len__(self) -> int:
        return self._total

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        return b"".join(self._views).decode(encoding, errors)

    # -- sending (aiohttp) ------------------------------------------------------
    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: AbstractStreamWriter, content_length: Optional[int]) -> None:
        left = self._total if content_length is None else min(content_length, self._total)
        for v in self._views:
            for i in range(0, len(v), SLICE):
                if left <= 0:
                    return
                piece = v[i : i + min(SLICE, left)]
                await writer.write(piece)
                left -= len(piece)

    # -- reading (botocore's signers and checksums, awscrt's input stream) ------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._total}.get(whence)
        if base is None:
            raise ValueError(f"seek: invalid whence {whence!r}")
        pos = base + offset
        if pos < 0:
            raise ValueError(f"seek: negative position {pos}")
        self._pos = pos
        return pos

    def readinto(self, out: Any) -> int:
        """Copy the next bytes into ``out`` (a writable buffer); 0 at the end."""
        dest = memoryview(out).cast("B")
        n = 0
        i = bisect.bisect_right(self._starts, self._pos) - 1
        while n < len(dest) and 0 <= i < len(self._views) and self._pos < self._total:
            v = self._views[i]
            within = self._pos - self._starts[i]
            take = min(len(v) - within, len(dest) - n)
            dest[n : n + take] = v[within : within + take]
            n += take
            self._pos += take
            i += 1
        return n

    readinto1 = readinto

    def read(self, size: Optional[int] = -1) -> bytes:
        """The next ``size`` bytes (all that are left when ``size`` is None or negative)."""
        left = max(0, self._total - self._pos)
        want = left if size is None or size < 0 else min(size, left)
        buf = bytearray(want)
        got = self.readinto(buf)
        return bytes(buf[:got])

    read1 = read


def body(views: Sequence[memoryview]) -> Any:
    return ViewsPayload(views)
