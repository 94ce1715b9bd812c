"""Fresh load destinations: fewer, larger page faults (and, optionally, pre-faulting).

A restarting job loads into tensors it has just allocated (``torch.empty``,
``to_empty`` of a meta-built model): none of their pages exists yet.  The first
write to each 4 KiB page faults and the kernel zeroes it, about 0.3-0.4 s per
GiB on one core (much more on a VM whose host reclaimed the memory).

Where transparent huge pages are on "madvise" (the common default), large
fresh destinations are advised ``MADV_HUGEPAGE`` (:func:`start`): the kernel
then maps them 2 MiB at a time, 512 times fewer faults.  The advice only
changes how the memory is backed, never its contents.  By default that is all:
each page is zeroed by the thread that receives its first bytes, right before
it writes them.

Not on a virtual machine whose balloon reports free pages to its host
(virtio ``VIRTIO_BALLOON_F_REPORTING``, as on the development machine): the guest hands
its free 2 MiB blocks back, the host drops them, and a huge page is then
taken from exactly such a block, so the host has to fault in and zero all of
it again underneath the guest's own zeroing.  Measured on one (2 cores,
1.03 GiB, new processes alternated): writing fresh destinations cost 0.78-0.80
CPU-s/GB with 4 KiB pages and 1.02-1.69 with the advice; a cold restore took
0.84-0.95 s and 1.02-1.16 CPU-s/GB without the advice, 1.15-1.47 s and 1.50-2.04
with it.  (Reloads within a second of freeing the previous destinations gain
from the advice there, 0.54-0.68 s against 0.73-0.98 s, because freshly freed
blocks have not been reported yet; a restarting job's first load is not that
case.)  :func:`huge_pages_wanted` therefore advises only where no such balloon
is found; ``OBJCKPT_HUGE_PAGES`` (``auto``, ``on``, ``off``) overrides it.

Pre-faulting from other threads (:data:`POPULATE`) is off: it takes the zeroing
off the receiving threads, and on an idle second core that can shorten the
first load of a process, but it costs more CPU.  1.03 GiB loads into fresh
tensors from a local server (2 cores, one run each, new processes alternated),
CPU-s/GB warm / cold and wall: populating threads 0.66 / 1.17, 0.66 s warm;
advice only 0.62 / 1.01-1.10, 0.63-0.66 s; neither 0.85 / 1.08, 0.80 s.  In
``bench_cold_warm`` (8 rounds, benchmarks/results/cpu-populate.json): advice
only 0.38 / 1.06 CPU-s/GB, cold wall 1.51 s; with populating 0.42 / 1.24, 1.23 s.
Populating only the destinations too small for huge pages did not pay either
(0.60 vs 0.55).  With :data:`POPULATE` on,
:func:`start` populates the pages from other threads, in the order the
requests were issued, while the responses are still coming:
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) maps each page writable *without
writing to it*, so it cannot race with the bytes the receiver stores (a thread
that touched the pages by writing could overwrite data already received).
Where the call is missing (other systems, older kernels) nothing is populated.
Pieces whose first and last pages are present already (a template loaded into
before) are skipped after two ``mincore`` probes.

Small destinations are populated ahead, though (:data:`SMALL_AHEAD`, on): a state of
thousands of small tensors (64 KiB each, too small for huge pages) spends the start of
its load on metadata (the manifest's decode, the template's match), Python that holds
the interpreter on one core while the other idles, and its fresh pages (51,200 for
200 MiB) were faulted in only once the bytes arrived.  :func:`begin` hands them to one
background thread that populates them meanwhile, merged into runs of adjacent
allocations (:func:`runs`: a few calls of at most :data:`STEP` bytes, not one per
tensor; small steps, because each call holds the process's memory-map lock, which the
decoding thread's allocations wait for: 2-6 ms of such waits with 8 MiB steps against
20-27 ms with 32 MiB ones, measured beside an allocating decode).  A run every page of
which is mapped already (one ``mincore``: a template loaded into before; the allocator's
headers between small tensors are written on allocation, so probing a run's ends would
find it mapped) starts no thread, and the fill cancels what is left when it starts.
The gain is the idle core's, so it is none where no core idles.  Measured on the
development VM while other work loaded it (2 cores, load average 1.3-2.6; 3,200 fresh
64 KiB tensors, 12 new processes each, alternated, medians): the first load took 0.417 s
without and 0.380-0.390 s with it (4-32 MiB steps), and, more loaded, 0.506 s against
0.504 s (8 MiB): the decode ended ~0.09 s later (the populating thread took the core it
would have had) and the fill took ~0.1 s less.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import glob
import os
import sys
import threading
from typing import Any, Iterable, Iterator, Optional

import torch

from ..runtime.memory import host_bytes, plain_host
from ..options import switch_word

_MADV_POPULATE_WRITE = 23
_MADV_HUGEPAGE = 14
_HUGE = 2 << 20
#: advise huge pages for fresh destinations of at least this size
HUGE_MIN = 4 << 20
#: at most this many regions get the advice per load (each may split a mapping in three)
HUGE_MAX_REGIONS = 4096
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: bytes per madvise call: small enough that the populating threads stay just ahead of the data
STEP = 8 << 20
#: switch for all of it, huge-page advice included (benchmarks compare loads with and without)
ENABLED = True
#: also populate the pages from other threads (see the module docstring: off, it costs more CPU)
POPULATE = False
#: loads smaller than this are not worth the threads
MIN_BYTES = 32 << 20
#: populate the small fresh destinations (below :data:`HUGE_MIN`) from a background thread while
#: the load reads its metadata (see the module docstring)
SMALL_AHEAD = True

#: the environment variable choosing the huge-page advice (read at every load)
HUGE_PAGES_ENV = "OBJCKPT_HUGE_PAGES"
#: virtio device id of a memory balloon, and its free page reporting feature bit
_BALLOON_DEVICE = 0x5
_BALLOON_F_REPORTING = 5

_lock = threading.Lock()
_madvise: Optional[ctypes._CFuncPtr] = None  # type: ignore[name-defined]
_supported: Optional[bool] = None if sys.platform.startswith("linux") else False
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _threads() -> int:
    """Populating threads: one core is left to the receiving event loop."""
    return max(1, min(4, (os.cpu_count() or 2) - 1))


def _get_madvise() -> Optional[ctypes._CFuncPtr]:  # type: ignore[name-defined]
    global _madvise, _supported
    if _supported is False:
        return None
    if _madvise is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            _supported = False
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    return _madvise


_mincore: Optional[ctypes._CFuncPtr] = None  # type: ignore[name-defined]


@functools.lru_cache(maxsize=None)
def host_takes_free_pages(sysfs: str = "/sys") -> bool:
    """Whether a virtio balloon reports this guest's free pages to its host (the host
    then drops them, and the guest's next use of such memory is faulted in again
    underneath).  Read once from sysfs: the device's ``features`` file lists the
    negotiated feature bits as '0'/'1' characters, bit 0 first.  False where sysfs
    has no virtio bus (bare metal, other systems)."""
    for dev in glob.glob(os.path.join(sysfs, "bus", "virtio", "devices", "*")):
        try:
            with open(os.path.join(dev, "device")) as f:
                if int(f.read().strip(), 16) != _BALLOON_DEVICE:
                    continue
            with open(os.path.join(dev, "features")) as f:
                bits = f.read().strip()
        except (OSError, ValueError):
            continue
        if len(bits) > _BALLOON_F_REPORTING and bits[_BALLOON_F_REPORTING] == "1":
            return True
    return False


def huge_pages_wanted() -> bool:
    """Whether large fresh destinations get ``MADV_HUGEPAGE``: ``OBJCKPT_HUGE_PAGES``
    says ``on`` or ``off``; unset or ``auto``, yes unless :func:`host_takes_free_pages`
    (see the module docstring for why and what it measured).  Read at every load, so a
    change between calls takes effect."""
    raw = os.environ.get(HUGE_PAGES_ENV, "auto")
    said = switch_word(raw)
    if said is not None:
        return said
    if raw.strip().lower() in ("", "auto"):
        return not host_takes_free_pages()
    raise ValueError(f"{HUGE_PAGES_ENV}={raw!r}: expected auto, on (1/true/yes) or off (0/false/no)")


def _resident(addr: int) -> bool:
    """Whether the page holding ``addr`` is mapped already (``mincore``); False when unknown."""
    global _mincore
    if _mincore is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).mincore
        except (OSError, AttributeError):
            return False
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        fn.restype = ctypes.c_int
        _mincore = fn
    vec = ctypes.create_string_buffer(1)
    return _mincore(addr & ~(_PAGE - 1), _PAGE, vec) == 0 and bool(vec.raw[0] & 1)


#: mincore's answer per page with only its "resident" bit kept (the others are reserved)
_RESIDENT_BIT = bytes(b & 1 for b in range(256))


def _all_resident(addr: int, length: int) -> bool:
    """Whether every page holding [addr, addr + length) is mapped already (one ``mincore``);
    False when unknown.  Small destinations share pages with their allocator's headers, which
    are written on allocation: a probe of a run's first and last pages would find them mapped."""
    if length <= 0:
        return True
    if _mincore is None and not _resident(addr):  # (loads mincore)
        return False
    start = addr & ~(_PAGE - 1)
    pages = (addr + length - start + _PAGE - 1) // _PAGE
    vec = ctypes.create_string_buffer(pages)
    if _mincore is None or _mincore(start, pages * _PAGE, vec) != 0:
        return False
    return b"\x00" not in vec.raw[:pages].translate(_RESIDENT_BIT)


def _populate(addr: int, length: int) -> bool:
    """MADV_POPULATE_WRITE over the pages holding [addr, addr + length); False when the
    kernel does not know the advice (then it is never tried again)."""
    global _supported
    fn = _get_madvise()
    if fn is None or length <= 0:
        return False
    start = addr & ~(_PAGE - 1)
    end = (addr + length + _PAGE - 1) & ~(_PAGE - 1)
    if fn(start, end - start, _MADV_POPULATE_WRITE) != 0:
        if ctypes.get_errno() == 22:  # EINVAL: advice unknown to this kernel
            _supported = False
        return False  # ENOMEM / EFAULT / EHWPOISON: the receiver will fault as usual
    _supported = True
    return True


def _advise_huge(regions: list[tuple[int, int]]) -> None:
    """MADV_HUGEPAGE over the 2 MiB-aligned inside of large regions not yet mapped."""
    fn = _get_madvise()
    if fn is None:
        return
    done = 0
    for addr, n in regions:
        if n < HUGE_MIN:
            continue
        start = (addr + _HUGE - 1) & ~(_HUGE - 1)
        end = (addr + n) & ~(_HUGE - 1)
        # (the region's own first page may hold the allocator's header: probe inside)
        if end > start and not _resident(start):
            fn(start, end - start, _MADV_HUGEPAGE)  # refused (no THP): nothing changes
            done += 1
            if done >= HUGE_MAX_REGIONS:
                return


def address(view: memoryview) -> int:
    """The address of a writable, contiguous buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _pieces(regions: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Regions cut into ``STEP``-sized pieces, in order."""
    out = []
    for addr, n in regions:
        for off in range(0, n, STEP):
            out.append((addr + off, min(STEP, n - off)))
    return out


class Prefault:
    """Threads populating pieces in order; :meth:`cancel` makes them give up what is left."""

    def __init__(self, pieces: list[tuple[int, int]], every_page: bool = False) -> None:
        self._pieces = pieces
        #: skip a piece only when every page of it is mapped (else: its first and last)
        self._every_page = every_page
        self._next = 0
        self._lock = threading.Lock()
        self._stopped = False
        self.futures: list[concurrent.futures.Future] = []

    def _work(self) -> None:
        while True:
            with self._lock:
                if self._stopped or self._next >= len(self._pieces):
                    return
                addr, n = self._pieces[self._next]
                self._next += 1
            # A piece whose first and last pages are there already (a template loaded into
            # before) is skipped: populating it would walk its page tables for nothing.
            if _all_resident(addr, n) if self._every_page else (_resident(addr) and _resident(addr + n - 1)):
                continue
            if not _populate(addr, n) and _supported is False:
                return

    def cancel(self) -> None:
        """Populate nothing more (the pieces being populated finish)."""
        with self._lock:
            self._stopped = True

    def close(self) -> None:
        """:meth:`finish`, from outside the event loop."""
        self.cancel()
        concurrent.futures.wait(self.futures)

    async def finish(self) -> None:
        """Cancel and wait for the threads: the memory must stay valid while one is
        inside madvise for it."""
        self.cancel()
        await asyncio.gather(*(asyncio.wrap_future(f) for f in self.futures), return_exceptions=True)


def start(views: Iterable[memoryview]) -> Optional[Prefault]:
    """Advise huge pages for the large fresh ones of ``views`` (when they total at least
    :data:`MIN_BYTES`); with :data:`POPULATE`, also populate their pages (in this order)
    from background threads.  None when no
    thread was started.  Await :meth:`Prefault.finish` before the buffers may be freed."""
    global _pool
    huge = huge_pages_wanted()  # first: a misspelt setting is reported on every load, small ones too
    if _supported is False or not ENABLED:
        return None
    try:
        regions = [(address(v), len(v)) for v in views if len(v) and not v.readonly]
    except Exception:  # noqa: BLE001 - an odd buffer or template: the load itself will say what is wrong
        return None
    if sum(n for _, n in regions) < MIN_BYTES or _get_madvise() is None:
        return None
    if HUGE_MIN > 0 and huge:
        _advise_huge(regions)
    if not POPULATE:
        return None
    job = Prefault(_pieces(regions))
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=_threads(), thread_name_prefix="objckpt-prefault")
        job.futures = [_pool.submit(job._work) for _ in range(_threads())]
    return job


#: tensors that are their own local part
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _host_local(t: Any) -> Optional[torch.Tensor]:
    """The CPU memory of a template tensor (a DTensor's local shard) that a load may write in
    place; None when there is none."""
    if type(t) in _PLAIN:  # most leaves: checked in as few steps as it takes (plain_host, without device.type)
        return t if t.is_cpu and t.numel() and t.is_contiguous() and not t.is_conj() and not t.is_neg() else None
    local = t.to_local() if hasattr(t, "to_local") else getattr(t, "local", t)  # DTensor, objckpt.Shard
    if isinstance(local, torch.Tensor) and local.numel() and plain_host(local) and not local.is_meta:
        return local
    return None


def begin(tensors: Iterable[Any]) -> Optional[Prefault]:
    """A load's start, before its metadata is read, for the template's ``tensors``: the large
    fresh ones advised huge pages (:func:`start`), and with :data:`SMALL_AHEAD` the small
    fresh ones populated by a background thread (:func:`populate_small`).  None when no
    thread was started; else close it before the template may be freed."""
    below = HUGE_MIN if SMALL_AHEAD and not POPULATE else 0
    at_least = smallest_used()
    large: list[memoryview] = []
    small: list[tuple[int, int]] = []
    try:
        for t in tensors:
            local = _host_local(t)
            if local is None:
                continue
            n = local.nbytes
            if n < below:
                small.append((local.data_ptr(), n))
            elif n >= at_least:
                large.append(host_bytes(local))
    except Exception:  # noqa: BLE001 - an odd template: the load itself will say what is wrong
        large, small = [], []
    job = start(large)  # first: it reports a misspelt OBJCKPT_HUGE_PAGES, on every load
    return job if job is not None else populate_small(small)


def runs(regions: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(address, length)`` regions merged into runs, in address order, where they lie at most a
    page apart: a state of thousands of small tensors allocated one after the other is a few
    runs.  (Populating the few bytes between two, an allocator's header, changes nothing.)"""
    out: list[list[int]] = []
    for a, n in sorted(regions):
        if out and a - out[-1][1] <= _PAGE:
            out[-1][1] = max(out[-1][1], a + n)
        else:
            out.append([a, a + n])
    return [(a, e - a) for a, e in out]


def populate_small(regions: list[tuple[int, int]]) -> Optional[Prefault]:
    """Populate the pages of ``regions`` (small destinations: fewer than :data:`HUGE_MIN` bytes
    each) from a background thread, merged into runs (:func:`runs`) and cut into
    :data:`STEP` pieces; None when they total less than :data:`MIN_BYTES`, or where
    ``MADV_POPULATE_WRITE`` is unknown, or when every page of them is mapped already (a
    template loaded into before: then no thread is started)."""
    global _pool
    if (not SMALL_AHEAD or _supported is False or not ENABLED or sum(n for _, n in regions) < MIN_BYTES
            or _get_madvise() is None):
        return None
    pieces = [(a + off, min(STEP, n - off)) for a, n in runs(regions) for off in range(0, n, STEP)]
    pieces = [(a, n) for a, n in pieces if not _all_resident(a, n)]
    if not pieces:
        return None  # loaded into before: no thread
    job = Prefault(pieces, every_page=True)
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=_threads(), thread_name_prefix="objckpt-prefault")
        job.futures = [_pool.submit(job._work)]  # one thread: in address order, a core the metadata leaves idle
    return job


def tensor_memory(tensors: Iterable[Any], at_least: int = 0) -> Iterator[memoryview]:
    """The bytes of each CPU tensor (a DTensor's local shard) that a load may write in place,
    of those holding at least ``at_least`` bytes (the others are not even viewed: a state of
    thousands of small tensors would pay ~10 us a view for nothing)."""
    for t in tensors:
        local = _host_local(t)
        if local is not None and local.nbytes >= at_least:
            yield host_bytes(local)


def smallest_used() -> int:
    """The size below which :func:`start` does nothing with a destination: with
    :data:`POPULATE` off (the default) only destinations of :data:`HUGE_MIN` bytes or more
    are advised, so only those need be handed to it."""
    return 0 if POPULATE or HUGE_MIN <= 0 else HUGE_MIN


def _after_fork_in_child() -> None:
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
