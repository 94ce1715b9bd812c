"""A rank's index object (format v2): the chunk records of the pieces it wrote.

Written by each rank next to its blobs before the commit, referenced from the
manifest by name, size and crc32c, and fetched only by readers that need a
piece that rank wrote.  JSON like the manifest (zstd above 1 MiB):

    {"format": "objckpt-rank-index", "attempt": "...", "rank": 3,
     "chunks": [[key, offsets, shape, blob, offset, length, crc32c, block_crc32c], ...]}

``blob`` numbers the rank's own blobs in manifest order (its n-th blob).
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import zstandard

from ..errors import CorruptCheckpointError
from .manifest import COMPRESS_ABOVE, ZSTD_MAGIC, Chunk, _int, _int_list

INDEX_FORMAT = "objckpt-rank-index"

Record = tuple[str, tuple[int, ...], tuple[int, ...], int, int, int, int, tuple[int, ...]]


def encode(attempt: str, rank: int, records: Sequence[Record]) -> bytes:
    chunks = [[k, list(o), list(s), b, off, ln, crc, list(blk)] for k, o, s, b, off, ln, crc, blk in records]
    raw = json.dumps({"format": INDEX_FORMAT, "attempt": attempt, "rank": rank, "chunks": chunks},
                     separators=(",", ":")).encode()
    return zstandard.ZstdCompressor(level=3).compress(raw) if len(raw) > COMPRESS_ABOVE else raw


def decode(data: bytes, where: str, *, attempt: str, rank: int, blobs: Sequence[int], blob_sizes: Sequence[int],
           crc_block: int) -> dict[str, dict[tuple[int, ...], Chunk]]:
    """Chunks by tensor key and global offsets; ``blobs`` maps the rank's n-th
    blob to its index in the manifest.  Everything is checked like the manifest."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"rank index {where}: {what}")

    if data[:4] == ZSTD_MAGIC:
        try:
            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 34)
        except zstandard.ZstdError as e:
            raise bad(f"bad zstd stream ({e})") from None
    try:
        obj: Any = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != INDEX_FORMAT:
        raise bad("not an objckpt rank index")
    if obj.get("attempt") != attempt or obj.get("rank") != rank:
        raise bad(f"belongs to attempt {obj.get('attempt')!r} rank {obj.get('rank')!r}, "
                  f"the manifest expects {attempt!r} rank {rank}")
    out: dict[str, dict[tuple[int, ...], Chunk]] = {}
    recs = obj.get("chunks")
    if not isinstance(recs, list):
        raise bad("'chunks' missing")
    for j, r in enumerate(recs):
        ok = isinstance(r, list) and len(r) == 8 and isinstance(r[0], str) and _int_list(r[1]) and _int_list(r[2])
        ok = ok and len(r[1]) == len(r[2]) and _int(r[3], 0, len(blobs) - 1) and _int(r[4]) and _int(r[5])
        ok = ok and _int(r[6], 0, 2**32 - 1) and isinstance(r[7], list) and all(_int(x, 0, 2**32 - 1) for x in r[7])
        if ok:
            b = blobs[r[3]]
            ok = r[4] + r[5] <= blob_sizes[b] and (not r[7] or (crc_block > 0 and len(r[7]) == -(-r[5] // crc_block)))
        if not ok:
            raise bad(f"chunk record #{j} malformed")
        offs = tuple(r[1])
        out.setdefault(r[0], {})[offs] = Chunk(offs, tuple(r[2]), b, r[4], r[5], r[6], tuple(r[7]))
    return out
