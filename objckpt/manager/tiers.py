"""The manager's tiered saves: local commit, peer replication, draining, local retention, restore.

:class:`objckpt.CheckpointManager` with ``tier=`` hands its saves and loads to
:class:`TieredSaves`.  A save commits to the node-local tier in the training's
thread (the stall), then one background thread per manager, on objckpt's own
gloo group, runs per step and in the same order on every rank: replication to
``replicas`` peers, the drain to the manager's root every ``persist_every``-th
save (or when ``persist_every_seconds`` passed since the last), the index update
(rank 0) and local retention.  See docs/tiering.md for the failure model.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Optional

from ..api import async_save as _async_save
from ..api import load_session
from ..api import save as _save
from ..distributed.comm import Comm, RankError, background_comm, refusal_class
from ..distributed.join import collective_timeout
from ..errors import CollectiveError, DcpDirectoryError, ObjckptError
from ..format import manifest as _manifest
from ..format import keys
from ..load.session import ReadSession
from ..results import LoadResult, SaveResult
from ..save.background import SaveHandle
from ..state import expand_for_save
from ..storage.local import LocalStore
from ..tier import damage as _damage
from ..tier import local as _local
from ..tier import owner as _owner
from ..tier import restore as _restore
from ..tier import space as _space
from ..tier import step_files as _step_files
from ..tier.advice import Advice, advise
from ..tier import backlog as _backlog
from ..tier.backlog import DrainQueue, Undrained
from ..tier.drain import drain
from ..tier.retry_clock import OrderedJobs, RetryClock, start_clock
from ..tier.errors import (LocalTierError, TierRestoreError, TierSettingsError, exists_problem, local_problem,
                            raise_problems, settings_problem, state_problem)
from ..tier.overlay import OverlayStore
from ..tier.settings import TierSettings, differences
from ..tier.mounts import small_pages_hint
from ..tier.peer_restore import Prepared, Received, load_of, prepared_everywhere, receive, step_reads
from ..tier.topology import Topology, node_name, tier_comm, tier_wire
from ..tier.wire import Wire, resolve_backend
from .steps import RootSteps, StepsHost
from .tier_preemption import TierPreemption

log = logging.getLogger("objckpt.manager")

#: saves that do not read the object store's steps again after a failed read
KNOWN_RETRY = 10
#: due steps whose drain failed that wait for another attempt (kept in the local tier); past
#: that the oldest is given up (an ERROR, and wait() raises it)
DRAIN_BACKLOG = 4
#: the purpose key of the group a synchronous save sends every node the step's metadata on
COMMIT_GROUP = "tier-commit"


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken CUDA install is no CUDA here
        return False


class TieredSaves(TierPreemption, RootSteps):
    """The local tier, peers and draining of one manager (every rank holds one)."""

    def __init__(self, host: StepsHost, settings: TierSettings, node_override: Optional[str],
                 failure_rate: Optional[float]) -> None:
        self.host = host
        self.s = settings
        self.failure_rate = failure_rate
        comm: Comm = host.comm
        self.comm = comm
        problem: Optional[RankError] = None
        pending: list[Undrained] = []  # due steps a run before could not drain (recorded in the folder)
        backend = "gloo"
        try:
            settings.check()
            backend = resolve_backend(settings.tier_backend, comm.backend(), _cuda())
            node = node_name(node_override)
            self.root = _local.resolve_dir(settings.local_dir, node)
            why = _local.writable_error(self.root)
            problem = local_problem(why) if why else None
            if problem is None:
                pending = _backlog.recorded(self.root, host.naming.parse, host.root)
        except (TierSettingsError, ValueError) as e:
            problem = settings_problem(str(e))
        mine = (settings, problem, pending)
        everyone: list[tuple[TierSettings, Optional[RankError], list[Undrained]]] = (
            comm.all_gather_object(mine) if comm.world_size > 1 else [mine])
        diffs = differences([s for s, _, _ in everyone])
        if diffs:
            hint = (" (for a folder per node, pass one local_dir with {node} in it: it is replaced by each "
                    "rank's node name)") if any(d.startswith("local_dir:") for d in diffs) else ""
            raise TierSettingsError("the ranks passed different tier settings to CheckpointManager: "
                                    + "; ".join(diffs) + ". Every rank must pass the same values" + hint)
        raise_problems("the local tier cannot be used", [p for _, p, _ in everyone])
        if settings.replicas is not None and 0 < comm.world_size <= settings.replicas:
            raise TierSettingsError(f"replicas={settings.replicas} needs more ranks than the world size "
                                    f"{comm.world_size}: use replicas < {comm.world_size}")
        self.topology = Topology.build(comm, node_override)
        #: the folder's listings: this root's step folders only (objckpt.tier.owner)
        self.owned = _owner.Owned.surveyed(self.root, host.naming.parse, host.root, self.first_on_node)
        if settings.replicas is None:  # the default: a copy elsewhere where there is an elsewhere
            self.s = settings = dataclasses.replace(settings, replicas=min(1, len(self.topology.node_names) - 1))
        if settings.replicas:
            self.topology.check_replicas(settings.replicas)
        self.bg: Comm = tier_comm(comm) if comm.world_size > 1 else comm
        #: how this manager's tier copies move (made here, on the caller's thread; see tier_backend);
        #: on one node nothing crosses between ranks, so no NCCL group (and its device memory)
        one_node = len(self.topology.node_names) <= 1
        self.wire: Optional[Wire] = tier_wire(comm, "gloo" if one_node else backend) if comm.world_size > 1 else None
        #: the metadata for every node goes over groups of objckpt's own, never the training's: a
        #: synchronous save's from the training's thread (a group apart from ``bg``, which the
        #: background thread uses meanwhile), an async save's from the background thread (``bg``);
        #: the rank indexes only among the nodes' first ranks (``leaders``)
        self.spread_comm: Comm = self.bg
        self.leaders: Optional[_local.NodeLeaders] = None
        if comm.world_size > 1 and len(self.topology.node_names) > 1:
            if not host.async_save:
                self.spread_comm = background_comm(comm, getattr(comm, "group", None), purpose=COMMIT_GROUP,
                                                   timeout=collective_timeout(None))
            self.leaders = _local.node_leaders(comm, self.topology.nodes, collective_timeout(None))
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="objckpt-tier")
        #: every job for the background thread goes through here, numbered alike on every rank
        #: (the drain clock places its retries by that number)
        self._jobs = OrderedJobs(self._pool)
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._draining: set[int] = set()
        self._replicated: Optional[int] = None
        self._saves = 0
        self._known_skip = 0
        self._last_drain = host.clock()
        self.stalls: list[float] = []
        self.commits: list[float] = []
        self.drains: list[float] = []
        #: due steps whose drain has not committed yet: retried oldest first (see DrainQueue)
        self._undrained = DrainQueue(DRAIN_BACKLOG)
        # every node's records, the same on every rank: a step one node lost fails its drain on
        # every rank alike (gone: dropped with a warning)
        adopted = {u.step: u for _, _, theirs in everyone for u in theirs}
        self._undrained.waiting = [adopted[s] for s in sorted(adopted)][-DRAIN_BACKLOG:]
        if adopted:
            log.warning("objckpt: step(s) %s under %s were due for %s and are not drained yet (a run before "
                        "could not): they are drained at the next save, wait() or drain retry", sorted(adopted),
                        self.root, host.root)
        self._closed = False  # close() ended the background thread: wait() tries no drain again
        #: retries failed drains after a backoff with no save or wait() (None: drain_retry_s=None)
        self._clock: Optional[RetryClock] = start_clock(comm, self._jobs, self._undrained, settings.drain_retry_s,
                                                        self._retry_round)
        self._last_handle: Optional[SaveHandle] = None  # the last async save's, to bound them to one
        #: step -> (bytes, manifest when decoded) of the local steps the last restore plan read (see load)
        self._scanned: dict[int, tuple[bytes, Optional[_manifest.Manifest]]] = {}
        pages = small_pages_hint(self.root) if self.first_on_node else None
        if pages:
            log.info("objckpt: %s", pages)

    # -- paths ---------------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.root / self.host.naming.name(step)

    @property
    def first_on_node(self) -> bool:
        nodes = self.topology.nodes
        return nodes.index(nodes[self.comm.rank]) == self.comm.rank

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: int, state: Any, md: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self._raise_failed()
        d = self.step_dir(step)
        failed: Optional[BaseException] = None
        try:  # each state_dict() called once: the space check and the save take this
            state = expand_for_save(state)
            share = _space.share_of(state)
        except Exception as e:  # noqa: BLE001 - told to every rank in the all-gather below, so
            if self.comm.world_size == 1:  # none waits in a collective for the collective timeout
                raise
            failed, share = e, _space.Share()
        problem = (state_problem(failed, f"its state could not be read ({type(failed).__name__}: {failed})")
                   if failed is not None else self._check(step, d, share))
        known = self._known()
        if problem is None and known is not None and step in known:  # drained before: never replaced
            problem = exists_problem(f"step {step} is already committed under {self.host.root!r}")
        claim = _owner.claim(d, self.owned.owner) if problem is None else None  # before any byte of the step
        problem = claim.problem if claim is not None else problem
        due = self._drain_due()  # rank 0's, carried in the same all-gather as the problems
        # and each rank's share and folder: every rank checks every filesystem's space alike
        mine = (problem, due, _space.measure(self.root, share))
        gathered: list[tuple[Optional[RankError], bool, _space.Room]] = (
            self.comm.all_gather_object(mine) if self.comm.world_size > 1 else [mine])
        problems = [p for p, _, _ in gathered]
        if not any(problems):  # then whether each filesystem holds what the save lands on it
            problems = _space.node_problems([r for _, _, r in gathered], self.topology, self.s.replicas or 0)
        with _owner.undone_if_refused(claim):
            raise_problems(f"step {step} not saved, nothing written", problems, cause=failed)
        due = gathered[0][1] or step == self.preempt_step  # a preemption save drains at once
        saved_at = self.host.clock()
        store = LocalStore("/", direct=self.s.direct)
        handle: Optional[SaveHandle] = None
        meta: Optional[_manifest.Manifest] = None
        saved: Optional[SaveResult] = None
        if self.host.async_save:  # the stall is the staging copy; the local commit follows in the background
            # one local commit in flight, as the manager's async saves; the previous step's
            # replication and drain go on (their errors come at the next save or wait())
            if self._last_handle is not None:
                concurrent.futures.wait([self._last_handle])
            handle = self._last_handle = _async_save(state, str(d), store=store, metadata=md, overwrite=False,
                                                     max_in_flight=1, process_group=self.host.process_group,
                                                     no_dist=self.host.no_dist)
        else:
            saved = _save(state, str(d), store=store, metadata=md, overwrite=False,
                          process_group=self.host.process_group, no_dist=self.host.no_dist)
            # on objckpt's own group: a failing node is an error on every rank at once
            meta = _local.spread_metadata(self.spread_comm, d, list(self.topology.nodes), self.comm.rank,
                                          self.leaders)
        commit_s = time.perf_counter() - t0
        self._saves += 1
        if due:
            self._last_drain = self.host.clock()
        if handle is None:
            self.commits.append(commit_s)
        # finished ones stay until _raise_failed (the next save) or wait() looks at them: an
        # error of the step before is raised, never dropped with its future
        self._pending.append(self._jobs.submit(self._after_commit, step, md, saved_at, due, handle, t0, meta,
                                               saved.files if saved is not None else ()))
        self.stalls.append(time.perf_counter() - t0)

    def _check(self, step: int, d: Path, share: _space.Share) -> Optional[RankError]:
        """This rank's reason not to save ``step`` (None: none): the folder unwritable, a
        file-size limit below the share, or the step committed in the local tier already
        (the free space is checked per filesystem, after the all-gather: objckpt.tier.space)."""
        why = _space.fsize_error(self.root, share.total) or _local.writable_error(self.root)
        if why:
            return local_problem(why)
        if clash := self.owned.collision(d):  # another root's step folder of that name: never touched
            return settings_problem(clash)
        if (d / keys.MANIFEST_NAME).exists():
            return exists_problem(f"step {step} is already committed in the local tier at {str(d)!r}")
        return None

    def _known(self) -> Optional[dict[int, Any]]:
        """The manager's known (drained) steps; None when object storage cannot be read now:
        the local tier goes on without it (the drain, later, reports its own error).  After a
        failed read the next :data:`KNOWN_RETRY` saves do not try again, so an outage does not
        add a timed-out request to every save's stall (a count, not a clock: every rank skips
        alike, the read being a collective)."""
        if self._known_skip > 0:
            self._known_skip -= 1
            return None
        try:
            return self.host.known_steps()  # rank 0's read, its error on every rank alike
        except DcpDirectoryError:
            raise  # not an outage: the root is someone's DCP run, never saved beside unseen
        except (ObjckptError, OSError) as e:
            self._known_skip = KNOWN_RETRY
            log.warning("objckpt: cannot read the steps under %s (%s: %s): saving to the local tier anyway",
                        self.host.root, type(e).__name__, e)
            return None

    def _drain_due(self) -> bool:
        """Whether the save about to be made drains, by this rank's count and clock (rank 0's
        answer is the one every rank takes: :meth:`save` gathers it with the checks)."""
        n = self._saves + 1
        if self.s.persist_every is not None and n % self.s.persist_every == 0:
            return True
        return (self.s.persist_every_seconds is not None
                and self.host.clock() - self._last_drain >= self.s.persist_every_seconds)

    def _after_commit(self, step: int, md: dict[str, Any], saved_at: float, due: bool,
                      handle: Optional[SaveHandle] = None, t0: float = 0.0,
                      meta: Optional[_manifest.Manifest] = None, files: tuple[str, ...] = ()) -> None:
        """Background, in save order on every rank: (an async save's local commit and the
        metadata for every node), replicate, drain (the steps whose drain failed before
        first, then this one when due), index, local retention.  A replication error that
        every rank shares (a peer's disk full) does not stop the drain; it is raised after."""
        d = self.step_dir(step)
        failed: Optional[ObjckptError] = None
        try:
            if handle is not None:
                files = handle.result().files  # raises on every rank alike when the local save failed
                meta = _local.spread_metadata(self.spread_comm, d, list(self.topology.nodes), self.comm.rank,
                                              self.leaders)
                self.commits.append(time.perf_counter() - t0)  # from the call to the local commit
            # this rank's files, as its save reported them (the manifest is decoded for them only
            # when the save could not say); each node's first rank lists the whole step's once
            if self.first_on_node:  # restores, drains and `objckpt ls` read the list instead of decoding
                data = (d / keys.MANIFEST_NAME).read_bytes()
                meta = meta or _manifest.decode(data, str(d))
                _step_files.write(d, data, _step_files.of_manifest(meta))
            if not files:
                meta = meta or _manifest.decode((d / keys.MANIFEST_NAME).read_bytes(), str(d))
                files = tuple(_local.files_of(meta, self.comm.rank))
            mine = list(files)
            if self.s.replicas:
                from ..tier import peers

                try:
                    peers.replicate(self.comm, self.topology, d, mine, self.s.replicas)
                    self._replicated = step
                except CollectiveError:
                    raise  # a rank stopped answering: the group is not used again (no drain)
                except ObjckptError as e:  # the same verdict on every rank: the group goes on
                    log.error("objckpt: replicating step %d failed (%s); the drain goes on", step, e)
                    failed = e
            new = Undrained(step, md, saved_at) if due else None
            if new is not None or self._undrained.waiting:
                self._drain_round(new, meta)
            if failed is not None:
                raise failed
        finally:
            self._retain(step)

    def _drain_round(self, new: Optional[Undrained], meta: Optional[_manifest.Manifest] = None) -> None:
        """Background: the waiting steps, oldest first, then ``new``; each node's first rank
        records ``new`` as due in its folder first, and afterwards keeps the records of the
        steps still waiting only."""
        if new is not None and self.first_on_node:
            _backlog.mark(self.root, self.host.naming.name(new.step), new, self.host.root)
        self._undrained.run(new, lambda u: self._drain_one(u, meta if u is new else None))
        if self.first_on_node:  # not after an error out of the round (a rank died): every record stays
            _backlog.reconcile(self.root, self.host.naming.parse, self._undrained.steps, self.host.root)

    def _drain_one(self, u: Undrained, meta: Optional[_manifest.Manifest] = None) -> None:
        """Drain ``u`` (collective on the tier group: every file its manifest names, from
        whichever node holds it intact), then index it (rank 0) and learn it as the root's."""
        self._draining.add(u.step)
        try:
            rep = drain(self.bg, u.step, self.step_dir(u.step), self.host.store, self.host.step_prefix(u.step),
                        self.host.step_uri(u.step), self.s.drain_bandwidth, node=self.topology.nodes[self.comm.rank],
                        known=meta, stop=self.cut)
        finally:
            self._draining.discard(u.step)
        self.note_drained(u.step, rep.seconds)
        self.host.drained(u.step, u.metadata, u.saved_at)  # learnt as the root's and indexed (rank 0)
        log.info("objckpt: step %d drained to %s (%d bytes from rank %d, %.2fs%s)", u.step,
                 self.host.step_uri(u.step), rep.bytes, self.comm.rank, rep.seconds,
                 f", attempt {u.attempts}" if u.attempts > 1 else "")

    def _retry_round(self) -> None:
        """Background, in the job order (wait() and the drain clock): one round of the steps
        waiting to be drained again, oldest first; nothing when none waits (decided here,
        where the queue is the same on every rank)."""
        if self._undrained.waiting:
            self._drain_round(None)

    def _retain(self, upto: int) -> None:
        """Local retention (each node's first rank), after step ``upto`` was replicated and
        drained: the newest ``local_keep`` steps stay, and never a step still draining, waiting
        to be drained again or given up (DrainQueue.held), the newest replicated one, or one
        newer than ``upto`` (an async save's local commit that this thread has not
        replicated or drained yet)."""
        if not self.first_on_node:
            return
        steps = _local.committed_steps(self.root, self.owned)
        keep = (set(steps[-self.s.local_keep:]) | self._draining | self._undrained.steps
                | set(self._undrained.held) | {s for s in steps if s > upto})
        if self._replicated is not None:
            keep.add(self._replicated)
        for s in steps:
            if s not in keep:
                try:
                    _local.delete_step(self.step_dir(s))
                except LocalTierError as e:
                    log.warning("objckpt: %s", e)

    def _raise_failed(self) -> None:
        err = self._clock.take_error() if self._clock is not None else None
        if err is not None:  # a rank stopped answering the drain clock, or died in its retry
            raise err
        for f in [f for f in self._pending if f.done()]:
            self._pending.remove(f)
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def wait(self, drains: bool = True) -> None:
        """Until every replication and drain issued so far finished; raises the first error.
        With ``drains`` (every rank calls it alike): the steps whose drain failed are tried
        once more, oldest first, and a :class:`DrainError` is raised while some are still not
        in object storage (they stay local and are retried at the next save, at ``wait()`` and on
        the drain clock: ``drain_retry_s``), or for those
        given up since the last such call (a failed drain does not stop the saves: object
        storage may be down for a while)."""
        pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)
        for f in pending:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        if not drains:
            return
        if not self._closed:  # on the background thread, in the job order, as every collective
            self._jobs.submit(self._retry_round).result()
        self._raise_failed()  # a retry of the drain clock that failed like a job
        error = self._undrained.take_errors()
        if error is not None:
            raise error

    def close(self) -> None:
        """After the manager's :meth:`wait` (which reported the drains): the background work
        finishes, its thread ends."""
        try:
            if self._clock is not None:  # rank 0 says stop; the others wait for that word
                self._clock.stop()
            self.wait(drains=False)
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)

    # -- restoring -----------------------------------------------------------------------------
    #: the last load's step, sources and what came from peers (None: no load yet)
    last_restore: Optional[_restore.RestoreReport] = None

    def _plan(self, step: Optional[int], prepared: Optional[Prepared] = None,
              avoid: Optional[_damage.Avoid] = None) -> _restore.RestorePlan:
        """The agreed restore plan (collective, one all-gather): every rank's node folder, with
        the files its ``prepared`` load reads from the newest step held there but not whole, and
        rank 0's index.  The files ``avoid`` found damaged count as absent; a step folder whose
        manifest does not decode counts with its other files, its manifest hidden (and added to
        ``avoid``: every rank learns it from the all-gather)."""
        self.wait(drains=False)
        avoid = avoid if avoid is not None else _damage.Avoid()
        node = self.topology.nodes[self.comm.rank]
        self._scanned = {}  # the manifests read here: the load of the chosen step takes its own
        unlisted = _local.Unlisted()
        steps = _local.scan(self.root, self.owned, self._scanned, unlisted=unlisted)
        for s, held in steps.items():
            hidden = avoid.hidden_on(node, s)
            if hidden:
                held.present = [f for f in held.present if f not in hidden]
        loose = dict(unlisted.loose)
        for s, why in unlisted.damaged.items():  # its other files still count; the manifest comes from elsewhere
            loose[s] = tuple(f for f in _local.folder_files(self.step_dir(s)) if f != keys.MANIFEST_NAME)
        reads = ({} if prepared is None else
                 step_reads(steps, self.step_dir, self.comm.rank, prepared, self._scanned, step))
        mine = _restore.Holding(node, steps, reads, loose, dict(unlisted.damaged))
        holdings = self.comm.all_gather_object(mine) if self.comm.world_size > 1 else [mine]
        for r, h in enumerate(holdings):
            for s, why in h.damaged.items():
                if keys.MANIFEST_NAME not in avoid.hidden_on(h.node, s):
                    avoid.hide(h.node, s, [keys.MANIFEST_NAME])
                    avoid.skipped.append(_restore.Skip(r, s, _restore.LOCAL, keys.MANIFEST_NAME, why[:400]))
                    if r == self.comm.rank:
                        log.warning("objckpt: the manifest of local step %d under %s is damaged (%s): that copy "
                                    "is skipped, the step taken from the next source", s, self.root, why)
        try:
            drained = self.host.steps()  # rank 0's read: its error reaches every rank alike
        except DcpDirectoryError:
            raise  # not an outage: restoring from the local tiers would pass that run over
        except (ObjckptError, OSError) as e:  # object storage down: the local tiers may still do
            log.warning("objckpt: cannot read the steps under %s (%s: %s): choosing among the local tiers only",
                        self.host.root, type(e).__name__, e)
            drained = []
        return _restore.plan_restore(holdings, drained, peers=True, step=step, forbid=avoid.forbidden())

    def step_tiers(self) -> dict[int, list[str]]:
        """Each step and the tiers that hold it, as this rank sees them: ``"local"`` (this node's
        folder holds it whole), ``"local-partial"`` (its manifest and some of its files: the rest
        is on other nodes), ``"object"`` (committed and indexed under the root)."""
        out: dict[int, list[str]] = {}
        for s, held in _local.scan(self.root, self.owned).items():
            out.setdefault(s, []).append("local" if held.complete else "local-partial")
        for s in self.host.steps():
            out.setdefault(s, []).append("object")
        return dict(sorted(out.items()))

    def latest_step(self) -> Optional[int]:
        """The newest step every rank can restore from some tier (None: none)."""
        step = self._plan(None).step
        self._scanned = {}  # no load follows: the manifests read are not kept
        return step

    def load(self, state: Any, step: Optional[int], load_kwargs: dict[str, Any]) -> LoadResult:
        """Plan, receive from peers, load; where a rank's load finds its copy damaged (a crc32c
        mismatch, a short blob, a manifest that does not decode), plan again without that copy
        and load again from the next source (objckpt.tier.damage), at most ``ATTEMPTS`` times."""
        avoid = _damage.Avoid()
        prepared = prepared_everywhere(self.comm, state, load_kwargs)  # the template once; each step's load once
        res: Optional[LoadResult] = None
        last: Optional[BaseException] = None  # the attempt before's error: raised when no source is left
        for attempt in range(1, _damage.ATTEMPTS + 1):
            plan = self._plan(step, prepared, avoid)
            if plan.step is None:
                self._scanned = {}
                if last is not None:
                    raise last
                skipped = f" (damaged copies skipped: {'; '.join(map(str, avoid.skipped))})" if avoid.skipped else ""
                raise TierRestoreError(f"nothing to restore from {str(self.root)!r} or {self.host.root!r}: "
                                       f"{plan.why}{skipped}")
            res, got, failed, outcomes = self._load_once(plan, state, load_kwargs, avoid, prepared)
            if res is not None:
                break
            if failed is None:  # the first failed rank's class (a TierRestoreError too), on every rank alike
                bad = {r: o.error for r, o in enumerate(outcomes) if o is not None}
                failed = refusal_class(bad[min(bad)].kind, TierRestoreError)(
                    f"restoring step {plan.step}: the load failed on rank(s) {sorted(bad)}: "
                    + "; ".join(f"rank {r}: {o.text}" for r, o in sorted(bad.items())[:4]))
            new = avoid.learn(outcomes, self.topology.nodes) if attempt < _damage.ATTEMPTS else []
            if not new:
                raise failed
            last = failed
            for skip in new:
                log.warning("objckpt: restoring step %d: %s; planning again without that copy", plan.step, skip)
        if res is None or plan.step is None:  # not reached: the last attempt returns or raises
            raise TierRestoreError(f"restoring from {str(self.root)!r}: no attempt succeeded")
        sources = list(plan.sources)
        skips = avoid.skips_of(plan.step)
        self.last_restore = _restore.RestoreReport(plan.step, tuple(sources), dict(got.sources),
                                                   dict(got.bytes_by_rank), got.rounds,
                                                   fetch_seconds=got.seconds, in_place_bytes=got.in_place_bytes,
                                                   skipped=skips)
        if step is None:
            self._drop_newer(plan.step)
        res.step = plan.step
        res.source = sources[self.comm.rank]
        res.tiers = {r: s for r, s in enumerate(sources)}
        res.received_bytes += got.bytes_by_rank.get(self.comm.rank, 0)
        res.skipped = [str(x) for x in skips]
        return res

    def _load_once(self, plan: _restore.RestorePlan, state: Any, load_kwargs: dict[str, Any],
                   avoid: _damage.Avoid, prepared: Prepared) -> tuple[Optional[LoadResult], Received,
                                                                      Optional[BaseException],
                                                                      list[Optional[_damage.Failed]]]:
        """One load of ``plan`` on every rank (collective): the result where every rank's load
        succeeded, else None with this rank's error and every rank's outcome.  The load is
        the one ``prepared`` while planning or receiving (objckpt.tier.peer_restore.load_of)."""
        step = plan.step if plan.step is not None else -1  # the caller plans a step
        d = self.step_dir(step)
        sources = list(plan.sources)
        log.info("objckpt: restoring %s", plan.why)
        hidden = avoid.hidden_on(self.topology.nodes[self.comm.rank], step)
        got = Received()
        if _restore.PEER in sources:  # into memory; the load reads through it (nothing written)
            got = receive(self.comm, self.topology, plan, d, prepared, hidden=hidden)
            log.info("objckpt: step %d: rank %d received %d bytes of %d file(s) from peers (%d in place; %d "
                     "round(s), %.3fs)", step, self.comm.rank, got.bytes, len(got.segments),
                     got.in_place_bytes, got.rounds, got.seconds)
        src = sources[self.comm.rank]
        uri = self.host.step_uri(step) if src == _restore.OBJECT else str(d)
        kw = {"process_group": self.host.process_group, "no_dist": self.host.no_dist, **load_kwargs}
        if src == _restore.OBJECT:
            kw.setdefault("storage_options", self.host.storage_options)
        elif got.segments or hidden:
            prefix = d.absolute().as_posix().strip("/")
            kw["store"] = OverlayStore(LocalStore("/"), got.segments, frozenset(f"{prefix}/{n}" for n in hidden))
        if len(set(sources)) > 1:
            kw["read_strategy"] = "direct"  # the same bytes, but from different places per rank
        # the manifest this rank's plan decoded from its folder is the one the load reads there
        # (a committed step's never changes): handed over, not fetched and decoded again
        held = self._scanned.pop(step, None) if src != _restore.OBJECT else None
        self._scanned = {}
        failed: Optional[BaseException] = None
        metadata: dict[str, bytes] = {}
        try:
            store, options = kw.pop("store", None), kw.pop("storage_options", None)
            load = load_of(prepared, step, uri, store, held, self.comm.rank)
            res = load_session(state, lambda: ReadSession(uri, options, store, held), uri, prepared=load, **kw)
            metadata = _local.received_metadata(d, got.segments)
        except Exception as e:  # noqa: BLE001 - said to every rank below: none goes on training alone
            failed = e
        finally:
            got.segments = {}  # the received bytes go with the load
        mine = (None if failed is None else
                _damage.failed(failed, step, src, list(plan.needed) + list(got.sources),
                               {n: r for n, (r, _size) in got.sources.items()}, plan.needed))
        outcomes: list[Optional[_damage.Failed]] = (
            self.comm.all_gather_object(mine) if self.comm.world_size > 1 else [mine])
        if failed is not None or any(o is not None for o in outcomes):
            return None, got, failed, outcomes
        if metadata and self.first_on_node:  # a folder the step's metadata never reached gets it now
            _local.write_back_metadata(d, metadata)
        return res, got, None, outcomes

    def _drop_newer(self, restored: int) -> None:
        """After restoring the newest step every rank could get, local steps newer than it are
        incomplete leftovers of the run before (a share lost with its node): the training
        will save those step numbers again, so each node's first rank removes them."""
        if not self.first_on_node:
            return
        for s in _local.committed_steps(self.root, self.owned):  # names only: no manifest decoded again
            if s > restored:
                log.warning("objckpt: local step %d under %s is not complete in any tier (restored step %d): "
                            "removed", s, self.root, restored)
                _local.delete_step(self.step_dir(s))

    def advice(self) -> Advice:
        if self.failure_rate is None:
            raise TierSettingsError("advice() needs failure_rate= (failures per hour) given to CheckpointManager")
        return advise(self.failure_rate, self.stalls, self.commits, self.drains, self.s.persist_every or 1)
