"""Host memory and copy streams: one budget per operation, one pinned pool, one side stream per device.

Four places hold bytes that are not the caller's: upload staging (a part is
copied, checksummed and uploaded from a host buffer), load temporaries
(strided, partial or cast destinations are read into a buffer, then copied),
collective-load batches (bytes in flight between ranks) and the device ring
(host slots that carry whole chunks into GPU memory).  Every operation gets
one :class:`OperationBudget`, given once (``load(..., memory_bytes=...)``,
``save(..., staging_bytes=...)``), and each of those parts draws from it: a
part sizes itself from what is left (:meth:`OperationBudget.share`) and holds
its bytes only while it uses them (:meth:`OperationBudget.hold`), so a load's
cast temporaries, its collective batch, its read temporaries and its ring
together stay within the one budget.  :class:`Budget` is the plain value the
pure planners cut batches with.

Staging buffers come from the process-wide :class:`HostPool` and are reused
across operations, so a job checkpointing every N steps allocates (and pins)
its staging memory once.  The pool's own cap on the idle buffers it keeps is
set once, when the pool is made (``$OBJCKPT_HOST_POOL_BYTES``, else
:data:`POOL_KEEP_BYTES`), and no caller changes it: a caller's budget bounds
only what that caller takes.  Buffers are pinned when CUDA is available (DMA-
direct device-to-host copies).  After ``fork`` the child starts empty:
reusing pinned memory across fork can hand stale pages to the uploader.

Every default size of the library's own buffers is named below, in one place.
"""
from __future__ import annotations

import ctypes
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

import torch

from ..errors import MemoryBudgetError
from ..units import MiB
from .env_numbers import nonnegative

# --------------------------------------------------------------------------- named defaults

#: a synchronous save's staging memory (``staging_bytes=None``; an async save stages its whole share)
SAVE_STAGING_BYTES = 512 * MiB
#: the DCP storage writer's staging memory
DCP_STAGING_BYTES = 512 * MiB
#: a load's read temporaries per batch (strided, partial or pinned-for-GPU destinations)
LOAD_TEMP_BYTES = 256 * MiB
#: a rank loading alone converts (``cast=True``) at most this many bytes of temporaries at a time
CAST_BATCH_BYTES = 256 * MiB
#: a collective load's batch (``load(..., collective_bytes=...)``)
COLLECTIVE_BYTES = 256 * MiB
#: the host ring that carries whole chunks into device memory: 32 slots, the S3 store's default
#: concurrency (fewer slots would cap the GETs in flight below what a host load keeps)
RING_BYTES = 256 * MiB
#: bytes per ring slot: one ranged GET each
RING_SLOT_BYTES = 8 * MiB
#: the smallest ring slot (and collective headroom) a load's budget may cut down to: less left
#: is an error naming the budget, not thousands of tiny GETs
MIN_SLOT_BYTES = 64 << 10
#: everything a load holds at once by default (``memory_bytes=None``): each of its parts' defaults
LOAD_MEMORY_BYTES = LOAD_TEMP_BYTES + CAST_BATCH_BYTES + COLLECTIVE_BYTES + RING_BYTES
#: ``read()`` and open checkpoints: temporaries per batch
READ_TEMP_BYTES = 64 * MiB
#: ``copy`` / ``diff`` / ``verify``: parts or tensors held at once
COPY_MEMORY_BYTES = 256 * MiB
DIFF_MEMORY_BYTES = 256 * MiB
#: a copy of the tier between ranks (``replicate``, ``repair``): its piece buffers, two per partner
#: and direction, drawn from the process-wide pool (``memory_bytes=`` overrides); pieces shrink to fit
TIER_COPY_BYTES = 64 * MiB
#: the smallest piece such a copy cuts files into: a budget without room for its buffers at this
#: size is refused before a byte moves
TIER_MIN_PIECE_BYTES = 1 * MiB
#: a drain's upload buffer (one part at a time, from the pool; ``memory_bytes=`` overrides)
DRAIN_MEMORY_BYTES = 64 * MiB
#: the idle buffers the process-wide pool keeps for the next operation, at most: this share of
#: physical memory (an async save's whole share stays pinned from one save to the next), or
#: :data:`POOL_KEEP_BYTES` where the machine does not say; ``$OBJCKPT_HOST_POOL_BYTES`` overrides
POOL_KEEP_FRACTION = 0.25
POOL_KEEP_BYTES = 4096 * MiB
POOL_KEEP_ENV = "OBJCKPT_HOST_POOL_BYTES"


def _check_budget(nbytes: int, name: str = "") -> None:
    """A budget is a positive number of bytes (``name``: which one, for the error)."""
    if nbytes <= 0:
        raise ValueError(f"{name + ': ' if name else ''}a memory budget must be positive, got {nbytes}")


@dataclass(frozen=True)
class Budget:
    """A cap on bytes, as a value: what a planner cuts batches and counts slots with."""

    nbytes: int

    def __post_init__(self) -> None:
        _check_budget(self.nbytes)

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


class OperationBudget:
    """The bytes one operation (one load, one save) may hold in its own buffers at
    once, given once and drawn from by every part of it.

    ``name`` says which budget it is (``"load memory budget (memory_bytes=67108864)"``), so an
    error can name it.  ``strict``: a piece that does not fit in what is left is a
    :class:`~objckpt.errors.MemoryBudgetError`; not strict (the defaults, where the
    caller gave no budget): the piece is taken anyway, alone, as it always was (a
    tensor larger than every default must still load), and :attr:`peak` shows it.
    Thread-safe: the ring draws on the I/O thread, fills on the caller's."""

    def __init__(self, nbytes: int, name: str, *, strict: bool = True) -> None:
        _check_budget(nbytes, name)
        self.nbytes, self.name, self.strict = nbytes, name, strict
        self.held = 0
        #: most bytes held at once
        self.peak = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"OperationBudget({self.name}, held={self.held}, peak={self.peak})"

    @property
    def value(self) -> Budget:
        """The whole budget as a plain value (what a planner counts slots with)."""
        return Budget(self.nbytes)

    def room(self) -> int:
        """Bytes not held now."""
        with self._lock:
            return max(self.nbytes - self.held, 0)

    def share(self, want: int) -> Budget:
        """A part's cap: ``want`` (its named default).  Under a budget the caller gave
        (strict), what is left when that is less (at least one byte: a part that gets
        nothing takes its pieces one at a time, and :meth:`hold` says when one of them
        cannot fit).  A default budget never shrinks a part: a load without
        ``memory_bytes`` keeps every part's default however much the others hold (a
        large cast temporary must not leave the device ring one 64 KiB slot)."""
        if not self.strict:
            return Budget(max(want, 1))
        return Budget(max(min(want, self.room()), 1))

    def draw(self, nbytes: int, what: str, *, sized: bool = False) -> None:
        """Hold ``nbytes`` more for ``what`` (named in the error when they do not fit).
        ``sized``: the part sized itself from :meth:`share` where every rank agreed on it
        (a collective batch), so it is recorded, never refused: a refusal on one rank
        alone would leave the others waiting in the collective."""
        with self._lock:
            if nbytes > 0 and self.held + nbytes > self.nbytes and self.strict and not sized:
                raise MemoryBudgetError(
                    f"{what} needs {nbytes} bytes, but only {max(self.nbytes - self.held, 0)} of the {self.name} "
                    f"({self.nbytes} bytes) are left ({self.held} held by the operation's other buffers); "
                    "give a larger budget")
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes

    @contextmanager
    def hold(self, nbytes: int, what: str, *, sized: bool = False) -> Iterator[None]:
        """``nbytes`` held for ``what`` while the block runs (``sized``: see :meth:`draw`)."""
        self.draw(nbytes, what, sized=sized)
        try:
            yield
        finally:
            self.release(nbytes)


AnyBudget = Union[Budget, OperationBudget]


def operation_budget(budget: AnyBudget, name: str) -> OperationBudget:
    """``budget`` as an :class:`OperationBudget` (a plain :class:`Budget` becomes a
    lenient one of its size, for callers that give only a value)."""
    return budget if isinstance(budget, OperationBudget) else OperationBudget(budget.nbytes, name, strict=False)


def positive_bytes(value: Any, name: str, *, optional: bool = False) -> Optional[int]:
    """``value`` when it is a positive whole number of bytes (or None, where ``optional``);
    anything else is a ValueError naming the option ``name`` (the one check every
    ``memory_bytes``-like option makes)."""
    if value is None and optional:
        return None
    if not (isinstance(value, int) and value > 0):
        raise ValueError(f"{name} must be a positive number of bytes{' or None' if optional else ''}, got {value!r}")
    return value


def given_or_default(what: str, given: Optional[int], default: int, *, option: str = "memory_bytes",
                     strict_default: bool = False) -> OperationBudget:
    """One operation's budget, named for its errors: ``given`` (the caller's, always strict:
    ``"<what> (<option>=<given>)"``), else ``default`` (``"<what> (default <n> bytes)"``,
    lenient unless ``strict_default``: a piece larger than a default is taken alone, as it
    always was).  Checking that ``given`` is positive is the options' job; here anything
    below one byte counts as one."""
    if given is not None:
        return OperationBudget(max(given, 1), f"{what} ({option}={given})")
    return OperationBudget(max(default, 1), f"{what} (default {default} bytes)", strict=strict_default)


def load_budget(memory_bytes: Optional[int] = None, collective_bytes: int = COLLECTIVE_BYTES) -> OperationBudget:
    """A load's one budget: ``memory_bytes`` when given (strict), else the sum of its
    parts' defaults with ``collective_bytes`` for the collective batch (lenient: a
    load that worked before still works)."""
    return given_or_default("load memory budget", memory_bytes,
                            LOAD_MEMORY_BYTES - COLLECTIVE_BYTES + max(collective_bytes, 1))


def save_budget(staging_bytes: Optional[int], default: int = SAVE_STAGING_BYTES) -> OperationBudget:
    """A save's one staging budget: ``staging_bytes`` when given (strict: a part to stage
    that is larger is refused before anything is written, see
    :func:`objckpt.save.upload.refuse_unstageable`), else ``default`` (lenient: a part
    larger than the whole budget is staged alone, as it always was)."""
    return given_or_default("save staging budget", staging_bytes, default, option="staging_bytes")


def plain_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s own memory holds its values as stored bytes: contiguous,
    on the CPU, no lazy conjugate or negation bit (those would need a copy)."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


#: ``ctypes.c_char * n`` by size ``n``: the array types :func:`host_bytes` views memory through
_BYTE_ARRAYS: dict[int, Any] = {}
_BYTE_ARRAY_TYPES_KEPT = 4096


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a :func:`plain_host` tensor, as a flat writable memoryview.

    A ctypes array over the tensor's memory (its ``data_ptr``) that holds a reference to
    its storage, so the view keeps the memory alive as a numpy view would: ~2 us where
    detach, reshape, a uint8 view and numpy cost ~8 (a save of 3,200 tensors: 27 -> 8 ms)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    kind = _BYTE_ARRAYS.get(n)
    if kind is None:
        if len(_BYTE_ARRAYS) >= _BYTE_ARRAY_TYPES_KEPT:
            _BYTE_ARRAYS.clear()
        kind = _BYTE_ARRAYS[n] = ctypes.c_char * n
    arr: Any = kind.from_address(t.data_ptr())
    # the memory's owner lives as long as the array and every view of it: the storage, not the
    # tensor object (as a numpy view held a derived tensor: the caller's tensor may go meanwhile)
    arr._objckpt_storage = t.untyped_storage()
    return memoryview(arr).cast("B")


def want_pinned() -> bool:
    """Pin host buffers only where a device can DMA from them."""
    try:
        return torch.cuda.is_available()
    except Exception:
        return False


def pool_keep_bytes() -> int:
    """The pool's cap on idle buffers: ``$OBJCKPT_HOST_POOL_BYTES`` (bytes; 0 keeps none), else
    :data:`POOL_KEEP_FRACTION` of physical memory divided among the node's processes
    (``LOCAL_WORLD_SIZE``).  Read once, when the pool is made."""
    given = nonnegative(POOL_KEEP_ENV, "a number of bytes (0 or more)")
    if given is None:
        # each of a node's processes keeps its share of the fraction, not the whole of it
        # (torchrun's LOCAL_WORLD_SIZE: 8 ranks a node must not each pin a quarter of RAM)
        try:
            local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
        except ValueError:
            local = 1
        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * POOL_KEEP_FRACTION) // local
        except (AttributeError, ValueError, OSError):
            return POOL_KEEP_BYTES
    return given


class HostPool:
    """Reusable host buffers.

    ``keep``: the most bytes the pool owns when nothing is lent (idle buffers for the
    next operation), fixed when the pool is made.  A caller's :class:`Budget` bounds
    only the buffers that caller is handed (never one larger than its budget); it does
    not change what the pool keeps for everyone else."""

    def __init__(self, *, pin: Optional[bool] = None, keep: Optional[int] = None) -> None:
        self.pin = want_pinned() if pin is None else pin
        self.keep = pool_keep_bytes() if keep is None else keep
        self._free: list[torch.Tensor] = []
        self._lent = 0
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.allocated = 0  # bytes owned by the pool (free + lent): at most max(keep, lent + one buffer)
        self.peak = 0  # most bytes lent at once (what its callers held) since the last reset_peak()

    def _alloc(self, size: int) -> torch.Tensor:
        t = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        self.allocated += size
        return t

    def _drop_free(self, limit: int) -> None:
        """Free idle buffers, smallest first, until at most ``limit`` bytes are owned."""
        self._free.sort(key=lambda b: b.numel())
        while self._free and self.allocated > limit:
            self.allocated -= self._free.pop(0).numel()

    def take(self, size: int, budget: AnyBudget) -> torch.Tensor:
        """A buffer of at least ``size`` bytes and at most the caller's ``budget`` (unless
        ``size`` itself is larger); callers bound how many they hold by ``budget.slots``."""
        with self._lock:
            if os.getpid() != self._pid:  # forked: forget the parent's buffers
                self._free, self.allocated, self._lent, self._pid = [], 0, 0, os.getpid()
            best = None
            for i, b in enumerate(self._free):  # the smallest idle buffer that fits, within the caller's budget
                n = b.numel()
                if size <= n <= max(budget.nbytes, size) and (best is None or n < self._free[best].numel()):
                    best = i
            if best is not None:
                buf = self._free.pop(best)
            else:  # idle buffers that serve nobody now make room rather than grow the pool past its cap
                self._drop_free(max(self.keep - size, 0))
                buf = self._alloc(max(size, 1))
            self._lent += buf.numel()
            self.peak = max(self.peak, self._lent)
            return buf

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if os.getpid() != self._pid:
                return
            self._lent -= buf.numel()
            self._free.append(buf)
            if self._lent == 0:  # every buffer is back: keep what the pool's own cap allows
                self._drop_free(self.keep)

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
