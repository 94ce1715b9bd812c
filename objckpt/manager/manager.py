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
(or under the names ``step_format`` gives: :mod:`objckpt.manager.naming`),
committed by its manifest as any other; the manager adds the step index (:mod:`objckpt.manager.index`) and the
retention policy (:mod:`objckpt.manager.retention`), both handled by rank 0 in
a background worker (:mod:`objckpt.manager.worker`).

Multi-rank: every rank calls every method (they are collectives, like
:func:`objckpt.save`); only rank 0 reads or writes the index and deletes, and
``steps()`` / ``latest_step()`` are read by rank 0 and broadcast, so every
rank gets the same answer.  Errors of the index update or of retention are
raised by :meth:`wait` on rank 0 only (the checkpoint itself committed); a
failed save raises on every rank.

What the manager knows of the run's steps (for :meth:`should_save` and for
refusing a save that retention would delete at once) is read from the index once,
at the first :meth:`save` / :meth:`should_save` (rank 0, broadcast), then kept up to
date with its own saves, so neither costs a request per step.  With a local tier
these are the steps in object storage: a save is learnt once its drain committed
(a local-only step that a restore dropped may be saved again).  A step another
writer saved meanwhile is not in it: if that makes retention drop a step this
manager just saved, the worker says so (a warning naming the step and why).
"""
from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable, Optional

from ..runtime import loop as _runtime
from ..ops.delete import DeleteReport, delete_checkpoint
from ..distributed.comm import Comm, LocalComm, decide_on_root, get_comm
from ..errors import CheckpointExistsError, CommitReplacedError, NotFoundError
from ..format import keys
from ..results import LoadResult
from ..save.background import SaveHandle
from ..storage import open_store
from .index import IndexDoc, StepIndex, refuse_dcp
from .leftovers import LEFTOVER_GRACE
from .naming import (DEFAULT_STEP_FORMAT, InvalidStepError, StepNaming, SwappedArgumentsError, check_step, describe,
                     looks_like_step)
from ..tier.advice import Advice
from ..tier.settings import DEPRECATED_KEYWORDS, TierSettings
from ..tier.settings import from_keywords as tier_from_keywords
from .preemption import (DEFAULT_CHECK_EVERY, DEFAULT_DEADLINE_S, DEFAULT_SIGNALS, Preemption,
                         PreemptionSettings)
from .steps import PlainSteps, RootSteps, StepsHost
from .tiers import TieredSaves
from .retention import Candidate, RetentionPolicy, RetentionPolicyError, StepOrderError, best_step, steps_to_keep
from .worker import CommitJob, RetentionReport, Worker, apply_retention, candidates, sweep_into

log = logging.getLogger("objckpt.manager")

#: a deprecated keyword the caller did not pass
_UNSET: Any = object()


class CheckpointManager:
    """Saves, finds, loads and prunes the numbered checkpoints of one training run."""

    def __init__(self, root: str, *, keep_last: Optional[int] = None, keep_every: Optional[int] = None,
                 keep_best: Optional[int] = None, best_key: Optional[str] = None, best_mode: str = "max",
                 keep_every_seconds: Optional[float] = None, save_every: Optional[int] = None,
                 step_format: str = DEFAULT_STEP_FORMAT, async_save: bool = False,
                 storage_options: Optional[dict[str, Any]] = None, process_group: Any = None,
                 no_dist: bool = False, leftover_grace: float = LEFTOVER_GRACE,
                 clock: Callable[[], float] = time.time, tier: Optional[TierSettings] = None,
                 node_override: Optional[str] = None, failure_rate: Optional[float] = None,
                 single_writer: bool = False, preemption_signals: tuple[int, ...] = DEFAULT_SIGNALS,
                 preemption_deadline_s: float = DEFAULT_DEADLINE_S,
                 preemption_check_every: int = DEFAULT_CHECK_EVERY,
                 # deprecated: the fields of ``tier`` (one DeprecationWarning per manager that gets any)
                 local_dir: Optional[str] = _UNSET, replicas: Optional[int] = _UNSET,
                 persist_every: Optional[int] = _UNSET, persist_every_seconds: Optional[float] = _UNSET,
                 local_keep: int = _UNSET, drain_bandwidth: Optional[float] = _UNSET, direct: bool = _UNSET,
                 tier_backend: str = _UNSET, drain_retry_s: Optional[float] = _UNSET) -> None:
        """``root``: where the run's steps go (``s3://bucket/run``, a path, ...).
        Retention (see :mod:`objckpt.manager.retention`): ``keep_last``, ``keep_every``,
        ``keep_best`` ranked by ``metadata[best_key]`` (``best_mode="max"``: higher is
        better, ``"min"``: lower), ``keep_every_seconds`` (one step per that many seconds
        of save time, kept for ever); no rule keeps everything.  ``save_every``: the
        save interval in steps (:meth:`should_save`; :meth:`save` skips other steps
        unless ``force=True``).  ``step_format``: the step folders' names
        (:mod:`objckpt.manager.naming`, e.g. ``"step_{step}"``).  ``async_save``:
        :meth:`save` returns once the state is staged, one save in flight at a time.
        ``leftover_grace``: seconds after which what killed saves left under a step
        that retention deletes is removed with it (the rule and default of ``objckpt
        gc``; see :mod:`objckpt.manager.leftovers`).  ``clock``: the save times the
        index records (``time.time``; tests pass their own to exercise
        ``keep_every_seconds`` without waiting).  ``single_writer=True``: you guarantee one
        writer (this job) under ``root``; a store that ignores ``If-None-Match: *`` is then
        used instead of refused with :class:`~objckpt.errors.ConditionalWriteIgnoredError`
        (see :func:`objckpt.save`).

        Tiered checkpoints (docs/tiering.md; without ``tier`` none of this applies):
        ``tier=objckpt.TierSettings(local_dir=..., ...)``: ``local_dir`` (a node-local
        directory, ``{node}`` replaced by the node's name) receives every save, committed
        there; ``replicas`` peers on other nodes get a copy in the background; every
        ``persist_every``-th save (or one every ``persist_every_seconds``) drains to ``root``
        in the background and is indexed there; the fields and their defaults are
        :class:`~objckpt.tier.settings.TierSettings`'s, the same on every rank.  Two options
        stay keywords here: ``node_override``, this rank's node name (else
        ``$OBJCKPT_NODE``, else the hostname; per rank by design), and ``failure_rate``
        (failures per hour) for :meth:`advice`.  The keywords ``local_dir=``, ``replicas=``,
        ``persist_every=``, ... (the fields of ``TierSettings``) still work for one release,
        with a ``DeprecationWarning``; passing one of them with ``tier=`` is a
        :class:`~objckpt.TierSettingsError`.

        Preemption (:meth:`reached_preemption`; docs/tiering.md, "Preemption"):
        ``preemption_signals`` (default ``(signal.SIGTERM,)``; ``()``: off, no handler) are
        recorded by a handler installed here (main thread; the handler there before still
        runs after it; :meth:`close` puts it back); ``preemption_deadline_s`` bounds the
        preemption save from the first signal any rank received; ``preemption_check_every``:
        :meth:`reached_preemption` communicates at its first call and every that many calls
        after (the same on every rank; a :class:`~objckpt.manager.preemption.PreemptionSettingsError`
        names a bad value or ranks that differ)."""
        self.root = root.rstrip("/")
        self.policy = RetentionPolicy(keep_last, keep_every, keep_best, best_key, best_mode, keep_every_seconds)
        if save_every is not None and (not looks_like_step(save_every) or check_step(save_every) < 1):
            raise RetentionPolicyError(f"save_every must be a positive int or None, got {describe(save_every)}")
        self.save_every = save_every
        self.naming = StepNaming(step_format)
        self.clock = clock
        self.async_save = async_save
        self.storage_options = storage_options
        self.process_group = process_group
        self.no_dist = no_dist
        self.single_writer = single_writer
        preemption = PreemptionSettings.checked(preemption_signals, preemption_deadline_s, preemption_check_every)
        self._comm: Comm = LocalComm() if no_dist else get_comm(process_group)
        store, prefix = open_store(self.root, storage_options)
        self.index = StepIndex(store, prefix, self.naming)
        #: the run's steps as this manager knows them (see the module docstring); None: not read yet
        self._known: Optional[dict[int, Candidate]] = None
        self._jobs: list[CommitJob] = []  # rank 0: submitted, maybe not indexed yet
        self.leftover_grace = float(leftover_grace)
        self._worker: Optional[Worker] = (Worker(self.index, self.policy, self.root, self.leftover_grace,
                                                 single_writer) if self.is_root else None)
        old = {k: v for k, v in zip(DEPRECATED_KEYWORDS, (local_dir, replicas, persist_every, persist_every_seconds,
                                                          local_keep, drain_bandwidth, direct, tier_backend,
                                                          drain_retry_s)) if v is not _UNSET}
        settings, deprecated = tier_from_keywords(tier, old)
        if deprecated:
            warnings.warn(deprecated, DeprecationWarning, stacklevel=2)
        host = self._host()
        #: how this manager's steps are saved, found and loaded: the one seam (objckpt.manager.steps)
        self._steps: RootSteps = (PlainSteps(host) if settings is None
                                  else TieredSaves(host, settings, node_override, failure_rate))
        #: the signal record and the ranks' agreement (installed last: a refused manager installs nothing)
        self._preemption = Preemption(preemption, self._comm)
        self._preemption_saved = False  # the agreed step's save was issued: wait() is bounded by its deadline

    def _host(self) -> StepsHost:
        """What the steps implementation may use of this manager (late-bound: each callback
        looks the method up when called)."""
        return StepsHost(
            root=self.root, naming=self.naming, clock=self.clock, async_save=self.async_save,
            single_writer=self.single_writer, process_group=self.process_group, no_dist=self.no_dist,
            storage_options=self.storage_options, comm=self._comm, store=self.index.store,
            step_prefix=self.index.step_prefix, step_uri=self.step_uri, steps=lambda: self.steps(),
            known_steps=lambda: self._known_steps(), drained=lambda *a: self._drained(*a),
            check_order=lambda *a: self._check_order(*a), exists_error=lambda *a: self._exists_error(*a),
            committed=lambda *a: self._record(*a), newest=lambda: self._on_root(self._newest_existing),
            forget=self._forget)

    @property
    def _tiers(self) -> Optional[TieredSaves]:
        """The tiered implementation, when this manager has a tier (diagnostics and tests)."""
        return self._steps if isinstance(self._steps, TieredSaves) else None

    # -- naming -----------------------------------------------------------------------------
    @property
    def is_root(self) -> bool:
        """Whether this rank keeps the index (rank 0 of the group)."""
        return self._comm.rank == 0

    def step_uri(self, step: int) -> str:
        """The checkpoint URI of ``step`` (``<root>/step-0000000100`` by default)."""
        return f"{self.root}/{self.naming.name(step)}"

    # -- saving -----------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, metadata: Optional[dict[str, Any]] = None,
             force: bool = False) -> Optional[SaveHandle]:
        """Save ``state`` as ``step`` (every rank calls it).  Returns the :class:`SaveHandle`
        (a ``concurrent.futures.Future``) with ``async_save`` (at most one in flight: the
        previous save is waited for first), else None once committed and indexed.

        With ``save_every``, a step off the interval is skipped (None, nothing written)
        unless ``force=True``.  A step already committed raises :class:`CheckpointExistsError`;
        a step older than the newest that retention would delete as soon as it is indexed
        raises :class:`StepOrderError`, before anything is uploaded."""
        step = _step_arg("save(step, state)", step, state, "save(step=..., state=...)")
        md = dict(metadata or {})
        agreed = self._preemption.agreed
        if agreed is not None and step == agreed.step:  # saved whatever save_every says, to the fastest tier
            log.info("objckpt: preemption save of step %d (%.1f s left of the deadline)", step,
                     self._preemption.left())
            handle = self._steps.preemption_save(step, state, md, agreed.deadline)
            self._preemption_saved = True
            return handle
        if self.save_every is not None and not force and step % self.save_every:
            log.debug("objckpt: step %d is off the save interval (save_every=%d): not saved", step, self.save_every)
            return None
        return self._steps.save(step, state, md)

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is one to save: on the ``save_every`` interval (any step without
        one) and newer than every step this manager knows of.  Every rank calls it (the
        first call reads the index on rank 0, no request after that)."""
        step = _step_arg("should_save(step)", step)
        if self.save_every is not None and step % self.save_every:
            return False
        known = self._known_steps()
        return not known or step > max(known)

    # -- preemption (objckpt.manager.preemption) --------------------------------------------
    def reached_preemption(self, step: int) -> bool:
        """Whether to save ``step`` now because the job is being preempted: True on every rank at
        the same call once any rank received one of ``preemption_signals``, then True at every
        later call (without communicating).  A collective: every rank calls it every step.  It
        communicates (one tiny all-reduce) at its first call and every
        ``preemption_check_every``-th call after, and returns False in between; without
        ``preemption_signals`` it returns False (after one check at its first call that every
        rank agrees on that).  Save the step it returns True for, then ``wait()`` and exit::

            if mgr.should_save(step) or mgr.reached_preemption(step):
                mgr.save(step, state)
            if mgr.preemption_step == step:
                mgr.wait()
                sys.exit(0)
        """
        return self._preemption.reached(_step_arg("reached_preemption(step)", step))

    @property
    def preemption_step(self) -> Optional[int]:
        """The step every rank agreed to save at a preemption (None: none yet)."""
        agreed = self._preemption.agreed
        return None if agreed is None else agreed.step

    @property
    def preempted(self) -> bool:
        """Whether this process received one of ``preemption_signals`` (other ranks may have
        without this one: :meth:`reached_preemption` is what the ranks agree on)."""
        return self._preemption.received

    def _submit(self, job: CommitJob) -> Optional[CommitJob]:
        if self._worker is None:
            return None
        self._jobs = [j for j in self._jobs if not j.indexed.is_set()]
        self._jobs.append(job)
        self._worker.submit(job)
        return job

    def _record(self, step: int, md: dict[str, Any], saved_at: float,
                handle: Optional[SaveHandle]) -> Optional[CommitJob]:
        """A step saved under the root (or being saved: ``handle``): learnt, and handed to the
        index worker (rank 0: its job, else None)."""
        self._learn(step, md, saved_at)
        return self._submit(CommitJob(step, md, handle, saved_at=saved_at))

    def _drained(self, step: int, md: dict[str, Any], saved_at: float) -> None:
        """The tier's background thread drained ``step`` to the root: learnt without a read (see
        :meth:`_learn`), indexed (rank 0), returning once it is."""
        self._learn(step, md, saved_at, read=False)
        job = self._submit(CommitJob(step, md, saved_at=saved_at))
        if job is not None:
            job.indexed.wait()

    def _forget(self) -> None:
        """A save failed: the run's steps are read again when next needed."""
        self._known = None

    # -- what the manager knows of the run's steps -------------------------------------------
    def _known_steps(self) -> dict[int, Candidate]:
        """The run's steps (see the module docstring): read once (rank 0, broadcast)."""
        if self._known is None:
            entries = self._on_root(lambda: candidates(self._checked(_runtime.run(self.index.read()))))
            self._known = {c[0]: c for c in entries}
        return self._known

    def _learn(self, step: int, md: dict[str, Any], saved_at: float, read: bool = True) -> None:
        """Add a step this manager committed under the root; drop what the policy drops, as the
        worker will.  With a local tier only drained steps are learnt (a local-only step is
        not the root's: a restore may drop it and the training save its number again), from
        the tier's background thread with ``read=False``: nothing is read there (the read is
        a collective of the training's group), the step is only added to what was read."""
        known = self._known_steps() if read else self._known
        if known is None:
            return
        known[step] = (step, md, saved_at)
        if self.policy.deletes:
            keep = steps_to_keep(self.policy, known.values())
            for s in [s for s in known if s not in keep]:
                del known[s]

    def _check_order(self, step: int, md: dict[str, Any]) -> None:
        """Refuse a step older than the newest known one that retention would delete at
        once (it would be uploaded and deleted, silently).  Rank 0 decides, as it alone
        has the clock the index records."""
        known = self._known_steps()
        if not self.policy.deletes or not known or step >= max(known) or step in known:
            return

        def verdict() -> str:
            keep = steps_to_keep(self.policy, [*known.values(), (step, md, self.clock())])
            return "" if step in keep else f"{max(known)}"

        newest = self._on_root(verdict)
        if newest:
            raise StepOrderError(
                f"step {step} is older than the latest step {newest} under {self.root!r}, and the retention policy "
                f"({self._policy_text()}) would delete it as soon as it is saved: not saved.  Save a newer step, "
                f"delete the newer steps first (CheckpointManager.delete), or use a root without those steps")

    def _policy_text(self) -> str:
        p = self.policy
        rules = [f"{k}={getattr(p, k)!r}" for k in ("keep_last", "keep_every", "keep_best", "keep_every_seconds")
                 if getattr(p, k) is not None]
        if p.keep_best is not None:
            rules.append(f"best_key={p.best_key!r}, best_mode={p.best_mode!r}")
        return ", ".join(rules)

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
        cls = CommitReplacedError if isinstance(cause, CommitReplacedError) else CheckpointExistsError
        detail = f" ({cause})" if cls is CommitReplacedError else ""
        return cls(f"step {step} is already committed under {self.root!r} ({uri}); it was not replaced.{why} "
                   f"Delete it first (CheckpointManager.delete) to save it again{detail}")

    def wait(self) -> None:
        """Until every save issued so far has committed and been indexed (and retention ran);
        raises the first error (a failed save on every rank, index/retention errors on rank 0).
        After a preemption save: returns by the preemption deadline at most, and says in the
        log what reached which tier (a drain the deadline cut is a WARNING, not an error: the
        step is committed in the local tier; docs/tiering.md, "Preemption")."""
        agreed = self._preemption.agreed
        if agreed is not None and self._preemption_saved:
            self._steps.preemption_wait(agreed.step, agreed.deadline)
        else:
            self._steps.wait()
        if self._worker is not None:
            errors = self._worker.join()
            if errors:
                raise errors[0]

    def close(self) -> None:
        """:meth:`wait`, then stop the background worker."""
        try:
            self.wait()
        finally:
            self._preemption.close()
            self._steps.close()
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

    def _flush(self) -> None:
        """Rank 0: wait until the saves that already committed are indexed too, so a reader
        after ``concurrent.futures.wait([handle])`` sees the step."""
        for job in self._jobs:
            if job.handle is None or job.handle.done():
                job.indexed.wait()

    def _read(self) -> IndexDoc:
        self._flush()
        return self._checked(_runtime.run(self.index.read()))

    def _checked(self, doc: IndexDoc) -> IndexDoc:
        """``doc``, unless the root is someone's torch.distributed.checkpoint run and has no
        objckpt step (:class:`~objckpt.errors.DcpDirectoryError`, not "no step yet")."""
        refuse_dcp(doc, self.root, self.naming)
        return doc

    def steps(self) -> list[int]:
        """Committed (and indexed) steps, ascending: a GET or two on rank 0, no LIST."""
        return self._on_root(lambda: self._read().step_numbers())

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or None; the same value on every rank.  The index's newest
        step is checked (a HEAD of its manifest): a step deleted behind the manager's back
        (its folder removed by hand) is dropped from the index, with a warning, and the
        newest step that exists is the answer.  With a local tier: the newest step every rank
        can restore from some tier (local, peers, object storage; see docs/tiering.md)."""
        self._known = None  # steps deleted by hand leave the index here: read it again at the next save
        return self._steps.latest_step()

    def _newest_existing(self) -> Optional[int]:
        """Rank 0: the newest indexed step whose manifest exists; indexed steps above it
        whose manifest is gone leave the index (re-checked after, so a step committed
        again meanwhile is put back)."""
        steps = self._read().step_numbers()
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
        """The indexed steps: iterate it for :class:`~objckpt.manager.index.StepEntry` s
        (``step``, ``time`` saved, ``bytes`` stored, ``metadata``), oldest first; ``len()``,
        ``.get(step)`` and ``.step_numbers()`` too.  Rank 0's read, broadcast."""
        doc: IndexDoc = self._on_root(self._read)
        self._known = {c[0]: c for c in candidates(doc)}
        return doc

    def best_step(self, key: Optional[str] = None, mode: Optional[str] = None) -> Optional[int]:
        """The best indexed step by ``metadata[key]`` (default: ``best_key``; ``mode`` default
        ``best_mode``, "max" or "min"); None when no step has a number there."""
        key = key if key is not None else self.policy.best_key
        if not key:
            raise RetentionPolicyError("best_step() needs a metadata key: pass best_step(key=...) or best_key= "
                                       "to the CheckpointManager")
        return best_step(candidates(self.entries()), key, mode if mode is not None else self.policy.best_mode)

    def reindex(self) -> list[int]:
        """Rebuild the index from the committed manifests (LIST + GETs): adopts a step whose
        save was killed after its commit but before its index update."""
        self._known = None
        return self._on_root(lambda: _runtime.run(self.index.rebuild()).step_numbers())

    # -- loading and deleting ---------------------------------------------------------------
    def load(self, state: Any, step: Optional[int] = None, **load_kwargs: Any) -> LoadResult:
        """Load ``step`` (the latest when None) into ``state`` in place, any world size;
        ``load_kwargs`` go to :func:`objckpt.load`.  :class:`NotFoundError` when there is none.
        The result's ``step`` is the step loaded (with a local tier or without)."""
        if step is not None:
            step = _step_arg("load(state, step)", step, state, "load(state, step=...)", state_first=True)
        elif looks_like_step(state):
            raise SwappedArgumentsError(
                f"CheckpointManager.load(state, step=None): got {describe(state)} as state, which looks like a "
                "step; pass the state to fill and the step by keyword: load(state, step=N)")
        return self._steps.load(state, step, load_kwargs)

    def step_tiers(self) -> dict[int, list[str]]:
        """Each step and where it is: ``"object"`` (under the root), and with a local tier
        ``"local"`` / ``"local-partial"`` (this node's folder; see docs/tiering.md).  Every
        rank calls it."""
        return self._steps.step_tiers()

    def advice(self) -> Advice:
        """The Young/Daly checkpoint interval from this manager's measured tiered saves and
        ``failure_rate`` (see :mod:`objckpt.tier.advice`)."""
        return self._steps.advice()

    def delete(self, step: int) -> Optional[DeleteReport]:
        """Delete ``step``: out of the index first, then its manifest, then its objects, then what
        killed saves left under it past ``leftover_grace`` (rank 0; every rank calls it).
        :class:`NotFoundError` when it is neither indexed nor committed."""
        step = _step_arg("delete(step)", step)
        uri = self.step_uri(step)
        self._known = None

        def run() -> DeleteReport:
            _runtime.run(self.index.remove({step}))
            report = _runtime.run(delete_checkpoint(self.index.store, self.index.step_prefix(step), uri))
            sweep_into(RetentionReport(), self.index, step, self.leftover_grace)  # killed saves' leftovers
            return report

        return self._on_root(run)

    def prune(self, dry_run: bool = False) -> RetentionReport:
        """Apply the retention policy now (normally done after each save); rank 0 deletes."""
        self._known = None
        return self._on_root(lambda: apply_retention(self.index, self.policy, self.root, dry_run,
                                                     grace=self.leftover_grace))


def _step_arg(call: str, step: Any, other: Any = None, keywords: str = "", state_first: bool = False) -> int:
    """``step`` checked; a short error saying which argument is which when it and the state
    look swapped (never the repr of a whole state: thousands of characters for a model)."""
    if looks_like_step(step):
        return check_step(step)
    if keywords and looks_like_step(other):
        order = "the state first, then the step" if state_first else "the step first, then the state"
        raise SwappedArgumentsError(
            f"CheckpointManager.{call}: the arguments look swapped: {describe(other)} was passed as the state "
            f"and {describe(step)} as the step; it takes {order} (or by keyword: {keywords})")
    try:
        return check_step(step)
    except InvalidStepError as e:
        raise InvalidStepError(f"CheckpointManager.{call}: {e}") from None


__all__ = ["CheckpointManager", "StepOrderError"]
