"""Host memory and copy streams: one budget mechanism, one pinned pool, one side stream per device.

Three places hold bytes that are not the caller's: upload staging (a part is
copied, checksummed and uploaded from a host buffer), load temporaries
(strided, partial or GPU destinations are read into a buffer, then copied),
and collective-load batches (bytes in flight between ranks).  Each is bounded
by a :class:`Budget`: staging runs at most ``slots`` parts at once, reads and
collectives are cut into ``batches`` that fit.

Staging buffers come from the process-wide :class:`HostPool` and are reused
across saves, so a job checkpointing every N steps allocates (and pins) its
staging memory once; when the last save asked for less, the surplus is freed
once every buffer is back.  Buffers are pinned when CUDA is available (DMA-
direct device-to-host copies).  After ``fork`` the child starts empty:
reusing pinned memory across fork can hand stale pages to the uploader.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


@dataclass(frozen=True)
class Budget:
    """A cap on the bytes one operation holds in its own buffers at a time."""

    nbytes: int

    def __post_init__(self) -> None:
        if self.nbytes <= 0:
            raise ValueError(f"a memory budget must be positive, got {self.nbytes}")

    def slots(self, size: int) -> int:
        """How many buffers of ``size`` bytes fit (at least one)."""
        return max(1, self.nbytes // max(size, 1))

    def batches(self, sizes: Sequence[int]) -> list[range]:
        """Consecutive runs of ``sizes`` that each fit; an item larger than the
        budget is a run of its own (it cannot be cut here)."""
        out: list[range] = []
        start, held = 0, 0
        for i, n in enumerate(sizes):
            if held + n > self.nbytes and held > 0:
                out.append(range(start, i))
                start, held = i, 0
            held += n
        if start < len(sizes):
            out.append(range(start, len(sizes)))
        return out


def plain_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s own memory holds its values as stored bytes: contiguous,
    on the CPU, no lazy conjugate or negation bit (those would need a copy)."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a :func:`plain_host` tensor, as a flat writable memoryview."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray(0))
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def want_pinned() -> bool:
    """Pin host buffers only where a device can DMA from them."""
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


class HostPool:
    """Reusable host buffers, lent against a :class:`Budget`."""

    def __init__(self, *, pin: Optional[bool] = None) -> None:
        self.pin = want_pinned() if pin is None else pin
        self._free: list[torch.Tensor] = []
        self._lent = 0
        self._keep = 0
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.allocated = 0  # bytes owned by the pool (free + lent)
        self.peak = 0  # most bytes owned at once since the last reset_peak()

    def _alloc(self, size: int) -> torch.Tensor:
        t = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        return t

    def _drop_free(self, limit: int) -> None:
        """Free idle buffers, smallest first, until at most ``limit`` bytes are owned."""
        self._free.sort(key=lambda b: b.numel())
        while self._free and self.allocated > limit:
            self.allocated -= self._free.pop(0).numel()

    def take(self, size: int, budget: Budget) -> torch.Tensor:
        """A buffer of at least ``size`` bytes; callers bound concurrency by ``budget.slots``."""
        with self._lock:
            if os.getpid() != self._pid:  # forked: forget the parent's buffers
                self._free, self.allocated, self._lent, self._pid = [], 0, 0, os.getpid()
            self._keep = budget.nbytes
            best = None
            for i, b in enumerate(self._free):  # the smallest idle buffer that fits, within the budget
                n = b.numel()
                if size <= n <= budget.nbytes and (best is None or n < self._free[best].numel()):
                    best = i
            if best is not None:
                buf = self._free.pop(best)
                self._drop_free(budget.nbytes)  # idle buffers of an earlier, larger budget
            else:  # free idle buffers rather than exceed the budget
                self._drop_free(max(budget.nbytes - size, 0))
                buf = self._alloc(max(size, 1))
            self.peak = max(self.peak, self.allocated)
            self._lent += buf.numel()
            return buf

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if os.getpid() != self._pid:
                return
            self._lent -= buf.numel()
            self._free.append(buf)
            if self._lent == 0:  # every buffer is back: keep only what the last budget allows
                self._drop_free(self._keep)

    def reset_peak(self) -> None:
        """Start measuring the peak anew (counted from the next ``take``)."""
        with self._lock:
            self.peak = 0

    def clear(self) -> None:
        """Free every idle buffer."""
        with self._lock:
            self._drop_free(0)


_pool: Optional[HostPool] = None
_pool_lock = threading.Lock()


def host_pool() -> HostPool:
    """The process-wide staging pool (a fresh one in a forked child)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool._pid != os.getpid():
            _pool = HostPool()
        return _pool


_streams: dict[int, Any] = {}


def side_stream(device: torch.device) -> Any:
    """objckpt's copy stream on ``device`` (one per device, made once): staging
    copies run there so the caller's kernels on its own stream keep running."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _streams:
        _streams[idx] = torch.cuda.Stream(device=idx)
    return _streams[idx]
