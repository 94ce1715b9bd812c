"""One S3 object written from parts (see :class:`S3Writer`)."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ...runtime import loop as _runtime
from ...checksum import composite_header, crc_header, crc_of_views
from ...errors import CorruptCheckpointError
from ..base import BlobWriter, UploadInfo
from .write_outcome import Expected

if TYPE_CHECKING:
    from .store import S3Store


class S3Writer(BlobWriter):
    """One object: a single PUT when it is one part, else a multipart upload
    created on the first part, parts uploaded concurrently, completed in order.

    With ``checksums`` (the default) every part carries its crc32c
    (``x-amz-checksum-crc32c``): the server recomputes it and refuses a part
    whose bytes changed in flight, and the checksums it reports back (per part,
    and the composite of the object) are compared with ours.  A store that
    reports none back does not check them (Ceph RGW): the store warns once
    (:meth:`S3Store.checksum_not_reported`)."""

    def __init__(self, store: "S3Store", key: str, size: int, num_parts: int) -> None:
        self._s = store
        self._key = key
        self._single = num_parts <= 1
        self._upload_id: Optional[str] = None
        self._create: Optional["asyncio.Future[str]"] = None
        self._etags: dict[int, str] = {}
        self._crcs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}  # bytes per part: what the completed object must hold

    async def _ensure_upload(self) -> str:
        # The create runs as its own task, shielded: if the caller is cancelled
        # mid-request the upload may still be created server-side, and abort()
        # must learn its id to clean it up.
        if self._create is None:
            async def create() -> str:
                return await self._s.create_upload(self._key)

            self._create = asyncio.ensure_future(create())
        self._upload_id = await asyncio.shield(self._create)
        return self._upload_id

    async def write_part(self, index: int, offset: int, data: memoryview) -> None:
        await self.write_part_views(index, offset, [data])

    async def write_part_views(self, index: int, offset: int, views: Sequence[memoryview],
                               crc32c: Optional[int] = None) -> None:
        headers: dict[str, str] = {}
        if self._s.checksums:
            if crc32c is None:
                crc32c = await _runtime.in_thread(crc_of_views, views)
            self._crcs[index] = crc32c
            headers["x-amz-checksum-crc32c"] = crc_header(crc32c)
        if self._single:
            r = await self._s.put_views(self._key, views, headers)
        else:
            upload_id = await self._ensure_upload()
            r = await self._s.put_views(self._key, views, headers, part=(upload_id, index + 1))
            self._etags[index] = r["ETag"]
            self._sizes[index] = sum(v.nbytes for v in views)
        self._check_reported(r, headers.get("x-amz-checksum-crc32c"), f"part {index + 1}")
        if "x-amz-checksum-crc32c" in headers and not (isinstance(r, dict) and r.get("ChecksumCRC32C")):
            self._s.checksum_not_reported("PutObject" if self._single else "UploadPart")

    def _check_reported(self, r: Any, ours: Optional[str], what: str) -> None:
        """The server reports the checksum of what it stored: it must be ours."""
        theirs = r.get("ChecksumCRC32C") if isinstance(r, dict) else None
        if ours is not None and theirs and theirs != ours:
            raise CorruptCheckpointError(
                f"{what} of s3://{self._s.bucket}/{self._key}: the server stored crc32c {theirs}, "
                f"objckpt sent {ours} (bytes changed in flight)")

    async def complete(self) -> None:
        if self._single:
            return
        if self._upload_id is None:  # zero-part object
            await self._s.put(self._key, b"")
            return
        parts: list[dict[str, Any]] = [{"PartNumber": i + 1, "ETag": self._etags[i]} for i in sorted(self._etags)]
        composite = None
        if self._s.checksums:
            for p in parts:
                p["ChecksumCRC32C"] = crc_header(self._crcs[p["PartNumber"] - 1])
            composite = composite_header([self._crcs[i] for i in sorted(self._etags)])
        # what the object is, should the answer be lost and the upload found gone (see S3Store.complete_upload)
        expect = Expected(sum(self._sizes.values()), len(parts), composite)
        r = await self._s.complete_upload(self._key, self._upload_id, parts, expect)
        self._check_reported(r, composite, "the object")

    async def abort(self) -> None:
        if self._create is not None:
            try:
                upload_id = await self._create
                await self._s.abort_upload(UploadInfo(self._key, upload_id))
            except Exception:
                pass  # gc will find it
        # a single PUT cancelled in flight may still land: delete it (absent is fine)
        try:
            await self._s.delete([self._key])
        except Exception:
            pass
