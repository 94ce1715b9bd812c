"""What is left under a step after retention deleted it: the leftovers of killed saves.

Why: :func:`objckpt.ops.delete.delete_checkpoint` removes the manifest and the
objects that manifest names, nothing else, because anything else under the
prefix might belong to a save in progress.  A save of the same step that was
killed earlier (then saved again by the restarted job) leaves its blobs,
rank indexes and unfinished multipart uploads beside the committed attempt,
and once retention deleted the step nothing refers to that folder any more:
they would stay for ever unless someone runs ``objckpt gc``.

What proves a leftover stale is the rule ``gc`` uses (docs/format.md §8), never
a guess from the key's shape alone: an object is deleted once older than the
grace period, its age judged by the attempt id's timestamp in
``blobs/<attempt>/...`` (else its modification time; unknown age counts as
young).  A save of that step started after the deletion (a job re-saving it)
is young, so it is never touched, and a prefix whose manifest is back (the
step was committed again) is not swept at all.  Young leftovers are reported
with the time they become old, so the manager's worker sweeps the step again
then (:class:`~objckpt.manager.worker.Worker`); a process that exits before
that leaves them to ``gc``.
"""
from __future__ import annotations

import calendar
import time
from dataclasses import dataclass, field
from typing import Optional

from ..format import keys
from ..storage import ObjectStore

#: the default grace period, the same as ``objckpt gc``'s: a save running longer than this
#: could lose objects to a sweep (as to gc)
LEFTOVER_GRACE = 6 * 3600.0


@dataclass
class SweepReport:
    """What :func:`sweep_step` did under one step prefix."""

    deleted: list[str] = field(default_factory=list)  # object keys
    aborted: list[str] = field(default_factory=list)  # keys of aborted multipart uploads
    young: int = 0  # objects and uploads still inside the grace period (left)
    due: Optional[float] = None  # when the youngest of them becomes old (time.time() scale)
    recommitted: bool = False  # a manifest is there again: nothing was swept


def _attempt_time(key: str, prefix: str) -> Optional[float]:
    """The time in the attempt id of ``<prefix>/blobs/<attempt>/...``, else None."""
    rel = key[len(prefix) + 1:].split("/")
    if len(rel) < 3 or rel[0] != keys.BLOB_DIR:
        return None
    try:
        return float(calendar.timegm(time.strptime(rel[1].split("-", 1)[0], "%Y%m%dT%H%M%S")))
    except (ValueError, IndexError):
        return None


async def sweep_step(store: ObjectStore, prefix: str, grace: float = LEFTOVER_GRACE,
                     now: Optional[float] = None) -> SweepReport:
    """Delete what is under ``prefix`` (a step retention deleted) once older than ``grace``
    seconds, and abort its multipart uploads as old; see the module docstring."""
    now = time.time() if now is None else now
    report = SweepReport()
    base = prefix.rstrip("/") + "/"
    listing = await store.list(base)
    if await store.head(keys.manifest_key(prefix)) is not None:
        report.recommitted = True
        return report
    doomed: list[str] = []

    def judge(born: Optional[float]) -> bool:
        if born is not None and now - born >= grace:
            return True
        report.young += 1
        due = (born if born is not None else now) + grace
        report.due = due if report.due is None else min(report.due, due)
        return False

    for o in listing:
        if judge(_attempt_time(o.key, prefix) or o.mtime):
            doomed.append(o.key)
    for u in await store.list_uploads(base):
        if judge(_attempt_time(u.key, prefix) or u.initiated):
            try:
                await store.abort_upload(u)
            except Exception:  # noqa: BLE001 - gc aborts it later
                continue
            report.aborted.append(u.key)
    if doomed:
        await store.delete(doomed)
        report.deleted = doomed
    return report
