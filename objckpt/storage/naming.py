"""A store that remembers which object a failed read was for.

A collective load reports, on every rank, which rank failed and on which
object; the read path underneath raises whatever the backend raised, which
does not always name the object.  Wrapping the store records it.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence


class NamingStore:
    """Delegates to a store, remembering the first object whose read failed (for error messages)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.failed: Optional[str] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _note(self, key: str) -> None:
        if self.failed is None:
            self.failed = key

    async def get(self, key: str) -> bytes:
        try:
            return await self._inner.get(key)
        except BaseException:
            self._note(key)
            raise

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            return await self._inner.get_range(key, offset, length)
        except BaseException:
            self._note(key)
            raise

    async def get_range_into(self, key: str, offset: int, out: memoryview) -> None:
        try:
            await self._inner.get_range_into(key, offset, out)
        except BaseException:
            self._note(key)
            raise

    async def get_range_scatter(self, key: str, offset: int, outs: Sequence[memoryview]) -> None:
        try:
            await self._inner.get_range_scatter(key, offset, outs)
        except BaseException:
            self._note(key)
            raise

    async def get_range_tallied(self, key: str, offset: int, outs: Sequence[memoryview], tally: Any) -> None:
        """The inner store's ``get_range_tallied`` (a plain scatter where it has none:
        ``tally`` then stays incomplete and the reader hashes the bytes itself)."""
        tallied = getattr(self._inner, "get_range_tallied", None)
        try:
            if tallied is None:
                await self._inner.get_range_scatter(key, offset, outs)
            else:
                await tallied(key, offset, outs, tally)
        except BaseException:
            self._note(key)
            raise
