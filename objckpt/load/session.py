"""One read session: a committed checkpoint opened for reading, the one path every reader takes.

:func:`objckpt.load`, :func:`objckpt.read` and :func:`objckpt.inspect`, the
whole-checkpoint operations (copy, diff, verify) and the bridges (the DCP reader,
the converters, the Hugging Face exporter) all open a checkpoint the same way,
through one :class:`ReadSession`:

* **where**: the store and key prefix of a URI (:func:`open_location`; a caller's
  ``store`` replaces the backend the URI names, the URI's path is then the prefix);
* **what**: the manifest, fetched once and held (:meth:`ReadSession.refresh` fetches
  it anew, for the reads that start over when the checkpoint was overwritten
  meanwhile), with its chunk resolver (format v2: the rank indexes already fetched);
* **which bytes**: a tensor key resolves to the key whose chunks hold its bytes
  (:func:`stored_key`: itself, or the tensor it is tied to);
* **the reads**: fill caller-given boxes (:meth:`ReadSession.fill`), read a whole
  tensor (:meth:`ReadSession.read`) or the whole tree without a template
  (:meth:`ReadSession.read_tree`; :func:`select_keys`: what ``read(uri, keys=...)``
  selects, globs included).  Every read is a resharding read: only the byte
  ranges overlapping the box are fetched, and every byte is checked against its crc32c.

A template load (:mod:`objckpt.load.pipeline`) takes its manifest and store from the
session too; matching the template is its own work.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Iterable, Optional, Sequence

import torch

from ..errors import (BlobMissingError, BucketNotFoundError, CorruptCheckpointError, MissingKeyError, NotFoundError,
                      ObjckptError)
from ..format import keys as objkeys
from ..format.dtypes import dtype_from_name, itemsize, new_empty
from ..format.manifest import Manifest, decode
from ..format.subtree import NOTHING, select, tensor_keys
from ..format.tree import decode_tree, iter_leaves
from ..layout import Resolver, resolver_for
from ..logs import get_logger
from ..planning.boxes import whole
from ..results import IOStats
from ..runtime import loop as _runtime
from ..runtime.memory import READ_TEMP_BYTES, Budget
from ..storage import ObjectStore, open_store, split_uri
from .fill import FillTarget, fill_boxes

log = get_logger("objckpt.load")

#: how many times a read or load starts over on a re-fetched manifest when the one it
#: read was replaced meanwhile (an overwrite deletes the old attempt's blobs once the
#: new manifest is in place: docs/format.md, "readers")
REPLACED_RETRIES = 3

#: temporaries one piece-by-piece fill may hold (pieces that cannot land in place): small,
#: so a converter's memory stays near one tensor
FILL_BUDGET = Budget(READ_TEMP_BYTES)


def open_location(uri: str, storage_options: Optional[dict[str, Any]] = None,
                  store: Optional[ObjectStore] = None) -> tuple[ObjectStore, str]:
    """The store and key prefix of ``uri`` (``store`` replaces the one the URI names)."""
    if store is None:
        return open_store(uri, storage_options)
    return store, split_uri(uri)[2].strip("/")


async def manifest_bytes(store: ObjectStore, prefix: str, uri: str) -> bytes:
    """The stored manifest of the checkpoint at ``prefix``, undecoded; :class:`NotFoundError`
    saying there is no checkpoint at ``uri`` (a missing bucket keeps its own, more precise error)."""
    try:
        return await store.get(objkeys.manifest_key(prefix))
    except BucketNotFoundError:
        raise  # names the bucket: more precise than "no checkpoint"
    except NotFoundError:
        pass
    if await _is_dcp_directory(store, prefix):
        raise NotFoundError(
            f"no objckpt checkpoint at {uri!r}: it is a torch.distributed.checkpoint (DCP) directory (a .metadata, "
            f"no {objkeys.MANIFEST_NAME}). {dcp_convert_hint(uri)}")
    raise NotFoundError(f"no checkpoint at {uri!r} (no {objkeys.MANIFEST_NAME} under it)")


def dcp_convert_hint(uri: str, target: str = "<new uri>") -> str:
    """What to do with the torch.distributed.checkpoint (DCP) directory at ``uri``: the one
    wording of a load that finds one and of a manager whose root is one (``target``: where
    the command would write)."""
    return (f"Convert it once, streaming: objckpt convert {uri} {target} "
            "(objckpt.integrations.convert.convert in Python); or load it with torch.distributed.checkpoint")


async def _is_dcp_directory(store: ObjectStore, prefix: str) -> bool:
    """Whether ``prefix`` holds DCP's ``.metadata`` (asked only once the manifest is known missing)."""
    try:
        return await store.head(objkeys.join(prefix, ".metadata")) is not None
    except ObjckptError:
        return False  # the hint is a courtesy: the NotFoundError stays the answer


async def fetch_manifest(store: ObjectStore, prefix: str, uri: str, stats: Optional[IOStats] = None) -> Manifest:
    """The decoded manifest of the checkpoint at ``prefix`` (its bytes and time counted in ``stats``)."""
    return (await _fetch(store, prefix, uri, stats))[1]


async def _fetch(store: ObjectStore, prefix: str, uri: str, stats: Optional[IOStats]) -> tuple[bytes, Manifest]:
    """The manifest's stored bytes (a copy writes them unchanged) and the manifest they decode to."""
    t0 = time.perf_counter()
    data = await manifest_bytes(store, prefix, uri)
    return data, _decoded(data, prefix, uri, stats, t0)


def _decoded(data: bytes, prefix: str, uri: str, stats: Optional[IOStats], t0: float) -> Manifest:
    """The manifest ``data`` decodes to, checked against this checkpoint's namespace; its bytes
    and the time since ``t0`` counted in ``stats``."""
    m = decode(data, f"{uri.rstrip('/')}/{objkeys.MANIFEST_NAME}")
    if stats is not None:
        stats.add(len(data))
        stats.timings.add("manifest", time.perf_counter() - t0)
    if m.spread_up:
        m.object_keys(prefix)  # a spread entry that places outside this checkpoint's namespace: corrupt, now
    return m


def stored_key(m: Manifest, key: str) -> str:
    """The key whose chunks hold ``key``'s bytes: itself, or the tensor it is tied to."""
    return m.tensors[key].alias_of or key


#: the characters that make a key a glob pattern
PATTERN_CHARS = "*?["


def is_pattern(key: str) -> bool:
    return any(c in key for c in PATTERN_CHARS)


@dataclass(frozen=True)
class ReadSelection:
    """The encoded values a read returns (``nodes``, by the key each is returned under;
    None: the whole tree) and the tensor keys whose bytes it fetches.

    What ``read(uri, keys=...)`` selects is resolved against the manifest alone, before
    any tensor byte moves, so a read fetches exactly the tensors its keys select.  A key
    is, in this order: a leaf (``"model.w"``); a glob pattern when it holds ``*``, ``?``
    or ``[`` (``fnmatch`` rules, case-sensitive, ``*`` crossing dots: ``"model.*lora*"``
    selects every leaf whose key matches, each returned under its own key); else a
    subtree or key prefix (``"optim"``, ``"model.layers.0"``), returned as the nested
    subtree under it."""

    nodes: Optional[dict[str, Any]]
    tensors: list[str]


def select_keys(m: Manifest, keys: Optional[Sequence[str]], uri: str) -> ReadSelection:
    """Resolve ``keys`` (the rules in :class:`ReadSelection`'s docstring); a key or pattern that
    selects nothing is a :class:`MissingKeyError` naming it."""
    if keys is None:
        return ReadSelection(None, list(m.tensors))
    leaves = dict(iter_leaves(m.tree))
    nodes: dict[str, Any] = {}
    missing: list[str] = []
    for k in keys:
        if not isinstance(k, str):
            raise TypeError(f"read(keys=...) takes str keys, got {type(k).__name__} {k!r}")
        if k in leaves:
            nodes[k] = leaves[k]
        elif is_pattern(k):
            hits = [lk for lk in leaves if fnmatchcase(lk, k)]
            nodes.update((lk, leaves[lk]) for lk in hits)
            if not hits:
                missing.append(k)
        else:
            node = select(m.tree, k)
            if node is NOTHING:
                missing.append(k)
            else:
                nodes[k] = node
    if missing:
        plain = [k for k in missing if not is_pattern(k)]
        patterns = [k for k in missing if is_pattern(k)]
        what = "; ".join(
            ([f"key(s) {plain[:10]} not in checkpoint {uri!r}, neither as a key nor as a key prefix"] if plain else [])
            + ([f"glob pattern(s) {patterns[:10]} match no key of checkpoint {uri!r}"] if patterns else []))
        raise MissingKeyError(f"{what} (it has {len(leaves)} keys, e.g. {list(leaves)[:5]})")
    return ReadSelection(nodes, list(dict.fromkeys(t for n in nodes.values() for t in tensor_keys(n))))


class ReadSession:
    """A committed checkpoint opened for reading: where it is, its manifest, and reads of any box.

    The manifest is fetched on first use (a load first walks its template, then asks),
    once, and held; :meth:`refresh` fetches it anew."""

    def __init__(self, uri: str, storage_options: Optional[dict[str, Any]] = None,
                 store: Optional[ObjectStore] = None, held: Optional[tuple[bytes, Optional[Manifest]]] = None
                 ) -> None:
        self.uri = uri
        self.store, self.prefix = open_location(uri, storage_options, store)
        self.stats = IOStats()
        self._manifest: Optional[Manifest] = None
        self._resolver: Optional[Resolver] = None
        #: the stored bytes of the manifest held (a copy writes them unchanged)
        self.manifest_raw = b""
        #: the manifest's bytes, and its decoded form when it was decoded, read before the
        #: session was opened from the same committed object (a tiered restore's plan reads
        #: the local step's to choose it): a load's first try takes it instead of fetching
        #: (and decoding) it again.  The session owns it from here (a load may add resolved
        #: chunks to it).
        self._held = held

    def first(self, stats: Optional[IOStats] = None,
              expect: Optional[tuple[bytes, Manifest]] = None) -> Manifest:
        """The manifest for a load's first try: the held one (no request; decoded now when it
        was held undecoded), else :meth:`refresh`; with ``expect`` (bytes, and the manifest they
        decoded to elsewhere: a prepared load's), the fetched bytes are decoded only when they
        differ from those (the same committed checkpoint in another store: the same bytes)."""
        if expect is not None and (self._held is None or self._held[1] is None):
            t0, counted = time.perf_counter(), self.stats if stats is None else stats
            fetched = self._held is None
            data = _runtime.run(manifest_bytes(self.store, self.prefix, self.uri)) if fetched else self._held[0]
            same = data == expect[0]
            self._held = (data, expect[1] if same else None)  # not the same: decoded below
            if same and fetched:
                counted.add(len(data))
                counted.timings.add("manifest", time.perf_counter() - t0)
        if self._held is None:
            return self.refresh(stats)
        self.manifest_raw, m = self._held
        self._held = None
        if m is None:  # read, not decoded yet: decoded here, as a fetch would
            m = _decoded(self.manifest_raw, self.prefix, self.uri, self.stats if stats is None else stats,
                         time.perf_counter())
        elif m.spread_up:
            m.object_keys(self.prefix)  # as _fetch: spread entries must place inside this namespace
        self._manifest, self._resolver = m, None
        return m

    @classmethod
    def open(cls, uri: str, storage_options: Optional[dict[str, Any]] = None,
             store: Optional[ObjectStore] = None) -> "ReadSession":
        """A session whose manifest is fetched now (a missing or corrupt checkpoint raises here)."""
        session = cls(uri, storage_options, store)
        session.refresh()
        return session

    @property
    def manifest(self) -> Manifest:
        if self._manifest is None:
            return self.refresh()
        return self._manifest

    @property
    def resolver(self) -> Resolver:
        """The manifest's chunk resolver (v2: rank indexes fetched as reads need them, then kept)."""
        if self._resolver is None:
            self._resolver = resolver_for(self.manifest, self.store, self.prefix)
        return self._resolver

    def refresh(self, stats: Optional[IOStats] = None) -> Manifest:
        """Fetch the manifest anew (counted in ``stats``, else in the session's own) and hold it."""
        self.manifest_raw, m = _runtime.run(_fetch(self.store, self.prefix, self.uri,
                                                   self.stats if stats is None else stats))
        self._manifest, self._resolver = m, None
        return m

    def replaced_since(self, err: BlobMissingError, tries: int) -> bool:
        """True (start over: :meth:`refresh`) when the checkpoint's manifest is no longer the one
        this session holds: the object ``err`` names went with the old attempt.  False: ``err`` is real."""
        if tries >= REPLACED_RETRIES:
            return False
        try:
            now = _runtime.run(fetch_manifest(self.store, self.prefix, self.uri)).attempt
        except (NotFoundError, CorruptCheckpointError):
            return False
        if now == self.manifest.attempt:
            return False
        log.info("checkpoint %r was replaced while reading it (%s); reading attempt %s", self.uri, err, now)
        return True

    def inspect(self, chunks: bool) -> Manifest:
        """The manifest; with ``chunks``, every tensor lists its chunks (v2: all rank indexes fetched)."""
        m = self.manifest
        if chunks:
            _runtime.run(self.resolver.resolve_all())
        return m

    def stored_key(self, key: str) -> str:
        """The key whose chunks hold ``key``'s bytes (itself, or its alias target)."""
        return stored_key(self.manifest, key)

    def dtype(self, key: str) -> torch.dtype:
        return dtype_from_name(self.manifest.tensors[key].dtype, key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.manifest.tensors[key].shape)

    def fill(self, targets: Sequence[FillTarget], stats: Optional[IOStats] = None,
             budget: Budget = FILL_BUDGET) -> None:
        """Fill each target's ``dest`` with its box (keys may be aliases); temporaries within ``budget``."""
        real = [FillTarget(self.stored_key(t.key), t.box, t.dest) for t in targets if t.dest.numel()]
        if real:
            fill_boxes(self.store, self.prefix, self.manifest, real, self.stats if stats is None else stats,
                       budget=budget, resolver=self.resolver)

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor ``key`` as a new CPU tensor."""
        out = self._alloc(self.stored_key(key))
        self.fill([FillTarget(key, whole(out.shape), out)])
        return out

    def _alloc(self, sk: str) -> torch.Tensor:
        """A new CPU tensor for stored key ``sk``: refused before allocating when the
        checkpoint holds fewer bytes than it claims; packed dtypes allocated as bytes
        (``new_empty``: torch's deterministic mode refuses them otherwise)."""
        m = self.manifest
        e = m.tensors[sk]
        dt = dtype_from_name(e.dtype, sk)
        held = sum(c.length for c in e.chunks) if e.chunks else m.total_blob_bytes
        if e.numel * itemsize(dt) > held:
            raise CorruptCheckpointError(
                f"checkpoint {self.uri!r}: tensor {sk!r} of shape {list(e.shape)} needs "
                f"{e.numel * itemsize(dt)} bytes but only {held} are stored")
        return new_empty(e.shape, dt)

    def read_tree(self, keys: Optional[Iterable[str]], allow_pickle: bool) -> Any:
        """Tensors (on CPU) and values without a template; with ``keys``, only what they select
        (:func:`select_keys`).

        A checkpoint overwritten while it is read is read again from its new manifest."""
        wanted_keys = list(keys) if keys is not None else None
        tries = 0
        while True:
            t0 = time.perf_counter()
            stats = IOStats()
            # the manifest held (fetched now if none yet); anew only when it was replaced meanwhile
            m = self.refresh(stats) if self._manifest is None or tries else self._manifest
            try:
                sel = select_keys(m, wanted_keys, self.uri)
                out = self._read_selection(sel, allow_pickle, stats)
                log.info("read %s: %d tensors, %d bytes, %d requests, %.3f s (%s)", self.uri, len(sel.tensors),
                         stats.bytes, stats.requests, time.perf_counter() - t0, stats.timings.describe())
                return out
            except BlobMissingError as e:
                if not self.replaced_since(e, tries):
                    raise
                tries += 1

    def _read_selection(self, sel: ReadSelection, allow_pickle: bool, stats: IOStats) -> Any:
        m = self.manifest
        bufs: dict[str, torch.Tensor] = {}
        for k in sel.tensors:
            sk = stored_key(m, k)
            if sk not in bufs:
                bufs[sk] = self._alloc(sk)
        fill_boxes(self.store, self.prefix, m, [FillTarget(k, whole(t.shape), t) for k, t in bufs.items()], stats,
                   resolver=self.resolver)
        tensors = {k: bufs[stored_key(m, k)] for k in sel.tensors}  # aliases: the tensor they are tied to
        where = repr(self.uri)
        if sel.nodes is None:
            return decode_tree(m.tree, tensors.__getitem__, allow_pickle=allow_pickle, where=where)
        return {k: decode_tree(n, tensors.__getitem__, allow_pickle=allow_pickle, where=where)
                for k, n in sel.nodes.items()}

