"""The manager's background worker (rank 0 only): index each commit, then apply retention.

Why a worker: after a save commits, the index update (a few small requests)
and the deletion of steps that fell out of the retention policy (a DeleteObjects
per step) must not stall the training loop, and with ``async_save`` the commit
itself happens in the background, so whoever waits for it has to be off the
training thread too.  Jobs run one at a time in issue order, so the index
learns steps in the order they were saved, and a deletion only ever follows
the commit of a newer step.

Deletion order for each step out of policy: first the step leaves the index
(in the same conditional index update that adds the newly committed step, the
policy evaluated on the version that update is based on, so a concurrent
writer's new step is never lost),
then :func:`objckpt.ops.delete.delete_checkpoint` removes its manifest (the
checkpoint stops existing) and then the objects that manifest names.  A step
that is not in the index — a save of another manager still in flight — is
never a candidate, so retention never deletes a step someone is writing.

At interpreter exit the queued jobs are finished (an un-indexed commit would
otherwise be invisible to ``latest_step()`` until a :meth:`StepIndex.rebuild`)
by a threading exit hook, which runs before ``concurrent.futures`` stops
accepting work (the I/O needs its pools) and after objckpt's hook that waits
for async saves in flight (registered later, so it runs earlier).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from ..runtime import loop as _runtime
from ..ops.delete import delete_checkpoint
from ..errors import NotFoundError
from ..save.background import SaveHandle
from ..save.store_check import ConditionalWriteCheck, conditional_writes, save_refusal
from .index import IndexDoc, StepIndex
from .leftovers import LEFTOVER_GRACE, sweep_step
from .retention import Candidate, RetentionPolicy, retention_verdicts

log = logging.getLogger("objckpt.manager")


@dataclass
class CommitJob:
    """One save to index once it committed (``handle`` for async saves)."""

    step: int
    metadata: dict[str, Any]
    handle: Optional[SaveHandle] = None
    #: the save time the manager's clock gave (time-based retention); None: the manifest's
    saved_at: Optional[float] = None
    indexed: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None


@dataclass
class RetentionReport:
    """What one retention pass removed."""

    deleted: list[int] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)
    #: objects (and multipart uploads) of killed saves removed from the deleted steps' prefixes
    leftovers: int = 0
    #: deleted steps with leftovers still inside the grace period: step -> when they become old
    young: dict[int, float] = field(default_factory=dict)


def apply_retention(index: StepIndex, policy: RetentionPolicy, root_uri: str, dry_run: bool = False,
                    adopt: bool = False, grace: float = LEFTOVER_GRACE) -> RetentionReport:
    """Delete the indexed steps ``policy`` does not keep (see the module docstring for the order).
    ``adopt``: first adopt committed steps missing from the index (a LIST; ``objckpt prune``)."""
    if not policy.deletes:
        return RetentionReport()
    if adopt and not dry_run:
        _runtime.run(index.rebuild())
    if dry_run:
        doc = _runtime.run(index.survey() if adopt else index.read(repair=False))
        return RetentionReport(deleted=sorted(retention_verdicts(policy, candidates(doc))))
    doomed: dict[int, str] = {}

    def change(d: IndexDoc) -> IndexDoc:
        doomed.clear()
        doomed.update(retention_verdicts(policy, candidates(d)))
        return d.without(set(doomed))

    _runtime.run(index.update(change))
    return delete_steps(index, sorted(doomed), root_uri, grace, doomed)


def candidates(doc: IndexDoc) -> list[Candidate]:
    """What retention sees of an index version: (step, metadata, save time) per entry."""
    return [(e.step, e.metadata, e.time) for e in doc.steps]


def delete_steps(index: StepIndex, steps: list[int], root_uri: str, grace: float = LEFTOVER_GRACE,
                 reasons: Optional[dict[int, str]] = None) -> RetentionReport:
    """``objckpt.delete`` each step (already out of the index): manifest first, then its objects,
    then what killed saves of that step left under its prefix (:mod:`~objckpt.manager.leftovers`).
    Each deletion is logged at INFO with its step and ``reasons[step]`` (why retention dropped it)."""
    report = RetentionReport()
    for step in steps:
        prefix = index.step_prefix(step)
        uri = f"{root_uri}/{prefix.rsplit('/', 1)[-1]}"
        try:
            _runtime.run(delete_checkpoint(index.store, prefix, uri))
        except NotFoundError:
            pass  # another manager deleted it first
        except Exception as e:  # noqa: BLE001 - reported; the step is out of the index, gc cleans the rest
            report.failed[step] = f"{type(e).__name__}: {e}"
            continue
        report.deleted.append(step)
        if reasons is not None:
            log.info("objckpt: retention deleted step %d (%s): %s", step, uri, reasons.get(step, "out of policy"))
        sweep_into(report, index, step, grace)
    return report


def sweep_into(report: RetentionReport, index: StepIndex, step: int, grace: float) -> None:
    """Sweep the leftovers under a deleted ``step`` into ``report`` (a failure is logged: gc's job then)."""
    try:
        swept = _runtime.run(sweep_step(index.store, index.step_prefix(step), grace))
    except Exception as e:  # noqa: BLE001 - the step itself is deleted; what is left is gc's
        log.warning("objckpt: could not sweep the leftovers under deleted step %d: %s: %s", step, type(e).__name__, e)
        return
    report.leftovers += len(swept.deleted) + len(swept.aborted)
    if swept.due is not None:
        report.young[step] = swept.due


_live: "weakref.WeakSet[Worker]" = weakref.WeakSet()
_hook_lock = threading.Lock()
_hook_installed = [False]


def _drain_at_exit() -> None:
    for w in list(_live):
        if w._pid != os.getpid():
            continue  # a forked child's copy: the thread that would run its jobs is the parent's
        for e in w.join():
            log.warning("objckpt: checkpoint manager under %s: %s: %s", w.root_uri, type(e).__name__, e)


def _install_exit_hook() -> None:
    with _hook_lock:
        if _hook_installed[0]:
            return
        _hook_installed[0] = True
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_drain_at_exit)
    else:  # pragma: no cover - very old Python
        import atexit

        atexit.register(_drain_at_exit)


class Worker:
    """One thread that runs :class:`CommitJob` s in order."""

    def __init__(self, index: StepIndex, policy: RetentionPolicy, root_uri: str,
                 grace: float = LEFTOVER_GRACE, single_writer: bool = False) -> None:
        self.index = index
        self.single_writer = single_writer
        self.policy = policy
        self.root_uri = root_uri
        self.grace = grace
        #: deleted steps whose leftovers were still young: step -> when to sweep it again
        self.pending: dict[int, float] = {}
        #: whether the store honours create-only writes (probed before the first index update)
        self.conditional: Optional[ConditionalWriteCheck] = None
        self._jobs: "queue.Queue[Optional[CommitJob]]" = queue.Queue()
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.last_retention = RetentionReport()
        self._thread = threading.Thread(target=self._run, name="objckpt-manager", daemon=True)
        self._thread.start()
        _install_exit_hook()
        _live.add(self)

    def submit(self, job: CommitJob) -> None:
        self._jobs.put(job)

    def join(self) -> list[BaseException]:
        """Wait for every job submitted so far; return (and forget) their errors."""
        self._jobs.join()
        with self._lock:
            errors, self._errors = self._errors, []
        return errors

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            try:
                self._commit(job)
            finally:
                self._jobs.task_done()

    def _commit(self, job: CommitJob) -> None:
        """Index the step and drop what falls out of the policy in ONE conditional update
        (the policy is evaluated on the version the update is based on), then delete those."""
        doomed: dict[int, str] = {}

        def change(d: IndexDoc) -> IndexDoc:
            d = d.with_step(entry)
            doomed.clear()
            if not self.policy.deletes:
                return d
            doomed.update(retention_verdicts(self.policy, candidates(d)))
            return d.without(set(doomed))

        try:
            if job.handle is not None:
                job.handle.result()  # the save's own error is raised to every rank by the manager
            self._check_store_once()
            entry = _runtime.run(self.index.describe_step(job.step, job.metadata, saved_at=job.saved_at))
            _runtime.run(self.index.update(change))
        except BaseException as e:  # noqa: BLE001 - handed to wait()
            job.error = e
            if job.handle is None or job.handle.exception() is None:
                with self._lock:
                    self._errors.append(e)
            return
        finally:
            job.indexed.set()
        if job.step in doomed:  # another writer's newer steps, which this manager did not know of
            log.warning("objckpt: step %d under %s committed, then retention dropped it at once: %s",
                        job.step, self.root_uri, doomed[job.step])
        try:
            self.last_retention = delete_steps(self.index, sorted(doomed), self.root_uri, self.grace, doomed)
            if self.last_retention.failed:
                log.warning("objckpt: retention could not delete %s", self.last_retention.failed)
            self._sweep_due(self.last_retention, set(doomed))
        except BaseException as e:  # noqa: BLE001
            with self._lock:
                self._errors.append(e)

    def _check_store_once(self) -> None:
        """Whether the store honours create-only writes (:mod:`~objckpt.save.store_check`): the
        verdict the save's own probe left on this store, at no request; probed here only after
        a tiered save's drain, which reaches the store without that probe.  A store that
        ignores them gets a warning, unless ``single_writer``: the index's compare-and-swap
        and two writers on this root are unsafe there."""
        if self.conditional is not None:
            return
        try:
            self.conditional = _runtime.run(conditional_writes(self.index.store, self.index.root))
        except Exception as e:  # noqa: BLE001 - the probe must not fail a save; tried again next time
            log.debug("objckpt: conditional-write probe under %s failed: %s: %s", self.root_uri, type(e).__name__, e)
            return
        if not self.conditional.honoured and self.single_writer:
            save_refusal(self.index.store, self.conditional, self.root_uri, True)  # logged once per store
        elif not self.conditional.honoured:
            log.warning("objckpt: checkpoint manager under %s: %s.  Two writers of this root (two jobs, or a "
                        "restarted job beside the old one) can then both be told a step committed; objckpt "
                        "reads each commit back, which catches most such races but not all.  Use one writer "
                        "per root (and say so: single_writer=True), or a store that honours If-None-Match "
                        "(docs/reliability.md).",
                        self.root_uri, self.conditional.detail)

    def _sweep_due(self, report: RetentionReport, just_deleted: "set[int]") -> None:
        """Sweep again the deleted steps whose leftovers have aged past the grace period
        (a step indexed again meanwhile is live: its leftovers are gc's), then remember
        the ones still young."""
        now = time.time()
        for step, due in sorted(self.pending.items()):
            if due > now or step in just_deleted:
                continue
            del self.pending[step]
            sweep_into(report, self.index, step, self.grace)
        self.pending.update(report.young)
