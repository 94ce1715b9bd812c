"""Draining: a committed local step copied to object storage as an ordinary checkpoint.

Every rank uploads the files it wrote into its node's step folder (its blobs and
its rank index: :func:`objckpt.tier.local.files_of`) to the same names under the
destination step prefix, at most ``bandwidth`` bytes per second each (the
training's own traffic keeps priority); the ranks then exchange their outcomes
and rank 0 writes the manifest, conditionally (``If-None-Match``), only when
every rank succeeded.  A rank that fails or dies before that leaves no manifest:
the step does not exist in object storage (its blobs are leftovers for ``objckpt
gc``, as a killed ordinary save leaves).  The manifest is the local one byte for
byte: the names it records are relative to the step prefix, the same in both
tiers.

Each rank uploads from one reused buffer at a time, taken from the process-wide
host pool and drawn from the drain's memory budget (``memory_bytes``, else
:data:`~objckpt.runtime.memory.DRAIN_MEMORY_BYTES`): the part shrinks to fit a
given budget, down to the store's smallest part; below that the rank's upload
fails with a :class:`~objckpt.errors.MemoryBudgetError` naming the budget, and
the drain commits nothing.

A drain may be tried again (:class:`DrainQueue`, the manager's retries of due steps
whose drain failed): the blobs go up again under the same names, and a manifest
already at the destination that is the local one byte for byte means an earlier
attempt committed (its answer lost): success.  A :class:`DrainError` says whether a
later attempt may succeed (``retryable``): not when a rank's local files are gone (``gone``: the
local step itself is) or another checkpoint is committed there.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Optional

from ..distributed.comm import Comm
from ..errors import CheckpointExistsError, MemoryBudgetError, ObjckptError, PreconditionFailed
from ..format import keys
from ..runtime import loop as _runtime
from ..runtime.memory import (DRAIN_MEMORY_BYTES, Budget, OperationBudget, given_or_default, host_bytes, host_pool,
                              positive_bytes)
from ..storage import ObjectStore
from ..units import MiB
from .errors import DrainError

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


def _part_size(src: Path, size: int, store: ObjectStore, budget: OperationBudget) -> int:
    """Bytes per upload (``size`` itself: one PUT): :data:`DRAIN_PART`, fewer where the
    budget says, never fewer than the store's smallest part or than its part count allows."""
    floor = max(store.min_part_size, -(-size // max(store.max_parts, 1)))
    part = max(DRAIN_PART, floor)
    if size <= min(part, budget.nbytes) or not budget.strict:
        return min(size, part)
    if budget.nbytes < floor:
        need = floor if size > floor else size
        raise MemoryBudgetError(
            f"draining {str(src)!r} ({size} bytes) needs a buffer of {need} bytes (the store's smallest part), "
            f"more than the {budget.name} ({budget.nbytes} bytes); give a larger budget")
    return min(part, budget.nbytes)


def upload_file(src: Path, store: ObjectStore, key: str, throttle: Throttle,
                budget: Optional[OperationBudget] = None) -> int:
    """``src`` to ``key``, in parts of :data:`DRAIN_PART` (a multipart upload past one part),
    through one buffer from the host pool drawn from ``budget`` (default :func:`drain_budget`)."""
    budget = budget if budget is not None else drain_budget()
    size = src.stat().st_size
    part = _part_size(src, size, store, budget)
    pool = host_pool()
    with open(src, "rb", buffering=0) as f, budget.hold(part, f"a drain's upload buffer for {str(src)!r}"):
        buf = pool.take(max(part, 1), Budget(max(part, 1)))  # exactly what the budget drew
        try:
            view = host_bytes(buf)

            def fill(n: int) -> memoryview:
                got = 0
                while got < n:
                    r = f.readinto(view[got:n])
                    if not r:
                        raise OSError(f"{str(src)!r} is shorter than the {size} bytes it had (changed while draining)")
                    got += r
                _forget(f)
                return view[:n]

            if size <= part:
                data = fill(size)
                _runtime.run(store.put(key, data))
                throttle.account(size)
                return size
            nparts = -(-size // part)
            writer = store.open_writer(key, size, nparts)
            try:
                for i in range(nparts):
                    n = min(part, size - i * part)
                    _runtime.run(writer.write_part(i, i * part, fill(n)))
                    throttle.account(n)
                _runtime.run(writer.complete())
            except BaseException:
                _runtime.run(writer.abort())
                raise
        finally:
            pool.give(buf)
    return size


def drain(comm: Comm, step: int, step_dir: Path, files: Optional[list[str]], store: ObjectStore, prefix: str,
          uri: str, bandwidth: Optional[float] = None, memory_bytes: Optional[int] = None) -> DrainReport:
    """Collective over ``comm``: copy this rank's ``files`` from ``step_dir`` to ``prefix``
    (None: the files the local manifest says this rank wrote), then rank 0 commits the
    local manifest there once every rank succeeded.  Raises a :class:`DrainError` on every
    rank when any rank failed (naming them); nothing is committed then.  Its
    ``retryable`` is False when a later attempt cannot succeed: a rank's local file is
    gone or unreadable, or another checkpoint is committed at ``uri``.  A manifest already
    at ``uri`` that is this step's own, byte for byte (an earlier attempt committed, its
    answer lost), is success.  ``memory_bytes``: the upload buffer's budget (:func:`drain_budget`)."""
    rep = DrainReport(step, uri)
    budget = drain_budget(memory_bytes)
    t0 = time.perf_counter()
    throttle = Throttle(bandwidth)
    error: tuple[str, bool, bool] = ("", True, False)  # why, whether a later attempt may mend it, step gone
    try:
        for name in (files if files is not None else _files_of(step_dir, comm.rank)):
            rep.bytes += upload_file(step_dir / name, store, keys.join(prefix, name), throttle, budget)
            rep.files += 1
    except (OSError, ObjckptError) as e:
        # a plain OSError is the local file (object stores raise objckpt errors, after their retries)
        error = (f"{type(e).__name__}: {e}", isinstance(e, ObjckptError), isinstance(e, StepGoneError))
    outcomes: list[tuple[str, bool, bool]] = comm.all_gather_object(error)
    rep.errors = {r: why for r, (why, _, _) in enumerate(outcomes) if why}
    retryable = all(ok for why, ok, _ in outcomes if why)
    gone = any(g for _, _, g in outcomes)
    verdict: tuple[str, bool] = ("", True)
    if comm.rank == 0 and not rep.errors:
        manifest = b""
        try:
            manifest = (step_dir / keys.MANIFEST_NAME).read_bytes()
            _runtime.run(store.put(keys.manifest_key(prefix), manifest, if_absent=True))
        except (PreconditionFailed, CheckpointExistsError):
            verdict = (_already_there(store, prefix, manifest, step, uri), False)
        except (OSError, ObjckptError) as e:
            verdict = (f"committing {uri!r} failed: {type(e).__name__}: {e}", isinstance(e, ObjckptError))
    verdict = comm.broadcast_object(verdict, 0) if comm.world_size > 1 else verdict
    rep.seconds = time.perf_counter() - t0
    if rep.errors:
        shown = "; ".join(f"rank {r}: {why}" for r, why in sorted(rep.errors.items())[:4])
        raise DrainError(f"draining step {step} to {uri!r} failed, nothing committed there ({shown})",
                         step=step, retryable=retryable and not gone, gone=gone)
    if verdict[0]:
        raise DrainError(f"draining step {step}: {verdict[0]}", step=step, retryable=verdict[1])
    rep.committed = True
    return rep


class StepGoneError(FileNotFoundError):
    """A step to drain again is no local checkpoint any more (deleted, or dropped by a restore)."""


def _files_of(step_dir: Path, rank: int) -> list[str]:
    """The files ``rank`` wrote into ``step_dir``, from its local manifest (a plain OSError
    when the folder or its manifest is gone: the step cannot be drained from here)."""
    from . import local as _local

    got = _local.read_listed(step_dir)
    if got is None:
        raise StepGoneError(f"the local step {str(step_dir)!r} has no readable manifest")
    return got[2].of_rank(rank)


def _already_there(store: ObjectStore, prefix: str, manifest: bytes, step: int, uri: str) -> str:
    """Rank 0, when the conditional commit found a manifest: "" when it is this step's own,
    byte for byte (an earlier attempt of this drain committed and its answer was lost, so
    a retry succeeds), else why the drain is refused (another checkpoint is there)."""
    try:
        there = _runtime.run(store.get(keys.manifest_key(prefix)))
    except (OSError, ObjckptError) as e:
        return f"step {step} is already committed at {uri!r} (its manifest could not be read: {e})"
    if bytes(there) == manifest:
        return ""
    return f"step {step} is already committed at {uri!r}, with another manifest: not replaced"
