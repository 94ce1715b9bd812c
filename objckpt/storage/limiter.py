"""An AIMD limit on the requests one store has in flight.

When the server throttles (503 SlowDown, 429), sending as many requests as
before only earns more refusals, each one a wasted request and a backoff.
Like TCP congestion control, the limit halves on throttling (multiplicative
decrease; only refusals of requests sent after the last cut count, so one
burst of refusals counts once, and ``cooldown`` spaces cuts further) and grows
by one after each ``limit`` successes (additive increase), back up to its
ceiling.  Changes are logged at WARNING on ``objckpt.storage``.
"""
from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Optional

from ..logs import get_logger

log = get_logger("objckpt.storage")


class AimdLimiter:
    """``async with limiter:`` around one request; ``throttled()`` / ``succeeded()`` after it."""

    def __init__(self, ceiling: int, *, floor: int = 1, cooldown: float = 0.0, name: str = "") -> None:
        if ceiling < 1 or floor < 1 or floor > ceiling:
            raise ValueError(f"AimdLimiter: need 1 <= floor <= ceiling, got floor={floor} ceiling={ceiling}")
        self.ceiling, self.floor, self.cooldown, self.name = ceiling, floor, cooldown, name
        self.limit = ceiling
        self.in_flight = 0
        self._successes = 0
        self._last_cut = -float("inf")
        self._cond: Optional[asyncio.Condition] = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:  # made on first use, on the loop that uses it
            self._cond = asyncio.Condition()
        return self._cond

    async def __aenter__(self) -> "AimdLimiter":
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self.in_flight < self.limit)
            self.in_flight += 1
        return self

    async def __aexit__(self, et: Optional[type], e: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        cond = self._condition()
        async with cond:
            self.in_flight -= 1
            cond.notify_all()

    def throttled(self, sent_at: Optional[float] = None) -> None:
        """The server refused a request for load: halve the limit.

        ``sent_at`` (``time.monotonic()`` when the request was sent): a refusal
        of a request sent before the last cut says nothing about the new limit."""
        now = time.monotonic()
        if sent_at is not None and sent_at < self._last_cut:
            return
        if now - self._last_cut < self.cooldown or self.limit <= self.floor:
            return
        old, self.limit = self.limit, max(self.floor, self.limit // 2)
        self._last_cut, self._successes = now, 0
        log.warning("%s throttled by the server: requests in flight %d -> %d", self.name or "store", old, self.limit)

    def succeeded(self) -> None:
        """A request succeeded: after ``limit`` of them, allow one more in flight."""
        if self.limit >= self.ceiling:
            return
        self._successes += 1
        if self._successes >= self.limit:
            self._successes = 0
            self.limit += 1
            if self._cond is not None:
                self._wake()
            if self.limit == self.ceiling:
                log.warning("%s: requests in flight back to %d", self.name or "store", self.limit)

    def _wake(self) -> None:
        cond = self._condition()

        async def wake() -> None:
            async with cond:
                cond.notify_all()

        asyncio.ensure_future(wake())
