"""In-process object store: for tests and examples, never for real checkpoints.

``memory://NAME/prefix`` URIs in one process share the namespace ``NAME``.
"""
from __future__ import annotations

import threading
from typing import Optional, Sequence

from ..errors import PreconditionFailed
from .base import ObjectInfo, ObjectStore, not_found

_NAMESPACES: dict[str, dict[str, bytes]] = {}
_NS_LOCK = threading.Lock()


def namespace(name: str) -> dict[str, bytes]:
    with _NS_LOCK:
        return _NAMESPACES.setdefault(name, {})


class MemoryStore(ObjectStore):
    min_part_size = 1  # no multipart protocol to satisfy
    if_absent_enforced = True  # one process's dict: put(if_absent=True) checks and writes with no await between

    def __init__(self, objects: Optional[dict[str, bytes]] = None, name: str = "") -> None:
        self.objects: dict[str, bytes] = {} if objects is None else objects
        self.name = name

    async def get(self, key: str) -> bytes:
        try:
            return self.objects[key]
        except KeyError:
            raise not_found(key) from None

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        data = await self.get(key)
        return data[offset : offset + length]

    async def put(self, key: str, data: memoryview | bytes, *, if_absent: bool = False) -> None:
        if if_absent and key in self.objects:
            raise PreconditionFailed(f"object {key!r} already exists")
        self.objects[key] = bytes(data)

    async def head(self, key: str) -> Optional[ObjectInfo]:
        d = self.objects.get(key)
        return None if d is None else ObjectInfo(key, len(d))

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return [ObjectInfo(k, len(v)) for k, v in sorted(self.objects.items()) if k.startswith(prefix)]

    async def delete(self, keys: Sequence[str]) -> None:
        for k in keys:
            self.objects.pop(k, None)

    def describe(self) -> str:
        return f"memory://{self.name}"
