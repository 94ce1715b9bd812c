"""CheckpointManager: numbered checkpoints under one root, an index to find the latest, retention.

    m = objckpt.CheckpointManager("s3://bucket/run", keep_last=3, keep_every=1000, async_save=True)
    start = m.latest_step()
    if start is not None:
        m.load(state)                        # the latest step
    for step in range(...):
        ...
        m.save(step, state, metadata={"loss": loss})
    m.wait()

Each step is one ordinary objckpt checkpoint at ``<root>/step-<10 digits>``
(:func:`objckpt.manager.index.step_name`), committed by its manifest as any
other; the manager adds the step index (:mod:`objckpt.manager.index`) and the
retention policy (:mod:`objckpt.manager.retention`), both handled by rank 0 in
a background worker (:mod:`objckpt.manager.worker`).

Multi-rank: every rank calls every method (they are collectives, like
:func:`objckpt.save`); only rank 0 reads or writes the index and deletes, and
``steps()`` / ``latest_step()`` are read by rank 0 and broadcast, so every
rank gets the same answer.  Errors of the index update or of retention are
raised by :meth:`wait` on rank 0 only (the checkpoint itself committed); a
failed save raises on every rank.
"""
from __future__ import annotations

import concurrent.futures
import logging
import operator
from typing import Any, Optional

from .. import _runtime
from ..api import async_save as _async_save
from ..api import load as _load
from ..api import save as _save
from ..deletion import DeleteReport, delete_checkpoint
from ..distributed.comm import Comm, LocalComm, decide_on_root, get_comm
from ..errors import CheckpointExistsError, ConditionalWriteIgnoredError, NotFoundError
from ..format import keys
from ..results import LoadResult
from ..save.background import SaveHandle
from ..storage import open_store
from .index import IndexDoc, StepIndex, step_name
from .leftovers import LEFTOVER_GRACE
from .retention import RetentionPolicy
from .worker import CommitJob, RetentionReport, Worker, apply_retention, sweep_into

log = logging.getLogger("objckpt.manager")


class CheckpointManager:
    """Saves, finds, loads and prunes the numbered checkpoints of one training run."""

    def __init__(self, root: str, *, keep_last: Optional[int] = None, keep_every: Optional[int] = None,
                 keep_best: Optional[int] = None, best_key: Optional[str] = None, best_mode: str = "max",
                 async_save: bool = False, storage_options: Optional[dict[str, Any]] = None,
                 process_group: Any = None, no_dist: bool = False, leftover_grace: float = LEFTOVER_GRACE) -> None:
        """``root``: where the run's steps go (``s3://bucket/run``, a path, ...).
        Retention (see :mod:`objckpt.manager.retention`): ``keep_last``, ``keep_every``,
        ``keep_best`` ranked by ``metadata[best_key]`` (``best_mode="max"``: higher is
        better, ``"min"``: lower); no rule keeps everything.  ``async_save``: :meth:`save`
        returns once the state is staged, one save in flight at a time.  ``leftover_grace``:
        seconds after which what killed saves left under a step that retention deletes
        is removed with it (the rule and default of ``objckpt gc``; see
        :mod:`objckpt.manager.leftovers`)."""
        self.root = root.rstrip("/")
        self.policy = RetentionPolicy(keep_last, keep_every, keep_best, best_key, best_mode)
        self.async_save = async_save
        self.storage_options = storage_options
        self.process_group = process_group
        self.no_dist = no_dist
        self._comm: Comm = LocalComm() if no_dist else get_comm(process_group)
        store, prefix = open_store(self.root, storage_options)
        self.index = StepIndex(store, prefix)
        self._handles: list[SaveHandle] = []
        self.leftover_grace = float(leftover_grace)
        self._worker: Optional[Worker] = (Worker(self.index, self.policy, self.root, self.leftover_grace)
                                          if self.is_root else None)

    # -- naming -----------------------------------------------------------------------------
    @property
    def is_root(self) -> bool:
        """Whether this rank keeps the index (rank 0 of the group)."""
        return self._comm.rank == 0

    def step_uri(self, step: int) -> str:
        """The checkpoint URI of ``step`` (``<root>/step-0000000100``)."""
        return f"{self.root}/{step_name(step)}"

    def _dist_kwargs(self) -> dict[str, Any]:
        return {"storage_options": self.storage_options, "process_group": self.process_group,
                "no_dist": self.no_dist}

    # -- saving -----------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, metadata: Optional[dict[str, Any]] = None) -> Optional[SaveHandle]:
        """Save ``state`` as ``step`` (every rank calls it).  Returns the :class:`SaveHandle`
        with ``async_save`` (at most one in flight: the previous save is waited for first),
        else None once committed and indexed.  A step already committed raises
        :class:`CheckpointExistsError`."""
        uri = self.step_uri(step)  # validates step
        step = operator.index(step)
        md = dict(metadata or {})
        self._settle_handles()
        try:
            handle = self._start(state, uri, md)
        except CheckpointExistsError as e:
            # Never replaced, indexed or not: a committed manifest the index does not list yet
            # is another writer's checkpoint (a second job on this root, a restarted job beside
            # the old one) or the commit of a save killed before its index update, and nothing
            # stored can prove which.  A prefix with no manifest never gets here: the save just
            # goes on beside the leftover (blob keys are unique per attempt).
            raise self._exists_error(step, uri, e) from None
        if handle is not None:
            self._handles.append(handle)
            if self._worker is not None:
                self._worker.submit(CommitJob(step, md, handle))
            return handle
        if self._worker is not None:
            job = CommitJob(step, md)
            self._worker.submit(job)
            job.indexed.wait()
            if job.error is not None:
                raise job.error
        return None

    def _start(self, state: Any, uri: str, md: dict[str, Any]) -> Optional[SaveHandle]:
        """The async save's handle, or None once a synchronous save committed (never an overwrite)."""
        if self.async_save:
            return _async_save(state, uri, metadata=md, max_in_flight=1, overwrite=False, **self._dist_kwargs())
        _save(state, uri, metadata=md, overwrite=False, **self._dist_kwargs())
        return None

    def _exists_error(self, step: int, uri: str, cause: CheckpointExistsError) -> CheckpointExistsError:
        """The error for a save that found ``step`` committed; rank 0 first adopts the step into
        the index when it is missing there (it is a checkpoint, whoever wrote it), so
        ``latest_step()`` shows what is stored.  The same error on every rank."""
        def adopt() -> str:
            try:
                if step in _runtime.run(self.index.read()).step_numbers():
                    return ""
                entry = _runtime.run(self.index.describe_step(step))
                _runtime.run(self.index.add(entry))
            except NotFoundError:
                return "; it was deleted meanwhile."
            except Exception as e:  # noqa: BLE001 - the save's own error is what the caller gets
                log.warning("objckpt: could not index the committed step %d under %s: %s: %s", step, self.root,
                            type(e).__name__, e)
                return "; indexing it failed (see the log)."
            return "; it is now indexed."

        outcome = self._on_root(adopt)
        why = "" if not outcome else (
            " It was not in the index: another job is saving under this root, or a save was killed after its "
            "commit and before its index update" + outcome)
        cls = ConditionalWriteIgnoredError if isinstance(cause, ConditionalWriteIgnoredError) else CheckpointExistsError
        detail = f" ({cause})" if cls is ConditionalWriteIgnoredError else ""
        return cls(f"step {step} is already committed under {self.root!r} ({uri}); it was not replaced.{why} "
                   f"Delete it first (CheckpointManager.delete) to save it again{detail}")

    def _settle_handles(self) -> None:
        """Wait for the async save in flight (one at most) and raise its error, on every rank."""
        handles, self._handles = self._handles, []
        if handles:
            concurrent.futures.wait([h._future for h in handles])
        for h in handles:
            err = h.exception()
            if err is not None:
                raise err

    def wait(self) -> None:
        """Until every save issued so far has committed and been indexed (and retention ran);
        raises the first error (a failed save on every rank, index/retention errors on rank 0)."""
        self._settle_handles()
        if self._worker is not None:
            errors = self._worker.join()
            if errors:
                raise errors[0]

    def close(self) -> None:
        """:meth:`wait`, then stop the background worker."""
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._worker.stop()
                self._worker = None

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- finding ----------------------------------------------------------------------------
    def _on_root(self, fn: Any) -> Any:
        """``fn()`` on rank 0, its value (or its error) on every rank."""
        if self._comm.world_size == 1:
            return fn()
        return decide_on_root(self._comm, None, lambda _: fn())

    def steps(self) -> list[int]:
        """Committed (and indexed) steps, ascending: a GET or two on rank 0, no LIST."""
        return self._on_root(lambda: _runtime.run(self.index.read()).step_numbers())

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None; the same value on every rank.  The index's newest
        step is checked (a HEAD of its manifest): a step deleted behind the manager's back
        (its folder removed by hand) is dropped from the index, with a warning, and the
        newest step that exists is the answer."""
        return self._on_root(self._newest_existing)

    def _newest_existing(self) -> Optional[int]:
        """Rank 0: the newest indexed step whose manifest exists; indexed steps above it
        whose manifest is gone leave the index (re-checked after, so a step committed
        again meanwhile is put back)."""
        steps = _runtime.run(self.index.read()).step_numbers()
        gone: list[int] = []
        found: Optional[int] = None
        for s in reversed(steps):
            if self._committed(s):
                found = s
                break
            gone.append(s)
        if gone:
            log.warning("objckpt: step(s) %s under %s are in the index but their manifest is gone (deleted "
                        "outside the manager?): dropped from the index; the latest step is %s", sorted(gone),
                        self.root, found)
            _runtime.run(self.index.remove(set(gone)))
            back = [s for s in gone if self._committed(s)]
            for s in back:  # committed again between our HEAD and our update
                _runtime.run(self.index.add(_runtime.run(self.index.describe_step(s))))
            if back:
                found = max([*back] + ([found] if found is not None else []))
        return found

    def _committed(self, step: int) -> bool:
        return _runtime.run(self.index.store.head(keys.manifest_key(self.index.step_prefix(step)))) is not None

    def entries(self) -> IndexDoc:
        """The index document (steps with time, size and metadata); rank 0's, broadcast."""
        return self._on_root(lambda: _runtime.run(self.index.read()))

    def reindex(self) -> list[int]:
        """Rebuild the index from the committed manifests (LIST + GETs): adopts a step whose
        save was killed after its commit but before its index update."""
        return self._on_root(lambda: _runtime.run(self.index.rebuild()).step_numbers())

    # -- loading and deleting ---------------------------------------------------------------
    def load(self, state: Any, step: Optional[int] = None, **load_kwargs: Any) -> LoadResult:
        """Load ``step`` (the latest when None) into ``state`` in place, any world size;
        ``load_kwargs`` go to :func:`objckpt.load`.  :class:`NotFoundError` when there is none."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise NotFoundError(f"no committed step under {self.root!r} to load")
        kw = {**self._dist_kwargs(), **load_kwargs}
        return _load(state, self.step_uri(step), **kw)

    def delete(self, step: int) -> Optional[DeleteReport]:
        """Delete ``step``: out of the index first, then its manifest, then its objects, then what
        killed saves left under it past ``leftover_grace`` (rank 0; every rank calls it).
        :class:`NotFoundError` when it is neither indexed nor committed."""
        uri = self.step_uri(step)

        def run() -> DeleteReport:
            _runtime.run(self.index.remove({step}))
            report = _runtime.run(delete_checkpoint(self.index.store, self.index.step_prefix(step), uri))
            sweep_into(RetentionReport(), self.index, step, self.leftover_grace)  # killed saves' leftovers
            return report

        return self._on_root(run)

    def prune(self, dry_run: bool = False) -> RetentionReport:
        """Apply the retention policy now (normally done after each save); rank 0 deletes."""
        return self._on_root(lambda: apply_retention(self.index, self.policy, self.root, dry_run,
                                                     grace=self.leftover_grace))


__all__ = ["CheckpointManager"]
