"""Drain retries on a clock: a due step whose drain failed is tried again after a backoff,
in the background, with no save or ``wait()`` from the training loop.

Why it is built this way.  A drain is collective over the tier group, and every rank's
:class:`~objckpt.tier.backlog.DrainQueue` changes only from the results of collective
drains, in the same order on every rank: the manager's one background thread runs the
jobs of the saves (and of ``wait()``) in the order the training issued them, which is
the same on every rank.  A retry must run on that thread, at the same place in that order
on every rank.  A timer on each rank fires at its own time: a drain started from it would
meet another rank's replication or drain of a save (a deadlock, or queues that differ).
Nor can a node drain on its own: rank 0 commits a step's manifest only once every rank
uploaded its files.  So:

* only the tier group's rank 0 keeps the clock (:class:`RetryClock`).  When the waiting
  steps are due (:meth:`DrainQueue.retry_in`: ``drain_retry_s`` after the last round,
  doubled for each round that failed in a row, at most
  :data:`~objckpt.tier.backlog.DRAIN_RETRY_CAP_S`; a round that drains a step starts
  again from ``drain_retry_s``), it says so to every rank over a gloo group of objckpt's
  own kept for this word (:data:`CLOCK_GROUP`: never the training's group, nor the tier
  group the drains use), from a thread of its own on each rank, never the training's;
* the ranks then agree where the retry goes in their job order (:class:`OrderedJobs`):
  each stops handing new jobs to the background thread (a save made meanwhile is held
  there, not waited for: the training thread never blocks), they all-gather how many
  jobs each has handed over, and every rank puts the retry right after job number ``K``,
  the largest count (every rank hands over the same jobs in the same order: saves and
  ``wait()`` are called on every rank alike);
* the retry is then a job like the others: one drain round of the waiting steps, oldest
  first, on the background thread, at that place on every rank.  It decides from the
  queue as it is there (the same on every rank): a retry that finds nothing waiting, or
  finds that a round ran since rank 0 decided it (a save's, or ``wait()``'s: the word
  carries :attr:`DrainQueue.rounds`), does nothing, so the backoff is kept.

Rank 0 also sends a heartbeat every :func:`heartbeat_s` (a tenth of the collective
timeout, at most a minute): the other ranks, which wait for its word, never time out
while all is well; a rank that died makes the others' wait a
:class:`~objckpt.errors.CollectiveError` after the collective timeout, raised at the next
save or ``wait()``.  ``close()`` on rank 0 sends "stop" at once; the other ranks'
``close()`` waits for that word (``close()`` is called on every rank, as ``wait()``),
at most the collective timeout.  A forked child inherits no clock thread, and
:func:`_after_fork_in_child` marks every clock stopped there (it never sends a word on
the parent's group) and gives its job order a fresh lock.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import weakref
from typing import Any, Callable, Optional

from ..distributed.comm import Comm, background_comm
from ..distributed.join import collective_timeout
from ..errors import CollectiveError
from .backlog import DRAIN_RETRY_CAP_S, DrainQueue

log = logging.getLogger("objckpt.tier")

#: the default first wait (seconds) before a failed drain is tried again on the clock
DRAIN_RETRY_S = 30.0
#: the purpose key of the group rank 0's clock speaks on
CLOCK_GROUP = "tier-drain-clock"
#: the longest time between two words of rank 0's clock
HEARTBEAT_MAX_S = 60.0

#: the words rank 0's clock sends every rank
BEAT, RETRY, STOP = "beat", "retry", "stop"


def heartbeat_s(timeout: float) -> float:
    """Seconds between two of rank 0's words: a tenth of the collective ``timeout`` (the
    others wait at most that long for each word), at most :data:`HEARTBEAT_MAX_S`."""
    return max(min(HEARTBEAT_MAX_S, timeout / 10.0), 0.01)


def retry_s_error(value: Any) -> Optional[str]:
    """Why ``value`` is no ``drain_retry_s`` (None: it is one: a finite number of seconds > 0,
    or None for no clock)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        return (f"drain_retry_s must be a positive, finite number of seconds (or None: failed drains are "
                f"retried at the next save and at wait() only), got {value!r}")
    return None


def _chain(src: "concurrent.futures.Future[Any]", dst: "concurrent.futures.Future[Any]") -> None:
    """``dst`` gets ``src``'s outcome once it has one."""
    def copy(f: "concurrent.futures.Future[Any]") -> None:
        e = f.exception()
        if e is not None:
            dst.set_exception(e)
        else:
            dst.set_result(f.result())

    src.add_done_callback(copy)


class OrderedJobs:
    """The background thread's jobs in the order the training issued them, with the clock's
    retries placed at the same place on every rank (see the module docstring).

    :meth:`submit` numbers every job (``handed``); :meth:`freeze` stops handing them to
    the pool (they are held, each with a future of its own, so the caller never waits)
    and returns the count; :meth:`place` puts a retry right after job number ``after``
    (now, or when that job is submitted) and hands the held jobs over, in order."""

    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self._pool = pool
        self._lock = threading.Lock()
        self.handed = 0  # jobs submitted (to the pool or held)
        self._given = 0  # jobs given to the pool
        self._held: list[tuple[int, "concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...]]] = []
        self._frozen = False
        #: retries agreed on, each to go right after job number ``after`` (in agreement order; a
        #: rank behind the others may hold several)
        self._placed: list[tuple[int, Callable[[], None]]] = []
        #: the retries given to the pool whose outcome nobody has looked at yet
        self.retries: list["concurrent.futures.Future[Any]"] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> "concurrent.futures.Future[Any]":
        with self._lock:
            self.handed += 1
            if self._frozen:
                fut: "concurrent.futures.Future[Any]" = concurrent.futures.Future()
                self._held.append((self.handed, fut, fn, args))
                return fut
            fut = self._pool.submit(fn, *args)
            self._given = self.handed
            self._place_at(self._given)
            return fut

    def freeze(self) -> int:
        """Hold every job submitted from now on; the number of jobs submitted so far."""
        with self._lock:
            self._frozen = True
            return self.handed

    def place(self, after: Optional[int], retry: Optional[Callable[[], None]]) -> None:
        """``retry`` right after job number ``after`` (None: no retry), then the held jobs."""
        with self._lock:
            held, self._held, self._frozen = self._held, [], False
            if after is not None and retry is not None:
                self._placed.append((after, retry))
            self._place_at(self._given)
            for n, fut, fn, args in held:
                _chain(self._pool.submit(fn, *args), fut)
                self._given = n
                self._place_at(n)

    def _place_at(self, n: int) -> None:
        while self._placed and self._placed[0][0] <= n:
            self.retries.append(self._pool.submit(self._placed.pop(0)[1]))

    def take_error(self) -> Optional[BaseException]:
        """The first error of a retry that finished since the last call (None: none)."""
        with self._lock:
            done = [f for f in self.retries if f.done()]
            self.retries = [f for f in self.retries if not f.done()]
        return next((f.exception() for f in done if f.exception() is not None), None)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._frozen, self._held, self._placed = False, [], []


#: every clock of this process (a forked child stops them); the groups whose clock runs
_clocks: "weakref.WeakSet[RetryClock]" = weakref.WeakSet()
_busy: set[Any] = set()
_busy_lock = threading.Lock()


class RetryClock:
    """Rank 0's clock and every rank's listener (see the module docstring): one daemon
    thread per rank, named ``objckpt-drain-clock``.  ``retry``: the drain round the clock
    puts in the job order (it decides from the queue as it finds it); ``comm``: the clock's
    group (None: one process, no words to send)."""

    def __init__(self, jobs: OrderedJobs, comm: Optional[Comm], queue: DrainQueue, first: float,
                 retry: Callable[[], None], timeout: float) -> None:
        self.jobs = jobs
        self.comm = comm
        self.queue = queue
        self.first = float(first)
        self.retry = retry
        self.timeout = timeout
        self.heartbeat = heartbeat_s(timeout)
        self.leader = comm is None or comm.rank == 0
        #: the error that ended the clock (a rank that stopped answering), raised once by take_error
        self.error: Optional[BaseException] = None
        #: the retries this clock ran (the same count on every rank)
        self.retries = 0
        self._wake = threading.Event()
        self._stopping = False
        self._in_flight = False
        self._key = getattr(comm, "group", None) if comm is not None else None
        queue.on_round = self._wake.set  # rank 0 computes the next retry's time after every round
        with _busy_lock:
            if comm is not None:
                _busy.add(self._key)
            _clocks.add(self)
        self._thread: Optional[threading.Thread] = threading.Thread(target=self._run, name="objckpt-drain-clock",
                                                                    daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._lead() if self.leader else self._follow()
        except BaseException as e:  # noqa: BLE001 - kept, raised at the next save or wait()
            if not self._stopping:
                self.error = CollectiveError(
                    f"the drain retry clock stopped on rank {self.comm.rank if self.comm is not None else 0} (a rank "
                    f"died or stopped answering on objckpt's own group; failed drains are no longer retried on the "
                    f"clock): {type(e).__name__}: {e}")
                log.error("objckpt: the drain retry clock stopped (failed drains are retried at the next save "
                          "and at wait() only): %s", e)
        finally:
            with _busy_lock:
                _busy.discard(self._key)

    def _due(self) -> Optional[float]:
        return None if self._in_flight else self.queue.retry_in(self.first)

    def _lead(self) -> None:
        while True:
            due = self._due()
            wait = self.heartbeat if due is None else min(self.heartbeat, max(due, 0.0))
            if wait > 0 and not self._stopping:
                self._wake.wait(wait)
            self._wake.clear()
            rounds = self.queue.rounds  # first: a round that ends meanwhile voids this retry
            due = self._due()
            word = STOP if self._stopping else RETRY if due is not None and due <= 0 else BEAT
            if self.comm is not None:
                self.comm.broadcast_object((word, rounds), 0)
            if word == STOP:
                return
            if word == RETRY:
                self._agree(rounds)

    def _follow(self) -> None:
        assert self.comm is not None
        while True:
            word, rounds = self.comm.broadcast_object(None, 0)
            if word == STOP:
                return
            if word == RETRY:
                self._agree(rounds)

    def _agree(self, rounds: int) -> None:
        """Every rank: the retry right after the largest count of jobs any rank has handed over
        (``rounds``: rank 0's count of rounds when it decided)."""
        mine = self.jobs.freeze()
        try:
            after = max(self.comm.all_gather_object(mine)) if self.comm is not None else mine
        except BaseException:
            self.jobs.place(None, None)  # the held saves go on; the error ends the clock
            raise
        self._in_flight = True
        self.jobs.place(after, lambda: self._job(rounds))

    def _job(self, rounds: int) -> None:
        """The background thread, at the agreed place on every rank: the retry, unless a round
        ran since rank 0 decided it (that round set a new backoff)."""
        try:
            steps = [u.step for u in self.queue.waiting]
            if steps and self.queue.rounds == rounds:
                log.info("objckpt: the drain retry clock tries step(s) %s again", steps)
                self.retries += 1
                self.retry()
        finally:
            self._in_flight = False
            self._wake.set()

    def take_error(self) -> Optional[BaseException]:
        """The error that ended the clock, or a retry's (a rank died mid-drain), once."""
        err, self.error = self.error, None
        return err or self.jobs.take_error()

    def stop(self) -> None:
        """Rank 0: send "stop" now; the others: wait for it (at most the collective timeout)."""
        t = self._thread
        if t is None:
            return
        self._stopping = True
        self._wake.set()
        t.join(None if self.comm is None else self.timeout + self.heartbeat)
        if t.is_alive():
            log.error("objckpt: the drain retry clock did not stop within %.0f s (rank 0 has not closed its "
                      "manager): left behind", self.timeout)
        self._thread = None
        _clocks.discard(self)

    def _after_fork_in_child(self) -> None:
        self._thread = None
        self._stopping = True
        self.jobs._after_fork_in_child()
        self.queue._lock = threading.Lock()


def start_clock(comm: Comm, jobs: OrderedJobs, queue: DrainQueue, first: Optional[float],
                retry: Callable[[], None]) -> Optional[RetryClock]:
    """Collective over ``comm`` (from the caller's thread, at the manager's construction):
    the clock of a manager, None with ``first=None``.  Over several ranks it speaks on its
    own group (:data:`CLOCK_GROUP`), one clock per group at a time: while an earlier
    manager's clock still runs on any rank (not closed), this one has none (a warning;
    its failed drains are retried at the next save and at ``wait()``)."""
    if first is None:
        return None
    timeout = collective_timeout(None)
    if comm.world_size <= 1:
        return RetryClock(jobs, None, queue, first, retry, timeout)
    clock_comm = background_comm(comm, getattr(comm, "group", None), purpose=CLOCK_GROUP, timeout=timeout)
    with _busy_lock:
        free = clock_comm is not comm and getattr(clock_comm, "group", None) not in _busy
    if not all(comm.all_gather_object(free)):
        log.warning("objckpt: another manager's drain retry clock still runs (close it first): this manager "
                    "retries failed drains at the next save and at wait() only")
        return None
    return RetryClock(jobs, clock_comm, queue, first, retry, timeout)


def _after_fork_in_child() -> None:
    """The parent's clock threads do not exist in the child: mark them stopped (the child
    never speaks on the parent's groups) and forget which groups were busy."""
    global _busy_lock
    _busy_lock = threading.Lock()
    _busy.clear()
    for c in list(_clocks):
        c._after_fork_in_child()
    _clocks.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

#: the longest wait between two clock retries (re-exported: the backlog computes the backoff)
__all__ = ["DRAIN_RETRY_CAP_S", "DRAIN_RETRY_S", "OrderedJobs", "RetryClock", "retry_s_error", "start_clock"]
