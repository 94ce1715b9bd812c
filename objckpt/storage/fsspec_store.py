"""Any fsspec filesystem (gcs://, az://, hdfs://, ...) as an object store.

fsspec offers no portable conditional create, so the commit here is
check-then-write: safe against crashes (the manifest is one object written
whole) but not against two writers racing on one path.  Prefer the native S3
or local backends where they apply.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..runtime import loop as _runtime
from ..errors import PreconditionFailed
from .base import ObjectInfo, ObjectStore, not_found


class FsspecStore(ObjectStore):
    min_part_size = 1

    def __init__(self, protocol: str, root: str, **options: Any) -> None:
        import fsspec

        self.protocol = protocol
        self.root = root.rstrip("/")
        self.fs = fsspec.filesystem(protocol, **options)

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    async def _run(self, fn: Any, *args: Any, **kw: Any) -> Any:
        return await _runtime.in_thread(lambda: fn(*args, **kw))

    async def get(self, key: str) -> bytes:
        try:
            return await self._run(self.fs.cat_file, self._path(key))
        except FileNotFoundError:
            raise not_found(f"{self.protocol}://{self._path(key)}") from None

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            return await self._run(self.fs.cat_file, self._path(key), start=offset, end=offset + length)
        except FileNotFoundError:
            raise not_found(f"{self.protocol}://{self._path(key)}") from None

    async def put(self, key: str, data: memoryview | bytes, *, if_absent: bool = False) -> None:
        path = self._path(key)
        if if_absent and await self._run(self.fs.exists, path):
            raise PreconditionFailed(f"object {self.protocol}://{path} already exists")
        def write() -> None:
            parent = self.fs._parent(path)
            if parent:
                self.fs.makedirs(parent, exist_ok=True)  # no-op on object stores
            self.fs.pipe_file(path, bytes(data))

        await self._run(write)

    async def head(self, key: str) -> Optional[ObjectInfo]:
        try:
            info = await self._run(self.fs.info, self._path(key))
        except FileNotFoundError:
            return None
        return ObjectInfo(key, int(info.get("size") or 0))

    async def list(self, prefix: str) -> list[ObjectInfo]:
        base = self._path(prefix.rsplit("/", 1)[0]) if "/" in prefix else self.root
        try:
            found = await self._run(self.fs.find, base, detail=True)
        except FileNotFoundError:
            return []
        out = []
        strip = self.fs._strip_protocol(self.root) if self.root else ""
        for path, info in found.items():
            key = path[len(strip) :].lstrip("/") if strip else path
            if key.startswith(prefix) and info.get("type", "file") == "file":
                out.append(ObjectInfo(key, int(info.get("size") or 0)))
        return sorted(out, key=lambda o: o.key)

    async def delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            try:
                await self._run(self.fs.rm_file, self._path(k))
            except FileNotFoundError:
                pass

    def describe(self) -> str:
        return f"{self.protocol}://{self.root}"
