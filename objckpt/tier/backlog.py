"""The due steps whose drain has not committed yet: retried oldest first, kept across restarts.

A drain that fails (object storage down) leaves its step in the local tier; the
manager tries it again at the next save and at ``wait()``, oldest first
(:class:`DrainQueue`).  So that a job that restarts (or a rank that died while
draining) does not forget what the policy promised, each node's first rank records
every due step in its local folder before draining it, one small JSON file per step
under :data:`PENDING_DIR`, and removes it once the step is drained or given up
(:func:`mark`, :func:`reconcile`); a new manager adopts the records whose step is
still a local checkpoint and whose destination is its own root (:func:`recorded`).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from ..format import keys
from .errors import DrainError

log = logging.getLogger("objckpt.tier")

#: the folder under the local root holding one record per due step not drained yet
PENDING_DIR = ".objckpt-drains"


@dataclass
class Undrained:
    """A step due for object storage whose drain has not committed yet."""

    step: int
    metadata: dict[str, Any]
    saved_at: float
    error: Optional[DrainError] = None
    attempts: int = 0


class DrainQueue:
    """The due steps not in object storage yet, retried oldest first.

    Every rank holds one and changes it only from the results of collective drains (the
    same on every rank), in the same order, so every rank's queue is the same and every
    rank makes the same attempts.  :meth:`run` tries the waiting steps, oldest first,
    then the new one; the first failure that a later attempt may mend (object storage
    down) ends the round, the rest wait for the next one (an outage costs one failed
    attempt per round, not one per waiting step).  A failure no attempt can mend (the
    local files gone, another checkpoint at the destination) drops the step, its error
    kept for :meth:`take_errors`.  At most ``limit`` steps wait: past that the oldest is
    given up (an ERROR in the log, its error kept), the newest due steps stay."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting: list[Undrained] = []
        self.given_up: list[DrainError] = []

    @property
    def steps(self) -> set[int]:
        """The steps waiting (local retention keeps them)."""
        return {u.step for u in self.waiting}

    def run(self, new: Optional[Undrained], attempt: Callable[[Undrained], None]) -> list[int]:
        """One round: ``attempt(u)`` (a collective drain, raising :class:`DrainError`) for each
        waiting step, oldest first, then ``new``; returns the steps drained."""
        todo = self.waiting + ([new] if new is not None else [])
        left: list[Undrained] = []
        done: list[int] = []
        for u in todo:
            if left:  # an earlier step of this round failed and may succeed later: so may this one
                left.append(u)
                continue
            u.attempts += 1
            try:
                attempt(u)
            except DrainError as e:
                u.error = e
                if e.gone:  # deleted, or dropped by a restore (its shares were lost): nothing to drain
                    log.warning("objckpt: %s; the step is no local checkpoint any more: not drained", e)
                elif e.retryable:
                    log.error("objckpt: %s; the step stays in the local tier and is retried at the next save "
                              "(attempt %d)", e, u.attempts)
                    left.append(u)
                else:
                    log.error("objckpt: %s; no later attempt can mend this: the step is not drained", e)
                    self.given_up.append(e)
            else:
                done.append(u.step)
        while len(left) > self.limit:
            old = left.pop(0)
            log.error("objckpt: step %d is given up for object storage: %d newer due steps wait to be drained "
                      "(at most %d wait); it stays under local retention", old.step, len(left), self.limit)
            self.given_up.append(DrainError(
                f"step {old.step} was not drained and is no longer retried ({len(left)} newer due steps wait, at "
                f"most {self.limit} do); its last error: {old.error}", step=old.step, retryable=False))
        self.waiting = left
        return done

    def take_errors(self) -> Optional[DrainError]:
        """The error :meth:`TieredSaves.wait` raises (and forgets the given-up steps'), or None:
        the steps given up since the last call, and those still waiting."""
        given_up, self.given_up = self.given_up, []
        parts = [str(e) for e in given_up[:3]]
        if self.waiting:
            last = next((u.error for u in reversed(self.waiting) if u.error is not None), None)
            parts.insert(0, f"step(s) {[u.step for u in self.waiting]} are not in object storage yet (they stay in "
                            f"the local tier and are retried at the next save): {last}")
        if not parts:
            return None
        steps = [u.step for u in self.waiting] + [e.step for e in given_up if e.step is not None]
        return DrainError("; ".join(parts), step=min(steps) if steps else None, retryable=bool(self.waiting))


def mark(root: Path, name: str, u: Undrained, dest: str) -> None:
    """Record ``u`` (step folder ``name``) as due for ``dest`` (the manager's root), written
    whole (temporary file, then rename).  Best effort: a record that cannot be written
    (its metadata not JSON, a full disk) is a warning; the step is still drained and
    retried within this run."""
    folder = root / PENDING_DIR
    try:
        data = json.dumps({"step": u.step, "metadata": u.metadata, "saved_at": u.saved_at, "root": dest}).encode()
        folder.mkdir(exist_ok=True)
        tmp = folder / f".{name}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, folder / f"{name}.json")
    except (OSError, TypeError, ValueError) as e:
        log.warning("objckpt: cannot record step %d as due for %s under %s (%s: %s): a restarted job would not "
                    "drain it", u.step, dest, folder, type(e).__name__, e)


def recorded(root: Path, parse: Callable[[str], Optional[int]], dest: str) -> list[Undrained]:
    """The recorded due steps for ``dest`` whose folder is still a local checkpoint (a
    manifest), oldest first; others are ignored (:func:`reconcile` removes them later)."""
    folder = root / PENDING_DIR
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    out: list[Undrained] = []
    for f in names:
        step = parse(f[:-5]) if f.endswith(".json") else None
        if step is None or not (root / f[:-5] / keys.MANIFEST_NAME).is_file():
            continue
        try:
            doc = json.loads((folder / f).read_bytes())
            if doc.get("root") != dest or doc.get("step") != step:
                continue
            out.append(Undrained(step, dict(doc.get("metadata") or {}), float(doc.get("saved_at") or 0.0)))
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("objckpt: ignoring the unreadable drain record %s: %s", folder / f, e)
    return sorted(out, key=lambda u: u.step)


def reconcile(root: Path, parse: Callable[[str], Optional[int]], waiting: Iterable[int]) -> None:
    """Remove the records of every step not in ``waiting`` (drained, given up, deleted), and
    their folder once empty."""
    keep = set(waiting)
    folder = root / PENDING_DIR
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for f in names:
        step = parse(f[:-5]) if f.endswith(".json") else None
        if step is None or step not in keep:
            try:
                (folder / f).unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("objckpt: cannot remove the drain record %s: %s", folder / f, e)
    try:
        folder.rmdir()  # when empty: the local root holds step folders only
    except OSError:
        pass
