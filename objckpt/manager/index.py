"""The latest-step index: which steps are committed under a manager's root, read with no LIST.

Why an index at all: finding the newest checkpoint by listing a training root
costs one LIST per 1,000 objects (every blob of every step is under it) and
LIST is the slowest, most throttled S3 call.  A resuming job of 1,000 ranks
must answer "which step?" with a GET or two.

Layout under the root (``<root>/``)::

    step-0000000100/manifest.json     a checkpoint (the default step format: zero-padded, so listings
                                      sort; :mod:`objckpt.manager.naming` for others)
    _objckpt_index/v-000000000042.json  index version 42: immutable, written with If-None-Match: *
    _objckpt_index/head.json            a copy of the newest version (a hint, plain PUT)

Design: **an append-only chain of immutable, sequence-numbered versions**,
each written with the store's create-only conditional PUT
(``put(if_absent=True)``, S3 ``If-None-Match: *``).  Version ``n+1`` is always
computed from version ``n``; two writers that both try to create ``n+1`` are
serialised by the store, the loser re-reads ``n+1`` and retries on top of it,
so neither loses the other's update (compare-and-swap without ``If-Match``:
every backend of the ObjectStore seam already has create-only writes, while
``If-Match`` on an ETag is missing from some S3-compatible stores and from
plain files).  After its version is in, the writer also PUTs ``head.json`` —
the whole document, not just a number — so a reader needs one GET for the
content and one more (``v-<n+1>``, normally a 404) to check that the hint is
not behind.  The hint may lag (a writer killed between its two PUTs, two
writers' hint PUTs landing out of order); readers and writers always walk
forward from it until a version is missing, so a lagging hint costs a GET,
never a lost step.

Repair: a missing or undecodable ``head.json`` (or a version that cannot be
read) falls back to one LIST of ``_objckpt_index/``, takes the newest version
that decodes, and rewrites the hint.  Without any version at all, the index
is rebuilt from the checkpoints themselves (a LIST of the root and a GET of
each ``manifest.json``): the index is a cache of what the manifests say, so it
can always be rebuilt (:func:`rebuild`).  A listing that finds no version and no
step also tells whether the root is a torch.distributed.checkpoint run
(:attr:`IndexDoc.dcp`, :func:`refuse_dcp`): at no extra request.

Old versions are deleted :data:`KEEP_VERSIONS` behind the head, so a reader
walking forward from a hint that lags by fewer than that many commits never
falls into a gap.  A writer checks, after its hint PUT, that no newer version
appeared meanwhile (one GET, normally a 404) and otherwise puts the newest
hint back, so a hint only stays behind when its writer stalled between its
two PUTs *and* died right after the late one; a gap needs that and 64 commits
by others in between (the residual risk: the next update would then be based
on the lagging version).  The documents are sealed JSON (a crc32c field, as
manifests), so a damaged one is detected rather than trusted.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

from ..errors import (ConditionalWriteIgnoredError, CorruptCheckpointError, DcpDirectoryError, NotFoundError,
                      ObjckptError, PreconditionFailed)
from ..format import keys
from ..format.manifest import decode
from ..format.sealed_json import load_json, seal, verify
from ..load.session import dcp_convert_hint
from ..storage import ObjectInfo, ObjectStore
from .naming import (DEFAULT_STEP_FORMAT, InvalidStepError, StepFormatError, StepNaming,  # noqa: F401
                     parse_step_name, step_name)  # re-exported: their home was this module

INDEX_DIR = "_objckpt_index"
#: torch.distributed.checkpoint's metadata file: a folder holding it is a DCP checkpoint
DCP_METADATA = ".metadata"
HEAD_NAME = "head.json"
STEP_FORMAT = DEFAULT_STEP_FORMAT
_VERSION_RE = re.compile(r"v-(\d+)\.json")
KIND = "objckpt-step-index"
#: versions kept behind the newest (older ones are deleted by the writer)
KEEP_VERSIONS = 64
#: how many times a writer retries a conditional PUT it lost to another writer
MAX_CAS_ATTEMPTS = 50


class IndexContentionError(ObjckptError, TimeoutError):
    """The step index could not be updated: every conditional write lost to another writer."""


@dataclass(frozen=True)
class StepEntry:
    """One committed step as the index records it (enough for ``ls`` and retention)."""

    step: int
    time: float = 0.0  # commit time, seconds since the epoch
    bytes: int = 0  # stored bytes (blob sizes)
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "time": self.time, "bytes": self.bytes, "metadata": self.metadata}


@dataclass(frozen=True)
class IndexDoc:
    """One version of the index."""

    seq: int = -1  # -1: no version exists yet
    steps: tuple[StepEntry, ...] = ()
    #: how the steps' folders are named (:mod:`objckpt.manager.naming`)
    step_format: str = DEFAULT_STEP_FORMAT
    #: with no version and no step: the torch.distributed.checkpoint directories the root's
    #: listing showed (``""`` the root itself, else a folder right under it; see :func:`refuse_dcp`)
    dcp: tuple[str, ...] = ()

    def __iter__(self) -> Iterator[StepEntry]:
        """The entries, oldest step first."""
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def step_numbers(self) -> list[int]:
        return sorted(e.step for e in self.steps)

    def get(self, step: int) -> Optional[StepEntry]:
        return next((e for e in self.steps if e.step == step), None)

    def with_step(self, entry: StepEntry) -> "IndexDoc":
        rest = [e for e in self.steps if e.step != entry.step]
        return replace(self, steps=tuple(sorted(rest + [entry], key=lambda e: e.step)))

    def adopt(self, entries: "tuple[StepEntry, ...]") -> "IndexDoc":
        """Add the ``entries`` whose step is not indexed yet (what is indexed wins)."""
        have = set(self.step_numbers())
        new = [e for e in entries if e.step not in have]
        return replace(self, steps=tuple(sorted(self.steps + tuple(new), key=lambda e: e.step))) if new else self

    def without(self, steps: "set[int]") -> "IndexDoc":
        return replace(self, steps=tuple(e for e in self.steps if e.step not in steps))

    def encode(self) -> bytes:
        obj: dict[str, Any] = {"kind": KIND, "version": 1, "seq": self.seq, "updated": time.time(),
                               "steps": [e.to_json() for e in self.steps]}
        if self.step_format != DEFAULT_STEP_FORMAT:  # only then: older readers stay right for the default
            obj["step_format"] = self.step_format
        return seal(obj)


def decode_doc(data: bytes, where: str) -> IndexDoc:
    """Parse and check one index document; :class:`CorruptCheckpointError` naming ``where``."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"step index {where!r}: {what}")

    obj = load_json(data, bad)
    if not isinstance(obj, dict) or obj.get("kind") != KIND:
        raise bad("not an objckpt step index")
    verify(obj, bad, required=True)
    try:
        seq = obj["seq"]
        entries = tuple(StepEntry(int(e["step"]), float(e.get("time", 0.0)), int(e.get("bytes", 0)),
                                  dict(e.get("metadata") or {})) for e in obj["steps"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise bad(f"malformed entry ({type(e).__name__}: {e})") from None
    if type(seq) is not int or seq < 0:
        raise bad(f"bad sequence number {seq!r}")
    fmt = obj.get("step_format", DEFAULT_STEP_FORMAT)
    try:
        StepNaming(fmt)
    except StepFormatError as e:
        raise bad(f"bad step_format ({e})") from None
    return IndexDoc(seq, tuple(sorted(entries, key=lambda e: e.step)), fmt)


def dcp_folders(listing: "list[ObjectInfo]", root: str) -> tuple[str, ...]:
    """The torch.distributed.checkpoint directories in a listing of ``root``: the root
    itself (``""``) and the folders right under it that hold DCP's ``.metadata``, sorted."""
    base = root + "/" if root else ""
    found = set()
    for o in listing:
        parts = o.key[len(base):].split("/") if o.key.startswith(base) else []
        if 0 < len(parts) <= 2 and parts[-1] == DCP_METADATA:
            found.add("/".join(parts[:-1]))
    return tuple(sorted(found))


def refuse_dcp(doc: IndexDoc, root_uri: str, naming: StepNaming) -> None:
    """:class:`DcpDirectoryError` when ``doc`` (a read of a root with no index and no step)
    found DCP checkpoints there.  Why refuse: ``latest_step()`` None is how a job decides to
    start from scratch, so a manager pointed at a DCP run would silently leave it behind."""
    if not doc.dcp:
        return
    uris = [root_uri if not d else f"{root_uri}/{d}" for d in doc.dcp]
    step_dir = re.sub(r"\{[^}]*\}", "<step>", naming.fmt)
    if uris[0] == root_uri:
        what = "is a torch.distributed.checkpoint (DCP) directory (a .metadata) with no objckpt step"
    else:
        more = f" and {len(uris) - 3} more" if len(uris) > 3 else ""
        what = (f"holds torch.distributed.checkpoint (DCP) checkpoints ({', '.join(doc.dcp[:3])}{more}: a .metadata "
                "in each) and no objckpt step")
    raise DcpDirectoryError(
        f"CheckpointManager root {root_uri!r} {what}, so the manager would find no step there and start from "
        f"scratch. {dcp_convert_hint(uris[0], f'<new root>/{step_dir}')}. A manager of <new root> then resumes "
        "from that step; for a new run, give the manager another root")


@dataclass
class ReadStats:
    """How a read found the head (tests and ``ls`` report it)."""

    listed: bool = False  # a LIST was needed (missing/corrupt hint, or no index yet)
    repaired: bool = False  # the hint was rewritten


class StepIndex:
    """The index of one root inside one store; all methods are coroutines for the background loop.

    ``naming``: the step folder format (a manager's ``step_format``); an index written
    with another one (and holding steps) is a :class:`StepFormatError` at the first
    read.  None (the command line): whatever format the index records, the default
    when there is no index."""

    def __init__(self, store: ObjectStore, root: str, naming: Optional[StepNaming] = None) -> None:
        self.store = store
        self.root = root.strip("/")
        self.naming = naming if naming is not None else StepNaming()
        self._fixed = naming is not None

    # -- keys ---------------------------------------------------------------------------------
    def step_prefix(self, step: int) -> str:
        return keys.join(self.root, self.naming.name(step))

    def _check_format(self, doc: IndexDoc) -> IndexDoc:
        """Follow (command line) or insist on (manager) the format ``doc`` was written with."""
        if doc.step_format == self.naming.fmt:
            return doc
        if not self._fixed:
            self.naming = StepNaming(doc.step_format)
        elif doc.steps:
            raise StepFormatError(
                f"the steps under {self.root or '/'!r} are named {doc.step_format!r} (their index says so), not "
                f"{self.naming.fmt!r}: pass step_format={doc.step_format!r} to manage them")
        return doc

    def _version_key(self, seq: int) -> str:
        return keys.join(self.root, INDEX_DIR, f"v-{seq:012d}.json")

    @property
    def head_key(self) -> str:
        return keys.join(self.root, INDEX_DIR, HEAD_NAME)

    # -- reading ------------------------------------------------------------------------------
    async def _get_doc(self, key: str, seq: Optional[int] = None) -> Optional[IndexDoc]:
        """The document at ``key``; None when absent; CorruptCheckpointError when damaged
        (or, for a version, when it does not hold sequence number ``seq``: a walk must advance)."""
        try:
            raw = await self.store.get(key)
        except NotFoundError:
            return None
        doc = decode_doc(raw, key)
        if seq is not None and doc.seq != seq:
            raise CorruptCheckpointError(f"step index {key!r}: holds sequence number {doc.seq}, not {seq}")
        return doc

    async def _forward(self, doc: IndexDoc) -> IndexDoc:
        """Walk from ``doc`` to the newest version (normally one 404)."""
        while True:
            nxt = await self._get_doc(self._version_key(doc.seq + 1), doc.seq + 1)
            if nxt is None:
                return doc
            doc = nxt

    async def read(self, stats: Optional[ReadStats] = None, *, repair: bool = True) -> IndexDoc:
        """The newest version: GET the hint, GET the next version (absent); LIST only to repair.
        ``repair=False`` (read-only tools): never write; without any version the result has
        ``seq == -1`` and the steps the manifests show."""
        stats = stats if stats is not None else ReadStats()
        try:
            hint = await self._get_doc(self.head_key)
        except CorruptCheckpointError:
            hint = None
        if hint is not None:
            try:
                head = await self._forward(hint)
            except CorruptCheckpointError:
                head = None  # a damaged version after the hint: repair from the listing
            if head is not None:
                self._check_format(head)
                if head.seq != hint.seq and repair:
                    await self._put_hint(head)
                return head
        stats.listed = True
        listing = await self.store.list(self.root + "/" if self.root else "")
        head = await self._newest_listed(listing)
        if head is not None:
            self._check_format(head)
        if head is None:
            head = await self._from_manifests(listing)
            if head.steps and repair:
                listed = head
                head = await self._append(IndexDoc(-1), lambda d: d.adopt(listed.steps))
        if head.seq < 0 and not head.steps:  # nothing of objckpt's: is it someone's DCP run? (no request)
            head = replace(head, dcp=dcp_folders(listing, self.root))
        if not repair:
            return head
        stats.repaired = True
        await self._put_hint(head)
        return head

    async def _newest_listed(self, listing: "list[ObjectInfo]") -> Optional[IndexDoc]:
        """The newest decodable version in a listing of the root (walked forward); None without any.
        When newer versions exist but are damaged, the manifests decide the content."""
        folder = keys.join(self.root, INDEX_DIR) + "/"
        seqs = sorted((int(m.group(1)) for o in listing if o.key.startswith(folder)
                       and (m := _VERSION_RE.fullmatch(o.key[len(folder):]))), reverse=True)
        if not seqs:
            return None
        try:
            doc = await self._get_doc(self._version_key(seqs[0]), seqs[0])
            if doc is not None:
                return await self._forward(doc)
        except CorruptCheckpointError:
            pass
        return IndexDoc(seqs[0], (await self._from_manifests(listing)).steps)

    async def _from_manifests(self, listing: "list[ObjectInfo]") -> IndexDoc:
        """What the committed checkpoints in a listing of the root say (a GET per manifest)."""
        base = self.root + "/" if self.root else ""
        entries = []
        for o in listing:
            parts = o.key[len(base):].split("/")
            if not o.key.startswith(base) or len(parts) != 2 or parts[1] != keys.MANIFEST_NAME:
                continue
            step = self.naming.parse(parts[0])
            if step is not None:
                entries.append(await self.describe_step(step, fallback_time=o.mtime or 0.0))
        return IndexDoc(-1, tuple(sorted(entries, key=lambda e: e.step)), self.naming.fmt)

    async def describe_step(self, step: int, metadata: Optional[dict[str, Any]] = None,
                            fallback_time: float = 0.0, saved_at: Optional[float] = None) -> StepEntry:
        """The entry for a committed step, from its manifest (size, time, metadata);
        ``saved_at``: the save time the manager recorded (its clock), instead of the manifest's."""
        mkey = keys.manifest_key(self.step_prefix(step))
        try:
            m = decode(await self.store.get(mkey), mkey)
        except CorruptCheckpointError:
            return StepEntry(step, saved_at if saved_at is not None else fallback_time, 0, dict(metadata or {}))
        when = saved_at if saved_at is not None else (m.created or fallback_time)
        return StepEntry(step, when, sum(b.size for b in m.blobs), dict(m.metadata if metadata is None else metadata))

    # -- writing ------------------------------------------------------------------------------
    async def _put_hint(self, doc: IndexDoc) -> None:
        if doc.seq >= 0:
            await self.store.put(self.head_key, doc.encode())

    async def _append(self, base: IndexDoc, change: Callable[[IndexDoc], IndexDoc]) -> IndexDoc:
        """Create version ``base.seq + 1`` = ``change(base)``; on losing the race, move forward and retry."""
        doc = base
        for _ in range(MAX_CAS_ATTEMPTS):
            new = replace(change(doc), seq=doc.seq + 1, step_format=self.naming.fmt)
            data, key = new.encode(), self._version_key(new.seq)
            try:
                await self.store.put(key, data, if_absent=True)
            except PreconditionFailed:
                try:
                    doc = await self._forward(doc)
                except CorruptCheckpointError:
                    doc = await self.read()
                continue
            await self._confirm_ours(key, data)
            return new
        raise IndexContentionError(f"step index under {self.root!r}: gave up after {MAX_CAS_ATTEMPTS} conditional "
                          "writes lost to other writers")

    async def _confirm_ours(self, key: str, data: bytes) -> None:
        """A create-only write reported success: the version at ``key`` must be ours (its
        bytes, which carry the time of the update).  Otherwise the store ignored
        ``If-None-Match`` and another writer's version replaced ours, so this update (and
        perhaps theirs) would be lost silently: :class:`ConditionalWriteIgnoredError`."""
        try:
            stored = await self.store.get(key)
        except NotFoundError:
            stored = None
        if stored == data:
            return
        what = "is gone" if stored is None else "holds another writer's version"
        raise ConditionalWriteIgnoredError(
            f"step index under {self.root!r}: {self.store.describe()} reported the create-only write "
            f"(If-None-Match: *) of {key!r} as successful, but a GET right after {what}: the store does not honour "
            "conditional writes (or does not read back what it acknowledged), so concurrent index updates can be "
            "lost.  Use a store that honours If-None-Match (docs/reliability.md, "
            "'What objckpt requires of a store').")

    async def update(self, change: Callable[[IndexDoc], IndexDoc]) -> IndexDoc:
        """Apply ``change`` to the newest version as one new version (no update is ever lost),
        refresh the hint, and drop the version :data:`KEEP_VERSIONS` behind."""
        base = await self.read()
        if change(base).steps == base.steps:
            return base  # nothing to change (e.g. removing a step that is not indexed)
        new = await self._append(base, change)
        await self._put_hint(new)
        # our hint PUT may have landed after a newer writer's (we stalled between our two
        # PUTs): one GET tells, and the newest hint goes back in
        newest = await self._forward(new)
        if newest.seq != new.seq:
            await self._put_hint(newest)
        old = new.seq - KEEP_VERSIONS
        if old >= 0:
            await self.store.delete([self._version_key(old)])
        return new

    async def add(self, entry: StepEntry) -> IndexDoc:
        return await self.update(lambda d: d.with_step(entry))

    async def remove(self, steps: "set[int]") -> IndexDoc:
        return await self.update(lambda d: d.without(steps))

    async def survey(self) -> IndexDoc:
        """Read-only: the index with the committed steps it misses adopted (LIST + a GET per
        unindexed manifest); what :meth:`rebuild` would write, for dry runs."""
        current = await self.read(repair=False)
        listing = await self.store.list(self.root + "/" if self.root else "")
        base = self.root + "/" if self.root else ""
        have = set(current.step_numbers())
        extra = []
        for o in listing:
            parts = o.key[len(base):].split("/")
            if len(parts) == 2 and parts[1] == keys.MANIFEST_NAME:
                step = self.naming.parse(parts[0])
                if step is not None and step not in have:
                    extra.append(await self.describe_step(step, fallback_time=o.mtime or 0.0))
        return current.adopt(tuple(extra))

    async def rebuild(self) -> IndexDoc:
        """Make the index agree with the committed checkpoints (LIST + a GET per manifest):
        adopts steps committed but never indexed (a save killed between its manifest and
        its index update) and drops steps whose manifest is gone (checked again with a
        HEAD, so a step another writer committed after the LIST is never dropped)."""
        listing = await self.store.list(self.root + "/" if self.root else "")
        truth = await self._from_manifests(listing)
        listed = {e.step for e in truth.steps}
        current = await self.read()
        gone = set()
        for s in set(current.step_numbers()) - listed:
            if await self.store.head(keys.manifest_key(self.step_prefix(s))) is None:
                gone.add(s)

        return await self.update(lambda d: d.adopt(truth.steps).without(gone))
