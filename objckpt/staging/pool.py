"""A bounded pool of reusable host buffers.

Saves stage every upload part into one of these buffers: copy (GPU or CPU ->
host), checksum, upload, release.  The pool caps host memory at about
``budget`` bytes however large the state is, and keeps buffers across saves
so a training job does not allocate (or pin) gigabytes every checkpoint.
Buffers are pinned when CUDA is available, which makes device-to-host copies
DMA-direct.  A pool is tied to the process that created it: after ``fork`` the
child starts with an empty one (reusing pinned memory across fork can hand
stale pages to the uploader).
"""
from __future__ import annotations

import os
import threading
from typing import Optional

import torch


def _want_pinned() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


class BufferPool:
    def __init__(self, budget: int, *, pin: Optional[bool] = None) -> None:
        self.budget = budget
        self.pin = _want_pinned() if pin is None else pin
        self._free: list[torch.Tensor] = []
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.allocated = 0  # bytes currently owned by the pool (free + lent)
        self.peak = 0

    def _alloc(self, size: int) -> torch.Tensor:
        t = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        return t

    def slots(self, size: int) -> int:
        """How many buffers of ``size`` bytes fit in the budget (at least one)."""
        return max(1, self.budget // max(size, 1))

    def take(self, size: int) -> torch.Tensor:
        """A buffer of at least ``size`` bytes (callers bound concurrency by :meth:`slots`)."""
        with self._lock:
            if os.getpid() != self._pid:  # forked: forget the parent's buffers
                self._free, self.allocated, self._pid = [], 0, os.getpid()
            best = None
            for i, b in enumerate(self._free):
                if b.numel() >= size and (best is None or b.numel() < self._free[best].numel()):
                    best = i
            if best is not None:
                return self._free.pop(best)
            # drop free buffers that are too small rather than exceed the budget
            while self._free and self.allocated + size > self.budget:
                self.allocated -= self._free.pop(0).numel()
            return self._alloc(max(size, 1))

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if os.getpid() == self._pid:
                self._free.append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.allocated = 0


_pools: dict[int, BufferPool] = {}
_pools_lock = threading.Lock()


def default_pool(budget: int) -> BufferPool:
    """The process-wide pool for ``budget`` bytes, reused by every save that asks for
    the same budget (a training job checkpointing every N steps allocates, and pins,
    its staging memory once)."""
    with _pools_lock:
        pool = _pools.get(budget)
        if pool is None or pool._pid != os.getpid():
            pool = _pools[budget] = BufferPool(budget)
        return pool
