"""The manifest (format v1 to v5): typed objects, JSON encode/decode, version check.

The manifest is the only metadata object of a checkpoint and its commit
record.  It is plain JSON (zstd-compressed when large, detected by magic), so
any language can read a checkpoint with one GET and a JSON parser; it is never
pickled.  ``docs/format.md`` is the normative spec, ``manifest.schema.json``
its JSON Schema.

Version 1 lists every chunk of every tensor.  Version 2 (multi-rank saves
whose layout every rank can compute) stores a tensor's *layout* instead (mesh,
placements, split, rot: see :mod:`objckpt.planning.layout`), and each rank's
chunk records go to that rank's index object, fetched only by readers that
need that rank's pieces: the manifest stays small at any world size.  A
writer emits version 1 whenever it lists chunks inline, so older readers keep
reading single-process checkpoints.

Version 3 (what this release writes) is version 2 plus the manifest's own
``crc32c`` over its canonical JSON (:mod:`objckpt.format.sealed_json`), so a
changed metadata value or tree key is detected, not returned; v1 and v2
manifests, which lack it, are still read.  :func:`reseal` recomputes it for
hand-edited manifests.

Version 4 is version 3 plus the "spread" key layout (:mod:`objckpt.format.spread`):
blobs and rank indexes may live under hashed prefixes outside the checkpoint's
prefix, recorded per object (``spread``) and once (``spread_up``).  Only such
manifests are written as v4, so a release that reads up to v3 refuses them
clearly instead of looking for blobs that are not there.

Version 5 stores a chunk's ``block_crc32c`` packed: one base64 string of little-endian
uint32 values instead of a list of integers (:mod:`objckpt.format.packed`), in the
manifest and in the rank indexes; written whenever block crcs may be present, so a
release that reads up to v4 refuses such a checkpoint by its version.  Lists are still
read, in every version.  A manifest is untrusted input: :func:`decode` checks every
field a reader later trusts (names under ``blobs/``, chunk lengths against shapes,
layouts against meshes, tree tags) before anything is allocated.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence


import zstandard

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from .dtypes import NAME_TO_DTYPE, itemsize
from . import keys as _keys
from . import packed as _blocks
from . import spread as _spread
from . import tables as _tables
from .keys import is_safe_object_name
from ..runtime.gc_pause import paused_gc
from .entry_json import entry_dict, entry_texts
from .sealed_json import ZSTD_MAGIC, EncodedDict, load_json, load_sealed, only_str_keys, reseal, seal, verify  # noqa: F401  (re-exported)
from .tree import check_tree
from .entries import (MAX_INT, Blob, Chunk, ChunkRecord, Mesh, RankIndexRef, ShardSpec, TensorCount,  # noqa: F401
                      TensorEntry, TensorLayout)  # (re-exported: the records a manifest is made of)
from .chunk_checks import block_list, crc_list, plain_chunk as _plain_chunk, chunk_blocks as _chunk_blocks  # noqa: F401

FORMAT_NAME = "objckpt"
FORMAT_VERSION = 3  # what this release writes for the default key layout
#: what it writes when objects are spread over hashed prefixes (docs/format.md §13)
SPREAD_VERSION = 4
#: what it writes when some chunk carries block crcs, stored packed (:mod:`.packed`)
PACKED_VERSION = _blocks.PACKED_VERSION
MAX_VERSION = 5  # the newest version this release reads
#: the first version whose manifests (and rank indexes) must carry their own "crc32c"
SEALED_VERSION = 3
COMPRESS_ABOVE = 1 << 20  # manifests larger than this are stored zstd-compressed


@dataclass
class Manifest:
    tensors: dict[str, TensorEntry]
    #: a list as built; as decoded from v5, a lazy :class:`~objckpt.format.tables.BlobTable`
    blobs: Sequence[Blob]
    tree: Any  # encoded nested structure (see objckpt.format.tree)
    metadata: dict[str, Any] = field(default_factory=dict)
    attempt: str = ""
    world_size: int = 1
    created: float = field(default_factory=time.time)
    writer: str = ""
    format_version: int = FORMAT_VERSION  # what decode read; encode writes :func:`written_version`
    #: block size of Chunk.block_crc32c (0: chunks carry only their whole crc)
    crc_block: int = 0
    #: non-tensor values per rank, when ranks saved different ones (else None)
    rank_trees: Optional[list[Any]] = None
    #: v2: meshes that layouts refer to, and one index object per rank
    meshes: list[Mesh] = field(default_factory=list)
    rank_indexes: Sequence[RankIndexRef] = field(default_factory=list)
    #: v4: how many segments above the prefix the spread objects' root is (0: not spread)
    spread_up: int = 0

    def object_key(self, prefix: str, name: str, spread: str = "") -> str:
        """The store key of an object this manifest names, for the checkpoint at ``prefix``.

        Spread objects lie outside the prefix; :class:`CorruptCheckpointError` when the
        manifest's spread fields cannot place one there (e.g. ``spread_up`` above the root)."""
        if not spread:
            return _keys.join(prefix, name)
        key = _spread.object_key(prefix, self.spread_up, spread, name)
        if key is None or not _spread.is_spread_name(name, self.attempt):
            raise CorruptCheckpointError(
                f"manifest at {prefix!r}: spread object {name[:200]!r} (bucket {spread!r}, spread_up "
                f"{self.spread_up}) is not in this checkpoint's spread namespace")
        return key

    def blob_key(self, prefix: str, blob: int) -> str:
        b = self.blobs[blob]
        return self.object_key(prefix, b.name, b.spread)

    def index_key(self, prefix: str, rank: int) -> str:
        r = self.rank_indexes[rank]
        return self.object_key(prefix, r.name, r.spread)

    def object_keys(self, prefix: str) -> list[str]:
        """The store keys of every object this manifest names (blobs, then rank indexes)."""
        return ([self.object_key(prefix, b.name, b.spread) for b in self.blobs]
                + [self.object_key(prefix, r.name, r.spread) for r in self.rank_indexes])

    @property
    def chunks_resolved(self) -> bool:
        """Whether every stored tensor lists its chunks (v1, or v2 after resolving)."""
        return all(t.layout is None or t.chunks for t in self.tensors.values() if t.alias_of is None)

    # -- convenience for inspect() users -----------------------------------
    @property
    def keys(self) -> list[str]:
        return list(self.tensors)

    def tensor_count(self) -> TensorCount:
        """The checkpoint's tensors as every command counts them (see :class:`TensorCount`)."""
        return TensorCount(len(self.tensors), sum(1 for t in self.tensors.values() if t.alias_of is not None))

    def nbytes(self, key: Optional[str] = None) -> int:
        """Stored bytes of one tensor, or of all (aliases counted once)."""
        if key is not None:
            return sum(c.length for c in self.tensors[key].chunks)
        return sum(c.length for t in self.tensors.values() if t.alias_of is None for c in t.chunks)

    @property
    def total_blob_bytes(self) -> int:
        return sum(b.size for b in self.blobs)


def to_json_obj(m: Manifest, *, entries_ahead: bool = False) -> dict[str, Any]:
    """``m`` as a JSON object; ``entries_ahead``: its ``tensors`` as the
    :class:`~objckpt.format.sealed_json.EncodedDict` of their canonical texts
    (:mod:`objckpt.format.entry_json`; every tensor key a ``str``), for :func:`encode`."""
    tensors: Any = (EncodedDict(entry_texts(m.tensors)) if entries_ahead else
                    {k: entry_dict(t) for k, t in m.tensors.items()})
    v2 = any(t.layout is not None for t in m.tensors.values())
    version = written_version(m)
    out = {
        "format": FORMAT_NAME,
        "format_version": version,
        "writer": m.writer,
        "created": m.created,
        "attempt": m.attempt,
        "world_size": m.world_size,
        "metadata": m.metadata,
        "blobs": (_tables.encode_blobs(m.blobs, m.attempt) if version >= PACKED_VERSION else
                  [_spread_field({"name": b.name, "size": b.size, "rank": b.rank}, b.spread) for b in m.blobs]),
        "tensors": tensors,
        "tree": m.tree,
    }
    if m.spread_up:
        out["spread_up"] = m.spread_up
    if m.crc_block:
        out["crc_block"] = m.crc_block
    if m.rank_trees is not None:
        out["rank_trees"] = m.rank_trees
    if v2:
        out["meshes"] = [{"shape": list(me.shape), "ranks": list(me.ranks)} for me in m.meshes]
        out["rank_indexes"] = (_tables.encode_indexes(m.rank_indexes, m.attempt) if version >= PACKED_VERSION else
                               [_spread_field({"name": r.name, "size": r.size, "crc32c": r.crc32c}, r.spread)
                                for r in m.rank_indexes])
    return out


def written_version(m: Manifest) -> int:
    """The version :func:`encode` writes for ``m``: the oldest that holds what it uses, so
    that an older release refuses, by its version check, only what it cannot read.  v5
    (packed columns, :mod:`.packed`) when a chunk of ``m`` has block crcs, or when its
    chunks are in rank indexes (a multi-rank save: its blob and index tables are written
    as columns, its indexes pack their block crcs); else v4 for spread objects; else v3."""
    if any(t.layout is not None for t in m.tensors.values()):
        return PACKED_VERSION
    if any(c.block_crc32c for t in m.tensors.values() for c in t.chunks):
        return PACKED_VERSION
    return SPREAD_VERSION if m.spread_up else FORMAT_VERSION


def _spread_field(d: dict[str, Any], spread: str) -> dict[str, Any]:
    if spread:
        d["spread"] = spread
    return d


def encode(m: Manifest, *, compress: Optional[bool] = None) -> bytes:
    """Sealed canonical JSON of ``m`` (format v3, its ``crc32c`` last: docs/format.md §9.1);
    zstd-compressed when larger than 1 MiB (or as told).  The garbage collector is paused
    meanwhile, as for :func:`decode` (the seal parses the text back: as many objects)."""
    # only the tensor names and the caller's values (metadata, trees) can hold keys that are
    # not strings; every other dict of the manifest is built here with string keys
    plain = all(type(k) is str for k in m.tensors) and only_str_keys([m.metadata, m.tree, m.rank_trees])
    with paused_gc():
        # each entry written once for both of the seal's encodings (format/entry_json.py)
        raw = seal(to_json_obj(m, entries_ahead=plain), str_keys=plain)
    if compress is None:
        compress = len(raw) > COMPRESS_ABOVE
    return zstandard.ZstdCompressor(level=3).compress(raw) if compress else raw


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise CorruptCheckpointError(f"manifest {where}: {what}")


def _int(v: Any, lo: int = 0, hi: int = MAX_INT - 1) -> bool:
    """A real JSON integer (not a bool) within [lo, hi] (by default below :data:`MAX_INT`)."""
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _int_list(v: Any) -> bool:
    """A list of :func:`_int` integers; a list of plain ints is checked in C (a mesh's rank
    list holds one per rank: 65,536 at 65,536 ranks)."""
    if type(v) is list and (not v or (set(map(type, v)) == {int} and min(v) >= 0 and max(v) < MAX_INT)):
        return True
    return isinstance(v, list) and all(_int(x) for x in v)


def decode(data: bytes, where: str = "<manifest>") -> Manifest:
    """Parse and check a manifest.  ``where`` names it in errors.

    Everything a reader later trusts (offsets, lengths, shapes, aliases) is
    checked here, so a damaged or hostile manifest fails with
    :class:`CorruptCheckpointError` instead of reading the wrong bytes.  The cyclic
    garbage collector is paused meanwhile (:mod:`objckpt.runtime.gc_pause`: the decode
    makes hundreds of thousands of objects and no cycle).
    """
    with paused_gc():
        return _decode(data, where)


def _decode(data: bytes, where: str) -> Manifest:
    obj, text_intact = load_sealed(data, lambda what: CorruptCheckpointError(f"manifest {where}: {what}"))
    _need(isinstance(obj, dict), where, "top level is not an object")
    _need(obj.get("format") == FORMAT_NAME, where, f"'format' is {obj.get('format')!r}, not {FORMAT_NAME!r}")
    version = obj.get("format_version")
    _need(_int(version, lo=-(2**63), hi=2**63), where, "'format_version' missing or not an integer")
    if version > MAX_VERSION or version < 1:
        raise UnsupportedFormatError(
            f"manifest {where} has format_version {version}; this objckpt release reads "
            f"versions 1 to {MAX_VERSION} — upgrade objckpt to read it"
        )
    for name in ("blobs", "tensors"):
        _need(name in obj, where, f"required field '{name}' missing")
    crc_block = obj.get("crc_block", 0)
    _need(_int(crc_block), where, "'crc_block' malformed")
    rank_trees = obj.get("rank_trees")
    _need(rank_trees is None or isinstance(rank_trees, list), where, "'rank_trees' malformed")
    attempt = str(obj.get("attempt", ""))
    spread_up = obj.get("spread_up", 0)
    _need(_int(spread_up, 0, 64) and (not spread_up or version >= SPREAD_VERSION), where,
          "'spread_up' malformed or in a manifest older than v4")
    meshes, rank_indexes = _v2_tables(obj, version, where, attempt, spread_up)
    packed = version >= PACKED_VERSION
    blobs_raw = obj["blobs"]
    _need(isinstance(blobs_raw, list) or (packed and isinstance(blobs_raw, dict)), where, "'blobs' is not a list")
    blobs: Sequence[Blob] = (_tables.decode_blobs(blobs_raw, attempt, spread_up, _bad(where), _name_check(where,
                             attempt, spread_up)) if isinstance(blobs_raw, dict) else [])
    for i, b in enumerate(blobs_raw if isinstance(blobs_raw, list) else ()):
        if _plain_entry(b, "rank", 0):  # the common case, checked inline: one blob per rank and more
            blobs.append(Blob(b["name"], b["size"], b.get("rank", 0)))  # type: ignore[attr-defined]
            continue
        _need(isinstance(b, dict) and isinstance(b.get("name"), str) and b["name"], where, f"blob #{i}: name malformed")
        _check_name(b, attempt, spread_up, where, f"blob #{i}")
        _need(_int(b.get("size")), where, f"blob #{i}: size malformed")
        _need(_int(b.get("rank", 0)), where, f"blob #{i}: rank malformed")
        blobs.append(Blob(b["name"], b["size"], b.get("rank", 0), b.get("spread", "")))  # type: ignore[attr-defined]
    tensors: dict[str, TensorEntry] = {}
    traw = obj["tensors"]
    _need(isinstance(traw, dict), where, "'tensors' is not an object")
    sizes: Optional[list[int]] = None
    specs: dict[tuple, ShardSpec] = {}
    for k, t in traw.items():
        _need(isinstance(t, dict), where, f"tensor {k!r} malformed")
        _need(isinstance(t.get("dtype"), str), where, f"tensor {k!r}: dtype missing")
        _need(_int_list(t.get("shape")), where, f"tensor {k!r}: shape malformed")
        dt = NAME_TO_DTYPE.get(t["dtype"])
        isz = itemsize(dt) if dt is not None else 0  # unknown dtypes fail when read (UnsupportedFormatError)
        _need(math.prod(t["shape"]) * max(isz, 1) < MAX_INT, where, f"tensor {k!r}: shape {t['shape']} is too large")
        alias = t.get("alias_of")
        _need(alias is None or isinstance(alias, str), where, f"tensor {k!r}: alias_of malformed")
        _need(alias is None or "chunks" not in t, where, f"tensor {k!r}: has both chunks and alias_of")
        entry = TensorEntry(k, t["dtype"], tuple(t["shape"]), alias_of=alias)
        if alias is None and "layout" in t:
            _need(version >= 2 and "chunks" not in t, where, f"tensor {k!r}: 'layout' needs format v2 and no chunks")
            entry.layout = _shard_spec_once(t["layout"], entry.shape, meshes, where, k, specs)
        elif alias is None:
            _need(isinstance(t.get("chunks"), list), where, f"tensor {k!r}: chunks missing")
            seen: set[tuple[int, ...]] = set()
            sizes = list(_tables.blob_columns(blobs)[1]) if sizes is None else sizes
            for j, c in enumerate(t["chunks"]):
                chunk = _plain_chunk(c, entry.shape, sizes, isz, crc_block, packed)
                if chunk is not None and chunk.offsets not in seen:  # the common case: every check passed
                    seen.add(chunk.offsets)
                    entry.chunks.append(chunk)
                    continue
                ok = (
                    isinstance(c, dict)
                    and _int_list(c.get("offsets"))
                    and _int_list(c.get("shape"))
                    and len(c["offsets"]) == len(entry.shape) == len(c["shape"])
                    and all(o + n <= d for o, n, d in zip(c["offsets"], c["shape"], entry.shape))
                    and _int(c.get("blob"), 0, len(blobs) - 1)
                    and _int(c.get("offset"))
                    and _int(c.get("length"))
                    and _int(c.get("crc32c"), 0, 2**32 - 1)
                    and c["offset"] + c["length"] <= blobs[c["blob"]].size
                )
                blocks = _chunk_blocks(c, crc_block, packed) if ok else None
                ok = ok and blocks is not None
                _need(ok, where, f"tensor {k!r}: chunk #{j} malformed")
                _need(not isz or c["length"] == math.prod(c["shape"]) * isz, where,
                      f"tensor {k!r}: chunk #{j} length {c['length']} is not its shape's {math.prod(c['shape'])} "
                      f"elements of {isz} bytes")
                _need(tuple(c["offsets"]) not in seen, where,
                      f"tensor {k!r}: chunk #{j} repeats offsets {c['offsets']}")
                seen.add(tuple(c["offsets"]))
                entry.chunks.append(
                    Chunk(tuple(c["offsets"]), tuple(c["shape"]), c["blob"], c["offset"], c["length"], c["crc32c"],
                          blocks)  # type: ignore[arg-type]  # a tuple by now (checked above)
                )
        tensors[k] = entry
    for k, t in tensors.items():
        if t.alias_of is not None:
            target = tensors.get(t.alias_of)
            _need(target is not None and target.alias_of is None, where,
                  f"tensor {k!r}: alias_of {t.alias_of!r} does not name a stored tensor")
            _need(target.dtype == t.dtype and target.shape == t.shape, where,  # type: ignore[union-attr]
                  f"tensor {k!r}: alias of {t.alias_of!r} with a different dtype or shape")
    meta = obj.get("metadata", {})
    _need(isinstance(meta, dict), where, "'metadata' is not an object")
    world = obj.get("world_size", 1)
    _need(_int(world, lo=1), where, "'world_size' malformed")
    if version == 2 or rank_indexes or meshes:
        _need(len(rank_indexes) == world, where, f"{len(rank_indexes)} rank indexes for world size {world}")
        _need(all(max(me.ranks, default=-1) < world for me in meshes), where, "a mesh names a rank >= world_size")
    created = obj.get("created", 0.0)
    _need(isinstance(created, (int, float)) and not isinstance(created, bool), where, "'created' malformed")
    for t_where, tree in [("", obj.get("tree"))] + [(f" rank_trees[{i}]", r) for i, r in enumerate(rank_trees or [])]:
        check_tree(tree, tensors, f"{where}{t_where}")
    verify(obj, lambda what: CorruptCheckpointError(f"manifest {where}: {what}"), required=version >= SEALED_VERSION,
           text_intact=text_intact)
    return Manifest(
        tensors=tensors,
        blobs=blobs,
        tree=obj.get("tree"),
        metadata=meta,
        attempt=attempt,
        world_size=world,
        created=float(created),
        writer=str(obj.get("writer", "")),
        format_version=version,
        crc_block=crc_block,
        rank_trees=rank_trees,
        meshes=meshes,
        rank_indexes=rank_indexes,
        spread_up=spread_up,
    )


def _check_name(entry: dict, attempt: str, spread_up: int, where: str, what: str) -> None:
    """A default-layout name is a plain path under ``blobs/``; a spread one (v4) is exactly
    ``spread/<this attempt>/<blob or index file>`` in a hex bucket, with ``spread_up`` set."""
    name = entry.get("name")
    if "spread" not in entry:
        _need(is_safe_object_name(name), where, f"{what}: name {str(name)[:200]!r} is not a plain path under blobs/")
        return
    ok = spread_up > 0 and _spread.is_bucket(entry["spread"]) and _spread.is_spread_name(name, attempt)
    _need(ok, where, f"{what}: spread object {str(name)[:200]!r} in bucket {str(entry['spread'])[:20]!r} is not "
                     f"spread/<this attempt>/<file> in a hex bucket (with spread_up set)")


def _plain_entry(e: Any, field: str, default: Optional[int]) -> bool:
    """Whether ``e`` is a blob (``field`` "rank", ``default`` 0) or rank-index entry
    (``field`` "crc32c", required) under ``blobs/`` with no ``spread``, every value a plain
    int in range and a safe name: what the full checks accept, at a fraction of their
    cost (131,072 entries at 65,536 ranks).  False sends an entry to the full checks,
    which accept it or name what is wrong."""
    if type(e) is not dict or "spread" in e:
        return False
    size, extra = e.get("size"), e.get(field, default)
    hi = 1 << 32 if field == "crc32c" else MAX_INT
    return (type(size) is int and 0 <= size < MAX_INT and type(extra) is int and 0 <= extra < hi
            and is_safe_object_name(e.get("name")))


def _bad(where: str) -> Callable[[str], Exception]:
    return lambda what: CorruptCheckpointError(f"manifest {where}: {what}")


def _name_check(where: str, attempt: str, spread_up: int) -> Callable[[dict[str, Any], str], None]:
    return lambda entry, what: _check_name(entry, attempt, spread_up, where, what)


def _v2_tables(obj: dict, version: int, where: str, attempt: str,
               spread_up: int) -> tuple[list[Mesh], Sequence[RankIndexRef]]:
    if version < 2:
        _need("meshes" not in obj and "rank_indexes" not in obj, where, "v2 tables in a v1 manifest")
        return [], []
    if version >= 3 and "meshes" not in obj and "rank_indexes" not in obj:
        return [], []  # v3: the tables only when some tensor has a layout
    meshes_raw, idx_raw = obj.get("meshes"), obj.get("rank_indexes")
    packed = version >= PACKED_VERSION and isinstance(idx_raw, dict)
    _need(isinstance(meshes_raw, list) and (packed or isinstance(idx_raw, list)), where,
          "'meshes' or 'rank_indexes' missing")
    meshes = []
    for i, me in enumerate(meshes_raw):
        ok = isinstance(me, dict) and _int_list(me.get("shape")) and _int_list(me.get("ranks"))
        ok = ok and all(n >= 1 for n in me["shape"]) and math.prod(me["shape"]) == len(me["ranks"])
        ok = ok and len(set(me["ranks"])) == len(me["ranks"])
        _need(ok, where, f"mesh #{i} malformed")
        meshes.append(Mesh(tuple(me["shape"]), tuple(me["ranks"])))
    if packed:
        return meshes, _tables.decode_indexes(idx_raw, attempt, spread_up, _bad(where), _name_check(where, attempt,
                                                                                                     spread_up))
    refs = []
    for i, r in enumerate(idx_raw):
        if _plain_entry(r, "crc32c", None):  # the common case, checked inline: one per rank
            refs.append(RankIndexRef(r["name"], r["size"], r["crc32c"]))
            continue
        ok = isinstance(r, dict) and _int(r.get("size"))
        _need(ok and _int(r.get("crc32c"), 0, 2**32 - 1), where, f"rank index #{i} malformed")
        _check_name(r, attempt, spread_up, where, f"rank index #{i}")
        refs.append(RankIndexRef(r["name"], r["size"], r["crc32c"], r.get("spread", "")))
    return meshes, refs


def _shard_spec_once(raw: Any, shape: tuple[int, ...], meshes: list[Mesh], where: str, key: str,
                     seen: dict[tuple, ShardSpec]) -> ShardSpec:
    """:func:`_shard_spec`, checked once per distinct (layout, rank and rows of the shape): a
    model's layers repeat a few layouts (2,892 tensors of a dense model, ~10 distinct)."""
    try:
        memo = (raw["mesh"], tuple(raw["placements"]), raw.get("split", 1), raw.get("rot", 0), len(shape),
                shape[0] if shape else 1)
        hash(memo)
    except (TypeError, KeyError, AttributeError):
        return _shard_spec(raw, shape, meshes, where, key)  # malformed: the full checks name it
    plain = type(memo[0]) is int and type(memo[2]) is int and type(memo[3]) is int
    if not (type(raw) is dict and plain and all(type(p) is str for p in memo[1])):
        return _shard_spec(raw, shape, meshes, where, key)  # (True == 1.0 == 1: only exact types share an entry)
    hit = seen.get(memo)
    if hit is None:
        hit = seen[memo] = _shard_spec(raw, shape, meshes, where, key)
    return hit


def _shard_spec(raw: Any, shape: tuple[int, ...], meshes: list[Mesh], where: str, key: str) -> ShardSpec:
    ok = isinstance(raw, dict) and _int(raw.get("mesh"), 0, len(meshes) - 1)
    ok = ok and isinstance(raw.get("placements"), list) and _int(raw.get("split", 1), 1) and _int(raw.get("rot", 0))
    _need(ok, where, f"tensor {key!r}: layout malformed")
    group = len(meshes[raw["mesh"]].ranks)
    _need(raw.get("split", 1) <= max(1, min(group, shape[0] if shape else 1)), where,
          f"tensor {key!r}: layout split {raw.get('split')} exceeds its rows and mesh")
    _need(raw.get("rot", 0) < max(1, group), where, f"tensor {key!r}: layout rot {raw.get('rot')} exceeds its mesh")
    pl = raw["placements"]
    _need(len(pl) == len(meshes[raw["mesh"]].shape), where, f"tensor {key!r}: placements do not match mesh")
    for p in pl:
        ok = p == "R" or (isinstance(p, str) and len(p) >= 2 and p[0] == "S" and p[1:].isdigit() and int(p[1:]) < len(shape))
        _need(ok, where, f"tensor {key!r}: placement {p!r} malformed")
    return ShardSpec(raw["mesh"], tuple(pl), raw.get("split", 1), raw.get("rot", 0))
