"""Garbage collection under a prefix: what failed, crashed or replaced saves left.

A failed save cleans up after itself, but a killed process cannot: its blobs,
rank index objects, unfinished multipart uploads (which S3 bills for) and
local ``manifest.json.tmp-*`` files stay behind.  ``collect_garbage`` removes
them following the rules of docs/format.md §8:

* only objects under a checkpoint's ``blobs/`` that its manifest does not
  name (all of them when there is no manifest), unfinished multipart uploads,
  stray manifest temporaries and the store probe objects (``_objckpt_probe/``)
  of saves killed while probing;
* only once older than ``grace`` seconds, judged by the attempt id's
  timestamp (else the object's modification time; unknown age = young), so a
  save in progress or an overwrite about to commit is never touched;
* the listing is taken before the manifests are read, so a blob listed for a
  manifest that committed meanwhile is seen as referenced;
* a checkpoint whose manifest cannot be read is left alone entirely;
* a Lightning marker (:mod:`objckpt.format.marker`) whose checkpoint is gone (no
  ``<key>/manifest.json``: what a delete of an older release left, which did not know
  markers, or a save of the same path racing a delete) is removed, once older than
  ``grace`` by its modification time (any age with ``grace=0``: a marker without a
  manifest is never a save in progress, since the plugin writes it after the commit).
  Which objects a checkpoint owns, and so keeps, is :mod:`objckpt.ops.owned`'s one
  definition: a marker whose manifest is there is never touched.  Candidates are the
  small objects no save wrote (at most :data:`~objckpt.format.marker.MAX_MARKER_BYTES`)
  with no manifest under them, and ``prefix`` itself, leaving out objckpt's own
  (``_objckpt*``: step indexes, probes); each is read (one GET) to recognise it, and its
  manifest asked for again (one HEAD) just before it goes.

Spread checkpoints (format v4, :mod:`objckpt.format.spread`) keep their objects
under ``<root>/.spread-<hh>/<rel>/spread/<attempt>/`` with ``<root>`` above the
checkpoint.  Such a key names its owner (``<root>/<rel>``) by its shape alone,
so it is judged against that owner's manifest like any blob.  Besides what lies
under ``prefix``, the collector lists the spread areas of the roots up to
``spread_levels`` segments above ``prefix`` (1: the parent, the default spread
root) and of every root a manifest under ``prefix`` records, keeping only the
objects whose owner is under ``prefix``.
"""
from __future__ import annotations

import calendar
import re
import time
from dataclasses import dataclass, field
from typing import Optional

from ..format import keys, spread
from ..format.manifest import Manifest, decode
from ..format.marker import MAX_MARKER_BYTES
from ..save.store_check import is_probe_key
from ..storage import ObjectStore
from ..storage.base import ObjectInfo, UploadInfo
from .owned import named_objects, orphaned_marker

TMP_MARK = f"{keys.MANIFEST_NAME}.tmp-"


@dataclass
class GcReport:
    checkpoints: int = 0  # committed checkpoints seen
    deleted: list[str] = field(default_factory=list)
    deleted_bytes: int = 0
    aborted_uploads: list[str] = field(default_factory=list)
    kept_young: int = 0  # garbage still inside the grace period
    unreadable: list[str] = field(default_factory=list)  # manifests that could not be read (left alone)
    #: Lightning markers whose checkpoint is gone (also in ``deleted``)
    markers: list[str] = field(default_factory=list)


def attempt_time(attempt: str) -> Optional[float]:
    """The UTC time encoded in an attempt id (``YYYYMMDDTHHMMSS-<hex>``)."""
    try:
        return float(calendar.timegm(time.strptime(attempt.split("-", 1)[0], "%Y%m%dT%H%M%S")))
    except (ValueError, IndexError):
        return None


#: the file names a save writes under ``blobs/<attempt>/``: blobs, v2 rank index objects, the
#: decision record of a multi-rank save (keys.DECISION_FILE), and the local store's temporaries of them (``<name>.tmp-<hex>``, left by a killed save)
_BLOB_FILE = re.compile(r"(r\d+(-\d+\.bin|\.index\.json)|decision\.json)(\.tmp-[0-9a-f]+)?")


def _split(key: str) -> Optional[tuple[str, str]]:
    """(checkpoint prefix, path relative to it) of an object a save wrote, else None.

    Only keys of the exact shape ``<prefix>/blobs/<attempt>/<blob or index file>``
    qualify: a folder *above* a checkpoint may itself be named ``blobs``
    (``team/blobs/ck1/manifest.json``), and taking any ``blobs`` component would
    attribute that checkpoint's manifest and blobs to a wrong, manifest-less
    prefix and delete them."""
    parts = key.split("/")
    if len(parts) < 3 or parts[-3] != keys.BLOB_DIR or parts[-2] in ("", ".", ".."):
        return None
    if not _BLOB_FILE.fullmatch(parts[-1]):
        return None
    return "/".join(parts[:-3]), "/".join(parts[-3:])


def _owner(key: str) -> Optional[tuple[str, str]]:
    """(checkpoint prefix, name in its manifest) of an object a save wrote, spread or not."""
    sp = spread.parse_key(key, allow_tmp=True)
    return (sp.owner, sp.name) if sp is not None else _split(key)


def _under(owner: str, base: str) -> bool:
    return not base or owner == base or owner.startswith(base + "/")


async def _spread_areas(store: ObjectStore, base: str, roots: list[str]) -> tuple[list[ObjectInfo], list[UploadInfo]]:
    """Objects and uploads in the spread areas of ``roots`` that belong to checkpoints under ``base``."""
    objs: list[ObjectInfo] = []
    ups: list[UploadInfo] = []
    for root in roots:
        area = f"{root}/{spread.MARK}" if root else spread.MARK
        objs += [o for o in await store.list(area) if (w := _owner(o.key)) is not None and _under(w[0], base)]
        found: list[UploadInfo] = list(await store.list_uploads(area))
        ups += [u for u in found if (w := _owner(u.key)) is not None and _under(w[0], base)]
    return objs, ups


async def _read_manifests(store: ObjectStore, manifests: list[str]) -> list[tuple[str, str, Optional[Manifest]]]:
    """(checkpoint prefix, manifest key, manifest or None if unreadable) for each manifest key."""
    out: list[tuple[str, str, Optional[Manifest]]] = []
    for mkey in manifests:
        ck = mkey[: -len(keys.MANIFEST_NAME)].rstrip("/")
        try:
            out.append((ck, mkey, decode(await store.get(mkey), mkey)))
        except Exception:
            out.append((ck, mkey, None))
    return out


def _age(rel: str, info: Optional[ObjectInfo], now: float) -> Optional[float]:
    t = attempt_time(keys.attempt_of(rel)) if rel else None
    if t is None and info is not None:
        t = info.mtime
    return None if t is None else now - t


def _maybe_marker(o: ObjectInfo, manifests: set[str]) -> bool:
    """Whether ``o`` could be a Lightning marker with no checkpoint: of a marker's size, not
    one of objckpt's own objects (a step index, a probe: names starting ``_objckpt``), and
    no manifest under its key in the listing (read and asked again before it goes)."""
    if not 0 < o.size <= MAX_MARKER_BYTES or any(p.startswith("_objckpt") for p in o.key.split("/")):
        return False
    return keys.manifest_key(o.key) not in manifests


async def collect_garbage(store: ObjectStore, prefix: str, *, grace: float = 6 * 3600, dry_run: bool = False,
                          now: Optional[float] = None, spread_levels: int = 1) -> GcReport:
    """Delete what no checkpoint under ``prefix`` references; see the module docstring."""
    now = time.time() if now is None else now
    report = GcReport()
    base = prefix.strip("/")
    listing = await store.list(base + "/" if base else "")
    uploads = await store.list_uploads(base + "/" if base else "")
    above = spread.roots_above(base)  # nearest last
    roots = set(above[max(0, len(above) - spread_levels):]) if spread_levels > 0 else set()
    more, more_uploads = await _spread_areas(store, base, sorted(roots))
    listing, uploads = listing + more, [*uploads, *more_uploads]
    manifests = [o.key for o in listing if o.key == keys.MANIFEST_NAME or o.key.endswith("/" + keys.MANIFEST_NAME)]
    decoded = await _read_manifests(store, manifests)
    extra = {w[0] for ck, _, m in decoded if m is not None and m.spread_up
             and (w := spread.root_and_rel(ck, m.spread_up)) is not None and w[0] in above} - roots
    if extra:  # spread roots further up that manifests record: list them, then read the manifests again
        more, more_uploads = await _spread_areas(store, base, sorted(extra))
        listing, uploads = listing + more, [*uploads, *more_uploads]
        decoded = await _read_manifests(store, manifests)
    referenced: dict[str, Optional[set[str]]] = {}  # checkpoint prefix -> keys its manifest uses (None: unreadable)
    for ck, mkey, m in decoded:
        try:
            if m is None:
                raise ValueError("unreadable")
            referenced[ck] = set(named_objects(m, ck))
        except Exception:
            referenced[ck] = None
            report.unreadable.append(mkey)
            continue
        report.checkpoints += 1

    doomed: list[ObjectInfo] = []
    committed = set(manifests)
    maybe_markers: list[ObjectInfo] = []
    for o in listing:
        if TMP_MARK in o.key.rsplit("/", 1)[-1] or is_probe_key(o.key):
            rel = ""  # a stray temporary, or a store probe of a killed save (save.store_check): aged by its time
        else:
            where = _owner(o.key)
            if where is None:
                if _maybe_marker(o, committed):
                    maybe_markers.append(o)
                continue
            ck, rel = where
            if not _under(ck, base):  # a spread area listed from inside: its owner's manifest was not read
                continue
            names = referenced.get(ck, set())
            if names is None or o.key in names:
                continue
        age = _age(rel, o, now)
        if age is None or age < grace:
            report.kept_young += 1
            continue
        doomed.append(o)
    own = await store.head(base) if base else None  # the marker of a checkpoint at ``prefix`` itself
    if own is not None and _maybe_marker(own, committed):
        maybe_markers.append(own)
    for o in maybe_markers:  # grace 0: every orphan, also one whose age the store does not say (an S3 HEAD)
        age = _age("", o, now)
        if grace > 0 and (age is None or age < grace):
            continue
        if await orphaned_marker(store, o.key, o.size):
            doomed.append(o)
            report.markers.append(o.key)
    if doomed and not dry_run:
        await store.delete([o.key for o in doomed])
    report.deleted = [o.key for o in doomed]
    report.deleted_bytes = sum(o.size for o in doomed)
    for u in uploads:
        where = _owner(u.key)
        if where is not None and not _under(where[0], base):
            continue
        rel = where[1] if where else ""
        t = attempt_time(keys.attempt_of(rel)) if rel else None
        t = t if t is not None else u.initiated
        if t is None or now - t < grace:
            report.kept_young += 1
            continue
        if not dry_run:
            await store.abort_upload(u)
        report.aborted_uploads.append(u.key)
    return report
