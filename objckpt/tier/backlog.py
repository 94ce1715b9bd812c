"""The due steps whose drain has not committed yet: retried oldest first, kept across restarts.

A drain that fails (object storage down) leaves its step in the local tier; the
manager tries it again at the next save, at ``wait()`` and on a clock (after a backoff
that :meth:`DrainQueue.retry_in` computes from the rounds that failed in a row; see
:mod:`objckpt.tier.retry_clock`), oldest first (:class:`DrainQueue`).  So that a job
that restarts (or a rank that died while draining) does not forget what the policy
promised, each node's first rank records every due step in its local folder before
draining it, one small JSON file per step under :data:`PENDING_DIR`, and removes it
once the step is drained or given up (:func:`mark`, :func:`reconcile`); a new manager
adopts the records whose step is still a local checkpoint and whose destination is its
own root (:func:`recorded`).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from ..format import keys
from .errors import DrainError

log = logging.getLogger("objckpt.tier")

#: the folder under the local root holding one record per due step not drained yet
PENDING_DIR = ".objckpt-drains"
#: the longest wait between two clock retries (the backoff doubles up to it), unless the
#: first wait is longer
DRAIN_RETRY_CAP_S = 600.0


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
    given up (an ERROR in the log, its error kept), the newest due steps stay.

    Each round also sets the backoff of the retries on a clock (:meth:`retry_in`): the
    rounds that ended on a failure in a row (``failed_rounds``, back to 0 once a round
    ends without one) and when the last round ended.  Rounds run on the manager's
    background thread; the clock and :meth:`take_errors` read from other threads, so the
    bookkeeping changes under a lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting: list[Undrained] = []
        self.given_up: list[DrainError] = []
        #: given-up steps (not gone) whose local copies retention keeps for the rest of the run,
        #: the newest ``limit`` of them: a failed drain is never why a step's last copies go
        self.held: list[int] = []
        #: rounds in a row that ended on a failure a later attempt may mend (0: the last did not)
        self.failed_rounds = 0
        #: time.monotonic() at the end of the last round (or when the queue was made)
        self.last_round = time.monotonic()
        #: rounds run so far: the same on every rank at the same place in the job order (the
        #: drain clock's retry runs only if no round ran since rank 0 decided it)
        self.rounds = 0
        self._lock = threading.Lock()
        #: called after every round (the drain clock's wake-up: a new backoff starts)
        self.on_round: Optional[Callable[[], None]] = None

    @property
    def steps(self) -> set[int]:
        """The steps waiting (local retention keeps them)."""
        return {u.step for u in self.waiting}

    def _hold(self, step: int) -> None:
        """Keep ``step``'s local copies (its drain was given up); past ``limit`` such steps the
        oldest is released to ordinary retention, with a warning."""
        self.held = sorted(set(self.held) | {step})
        while len(self.held) > self.limit:
            log.warning("objckpt: step %d, whose drain was given up, is released to local retention (%d newer "
                        "given-up steps are kept)", self.held[0], self.limit)
            self.held.pop(0)

    def run(self, new: Optional[Undrained], attempt: Callable[[Undrained], None]) -> list[int]:
        """One round: ``attempt(u)`` (a collective drain, raising :class:`DrainError`) for each
        waiting step, oldest first, then ``new``; returns the steps drained."""
        todo = self.waiting + ([new] if new is not None else [])
        left: list[Undrained] = []
        done: list[int] = []
        given_up: list[DrainError] = []
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
                    log.error("objckpt: %s; the step stays in the local tier and is retried later (attempt %d)",
                              e, u.attempts)
                    left.append(u)
                else:
                    log.error("objckpt: %s; no later attempt can mend this: the step is not drained (its local "
                              "copies are kept)", e)
                    with self._lock:  # kept even when a later attempt raises out of the round
                        self.given_up.append(e)
                        self._hold(u.step)
            else:
                done.append(u.step)
        failed = bool(left)
        while len(left) > self.limit:
            old = left.pop(0)
            log.error("objckpt: step %d is given up for object storage: %d newer due steps wait to be drained "
                      "(at most %d wait); its local copies are kept", old.step, len(left), self.limit)
            given_up.append(DrainError(
                f"step {old.step} was not drained and is no longer retried ({len(left)} newer due steps wait, at "
                f"most {self.limit} do); its last error: {old.error}", step=old.step, retryable=False))
            self._hold(old.step)
        with self._lock:
            self.given_up.extend(given_up)
            self.waiting = left
            # progress starts the backoff again; a failure with no progress doubles it
            self.failed_rounds = (self.failed_rounds + 1 if not done else 1) if failed else 0
            self.last_round = time.monotonic()
            self.rounds += 1
        if self.on_round is not None:
            self.on_round()
        return done

    def retry_in(self, first: float, cap: float = DRAIN_RETRY_CAP_S, now: Optional[float] = None) -> Optional[float]:
        """Seconds until the waiting steps are due for a retry on the clock (<= 0: now; None:
        none waits): ``first`` after the last round, doubled for each further round that
        failed in a row, at most ``max(cap, first)``."""
        with self._lock:
            if not self.waiting:
                return None
            doublings = min(max(self.failed_rounds - 1, 0), 60)
            last = self.last_round
        delay = min(first * 2.0 ** doublings, max(cap, first))
        return last + delay - (time.monotonic() if now is None else now)

    def take_errors(self) -> Optional[DrainError]:
        """The error :meth:`TieredSaves.wait` raises (and forgets the given-up steps'), or None:
        the steps given up since the last call, and those still waiting."""
        with self._lock:
            given_up, self.given_up = self.given_up, []
            waiting = list(self.waiting)
        parts = [str(e) for e in given_up[:3]]
        if waiting:
            last = next((u.error for u in reversed(waiting) if u.error is not None), None)
            parts.insert(0, f"step(s) {[u.step for u in waiting]} are not in object storage yet (they stay in "
                            f"the local tier and are retried later): {last}")
        if not parts:
            return None
        steps = [u.step for u in waiting] + [e.step for e in given_up if e.step is not None]
        return DrainError("; ".join(parts), step=min(steps) if steps else None, retryable=bool(waiting))


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


def reconcile(root: Path, parse: Callable[[str], Optional[int]], waiting: Iterable[int],
              dest: Optional[str] = None) -> None:
    """Remove the records of every step not in ``waiting`` (drained, given up, deleted), and
    their folder once empty; with ``dest``, never a record due for another root (a job
    sharing the folder: its restart drains it)."""
    keep = set(waiting)
    folder = root / PENDING_DIR
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for f in names:
        step = parse(f[:-5]) if f.endswith(".json") else None
        if dest is not None and step is not None and destination(root, f[:-5]) not in (dest, None):
            continue
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


def destination(root: Path, name: str) -> Optional[str]:
    """The root the drain record of step folder ``name`` names; None: no readable record."""
    try:
        doc = json.loads((root / PENDING_DIR / f"{name}.json").read_bytes())
        dest = doc.get("root")
    except (OSError, ValueError, AttributeError):
        return None
    return dest if isinstance(dest, str) else None
