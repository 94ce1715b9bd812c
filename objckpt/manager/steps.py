"""The steps of a root: the one seam between :class:`objckpt.CheckpointManager` and how its
steps are saved, found and loaded.

The manager keeps what is the same whichever way a step is written: the step index, the
retention policy, the steps it knows of, the background worker.  How a step gets under the
root is a :class:`RootSteps`: :class:`PlainSteps` saves straight to the root (object
storage); :class:`~objckpt.manager.tiers.TieredSaves` commits to the node-local tier and
drains to the root in the background.  The manager holds one and calls it; it never asks
which one it holds.

Neither implementation holds the manager: each gets a :class:`StepsHost`, the few values
and callbacks it may use (why: the tier used to reach into five of the manager's private
methods, so any change to the manager's bookkeeping could break the tier unseen; now the
host is the whole contract, and a test can build one from plain values).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..api import async_save as _async_save
from ..api import load as _load
from ..api import save as _save
from ..distributed.comm import Comm
from ..errors import CheckpointExistsError, NotFoundError
from ..results import LoadResult
from ..save.background import SaveHandle
from ..storage.base import ObjectStore
from ..tier.advice import Advice
from .naming import StepNaming
from .retention import Candidate, RetentionPolicyError
from .worker import CommitJob

log = logging.getLogger("objckpt.manager")


@dataclass(frozen=True)
class StepsHost:
    """What a :class:`RootSteps` may use of its manager: values, and callbacks into the
    manager's bookkeeping (index, retention, known steps).  The callbacks are collectives
    where the manager's methods are (every rank calls them alike)."""

    #: the manager's root (``s3://bucket/run``), without a trailing slash
    root: str
    naming: StepNaming
    #: the save times the index records
    clock: Callable[[], float]
    async_save: bool
    single_writer: bool
    process_group: Any
    no_dist: bool
    storage_options: Optional[dict[str, Any]]
    #: the training's group, as the manager speaks on it
    comm: Comm
    #: the root's store, and a step's key prefix in it (where a drain writes)
    store: ObjectStore
    step_prefix: Callable[[int], str]
    #: a step's checkpoint URI under the root
    step_uri: Callable[[int], str]
    #: the indexed steps, ascending (rank 0's read, broadcast)
    steps: Callable[[], list[int]]
    #: the run's steps the manager knows of (read once from the index, then kept up to date)
    known_steps: Callable[[], dict[int, Candidate]]
    #: a step drained to the root (tier background thread): learnt (nothing read) and
    #: indexed (rank 0), returning once indexed
    drained: Callable[[int, dict[str, Any], float], None]
    #: for a save straight to the root: refuse a step retention would delete at once
    check_order: Callable[[int, dict[str, Any]], None]
    #: ... the error for a step found committed (rank 0 adopts it into the index first)
    exists_error: Callable[[int, str, CheckpointExistsError], CheckpointExistsError]
    #: ... a step saved (or, with its handle, being saved): learnt and handed to the index
    #: worker; the worker's job (rank 0) or None
    committed: Callable[[int, dict[str, Any], float, Optional[SaveHandle]], Optional[CommitJob]]
    #: ... the newest indexed step whose manifest exists (index repaired; broadcast)
    newest: Callable[[], Optional[int]]
    #: ... a save failed: the known steps are read again when next needed
    forget: Callable[[], None]


class RootSteps(ABC):
    """How a manager's steps are saved, found and loaded (every rank calls every method)."""

    _preemption_told = False

    @abstractmethod
    def save(self, step: int, state: Any, md: dict[str, Any]) -> Optional[SaveHandle]:
        """Save ``state`` as ``step`` (``md``: its metadata); an async save's handle or None."""

    @abstractmethod
    def latest_step(self) -> Optional[int]:
        """The newest step a load can take (None: none)."""

    @abstractmethod
    def load(self, state: Any, step: Optional[int], load_kwargs: dict[str, Any]) -> LoadResult:
        """Load ``step`` (None: the latest) into ``state``."""

    @abstractmethod
    def wait(self) -> None:
        """Until the saves issued so far are done here; raises the first error."""

    @abstractmethod
    def close(self) -> None:
        """After :meth:`wait`: background work of this implementation ends."""

    @abstractmethod
    def step_tiers(self) -> dict[int, list[str]]:
        """Each step and where it is (``"object"``: under the root)."""

    def preemption_save(self, step: int, state: Any, md: dict[str, Any], deadline: float) -> Optional[SaveHandle]:
        """The save of the step every rank agreed on at a preemption (objckpt.manager.preemption),
        to be done by ``deadline`` (``time.monotonic()``): here the ordinary save, to the root."""
        return self.save(step, state, md)

    def preemption_wait(self, step: int, deadline: float) -> None:
        """:meth:`wait` after a preemption save of ``step``, saying where it got (logged once)."""
        self.wait()
        if self._preemption_told:
            return
        self._preemption_told = True
        log.info("objckpt: preemption save of step %d: committed in object storage (%s)", step,
                 self.host.step_uri(step))
        if time.monotonic() > deadline:
            log.warning("objckpt: the preemption save of step %d committed after its deadline "
                        "(preemption_deadline_s): the scheduler's grace period may be too short for a save to "
                        "object storage; a local tier commits faster (docs/tiering.md)", step)

    def advice(self) -> Advice:
        """The checkpoint interval advice; only tiered saves measure what it needs."""
        raise RetentionPolicyError("advice() measures tiered saves: pass tier=objckpt.TierSettings(local_dir=...) "
                                   "(and failure_rate=) to the CheckpointManager")


class PlainSteps(RootSteps):
    """Steps saved straight to the root: each a committed checkpoint under it, indexed by the
    manager's worker; with ``async_save`` one save in flight at a time."""

    def __init__(self, host: StepsHost) -> None:
        self.host = host
        self._handles: list[SaveHandle] = []

    def save(self, step: int, state: Any, md: dict[str, Any]) -> Optional[SaveHandle]:
        h = self.host
        uri = h.step_uri(step)
        h.check_order(step, md)
        self._settle()
        saved_at = h.clock()
        try:
            handle = self._start(state, uri, md)
        except CheckpointExistsError as e:
            # Never replaced, indexed or not: a committed manifest the index does not list yet
            # is another writer's checkpoint (a second job on this root, a restarted job beside
            # the old one) or the commit of a save killed before its index update, and nothing
            # stored can prove which.  A prefix with no manifest never gets here: the save just
            # goes on beside the leftover (blob keys are unique per attempt).
            raise h.exists_error(step, uri, e) from None
        job = h.committed(step, md, saved_at, handle)
        if handle is not None:
            self._handles.append(handle)
            return handle
        if job is not None:
            job.indexed.wait()
            if job.error is not None:
                raise job.error
        return None

    def _start(self, state: Any, uri: str, md: dict[str, Any]) -> Optional[SaveHandle]:
        """The async save's handle, or None once a synchronous save committed (never an overwrite)."""
        h = self.host
        kw: dict[str, Any] = {"storage_options": h.storage_options, "process_group": h.process_group,
                              "no_dist": h.no_dist, "metadata": md, "overwrite": False,
                              "single_writer": h.single_writer}
        if h.async_save:
            return _async_save(state, uri, max_in_flight=1, **kw)
        _save(state, uri, **kw)
        return None

    def _settle(self) -> None:
        """Wait for the async save in flight (one at most) and raise its error, on every rank."""
        handles, self._handles = self._handles, []
        if handles:
            concurrent.futures.wait(handles)
        for handle in handles:
            err = handle.exception()
            if err is not None:
                self.host.forget()  # that step does not exist: read the run's steps again when needed
                raise err

    def latest_step(self) -> Optional[int]:
        return self.host.newest()

    def load(self, state: Any, step: Optional[int], load_kwargs: dict[str, Any]) -> LoadResult:
        h = self.host
        if step is None:
            h.forget()  # as the manager's latest_step(): steps deleted by hand leave the index
            step = self.latest_step()
            if step is None:
                raise NotFoundError(f"no committed step under {h.root!r} to load")
        kw = {"storage_options": h.storage_options, "process_group": h.process_group, "no_dist": h.no_dist,
              **load_kwargs}
        res = _load(state, h.step_uri(step), **kw)
        res.step = step  # the step loaded, as a tiered restore's result says it
        return res

    def wait(self) -> None:
        self._settle()

    def close(self) -> None:
        """Nothing runs in the background here (the index worker is the manager's)."""

    def step_tiers(self) -> dict[int, list[str]]:
        return {s: ["object"] for s in self.host.steps()}


__all__ = ["PlainSteps", "RootSteps", "StepsHost"]
