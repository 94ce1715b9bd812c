"""crc32c over buffers (hardware-accelerated, GIL released), and combining.

Chunks carry one crc32c over their bytes and, when larger than the crc block,
one per block (so a partial read can be verified).  The chunk crc is combined
from the block crcs instead of hashing the bytes twice: ``crc(A+B)`` follows
from ``crc(A)``, ``crc(B)`` and ``len(B)`` by multiplying with the GF(2)
operator that appends ``len(B)`` zero bytes (as zlib's ``crc32_combine``); the
operator for each power of two is computed once and cached.

:class:`CellCrcs` hashes a byte stream while it is being written (a ranged
GET landing in its destinations): each received piece is hashed right after
the kernel copied it, while it is still in the CPU cache, at about twice the
speed of a later pass over the same bytes in memory (22 vs 11 GB/s measured).
"""
from __future__ import annotations

import base64
import logging
import os
from functools import lru_cache
from typing import Any, Callable, Iterable, Optional, Sequence

import crc32c as _crc32c

_POLY = 0x82F63B78  # Castagnoli, reflected

log = logging.getLogger("objckpt.checksum")

#: the ``crc32c`` package: the reference, and the implementation where no faster one is installed
REFERENCE = _crc32c.crc32c


def _agrees(fn: Callable[..., int]) -> bool:
    """``fn`` gives the reference's crc on the check value and on every length 0..1040 of
    one pattern, continued from a non-zero crc and at every alignment the SIMD paths split
    on (a build that miscomputes must not be the one that both writes and verifies)."""
    if fn(b"123456789") != 0xE3069283:  # RFC 3720's check value
        return False
    data = memoryview(bytes((i * 131 + 7) & 0xFF for i in range(4096 + 64)))
    for n in (*range(0, 300), 511, 512, 513, 1023, 1024, 1040, 4096):
        for at in (0, 1, 7, 33):
            if fn(data[at:at + n], 0x1EDC6F41) != REFERENCE(data[at:at + n], 0x1EDC6F41):
                return False
    return True


#: ``auto`` (the default): ``crc32c_rs`` where it is installed and agrees, else the
#: ``crc32c`` package; ``crc32c``: the package always (read once, at import)
IMPLEMENTATION_ENV = "OBJCKPT_CRC32C"


def _fastest() -> tuple[Callable[..., int], str]:
    """``crc32c_rs`` where it is installed and agrees with the reference: its AVX-512 /
    VPCLMULQDQ kernels hash cached bytes ~3.5x as fast as the ``crc32c`` package's SSE4.2
    one (37 vs 10 GB/s measured, benchmarks/bench_crc32c.py), which is what a restore
    that verifies every byte spends most of its time on beside the copy itself.
    Else (Python < 3.11, a build that disagrees, or ``OBJCKPT_CRC32C=crc32c``) the
    ``crc32c`` package."""
    choice = os.environ.get(IMPLEMENTATION_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "crc32c"):
        raise ValueError(f"{IMPLEMENTATION_ENV}={os.environ[IMPLEMENTATION_ENV]!r}: expected 'auto' or 'crc32c'")
    if choice == "crc32c":
        return REFERENCE, "crc32c"
    try:
        import crc32c_rs
    except ImportError:
        return REFERENCE, "crc32c"
    fn: Any = crc32c_rs.crc32c
    try:
        ok = _agrees(fn)
    except Exception:  # a build that cannot run on this CPU
        ok = False
    if not ok:
        log.warning("crc32c_rs %s disagrees with the crc32c package on this machine; using crc32c",
                    getattr(crc32c_rs, "__version__", "?"))
        return REFERENCE, "crc32c"
    return fn, "crc32c_rs"


_impl, IMPLEMENTATION = _fastest()


def crc32c(data: memoryview | bytes | bytearray, value: int = 0) -> int:
    """crc32c of ``data`` continuing from ``value`` (0 to start); the GIL is released for
    large buffers by both implementations, so threads hash in parallel."""
    return _impl(data, value)


def _times(mat: Sequence[int], vec: int) -> int:
    s, i = 0, 0
    while vec:
        if vec & 1:
            s ^= mat[i]
        vec >>= 1
        i += 1
    return s


def _square(mat: Sequence[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


@lru_cache(maxsize=None)
def _pow2_operator(i: int) -> tuple[int, ...]:
    """The operator that appends ``2**i`` zero bytes to a crc state (each one cached)."""
    if i == 0:
        op = [_POLY] + [1 << n for n in range(31)]  # one zero bit
        for _ in range(3):
            op = _square(op)  # 8 zero bits = one zero byte
        return tuple(op)
    return tuple(_square(_pow2_operator(i - 1)))


def _shift(crc: int, n: int) -> int:
    """``crc`` advanced over ``n`` zero bytes, one power of two at a time (one 32x32
    GF(2) matrix-vector product per set bit of ``n``, the matrices cached)."""
    i = 0
    while n:
        if n & 1:
            crc = _times(_pow2_operator(i), crc)
        n >>= 1
        i += 1
    return crc


@lru_cache(maxsize=64)
def _shift_tables(n: int) -> tuple[tuple[int, ...], ...]:
    """The operator of :func:`_shift` for ``n`` as four 256-entry tables, one per byte of
    the crc state: applying it is four lookups instead of a bit loop in Python.  Built
    from the operator's 32 columns (about 0.2 ms when ``n`` is a power of two); worth it
    for a length used many times (every block of a save)."""
    cols = [_shift(1 << j, n) for j in range(32)]
    tables = []
    for k in range(4):
        t = [0] * 256
        for b in range(1, 256):
            low = b & -b
            t[b] = t[b ^ low] ^ cols[8 * k + low.bit_length() - 1]
        tables.append(tuple(t))
    return tuple(tables)


def _shift_by_tables(crc: int, t: tuple[tuple[int, ...], ...]) -> int:
    return t[0][crc & 0xFF] ^ t[1][(crc >> 8) & 0xFF] ^ t[2][(crc >> 16) & 0xFF] ^ t[3][crc >> 24]


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c of A+B from crc32c(A), crc32c(B) and len(B).

    ``crc1`` is advanced over ``len2`` zero bytes (:func:`_shift`), so any length costs
    microseconds: part checksums are combined from chunk crcs of many different
    lengths.  A power-of-two length (crc blocks, 8 MiB reads) goes through cached
    tables (:func:`_shift_tables`), a quarter of a microsecond."""
    if len2 > 0 and len2 & (len2 - 1) == 0:
        return _shift_by_tables(crc1, _shift_tables(len2)) ^ crc2
    return _shift(crc1, len2) ^ crc2


def combine_blocks(blocks: Sequence[int], length: int, block: int) -> int:
    """The crc32c of ``length`` bytes from the crcs of its ``block``-byte blocks (the last one shorter)."""
    if not blocks:
        return 0
    total = blocks[0]
    full = length // block  # blocks[1:full] are whole: one table lookup each (see _shift_tables)
    t = _shift_tables(block) if full > 2 else None
    for i, c in enumerate(blocks[1:], 1):
        if t is not None and i < full:
            total = _shift_by_tables(total, t) ^ c
        else:
            total = crc32c_combine(total, c, min(block, length - i * block))
    return total


#: below this many bytes :func:`block_crcs` hashes the data again for the whole crc instead
#: of combining the blocks' crcs: the bytes were just hashed, so they are in the CPU's cache
#: (64 KiB in ~1 us), where combining costs ~0.25 us of Python per block (3,200 chunks of
#: 64 KiB with 1 KiB blocks: 52 ms combined, ~4 ms hashed again)
REHASH_BELOW = 512 << 10


def block_crcs(data: memoryview, block: int) -> tuple[int, list[int]]:
    """(crc of all of ``data``, crc of each ``block``-byte block); no blocks if it fits in one.
    For large data the whole crc is combined from the blocks' (:func:`combine_blocks`), not
    hashed again; below :data:`REHASH_BELOW` hashing again is the cheaper of the two."""
    n = len(data)
    if block <= 0 or n <= block:
        return _impl(data, 0), []
    # one C-level map over cached slices: a 64 KiB chunk of 1 KiB blocks is 64 calls, and
    # a Python loop around them cost more than the hashing (3,200 chunks: ~25 ms a save)
    blocks = list(map(_impl, map(data.__getitem__, _block_slices(n, block))))
    if n < REHASH_BELOW:
        return _impl(data, 0), blocks
    return combine_blocks(blocks, n, block), blocks


@lru_cache(maxsize=256)
def _block_slices(n: int, block: int) -> tuple[slice, ...]:
    """The ``block``-byte slices of ``n`` bytes (the last one shorter): the same few
    lengths recur for every chunk of a save."""
    return tuple(slice(i, i + block) for i in range(0, n, block))


class RunningCrc:
    """The crc32c of consecutive pieces (a part's chunks and its padding), built as each
    piece is hashed.  A piece below :data:`REHASH_BELOW` was just hashed, so its bytes are
    in the CPU's cache: hashing them again, continuing the running crc, costs ~1 us per
    64 KiB where combining its crc costs a Python shift per set bit of its length (a part
    of 3,200 small chunks: ~50 ms a save).  A larger piece is combined from its own crc."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def add(self, data: memoryview, crc: Optional[int] = None) -> None:
        """Append ``data``, whose crc32c is ``crc`` when already known."""
        n = len(data)
        if crc is None or n < REHASH_BELOW:
            self.value = _impl(data, self.value)
        else:
            self.value = crc32c_combine(self.value, crc, n)


def crc_of_views(views: Sequence[memoryview]) -> int:
    """crc32c of consecutive buffers, as one byte string."""
    crc = 0
    for v in views:
        crc = crc32c(v, crc)
    return crc


def crc_header(crc: int) -> str:
    """S3's encoding of a crc32c (``x-amz-checksum-crc32c``): base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def composite_header(part_crcs: Sequence[int]) -> str:
    """The checksum S3 reports for a multipart object: the crc32c of the parts'
    checksums (raw bytes, in order), then ``-<number of parts>``."""
    raw = b"".join(c.to_bytes(4, "big") for c in part_crcs)
    return f"{crc_header(crc32c(raw))}-{len(part_crcs)}"


class CellCrcs:
    """crc32c of consecutive cells of a byte stream, computed as the stream is written.

    The stream is ``total`` bytes cut at ``cuts`` (offsets inside it); :meth:`feed`
    takes the bytes in order, *from where they were written* (so what is hashed is
    what stays there).  A reader verifying chunks or crc blocks puts a cut at each
    boundary it checks, then combines or compares the cells' crcs instead of
    reading the bytes again (see :mod:`objckpt.load.ranged_get`)."""

    __slots__ = ("ends", "crcs", "fed", "_crc", "_end")

    def __init__(self, cuts: Iterable[int], total: int) -> None:
        self.ends = sorted({c for c in cuts if 0 < c < total}) + [total] if total > 0 else []
        self.crcs: list[int] = []  # of the cells completed so far
        self.fed = 0
        self._crc = 0
        self._end = self.ends[0] if self.ends else 0

    def feed(self, data: memoryview) -> None:
        """The next ``len(data)`` bytes of the stream; more than ``total`` is a bug of the caller."""
        while len(data):
            take = self._end - self.fed
            if take <= 0:
                raise ValueError("CellCrcs fed past the end of its stream")
            if take >= len(data):
                self._crc = crc32c(data, self._crc)
                self.fed += len(data)
                if take > len(data):
                    return
                data = data[len(data):]
            else:
                self._crc = crc32c(data[:take], self._crc)
                self.fed += take
                data = data[take:]
            self.crcs.append(self._crc)
            self._crc = 0
            k = len(self.crcs)
            self._end = self.ends[k] if k < len(self.ends) else self.fed

    def cells(self) -> Optional[list[tuple[int, int, int]]]:
        """(start, length, crc) of every cell once the whole stream was fed exactly once, else None."""
        if not self.ends or self.fed != self.ends[-1] or len(self.crcs) != len(self.ends):
            return None
        out, start = [], 0
        for end, crc in zip(self.ends, self.crcs):
            out.append((start, end - start, crc))
            start = end
        return out
