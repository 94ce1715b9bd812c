"""The blob and rank-index tables of a v5 manifest: columns, not a JSON object per entry.

A save of N ranks lists about 2N objects: each rank's blobs and its rank index.  As JSON
objects (``{"name": ..., "size": ..., "rank": ...}``) they were 12 of the 14 MB of a
65,536-rank manifest, and parsing and checking them was most of every loading rank's
decode, though a rank reads the blobs of a handful of writers.  In v5 each table is a few
packed columns (:mod:`.packed`):

    "blobs":        {"rank": <uint32>, "size": <uint64>}   (+ "name": [...], "spread": [...])
    "rank_indexes": {"size": <uint64>, "crc32c": <uint32>} (+ "name": [...], "spread": [...])

``name`` is written only when some name differs from the one the key scheme gives
(:func:`objckpt.format.keys.blob_name`: a rank's n-th blob, in table order; ``index_name``:
rank i's index), ``spread`` only when some object is spread.  A decoded table is a lazy
sequence: its columns are checked as a whole (maxima, lengths), and a :class:`Blob` or
:class:`RankIndexRef` is made only for the entries a reader looks at.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence, Union, overload

from . import keys as _keys
from . import packed as _packed
from . import spread as _spread
from .entries import MAX_INT, Blob, RankIndexRef

Bad = Callable[[str], Exception]


def _implied_blob_names(attempt: str, ranks: Sequence[int], spreads: Optional[Sequence[str]]) -> list[str]:
    seen: dict[int, int] = {}
    out = []
    for i, r in enumerate(ranks):
        n = seen.get(r, 0)
        seen[r] = n + 1
        out.append(_keys.blob_name(attempt, r, n, _spread.SPREAD_DIR if spreads and spreads[i] else _keys.BLOB_DIR))
    return out


def _implied_index_name(attempt: str, rank: int, spread: str) -> str:
    return _keys.index_name(attempt, rank, _spread.SPREAD_DIR if spread else _keys.BLOB_DIR)


class _Table:
    """A read-only sequence of entries made on demand from columns."""

    __slots__ = ("_names", "_spreads", "attempt", "_n")

    def __init__(self, n: int, names: Optional[list[str]], spreads: Optional[list[str]], attempt: str) -> None:
        self._n, self._names, self._spreads, self.attempt = n, names, spreads, attempt

    def __len__(self) -> int:
        return self._n

    def spread(self, i: int) -> str:
        return self._spreads[i] if self._spreads is not None else ""

    def name(self, i: int) -> str:
        raise NotImplementedError

    def names(self) -> list[str]:
        """Every entry's name, without making the entries."""
        return list(self._names) if self._names is not None else [self.name(i) for i in range(self._n)]

    def spreads(self) -> list[str]:
        """Every entry's bucket ("" : not spread), without making the entries."""
        return list(self._spreads) if self._spreads is not None else [""] * self._n

    def _entry(self, i: int) -> Any:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...

    def __getitem__(self, i: Union[int, slice]) -> Any:
        if isinstance(i, slice):
            return [self._entry(j) for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(f"table index {i} out of range ({self._n} entries)")
        return self._entry(i)

    def __iter__(self) -> Iterator[Any]:
        return (self._entry(i) for i in range(self._n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, _Table)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


class BlobTable(_Table):
    """A v5 manifest's blobs: :class:`Blob` ``i`` is made when asked for."""

    __slots__ = ("ranks", "sizes", "_implied")

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[str, int, int, str]], attempt: str) -> "BlobTable":
        """The table of (name, size, rank, spread) rows: how rank 0 builds a manifest's blobs
        from the outcomes of many ranks without a :class:`Blob` per row."""
        names, sizes, ranks, spreads = (list(c) for c in zip(*rows)) if rows else ([], [], [], [])
        return cls(ranks, sizes, names, spreads if any(spreads) else None, attempt)

    def __init__(self, ranks: Sequence[int], sizes: Sequence[int], names: Optional[list[str]],
                 spreads: Optional[list[str]], attempt: str) -> None:
        super().__init__(len(ranks), names, spreads, attempt)
        self.ranks, self.sizes = ranks, sizes
        self._implied: Optional[list[str]] = None

    def name(self, i: int) -> str:
        if self._names is not None:
            return self._names[i]
        if self._implied is None:  # a rank's n-th blob: one pass over the ranks, on first use
            self._implied = _implied_blob_names(self.attempt, self.ranks, self._spreads)
        return self._implied[i]

    def _entry(self, i: int) -> Blob:
        return Blob(self.name(i), self.sizes[i], self.ranks[i], self.spread(i))


class IndexTable(_Table):
    """A v5 manifest's rank indexes: :class:`RankIndexRef` ``i`` (rank i's) made when asked for."""

    __slots__ = ("sizes", "crcs")

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[str, int, int, str]], attempt: str) -> "IndexTable":
        """The table of (name, size, crc32c, spread) rows, rank r's at position r."""
        names, sizes, crcs, spreads = (list(c) for c in zip(*rows)) if rows else ([], [], [], [])
        return cls(sizes, crcs, names, spreads if any(spreads) else None, attempt)

    def __init__(self, sizes: Sequence[int], crcs: Sequence[int], names: Optional[list[str]],
                 spreads: Optional[list[str]], attempt: str) -> None:
        super().__init__(len(sizes), names, spreads, attempt)
        self.sizes, self.crcs = sizes, crcs

    def name(self, i: int) -> str:
        return self._names[i] if self._names is not None else _implied_index_name(self.attempt, i, self.spread(i))

    def _entry(self, i: int) -> RankIndexRef:
        return RankIndexRef(self.name(i), self.sizes[i], self.crcs[i], self.spread(i))


def blob_columns(blobs: Sequence[Blob]) -> tuple[Sequence[int], Sequence[int]]:
    """(ranks, sizes) of ``blobs``: a table's own columns, or read from a list."""
    if isinstance(blobs, BlobTable):
        return blobs.ranks, blobs.sizes
    return [b.rank for b in blobs], [b.size for b in blobs]


# ----------------------------------------------------------------------------------- encode

def _optional_columns(out: dict[str, Any], names: list[str], implied: list[str], spreads: list[str]) -> dict[str, Any]:
    if names != implied:
        out["name"] = names
    if any(spreads):
        out["spread"] = spreads
    return out


def encode_blobs(blobs: Sequence[Blob], attempt: str) -> dict[str, Any]:
    ranks, sizes = blob_columns(blobs)
    if isinstance(blobs, BlobTable):
        names, spreads = blobs.names(), blobs.spreads()
    else:
        names, spreads = [b.name for b in blobs], [b.spread for b in blobs]
    out = {"rank": _packed.pack(ranks), "size": _packed.pack(sizes, 8)}
    return _optional_columns(out, names, _implied_blob_names(attempt, ranks, spreads), spreads)


def encode_indexes(refs: Sequence[RankIndexRef], attempt: str) -> dict[str, Any]:
    if isinstance(refs, IndexTable):
        names, spreads, sizes, crcs = refs.names(), refs.spreads(), refs.sizes, refs.crcs
    else:
        names, spreads = [r.name for r in refs], [r.spread for r in refs]
        sizes, crcs = [r.size for r in refs], [r.crc32c for r in refs]
    out = {"size": _packed.pack(sizes, 8), "crc32c": _packed.pack(crcs)}
    implied = [_implied_index_name(attempt, i, s) for i, s in enumerate(spreads)]
    return _optional_columns(out, names, implied, spreads)


# ----------------------------------------------------------------------------------- decode

def _strings(raw: dict[str, Any], field: str, n: int, bad: Bad, what: str) -> Optional[list[str]]:
    v = raw.get(field)
    if v is None:
        return None
    if type(v) is not list or len(v) != n or set(map(type, v)) - {str}:
        raise bad(f"{what}: column {field!r} is not a list of {n} strings")
    return v


def _columns(raw: Any, spec: dict[str, int], bad: Bad, what: str) -> list[tuple[int, ...]]:
    """The packed columns of ``spec`` (field -> byte width) of table ``raw``, of one length."""
    if type(raw) is not dict or set(raw) - set(spec) - {"name", "spread"}:
        raise bad(f"{what}: not a v5 table (an object of columns {sorted(spec)}, 'name', 'spread')")
    cols = []
    for field, width in spec.items():
        col = _packed.unpack(raw.get(field), None, width)
        if col is None:
            raise bad(f"{what}: column {field!r} missing or not packed uint{8 * width} values")
        cols.append(col)
    if len({len(c) for c in cols}) > 1:
        raise bad(f"{what}: columns of different lengths")
    return cols


def _check_objects(t: Union[BlobTable, IndexTable], spreads: Optional[list[str]], spread_up: int, bad: Bad,
                   what: str, check_name: Callable[[dict[str, Any], str], None]) -> None:
    """Every name and bucket as :mod:`.manifest` checks a list entry's: explicit names one by
    one (rare: only a writer with other names writes them); implied names by their attempt
    (one safe path segment) and the buckets by their distinct values."""
    if spreads is not None:
        for s in set(spreads):
            if s and not (spread_up > 0 and _spread.is_bucket(s)):
                raise bad(f"{what}: spread bucket {s[:20]!r} is not a hex bucket (with spread_up set)")
    if t._names is not None:
        for i in range(len(t)):
            entry: dict[str, Any] = {"name": t.name(i)}
            if t.spread(i):
                entry["spread"] = t.spread(i)
            check_name(entry, f"{what} #{i}")
    elif len(t) and ("/" in t.attempt or not _keys.is_safe_object_name(_keys.blob_name(t.attempt, 0, 0))):
        raise bad(f"{what}: names are implied by the attempt {t.attempt[:200]!r}, which is not one safe path segment")


def _decode(cls: type, raw: Any, spec: dict[str, int], attempt: str, spread_up: int, bad: Bad,
            check_name: Callable[[dict[str, Any], str], None], what: str) -> Any:
    table = f"'{what}'"
    cols = _columns(raw, spec, bad, table)
    sizes = cols[list(spec).index("size")]
    if sizes and max(sizes) >= MAX_INT:
        raise bad(f"{table}: a size is too large")
    names = _strings(raw, "name", len(sizes), bad, table)
    spreads = _strings(raw, "spread", len(sizes), bad, table)
    t = cls(*cols, names, spreads, attempt)
    _check_objects(t, spreads, spread_up, bad, "blob" if what == "blobs" else "rank index", check_name)
    return t


def decode_blobs(raw: Any, attempt: str, spread_up: int, bad: Bad,
                 check_name: Callable[[dict[str, Any], str], None]) -> BlobTable:
    return _decode(BlobTable, raw, {"rank": 4, "size": 8}, attempt, spread_up, bad, check_name, "blobs")


def decode_indexes(raw: Any, attempt: str, spread_up: int, bad: Bad,
                   check_name: Callable[[dict[str, Any], str], None]) -> IndexTable:
    return _decode(IndexTable, raw, {"size": 8, "crc32c": 4}, attempt, spread_up, bad, check_name, "rank_indexes")
