"""Preemption: every rank saves the same step when a scheduler's signal reaches any of them.

A scheduler that takes spot or preemptible capacity back (SLURM, Kubernetes, the clouds'
spot notices) sends SIGTERM, then SIGKILL after a grace period.  The signal reaches the
ranks at different moments, often only some of them.  Each manager records the signal
(:func:`listen`), and :meth:`Preemption.reached` turns the ranks' records into one
decision every rank takes at the same step: one tiny MAX all-reduce
(:meth:`~objckpt.distributed.comm.Comm.any`) at the first call and then every
``check_every``-th call, nothing in between.

The signal plumbing is process-wide and lives here only: one handler function
(:func:`_on_signal`) per signal for every manager of the process, a registry of the
managers' :class:`SignalRecord` s, and the handler that was there before ours, which
still runs after ours (where it is a Python callable: ``SIG_DFL``, ``SIG_IGN``, a handler
set from C (``None``) and Python's own SIGINT handler, which raises ``KeyboardInterrupt``,
are not called: the point is to save, not to die).  The handler never does I/O and takes
no lock (it runs in the main thread between two bytecodes, possibly while that thread
holds any lock): it only records (the flag, the ``time.monotonic()`` of the first
signal, a count).  The registry is changed under a lock by :func:`listen` and
:func:`unlisten` and read by the handler without one: each change replaces a frozen
:class:`_Slot`.  A second signal during the save is recorded and nothing else.
"""
from __future__ import annotations

import logging
import math
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any, Iterable, Optional

from ..distributed.comm import Comm
from ..errors import ObjckptError

log = logging.getLogger("objckpt.manager")

#: the signals a manager listens to unless told otherwise (what schedulers send first)
DEFAULT_SIGNALS: tuple[int, ...] = (signal.SIGTERM,)
#: seconds a preemption save may take, from the first signal (most grace periods are 30 s or more)
DEFAULT_DEADLINE_S = 25.0
#: reached_preemption communicates at its first call and every k-th call after: one all-reduce was
#: measured at 0.2 / 0.6 / 2.5 / 5.2 ms per call on gloo at 2 / 4 / 8 / 16 ranks sharing 2 cores
#: (benchmarks/results/preemption-collective.json); every 10th call keeps 16 ranks under 1 ms a call,
#: and a signal is acted on within 10 steps (docs/tiering.md, "Preemption", says how to choose)
DEFAULT_CHECK_EVERY = 10
#: signals no process can catch
_UNCATCHABLE = frozenset({signal.SIGKILL, signal.SIGSTOP})


class PreemptionSettingsError(ObjckptError, ValueError):
    """A preemption setting of the CheckpointManager is invalid, or the ranks passed different ones."""


@dataclass
class SignalRecord:
    """What the handler records for one manager (written by the handler only, read by anyone)."""

    signals: frozenset[int]
    #: whether the handler is installed for this record (False: made off the main thread)
    installed: bool = True
    received: bool = False
    #: ``time.monotonic()`` at the first signal (None: none yet)
    first_at: Optional[float] = None
    count: int = 0
    last: Optional[int] = None

    def note(self, signum: int, now: float) -> None:
        if self.first_at is None:
            self.first_at = now
        self.count += 1
        self.last = signum
        self.received = True


@dataclass(frozen=True)
class _Slot:
    """One signal's registration: the handler there before ours, and the records to note,
    held weakly: a manager dropped without ``close()`` stops listening when it is collected,
    and the last live one's ``close()`` still puts the handler there before back."""

    previous: Any
    records: tuple["weakref.ref[SignalRecord]", ...] = ()


_slots: dict[int, _Slot] = {}
_lock = threading.Lock()
_chaining: set[int] = set()
_warned_thread = [False]


def _on_signal(signum: int, frame: Optional[FrameType]) -> None:
    """Record for every listening manager, then call the handler there before (see the module)."""
    if signum in _chaining:  # the previous handler called ours back (it chains too): noted already
        return
    slot = _slots.get(signum)
    if slot is None:
        return
    now = time.monotonic()
    for ref in slot.records:
        rec = ref()
        if rec is not None:
            rec.note(signum, now)
    prev = slot.previous
    if callable(prev) and prev is not _on_signal and prev is not signal.default_int_handler:
        _chaining.add(signum)
        try:
            prev(signum, frame)
        finally:
            _chaining.discard(signum)


def listen(signals: tuple[int, ...]) -> SignalRecord:
    """A record the handler fills whenever one of ``signals`` arrives, installing the handler
    where it is not installed (main thread only: elsewhere Python refuses; the record is then
    never filled, with one warning per process)."""
    rec = SignalRecord(frozenset(signals))
    if threading.current_thread() is not threading.main_thread():
        rec.installed = False
        if not _warned_thread[0]:
            _warned_thread[0] = True
            log.warning("objckpt: CheckpointManager created off the main thread: its preemption signal handler "
                        "(%s) is not installed, so this process does not notice a preemption signal itself; "
                        "reached_preemption() still agrees with the other ranks. Create the manager in the main "
                        "thread to listen here", ", ".join(_name(s) for s in signals))
        return rec
    with _lock:
        for s in signals:
            current = signal.getsignal(s)
            slot = _slots.get(s)
            if current is _on_signal and slot is not None:
                live = tuple(ref for ref in slot.records if ref() is not None)
                _slots[s] = replace(slot, records=live + (weakref.ref(rec),))
            else:  # not installed, or another handler replaced ours since: it becomes the previous one
                _slots[s] = _Slot(current, (slot.records if slot is not None else ()) + (weakref.ref(rec),))
                signal.signal(s, _on_signal)
    return rec


def unlisten(rec: SignalRecord) -> None:
    """Stop filling ``rec``; the last record of a signal gone, the handler there before ours is
    put back, where ours is still the installed one (another handler set since stays)."""
    if not rec.installed:
        return
    main = threading.current_thread() is threading.main_thread()
    with _lock:
        for s in rec.signals:
            slot = _slots.get(s)
            if slot is None or all(ref() is not rec for ref in slot.records):
                continue
            rest = tuple(ref for ref in slot.records if ref() is not None and ref() is not rec)
            ours = signal.getsignal(s) is _on_signal
            if rest or (ours and not main):  # off the main thread nothing can be put back: ours stays, empty
                _slots[s] = replace(slot, records=rest)
                continue
            if ours:
                signal.signal(s, slot.previous if slot.previous is not None else signal.SIG_DFL)
            del _slots[s]
    rec.installed = False


def _name(s: int) -> str:
    try:
        return signal.Signals(s).name
    except ValueError:
        return str(s)


@dataclass(frozen=True)
class PreemptionSettings:
    """A manager's preemption keywords, checked (see :meth:`checked`)."""

    signals: tuple[int, ...] = DEFAULT_SIGNALS
    deadline_s: float = DEFAULT_DEADLINE_S
    check_every: int = DEFAULT_CHECK_EVERY

    @classmethod
    def checked(cls, signals: Any, deadline_s: Any, check_every: Any) -> "PreemptionSettings":
        """The settings, or a :class:`PreemptionSettingsError` naming the keyword and what to pass."""
        if isinstance(signals, (str, bytes, int)) or not isinstance(signals, Iterable):
            raise PreemptionSettingsError(
                f"CheckpointManager(preemption_signals=...) takes a tuple of signals, e.g. (signal.SIGTERM,), or () "
                f"to turn preemption off; got {signals!r}")
        out: list[int] = []
        valid = signal.valid_signals()
        for s in signals:
            if isinstance(s, bool) or not isinstance(s, int) or s not in valid:
                raise PreemptionSettingsError(f"CheckpointManager(preemption_signals=...): {s!r} is not a signal of "
                                              "this platform; pass signal module members, e.g. signal.SIGTERM")
            if s in _UNCATCHABLE:
                raise PreemptionSettingsError(f"CheckpointManager(preemption_signals=...): {_name(s)} cannot be "
                                              "caught by any process; pass the signal the scheduler sends first "
                                              "(SIGTERM, or SIGUSR1 with SLURM's --signal)")
            if int(s) not in out:
                out.append(int(s))
        if (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                or not math.isfinite(deadline_s) or deadline_s <= 0):
            raise PreemptionSettingsError(f"CheckpointManager(preemption_deadline_s=...) must be a positive number "
                                          f"of seconds (the scheduler's grace period less a margin); got "
                                          f"{deadline_s!r}")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise PreemptionSettingsError(f"CheckpointManager(preemption_check_every=...) must be a positive int "
                                          f"(1: every call of reached_preemption communicates); got {check_every!r}")
        return cls(tuple(out), float(deadline_s), check_every)


@dataclass
class Agreement:
    """The step every rank agreed on, and the deadline this rank keeps."""

    step: int
    #: ``time.monotonic()`` by which the preemption save should be done here
    deadline: float
    #: the ranks that had received a signal when the ranks agreed
    signalled: list[int] = field(default_factory=list)


class Preemption:
    """One manager's preemption: its signal record and the ranks' agreement (see the module)."""

    def __init__(self, settings: PreemptionSettings, comm: Comm) -> None:
        self.settings = settings
        self.comm = comm
        self.record: Optional[SignalRecord] = listen(settings.signals) if settings.signals else None
        self.agreed: Optional[Agreement] = None
        self._calls = 0

    @property
    def received(self) -> bool:
        """Whether this process received one of the signals (since the manager was made)."""
        return self.record is not None and self.record.received

    def reached(self, step: int) -> bool:
        """Collective: True on every rank at the same call once any rank received a signal; then
        True at every later call without communicating.  The first call also checks that every
        rank has the same settings (an all-gather, once); later calls check every
        ``check_every``-th call (the first included) and return False in between."""
        if self.agreed is not None:
            return True
        self._calls += 1
        first = self._calls == 1
        every = self.settings.check_every if self.comm.world_size > 1 else 1
        if not first and (self.record is None or (self._calls - 1) % every):
            return False
        flag = self.received
        if first and self.comm.world_size > 1:
            mine = (bool(self.settings.signals), every, flag)
            everyone = self.comm.all_gather_object(mine)
            if len({(on, k) for on, k, _ in everyone}) > 1:
                raise PreemptionSettingsError(
                    "the ranks passed different preemption settings to CheckpointManager (rank: (listening, "
                    f"preemption_check_every)): {dict(enumerate((on, k) for on, k, _ in everyone))}; every rank "
                    "must pass the same preemption_signals (empty or not) and preemption_check_every")
            hit = any(f for _, _, f in everyone)
        elif self.record is None:
            return False
        else:
            hit = self.comm.any(flag)
        if hit:
            self._agree(step)
        return hit

    def _agree(self, step: int) -> None:
        """The ranks agreed on ``step``: every rank keeps the deadline of the rank that received
        its signal first (one all-gather, once): no rank waits in a collective of the save
        for a rank whose own deadline is later."""
        now = time.monotonic()
        first = self.record.first_at if self.record is not None else None
        mine = None if first is None else now - first
        elapsed = self.comm.all_gather_object(mine) if self.comm.world_size > 1 else [mine]
        signalled = [r for r, e in enumerate(elapsed) if e is not None]
        waited = max([e for e in elapsed if e is not None], default=0.0)
        self.agreed = Agreement(step, now + max(self.settings.deadline_s - waited, 0.0), signalled)
        if self.comm.rank == 0:
            log.warning("objckpt: preemption: rank(s) %s received %s; every rank saves step %d, within %.1f s "
                        "(preemption_deadline_s=%g from the first signal)", signalled,
                        "/".join(_name(s) for s in self.settings.signals), step, max(self.settings.deadline_s
                                                                                     - waited, 0.0),
                        self.settings.deadline_s)

    def left(self) -> float:
        """Seconds left before the agreed deadline (0 when past; inf before any agreement)."""
        if self.agreed is None:
            return math.inf
        return max(self.agreed.deadline - time.monotonic(), 0.0)

    def close(self) -> None:
        if self.record is not None:
            unlisten(self.record)


__all__ = ["DEFAULT_CHECK_EVERY", "DEFAULT_DEADLINE_S", "DEFAULT_SIGNALS", "Agreement", "Preemption",
           "PreemptionSettings", "PreemptionSettingsError", "SignalRecord", "listen", "unlisten"]
