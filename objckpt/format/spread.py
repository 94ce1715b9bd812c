"""The "spread" key scheme (``KeyScheme.SPREAD``): blob and rank-index keys under hashed prefixes.

S3 serves about 3,500 writes and 5,500 reads per second per *partitioned*
prefix, and partitions a bucket by key ranges it splits while the load lasts
(answering 503 SlowDown meanwhile).  With the default key scheme every object of a
save lies under ``<prefix>/blobs/<attempt>/``: a key range that did not exist
before the save, so each save of a 16,384-rank job starts on one cold
partition, however the keys below it are named.  A hash helps only where it
comes right after a part of the key that stays the same from save to save.

So a spread checkpoint at ``<root>/<rel>`` stores its objects at::

    <root>/.spread-<hh>/<rel>/spread/<attempt>/r<rank>-<n>.bin
    <root>/.spread-<hh>/<rel>/spread/<attempt>/r<rank>.index.json

``<root>`` is an ancestor of the checkpoint prefix that every save of the job
shares (by default its parent: ``run1`` for ``run1/step-100``), ``<rel>`` the
rest of the prefix, and ``<hh>`` a few hex digits that depend on the writing
rank only (:func:`spread_bucket`).  Rank r's objects land in the same key range
at every step, so the partitions S3 split for one save serve the next.  The
manifest stays at ``<prefix>/manifest.json`` and records, per object, its name
(``spread/<attempt>/<file>``) and its ``<hh>``, and once how many segments
``<root>`` lies above the prefix (``spread_up``): docs/format.md §13.

The names differ from the default scheme's (``spread/``, not ``blobs/``) so a
garbage collector of an older release, which takes ``.../blobs/<attempt>/<file>``
keys without a manifest beside them for garbage, never touches a spread object.
The key parses back to exactly one owning checkpoint (:func:`parse_key`),
because writers refuse prefixes with a ``.spread-*`` segment; that is what lets
gc, delete and overwrite cleanup check that a manifest names only its own objects.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from . import keys

SPREAD_DIR = "spread"  # the first segment of a spread object's name
MARK = ".spread-"  # the segment under the spread root that carries the hash digits
MAX_DIGITS = 4
#: ``.spread-<1 to 4 lowercase hex digits>``: a spread bucket segment
_MARK_SEGMENT = re.compile(r"\.spread-[0-9a-f]{1,4}")
_BUCKET = re.compile(r"[0-9a-f]{1,4}")
#: the file names a save writes (and the local store's temporaries of them)
FILE_NAME = re.compile(r"r\d+(-\d+\.bin|\.index\.json)")
_FILE_OR_TMP = re.compile(r"r\d+(-\d+\.bin|\.index\.json)(\.tmp-[0-9a-f]+)?")


def spread_bucket(rank: int, digits: int) -> str:
    """The ``digits`` hex digits of ``rank``'s bucket: the bits of ``rank mod 16**digits``
    in reverse order.  A bijection on ``[0, 16**digits)``, so any run of consecutive
    ranks fills the buckets evenly (counts differ by at most one), and ranks 0 and 1
    already land in opposite halves of the key range, where S3 splits first."""
    if not 1 <= digits <= MAX_DIGITS:
        raise ValueError(f"spread digits must be 1 to {MAX_DIGITS}, got {digits}")
    bits = 4 * digits
    v = rank % (1 << bits)
    rev = int(format(v, f"0{bits}b")[::-1], 2)
    return format(rev, f"0{digits}x")


def is_bucket(value: object) -> bool:
    return isinstance(value, str) and _BUCKET.fullmatch(value) is not None


def _segments(prefix: str) -> list[str]:
    p = prefix.strip("/")
    return p.split("/") if p else []


def has_mark(prefix: str) -> bool:
    """Whether a segment of ``prefix`` looks like a spread bucket (``.spread-3a``)."""
    return any(_MARK_SEGMENT.fullmatch(s) for s in _segments(prefix))


def is_spread_name(name: object, attempt: str) -> bool:
    """Whether ``name`` (from a manifest) is exactly ``spread/<attempt>/<blob or index file>``
    of this manifest's ``attempt``: a spread entry can name nothing else."""
    if not isinstance(name, str) or not attempt:
        return False
    parts = name.split("/")
    return (len(parts) == 3 and parts[0] == SPREAD_DIR and parts[1] == attempt
            and plain_segment(attempt) and FILE_NAME.fullmatch(parts[2]) is not None)


def plain_segment(name: str) -> bool:
    """One ordinary path component: not empty, not ``.``/``..``, no separator, NUL or control character."""
    return name not in ("", ".", "..") and _NOT_IN_SEGMENT.search(name) is None


#: what a path component may not hold: a separator, NUL or a control character
_NOT_IN_SEGMENT = re.compile(r"[\x00-\x1f/\\]")


def root_and_rel(prefix: str, up: int) -> Optional[tuple[str, str]]:
    """(spread root, prefix relative to it) for a checkpoint at ``prefix`` whose root
    lies ``up`` segments above it; None when that is impossible or ambiguous."""
    segs = _segments(prefix)
    if not 1 <= up <= len(segs) or has_mark(prefix) or not all(plain_segment(s) for s in segs):
        return None
    return "/".join(segs[: len(segs) - up]), "/".join(segs[len(segs) - up:])


def object_key(prefix: str, up: int, bucket: str, name: str) -> Optional[str]:
    """The store key of spread object ``name`` in ``bucket``; None if the parts are not valid."""
    where = root_and_rel(prefix, up)
    if where is None or not is_bucket(bucket):
        return None
    root, rel = where
    return "/".join(p for p in (root, MARK + bucket, rel, name) if p)


@dataclass(frozen=True)
class SpreadKey:
    """What a spread object's key says about it (see :func:`parse_key`)."""

    owner: str  # the checkpoint prefix it belongs to
    name: str  # its name in that checkpoint's manifest: spread/<attempt>/<file>
    bucket: str
    up: int  # how far above ``owner`` its spread root is


def parse_key(key: str, *, allow_tmp: bool = False) -> Optional[SpreadKey]:
    """The checkpoint a spread object belongs to, from its key alone; None if ``key``
    is not of the exact shape ``<root>/.spread-<hh>/<rel>/spread/<attempt>/<file>``.
    ``allow_tmp``: also a local store's temporary of such a file (``<file>.tmp-<hex>``)."""
    parts = key.strip("/").split("/")
    at = next((i for i, s in enumerate(parts) if _MARK_SEGMENT.fullmatch(s)), None)
    if at is None:
        return None
    rel = parts[at + 1: -3]
    tail = parts[-3:]
    if not rel or len(parts) < at + 5 or tail[0] != SPREAD_DIR or not plain_segment(tail[1]):
        return None
    if not (_FILE_OR_TMP if allow_tmp else FILE_NAME).fullmatch(tail[2]):
        return None
    if has_mark("/".join(rel)) or not all(plain_segment(s) for s in parts[:at] + rel):
        return None
    owner = "/".join(parts[:at] + rel)
    return SpreadKey(owner, "/".join(tail), parts[at][len(MARK):], len(rel))


def roots_above(prefix: str) -> list[str]:
    """Every spread root that can hold objects of checkpoints at or under ``prefix``
    and lies above it: its proper ancestors, the bucket root (``""``) included."""
    segs = _segments(prefix)
    return ["/".join(segs[:i]) for i in range(len(segs))]


def up_for(prefix: str, spread_root: Optional[str]) -> int:
    """How many segments the spread root lies above ``prefix`` (``spread_root``: the
    root's store-relative key prefix, None for the parent).  ValueError when the
    checkpoint cannot be spread there."""
    segs = _segments(prefix)
    if not segs:
        raise ValueError("key_layout='spread' needs a checkpoint prefix below the bucket or directory root")
    if has_mark(prefix):
        raise ValueError(f"key_layout='spread': the prefix {prefix!r} has a segment named like a spread "
                         f"bucket ({MARK}<hex>); choose another name")
    if spread_root is None:
        return 1
    root = _segments(spread_root)
    if root != segs[: len(root)] or len(root) >= len(segs):
        raise ValueError(f"spread_root {spread_root!r} must be an ancestor of the checkpoint prefix {prefix!r}")
    return len(segs) - len(root)


@dataclass(frozen=True)
class Placement:
    """Where one rank of a save puts its objects: under the checkpoint prefix
    (``up == 0``, the default scheme) or spread (``up`` segments above it)."""

    prefix: str
    rank: int = 0
    up: int = 0
    digits: int = 2

    @property
    def bucket(self) -> str:
        """This rank's hex bucket ("" when not spread)."""
        return spread_bucket(self.rank, self.digits) if self.up else ""

    @property
    def directory(self) -> str:
        return SPREAD_DIR if self.up else keys.BLOB_DIR

    def blob_name(self, attempt: str, index: int) -> str:
        return keys.blob_name(attempt, self.rank, index, self.directory)

    def index_name(self, attempt: str) -> str:
        return keys.index_name(attempt, self.rank, self.directory)

    def key(self, name: str) -> str:
        """The store key of this rank's object ``name``."""
        if not self.up:
            return keys.join(self.prefix, name)
        key = object_key(self.prefix, self.up, self.bucket, name)
        if key is None:  # up_for refused such prefixes before the save started
            raise ValueError(f"cannot spread {name!r} of the checkpoint at {self.prefix!r} (spread_up {self.up})")
        return key
