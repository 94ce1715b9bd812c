"""A rank's index object (format v2): the chunk records of the pieces it wrote.

Written by each rank next to its blobs before the commit, referenced from the
manifest by name, size and crc32c, and fetched only by readers that need a
piece that rank wrote.  JSON, zstd-compressed (detected by magic, like the manifest):

    {"format": "objckpt-rank-index", "attempt": "...", "rank": 3,
     "chunks": {key: [[offsets, shape, blob, offset, length, crc32c, block_crc32c], ...], ...},
     "crc32c": N}

``block_crc32c`` is packed (a base64 string, :mod:`.packed`) in indexes of v5
manifests, a list of integers (empty: none) before; a reader accepts both (an index is
reached only through its manifest, which names its size and crc32c).

``crc32c`` (since format v3) seals the index like the manifest: the crc32c of the
canonical JSON of everything else (docs/format.md §9.1, §12.3).

``blob`` numbers the rank's own blobs in manifest order (its n-th blob).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence

import zstandard

from ..errors import CorruptCheckpointError
from . import packed as _blocks
from .chunk_checks import block_list
from .entries import MAX_INT, Chunk, ChunkRecord
from ..runtime.gc_pause import paused_gc
from .sealed_json import EncodedDict, load_sealed, seal, verify

INDEX_FORMAT = "objckpt-rank-index"


def encode(attempt: str, rank: int, records: Sequence[ChunkRecord]) -> bytes:
    by_key: dict[str, list] = {}
    with paused_gc():  # as decode: many objects, no cycle
        for r in records:
            c = r.chunk
            by_key.setdefault(r.key, []).append([list(c.offsets), list(c.shape), c.blob, c.offset, c.length,
                                                 c.crc32c, _blocks.pack(c.block_crc32c) if c.block_crc32c else []])
        # (each key's records encoded once for both of the seal's encodings: lists, no dict to sort)
        chunks: Any = EncodedDict.of(by_key) if all(type(k) is str for k in by_key) else by_key
        raw = seal({"format": INDEX_FORMAT, "attempt": attempt, "rank": rank, "chunks": chunks})
    return zstandard.ZstdCompressor(level=3).compress(raw)  # internal: always compressed


_INT = {int}


def decode(data: bytes, where: str, *, attempt: str, rank: int, blobs: Sequence[int], blob_sizes: Sequence[int],
           crc_block: int, require_crc: bool = False, lazy: bool = False) -> "Mapping[str, dict[tuple[int, ...], Chunk]]":
    """Chunks by tensor key and global offsets; ``blobs`` maps the rank's n-th
    blob to its index in the manifest.  Everything is checked like the manifest
    (a reader of thousands of records per index: the checks are kept cheap).
    ``require_crc``: the manifest is v3 or later, so the index must carry its ``crc32c``.
    The cyclic garbage collector is paused meanwhile, as for a manifest.

    ``lazy``: the index's text, its crc and its header are checked now, each tensor's
    records when that tensor is first looked up (:class:`RankChunks`): a load rank reads a
    few tensors' pieces of each index it fetches (at 65,536 ranks, 9 indexes of 4,620
    tensors for ~6,000 reads), and making every record of every index a checked ``Chunk``
    was a third of its planning.  The bytes are whole either way (the index's crc covers
    them); a malformed record of a tensor never looked up is simply never read."""
    with paused_gc():
        by_key, check = _opened(data, where, attempt=attempt, rank=rank, blobs=blobs, blob_sizes=blob_sizes,
                                crc_block=crc_block, require_crc=require_crc)
        out = RankChunks(by_key, check)
        if not lazy:
            for key in by_key:
                out[key]
        return out


class RankChunks(Mapping):  # type: ignore[type-arg]
    """A decoded rank index: each tensor's records checked and made ``Chunk`` s on first lookup."""

    def __init__(self, by_key: dict[str, Any], check: Callable[[str, Any], dict[tuple[int, ...], Chunk]]) -> None:
        self._raw = by_key
        self._check = check
        self._done: dict[str, dict[tuple[int, ...], Chunk]] = {}

    def __getitem__(self, key: str) -> dict[tuple[int, ...], Chunk]:
        got = self._done.get(key)
        if got is None:
            got = self._done[key] = self._check(key, self._raw[key])  # (KeyError: not in this index)
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    @property
    def checked(self) -> int:
        """How many tensors' records were checked so far."""
        return len(self._done)


def _opened(data: bytes, where: str, *, attempt: str, rank: int, blobs: Sequence[int], blob_sizes: Sequence[int],
            crc_block: int, require_crc: bool) -> tuple[dict[str, Any], Callable[[str, Any], dict]]:
    """The index's records by key, its text, crc and header checked, and the check of one key's records."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"rank index {where}: {what}")

    obj, text_intact = load_sealed(data, bad)
    if not isinstance(obj, dict) or obj.get("format") != INDEX_FORMAT:
        raise bad("not an objckpt rank index")
    if obj.get("attempt") != attempt or obj.get("rank") != rank:
        raise bad(f"belongs to attempt {obj.get('attempt')!r} rank {obj.get('rank')!r}, "
                  f"the manifest expects {attempt!r} rank {rank}")
    verify(obj, bad, required=require_crc, text_intact=text_intact)
    by_key = obj.get("chunks")
    if not isinstance(by_key, dict):
        raise bad("'chunks' missing")
    nblobs = len(blobs)

    def check(key: str, recs: Any) -> dict[tuple[int, ...], Chunk]:
        mine: dict[tuple[int, ...], Chunk] = {}
        if not isinstance(recs, list):
            raise bad(f"tensor {key!r}: records malformed")
        for j, r in enumerate(recs):
            blocks = None
            try:
                o, s, b, off, ln, crc, blk = r
                dims = o + s  # every offset and extent, checked in C (no Python step per value)
                ok = (type(o) is list and type(s) is list and len(o) == len(s)
                      and (not dims or (set(map(type, dims)) == _INT and min(dims) >= 0 and max(dims) < MAX_INT))
                      and type(b) is int and 0 <= b < nblobs and type(off) is int and 0 <= off < MAX_INT
                      and type(ln) is int and 0 <= ln < MAX_INT and type(crc) is int and 0 <= crc < 1 << 32
                      and type(blk) in (list, str))
                blocks = block_list(blk, ln, crc_block, True) if ok else None
                ok = ok and blocks is not None and off + ln <= blob_sizes[blobs[b]]
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise bad(f"tensor {key!r}: chunk record #{j} malformed")
            offs = tuple(o)
            if offs in mine:
                raise bad(f"tensor {key!r}: chunk record #{j} repeats offsets {o}")
            mine[offs] = Chunk(offs, tuple(s), blobs[b], off, ln, crc, blocks)  # type: ignore[arg-type]
        return mine

    return by_key, check
