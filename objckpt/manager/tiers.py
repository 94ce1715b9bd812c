"""The manager's tiered saves: local commit, peer replication, draining, local retention, restore.

:class:`objckpt.CheckpointManager` with ``local_dir=`` hands its saves and loads to
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..api import async_save as _async_save
from ..api import load as _load
from ..api import save as _save
from ..distributed.comm import Comm
from ..errors import CheckpointExistsError, ObjckptError
from ..format import manifest as _manifest
from ..format import keys
from ..results import LoadResult
from ..save.background import SaveHandle
from ..storage.local import LocalStore
from ..tier import local as _local
from ..tier import restore as _restore
from ..tier.advice import Advice, advise
from ..tier.drain import drain
from ..tier.errors import DrainError, LocalTierError, TierRestoreError, TierSettingsError
from ..tier.overlay import OverlayStore
from ..tier.peer_restore import Received, receive, step_reads
from ..tier.topology import Topology, node_name, tier_comm
from .worker import CommitJob

if TYPE_CHECKING:
    from .manager import CheckpointManager

log = logging.getLogger("objckpt.manager")

#: saves that do not read the object store's steps again after a failed read
KNOWN_RETRY = 10


@dataclass(frozen=True)
class TierSettings:
    """The tier options, which every rank must pass alike (all-gathered and compared)."""

    local_dir: str
    #: None: one where the job spans several nodes, none on a single node
    replicas: Optional[int]
    persist_every: Optional[int]
    persist_every_seconds: Optional[float]
    local_keep: int
    drain_bandwidth: Optional[float]
    direct: bool

    def check(self) -> None:
        if not isinstance(self.local_dir, str) or not self.local_dir:
            raise TierSettingsError(f"local_dir must be a directory path, got {self.local_dir!r}")
        for name in ("replicas", "local_keep"):
            v = getattr(self, name)
            if v is None and name == "replicas":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "replicas" else 1):
                raise TierSettingsError(f"{name} must be an integer >= {0 if name == 'replicas' else 1}, got {v!r}")
        if self.persist_every is not None and (not isinstance(self.persist_every, int) or self.persist_every < 1):
            raise TierSettingsError(f"persist_every must be a positive integer or None, got {self.persist_every!r}")
        for name in ("persist_every_seconds", "drain_bandwidth"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or v <= 0):
                raise TierSettingsError(f"{name} must be a positive number or None, got {v!r}")


def _differences(all_settings: list[TierSettings]) -> list[str]:
    out = []
    for name in TierSettings.__dataclass_fields__:
        by_value: dict[str, list[int]] = {}
        for r, s in enumerate(all_settings):
            by_value.setdefault(repr(getattr(s, name)), []).append(r)
        if len(by_value) > 1:
            out.append(f"{name}: " + ", ".join(f"{v} on rank(s) {rs}" for v, rs in by_value.items()))
    return out


class TieredSaves:
    """The local tier, peers and draining of one manager (every rank holds one)."""

    def __init__(self, manager: "CheckpointManager", settings: TierSettings, node_override: Optional[str],
                 failure_rate: Optional[float]) -> None:
        self.m = manager
        self.s = settings
        self.failure_rate = failure_rate
        comm: Comm = manager._comm
        self.comm = comm
        problem = ""
        try:
            settings.check()
            node = node_name(node_override)
            self.root = _local.resolve_dir(settings.local_dir, node)
            problem = _local.writable_error(self.root) or ""
        except (TierSettingsError, ValueError) as e:
            problem = str(e)
        everyone: list[tuple[TierSettings, str]] = (comm.all_gather_object((settings, problem))
                                                     if comm.world_size > 1 else [(settings, problem)])
        diffs = _differences([s for s, _ in everyone])
        if diffs:
            hint = (" (for a folder per node, pass one local_dir with {node} in it: it is replaced by each "
                    "rank's node name)") if any(d.startswith("local_dir:") for d in diffs) else ""
            raise TierSettingsError("the ranks passed different tier settings to CheckpointManager: "
                                    + "; ".join(diffs) + ". Every rank must pass the same values" + hint)
        bad = {r: p for r, (_, p) in enumerate(everyone) if p}
        if bad:
            shown = "; ".join(f"rank {r}: {p}" for r, p in sorted(bad.items())[:4])
            cls = LocalTierError if any("local_dir" in p for p in bad.values()) else TierSettingsError
            raise cls(f"the local tier cannot be used ({shown})")
        if settings.replicas is not None and 0 < comm.world_size <= settings.replicas:
            raise TierSettingsError(f"replicas={settings.replicas} needs more ranks than the world size "
                                    f"{comm.world_size}: use replicas < {comm.world_size}")
        self.topology = Topology.build(comm, node_override)
        if settings.replicas is None:  # the default: a copy elsewhere where there is an elsewhere
            self.s = settings = dataclasses.replace(settings, replicas=min(1, len(self.topology.node_names) - 1))
        if settings.replicas:
            self.topology.check_replicas(settings.replicas)
        self.bg: Comm = tier_comm(comm) if comm.world_size > 1 else comm
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="objckpt-tier")
        self._pending: list[concurrent.futures.Future[Any]] = []
        self._draining: set[int] = set()
        self._replicated: Optional[int] = None
        self._saves = 0
        self._known_skip = 0
        self._last_drain = manager.clock()
        self.stalls: list[float] = []
        self.commits: list[float] = []
        self.drains: list[float] = []
        #: drains that did not commit, raised by the next wait() (logged at ERROR when they fail)
        self.drain_failures: list[DrainError] = []
        self._last_handle: Optional[SaveHandle] = None  # the last async save's, to bound them to one

    # -- paths ---------------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.root / self.m.naming.name(step)

    @property
    def first_on_node(self) -> bool:
        nodes = self.topology.nodes
        return nodes.index(nodes[self.comm.rank]) == self.comm.rank

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: int, state: Any, md: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self._raise_failed()
        d = self.step_dir(step)
        problem = _local.space_error(self.root, _local.share_bytes(state)) or _local.writable_error(self.root) or ""
        if d.exists() and (d / keys.MANIFEST_NAME).exists():
            problem = problem or f"step {step} is already committed in the local tier at {str(d)!r}"
        known = self._known()
        if known is not None and step in known:  # drained before (rank 0's index, broadcast): never replaced
            problem = problem or f"step {step} is already committed under {self.m.root!r}"
        problems = self.comm.all_gather_object(problem) if self.comm.world_size > 1 else [problem]
        bad = {r: p for r, p in enumerate(problems) if p}
        if bad:
            shown = "; ".join(f"rank {r}: {p}" for r, p in sorted(bad.items())[:4])
            cls = CheckpointExistsError if all("already committed" in p for p in bad.values()) else LocalTierError
            raise cls(f"step {step} not saved, nothing written ({shown})")
        saved_at = self.m.clock()
        store = LocalStore("/", direct=self.s.direct)
        handle: Optional[SaveHandle] = None
        if self.m.async_save:  # the stall is the staging copy; the local commit follows in the background
            # one local commit in flight, as the manager's async saves; the previous step's
            # replication and drain go on (their errors come at the next save or wait())
            if self._last_handle is not None:
                concurrent.futures.wait([self._last_handle])
            handle = self._last_handle = _async_save(state, str(d), store=store, metadata=md, overwrite=False, max_in_flight=1,
                                 process_group=self.m.process_group, no_dist=self.m.no_dist)
        else:
            _save(state, str(d), store=store, metadata=md, overwrite=False,
                  process_group=self.m.process_group, no_dist=self.m.no_dist)
            _local.spread_metadata(self.comm, d, list(self.topology.nodes), self.comm.rank)
        commit_s = time.perf_counter() - t0
        self._saves += 1
        if known is not None:
            self.m._learn(step, md, saved_at)
        due = self._drain_due()
        if handle is None:
            self.commits.append(commit_s)
        # finished ones stay until _raise_failed (the next save) or wait() looks at them: an
        # error of the step before is raised, never dropped with its future
        self._pending.append(self._pool.submit(self._after_commit, step, md, saved_at, due, handle, t0))
        self.stalls.append(time.perf_counter() - t0)

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
            return self.m._known_steps()  # rank 0's read, its error on every rank alike
        except (ObjckptError, OSError) as e:
            self._known_skip = KNOWN_RETRY
            log.warning("objckpt: cannot read the steps under %s (%s: %s): saving to the local tier anyway",
                        self.m.root, type(e).__name__, e)
            return None

    def _drain_due(self) -> bool:
        """Whether this save drains: rank 0 decides (its clock), every rank learns it."""
        due = False
        if self.s.persist_every is not None and self._saves % self.s.persist_every == 0:
            due = True
        if self.s.persist_every_seconds is not None and self.m.clock() - self._last_drain >= \
                self.s.persist_every_seconds:
            due = True
        if self.comm.world_size > 1:
            due = bool(self.comm.broadcast_object(due, 0))
        if due:
            self._last_drain = self.m.clock()
        return due

    def _after_commit(self, step: int, md: dict[str, Any], saved_at: float, due: bool,
                      handle: Optional[SaveHandle] = None, t0: float = 0.0) -> None:
        """Background, in save order on every rank: (an async save's local commit and the
        metadata for every node), replicate, drain, index, local retention."""
        d = self.step_dir(step)
        try:
            if handle is not None:
                handle.result()  # raises on every rank alike when the local save failed
                _local.spread_metadata(self.bg, d, list(self.topology.nodes), self.comm.rank)
                self.commits.append(time.perf_counter() - t0)  # from the call to the local commit
            m = _manifest.decode((d / keys.MANIFEST_NAME).read_bytes(), str(d))
            mine = _local.files_of(m, self.comm.rank)
            if self.s.replicas:
                from ..tier import peers

                peers.replicate(self.comm, self.topology, d, mine, self.s.replicas)
                self._replicated = step
            if due:
                self._draining.add(step)
                store, prefix = self.m.index.store, self.m.index.step_prefix(step)
                try:
                    rep = drain(self.bg, step, d, mine, store, prefix, self.m.step_uri(step),
                                self.s.drain_bandwidth)
                except DrainError as e:  # the same verdict on every rank (the outcomes were all-gathered)
                    log.error("objckpt: %s; the step stays in the local tier and training goes on", e)
                    self.drain_failures.append(e)
                else:
                    self.drains.append(rep.seconds)
                    if self.m._worker is not None:
                        job = self.m._submit(CommitJob(step, md, saved_at=saved_at))
                        if job is not None:
                            job.indexed.wait()
                    log.info("objckpt: step %d drained to %s (%d bytes from rank %d, %.2fs)", step,
                             self.m.step_uri(step), rep.bytes, self.comm.rank, rep.seconds)
        finally:
            self._draining.discard(step)
            self._retain(step)

    def _retain(self, upto: int) -> None:
        """Local retention (each node's first rank), after step ``upto`` was replicated and
        drained: the newest ``local_keep`` steps stay, and never a step still draining, the
        newest replicated one, or one newer than ``upto`` (an async save's local commit
        that this thread has not replicated or drained yet)."""
        if not self.first_on_node:
            return
        steps = sorted(_local.scan(self.root, self.m.naming.parse))
        keep = set(steps[-self.s.local_keep:]) | self._draining | {s for s in steps if s > upto}
        if self._replicated is not None:
            keep.add(self._replicated)
        for s in steps:
            if s not in keep:
                try:
                    _local.delete_step(self.step_dir(s))
                except LocalTierError as e:
                    log.warning("objckpt: %s", e)

    def _raise_failed(self) -> None:
        for f in [f for f in self._pending if f.done()]:
            self._pending.remove(f)
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]

    def wait(self, drains: bool = True) -> None:
        """Until every replication and drain issued so far finished; raises the first error,
        and with ``drains`` the first drain that failed since the last such call (a failed
        drain does not stop the saves: object storage may be down for a while)."""
        pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)
        for f in pending:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        if drains and self.drain_failures:
            first, self.drain_failures = self.drain_failures[0], []
            raise first

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    # -- restoring -----------------------------------------------------------------------------
    #: the last load's step, sources and what came from peers (None: no load yet)
    last_restore: Optional[_restore.RestoreReport] = None

    def _plan(self, step: Optional[int], state: Any = None,
              load_kwargs: Optional[dict[str, Any]] = None) -> _restore.RestorePlan:
        """The agreed restore plan (collective, one all-gather): every rank's node folder, with
        the files its load of ``state`` reads from each step held there but not whole, and
        rank 0's index."""
        self.wait(drains=False)
        steps = _local.scan(self.root, self.m.naming.parse)
        reads = ({} if state is None else
                 step_reads(steps, self.step_dir, state, self.comm.rank, load_kwargs or {}, step))
        mine = _restore.Holding(self.topology.nodes[self.comm.rank], steps, reads)
        holdings = self.comm.all_gather_object(mine) if self.comm.world_size > 1 else [mine]
        try:
            drained = self.m.steps()  # rank 0's read: its error reaches every rank alike
        except (ObjckptError, OSError) as e:  # object storage down: the local tiers may still do
            log.warning("objckpt: cannot read the steps under %s (%s: %s): choosing among the local tiers only",
                        self.m.root, type(e).__name__, e)
            drained = []
        return _restore.plan_restore(holdings, drained, peers=True, step=step)

    def step_tiers(self) -> dict[int, list[str]]:
        """Each step and the tiers that hold it, as this rank sees them: ``"local"`` (this node's
        folder holds it whole), ``"local-partial"`` (its manifest and some of its files: the rest
        is on other nodes), ``"object"`` (committed and indexed under the root)."""
        out: dict[int, list[str]] = {}
        for s, held in _local.scan(self.root, self.m.naming.parse).items():
            out.setdefault(s, []).append("local" if held.complete else "local-partial")
        for s in self.m.steps():
            out.setdefault(s, []).append("object")
        return dict(sorted(out.items()))

    def latest_step(self) -> Optional[int]:
        """The newest step every rank can restore from some tier (None: none)."""
        return self._plan(None).step

    def load(self, state: Any, step: Optional[int], load_kwargs: dict[str, Any]) -> LoadResult:
        plan = self._plan(step, state, load_kwargs)
        if plan.step is None:
            raise TierRestoreError(f"nothing to restore from {str(self.root)!r} or {self.m.root!r}: {plan.why}")
        d = self.step_dir(plan.step)
        sources = list(plan.sources)
        log.info("objckpt: restoring %s", plan.why)
        got = Received()
        if _restore.PEER in sources:  # into memory; the load reads through it (nothing written)
            got = receive(self.comm, self.topology, plan, d, state, load_kwargs)
            log.info("objckpt: step %d: rank %d received %d file(s), %d bytes, from peers (%d round(s), %.3fs)",
                     plan.step, self.comm.rank, len(got.files), got.bytes, got.rounds, got.seconds)
        src = sources[self.comm.rank]
        uri = self.m.step_uri(plan.step) if src == _restore.OBJECT else str(d)
        kw = {"process_group": self.m.process_group, "no_dist": self.m.no_dist, **load_kwargs}
        if src == _restore.OBJECT:
            kw.setdefault("storage_options", self.m.storage_options)
        elif got.files:
            kw["store"] = OverlayStore(LocalStore("/"), got.files)
        if len(set(sources)) > 1:
            kw["read_strategy"] = "direct"  # the same bytes, but from different places per rank
        try:
            res = _load(state, uri, **kw)
        finally:
            got.files = {}  # the received bytes go with the load
        self.last_restore = _restore.RestoreReport(plan.step, tuple(sources), dict(got.sources),
                                                   dict(got.bytes_by_rank), got.rounds)
        if step is None:
            self._drop_newer(plan.step)
        res.step = plan.step
        res.source = src
        res.tiers = {r: s for r, s in enumerate(sources)}
        res.received_bytes += got.bytes_by_rank.get(self.comm.rank, 0)
        return res

    def _drop_newer(self, restored: int) -> None:
        """After restoring the newest step every rank could get, local steps newer than it are
        incomplete leftovers of the run before (a share lost with its node): the training
        will save those step numbers again, so each node's first rank removes them."""
        if not self.first_on_node:
            return
        for s in sorted(_local.scan(self.root, self.m.naming.parse)):
            if s > restored:
                log.warning("objckpt: local step %d under %s is not complete in any tier (restored step %d): "
                            "removed", s, self.root, restored)
                _local.delete_step(self.step_dir(s))

    def advice(self) -> Advice:
        if self.failure_rate is None:
            raise TierSettingsError("advice() needs failure_rate= (failures per hour) given to CheckpointManager")
        return advise(self.failure_rate, self.stalls, self.commits, self.drains, self.s.persist_every or 1)
