"""Draining: a committed local step copied to object storage as an ordinary checkpoint.

The drain is collective and moves *files*, not ranks' shares: every rank learns the
step's manifest and which of the files it names (blobs and rank indexes) each rank's
node folder holds (one all-gather of :class:`~objckpt.tier.drain_plan.NodeFiles`), and
every rank computes the same assignment (:func:`~objckpt.tier.drain_plan.assign`): each
file to the rank that wrote it where its node holds it, the rest spread over the ranks
whose nodes hold a copy.  So a job restarted at another world size drains the step the
old ranks wrote, from whichever node holds each file.

Every byte is checked against the manifest as it is read, before the destination holds
it (:mod:`objckpt.ops.mover`, the mover ``objckpt.copy`` uses too): a rank index against
its size and crc32c before its PUT, a blob's chunks against their crc32c part by part
before the part is written, its multipart upload aborted on a mismatch.  A copy that
fails its check (or cannot be read) is rejected and the file goes, in the next round,
to another node's copy (a peer's replica); a file no node holds intact is a
non-retryable :class:`DrainError` naming the files and the nodes checked, and nothing is
committed.  Rank indexes go up first: their verified bytes, shared among the ranks, list
a format-v2 step's chunks for the blob checks.

Rank 0 commits through :func:`objckpt.save.commit.commit` (the one conditional manifest
write) only when every named file is up, with the local manifest's bytes unchanged (the
names it records are relative to the step prefix, the same in both tiers).  A rank that
fails or dies before that leaves no manifest: the step does not exist in object storage
(its blobs are leftovers for ``objckpt gc``).  Ranks' outcomes cross as
:class:`~objckpt.distributed.comm.RankError`.

Each rank uploads from one reused buffer at a time, taken from the process-wide host pool
and drawn from the drain's memory budget (``memory_bytes``, else
:data:`~objckpt.runtime.memory.DRAIN_MEMORY_BYTES`): the part shrinks to fit a given
budget, down to the store's smallest part; below that the rank's upload fails with a
:class:`~objckpt.errors.MemoryBudgetError` naming the budget, and the drain commits nothing.

A drain may be tried again (:class:`~objckpt.tier.backlog.DrainQueue`): the files go up
again under the same names, and a manifest of the same save attempt already at the
destination means an earlier attempt committed (its answer lost): success.  A
:class:`DrainError` says whether a later attempt may succeed (``retryable``): not when no
node holds a file intact or another checkpoint is committed there; ``gone`` when no node
holds the step's manifest at all.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Optional

from ..checksum import crc32c
from ..distributed.comm import Comm, RankError
from ..errors import CorruptCheckpointError, ObjckptError, error_class
from ..format import manifest as _manifest
from ..layout import resolver_for
from ..ops import mover
from ..results import IOStats
from ..runtime import loop as _runtime
from ..runtime.memory import (DRAIN_MEMORY_BYTES, Budget, OperationBudget, given_or_default, host_bytes, host_pool,
                              positive_bytes)
from ..save.commit import CommitState, CommitStatus, commit
from ..storage import ObjectStore
from ..storage.memory import MemoryStore
from ..units import MiB
from . import local as _local
from .drain_plan import DrainFile, NodeFiles, assign
from .errors import DrainCutError, DrainError

log = logging.getLogger("objckpt.tier")

#: bytes read from a local file and sent per write (a part of a multipart upload)
DRAIN_PART = 16 * MiB


@dataclass
class DrainReport:
    """One rank's part of one drain."""

    step: int
    uri: str
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    committed: bool = False  # rank 0: wrote the manifest (every rank learns it)
    errors: dict[int, str] = field(default_factory=dict)  # rank -> why its upload failed


class Throttle:
    """At most ``rate`` bytes per second, averaged from the first byte (None: no cap)."""

    def __init__(self, rate: Optional[float]) -> None:
        self.rate = rate
        self.t0 = time.monotonic()
        self.sent = 0

    def account(self, n: int) -> None:
        self.sent += n
        if self.rate:
            ahead = self.sent / self.rate - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)


def _forget(f: BinaryIO) -> None:
    """Drop what was just read from the page cache: a drain reads each local file once, and
    its pages would only push the training's own cached data out."""
    try:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def drain_budget(memory_bytes: Optional[int] = None) -> OperationBudget:
    """A drain's upload buffer budget: ``memory_bytes`` (strict), else
    :data:`~objckpt.runtime.memory.DRAIN_MEMORY_BYTES` (lenient: a part the store requires
    larger than that, for a huge file, is still taken alone, as it always was)."""
    given = None if memory_bytes is None else positive_bytes(memory_bytes, "memory_bytes")
    return given_or_default("drain memory budget", given, DRAIN_MEMORY_BYTES)


def upload_file(src: Path, store: ObjectStore, key: str, throttle: Throttle,
                budget: Optional[OperationBudget] = None, check: Optional[mover.BlobCheck] = None,
                size: Optional[int] = None, stop: Optional[Callable[[], bool]] = None) -> int:
    """``src`` to ``key``, in parts of :data:`DRAIN_PART` (a multipart upload past one part),
    through one buffer from the host pool drawn from ``budget`` (default :func:`drain_budget`).
    ``check`` (the blob's chunk crcs): every part is checked as it is read, before it is
    written; a mismatch raises :class:`~objckpt.errors.CorruptCheckpointError` and aborts the
    upload (nothing completed at ``key``).  ``size``: the size the manifest records (a copy
    of another size is damaged: refused before anything is sent).  ``stop``: checked before
    each part; true, the upload is aborted with :class:`DrainCutError`."""
    budget = budget if budget is not None else drain_budget()
    have = src.stat().st_size
    if size is not None and have != size:
        raise CorruptCheckpointError(f"{str(src)!r} holds {have} bytes, its manifest says {size}")
    size = have
    part = mover.budgeted_part(size, store, DRAIN_PART, budget, f"draining {str(src)!r}")
    pool = host_pool()
    with open(src, "rb", buffering=0) as f, budget.hold(part, f"a drain's upload buffer for {str(src)!r}"):
        buf = pool.take(max(part, 1), Budget(max(part, 1)))  # exactly what the budget drew
        try:
            view = host_bytes(buf)

            def fill(off: int, n: int) -> memoryview:
                got = 0
                while got < n:
                    r = f.readinto(view[got:n])
                    if not r:
                        raise OSError(f"{str(src)!r} is shorter than the {size} bytes it had (changed while draining)")
                    got += r
                _forget(f)
                if check is not None:  # before the bytes are sent
                    check.feed(off, view[:n])
                return view[:n]

            if size <= part:
                data = fill(0, size)
                if check is not None:
                    check.finish()
                _runtime.run(store.put(key, data))
                throttle.account(size)
                return size
            pieces = mover.parts(size, part)
            writer = store.open_writer(key, size, len(pieces))
            try:
                for i, (off, n) in enumerate(pieces):
                    _check_stop(stop, str(src))
                    _runtime.run(writer.write_part(i, off, fill(off, n)))
                    throttle.account(n)
                if check is not None:
                    check.finish()
                _runtime.run(writer.complete())
            except BaseException:
                _runtime.run(writer.abort())
                raise
        finally:
            pool.give(buf)
    return size


@dataclass
class RankOutcome:
    """One rank's uploads of one round (picklable: all-gathered)."""

    done: list[str] = field(default_factory=list)
    #: file -> why this node's copy was rejected (its check failed, it could not be read)
    bad: dict[str, str] = field(default_factory=dict)
    #: what stopped this rank's uploads (object storage down, a memory budget): the drain fails
    error: Optional[RankError] = None
    #: rank index name -> its verified bytes (the index round: they list a v2 step's chunks)
    indexes: dict[str, bytes] = field(default_factory=dict)
    bytes: int = 0


@dataclass
class _Step:
    """The step being drained, the same on every rank."""

    step: int
    uri: str
    prefix: str
    data: bytes
    m: _manifest.Manifest
    holders: list[NodeFiles]
    checks: dict[str, mover.BlobCheck] = field(default_factory=dict)
    rejected: set[tuple[str, str]] = field(default_factory=set)


def drain(comm: Comm, step: int, step_dir: Path, store: ObjectStore, prefix: str, uri: str,
          bandwidth: Optional[float] = None, memory_bytes: Optional[int] = None, node: str = "",
          known: Optional[_manifest.Manifest] = None, stop: Optional[Callable[[], bool]] = None) -> DrainReport:
    """Collective over ``comm``: every file the step's manifest names, from whichever rank's
    node folder (``step_dir`` on each, this rank's on ``node``) holds it intact, to
    ``prefix``; then rank 0 commits the manifest there (see the module).  Raises a
    :class:`DrainError` on every rank when it did not commit (naming the ranks, files and
    nodes).  ``memory_bytes``: the upload buffer's budget (:func:`drain_budget`); ``known``:
    the step's manifest where this rank decoded it already (its save's background job);
    ``stop``: checked before each file and each part (a preemption's deadline): once true,
    this rank's uploads stop with :class:`DrainCutError` and the drain commits nothing."""
    rep = DrainReport(step, uri)
    budget = drain_budget(memory_bytes)
    t0 = time.perf_counter()
    throttle = Throttle(bandwidth)
    st = _agree(comm, step, uri, prefix, step_dir, node, known)
    files = _files(st.m)
    indexes = [f for f in files if f.name in {r.name for r in st.m.rank_indexes}]
    refs = {r.name: r for r in st.m.rank_indexes}

    def index(name: str, out: RankOutcome) -> None:
        _check_stop(stop, name)
        data = (step_dir / name).read_bytes()
        mover.check_index(data, refs[name], str(step_dir / name))
        _runtime.run(store.put(st.m.object_key(prefix, name, refs[name].spread), data))
        throttle.account(len(data))
        out.indexes[name] = data
        out.bytes += len(data)

    got = _rounds(comm, st, indexes, index, rep)
    _resolve(st, got)
    blobs = {b.name: b for b in st.m.blobs}

    def blob(name: str, out: RankOutcome) -> None:
        b = blobs[name]
        _check_stop(stop, name)
        out.bytes += upload_file(step_dir / name, store, st.m.object_key(prefix, name, b.spread), throttle, budget,
                                 st.checks[name].fresh(), b.size, stop)

    _rounds(comm, st, [f for f in files if f.name in blobs], blob, rep)
    status = CommitStatus(CommitState.OK)
    if comm.rank == 0:
        try:
            status = commit(store, prefix, st.m, False, uri, [], IOStats(), [], data=st.data)
        except (OSError, ObjckptError) as e:
            status = CommitStatus(CommitState.FAILED, f"committing {uri!r} failed: {type(e).__name__}: {e}",
                                  error=RankError.of(e, f"committing {uri!r} failed: "))
    status = comm.broadcast_object(status, 0) if comm.world_size > 1 else status
    rep.seconds = time.perf_counter() - t0
    if status.state is CommitState.EXISTS:
        raise DrainError(f"draining step {step}: step {step} is already committed at {uri!r}, with another "
                         "manifest: not replaced", step=step, retryable=False)
    if status.state is not CommitState.OK:
        raise DrainError(f"draining step {step}: {status.message}", step=step, retryable=True)
    rep.committed = True
    return rep


def _check_stop(stop: Optional[Callable[[], bool]], what: str) -> None:
    if stop is not None and stop():
        raise DrainCutError(f"the drain was stopped before {what!r} (the preemption deadline passed)")


def _agree(comm: Comm, step: int, uri: str, prefix: str, step_dir: Path, node: str,
           known: Optional[_manifest.Manifest] = None) -> _Step:
    """Every rank's node folder gathered; the step's one manifest decoded on every rank (sent
    from the first rank that holds it to those whose node does not)."""
    got = _local.read_listed(step_dir)
    data = got[0] if got is not None else None
    m = (got[1] or known) if got is not None else None  # a committed step's manifest never changes
    names: frozenset[str] = frozenset()
    if data is not None:
        try:
            m = m or _manifest.decode(data, str(step_dir))
            names = frozenset(_intact_sizes(step_dir, m))
        except (OSError, ObjckptError):
            data = m = None
    mine = NodeFiles(node or f"rank {comm.rank}", None if data is None else crc32c(data), names)
    holders: list[NodeFiles] = comm.all_gather_object(mine) if comm.world_size > 1 else [mine]
    with_manifest = [r for r, h in enumerate(holders) if h.manifest_crc is not None]
    checked = sorted({h.node for h in holders})
    if not with_manifest:
        raise DrainError(f"draining step {step} to {uri!r}: no readable manifest of it in any node's folder "
                         f"(nodes checked: {checked}): the step is no local checkpoint any more",
                         step=step, retryable=False, gone=True)
    crcs = {holders[r].manifest_crc for r in with_manifest}
    if len(crcs) > 1:
        raise DrainError(f"draining step {step} to {uri!r}: the nodes' folders hold different manifests for it "
                         f"({', '.join(f'{holders[r].node}: {holders[r].manifest_crc:#010x}' for r in with_manifest)})"
                         "; nothing committed", step=step, retryable=False)
    if len(with_manifest) < len(holders):  # some ranks' nodes lack it: sent from the first that has it
        data = comm.broadcast_object(data if comm.rank == with_manifest[0] else None, with_manifest[0])
    if data is None:
        raise DrainError(f"draining step {step}: rank {with_manifest[0]}'s manifest did not arrive", step=step)
    if m is None:
        m = _manifest.decode(data, f"step {step}'s manifest (from rank {with_manifest[0]})")
    return _Step(step, uri, prefix, data, m, holders)


def _intact_sizes(step_dir: Path, m: _manifest.Manifest) -> list[str]:
    """The files ``m`` names that ``step_dir`` holds at the size ``m`` records (other sizes
    are damaged copies: never offered)."""
    sizes = {b.name: b.size for b in m.blobs} | {r.name: r.size for r in m.rank_indexes}
    out = []
    for name, size in sizes.items():
        try:
            if (step_dir / name).stat().st_size == size:
                out.append(name)
        except OSError:
            pass
    return out


def _files(m: _manifest.Manifest) -> list[DrainFile]:
    """Every file ``m`` names: its rank indexes, then its blobs, with the rank that wrote each."""
    return ([DrainFile(r.name, r.size, i) for i, r in enumerate(m.rank_indexes)]
            + [DrainFile(b.name, b.size, b.rank) for b in m.blobs])


def _rounds(comm: Comm, st: _Step, files: list[DrainFile], upload: Callable[[str, RankOutcome], None],
            rep: DrainReport) -> dict[str, bytes]:
    """Upload ``files``, each from one holder (collective); a copy rejected by its check goes
    to another holder in the next round.  Returns the rank indexes' verified bytes."""
    left = list(files)
    indexes: dict[str, bytes] = {}
    while left:
        plan = assign(left, st.holders, frozenset(st.rejected))
        if plan.unheld:
            raise DrainError(_unheld(st, plan.unheld), step=st.step, retryable=False)
        out = RankOutcome()
        for name in plan.of(comm.rank):
            try:
                upload(name, out)
                out.done.append(name)
                rep.files += 1
            except Exception as e:  # noqa: BLE001 - every rank learns it below: none waits alone
                if not _bad_copy(e):  # object storage down, a budget: this rank stops, the drain fails
                    out.error = RankError.of(e, f"uploading {name!r}: ")
                    break
                out.bad[name] = f"{type(e).__name__}: {e}"
                log.warning("objckpt: draining step %d: the copy of %s on node %s is rejected (%s); another "
                            "node's copy is tried", st.step, name, st.holders[comm.rank].node, out.bad[name])
        rep.bytes += out.bytes
        outs: list[RankOutcome] = comm.all_gather_object(out) if comm.world_size > 1 else [out]
        failed = {r: o.error for r, o in enumerate(outs) if o.error is not None}
        if failed:
            rep.errors = {r: e.text for r, e in failed.items()}
            shown = "; ".join(f"rank {r}: {e.text}" for r, e in sorted(failed.items())[:4])
            retryable = all(error_class(e.kind) is not None for e in failed.values())  # objckpt's: the store's
            raise DrainError(f"draining step {st.step} to {st.uri!r} failed, nothing committed there ({shown})",
                             step=st.step, retryable=retryable)
        done: set[str] = set()
        for r, o in enumerate(outs):
            done.update(o.done)
            indexes.update(o.indexes)
            st.rejected.update((name, st.holders[r].node) for name in o.bad)
        left = [f for f in left if f.name not in done]
    return indexes


def _bad_copy(e: BaseException) -> bool:
    """Whether ``e`` rejects this node's copy of a file (its bytes fail the manifest's check,
    or the local file cannot be read: a plain OSError) rather than stopping the drain."""
    return isinstance(e, CorruptCheckpointError) or (isinstance(e, OSError) and not isinstance(e, ObjckptError))


def _unheld(st: _Step, names: list[str]) -> str:
    rejected = sorted(f"{n} on {node}" for n, node in st.rejected if n in names)
    return (f"draining step {st.step} to {st.uri!r}: no node holds an intact copy of {len(names)} file(s) "
            f"({', '.join(names[:6])}{', ...' if len(names) > 6 else ''}; nodes checked: "
            f"{sorted({h.node for h in st.holders})}"
            + (f"; copies rejected: {', '.join(rejected[:6])}" if rejected else "")
            + "); nothing committed, the local copies are kept")


def _resolve(st: _Step, indexes: dict[str, bytes]) -> None:
    """The chunk checks of every blob; a format-v2 step's chunks listed from its rank indexes'
    verified bytes (the resolver every reader uses, over them in memory)."""
    m = st.m
    if m.rank_indexes:
        objects = {m.index_key("step", r): indexes[ref.name] for r, ref in enumerate(m.rank_indexes)}
        _runtime.run(resolver_for(m, MemoryStore(objects), "step").resolve_all())
    st.checks = dict(zip((b.name for b in m.blobs), mover.blob_checks(m)))
