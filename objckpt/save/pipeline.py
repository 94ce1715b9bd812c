"""The three phases of a save, shared by :func:`objckpt.save` and :func:`objckpt.async_save`.

1. :func:`prepare` (caller's thread): describe local state, one small
   exchange between ranks, choose the layout, plan this rank's writes.
2. :func:`upload` (coroutine on the I/O loop): stage and upload this rank's
   blobs, publish its chunk records; reports when every part is staged.
3. :func:`finish` (a thread that may issue collectives): exchange outcomes,
   rank 0 commits the manifest, every rank learns the result.

Collectives happen only in phases 1 and 3, always in the same order on every
rank; an async save runs phase 3 on a gloo group from its own thread, never on
NCCL.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

import torch

from ..runtime import loop as _runtime
from ..distributed.comm import Comm, DecisionNotShared, RankError, decide_on_root, refusal, refusal_class
from ..distributed.join import join, unanswered_ranks
from ..errors import (CheckpointExistsError, ObjckptError, RankLostError, StateDictMismatchError,
                      TensorChangedError, UnsupportedValueError)
from ..format import keys
from ..format.manifest import Manifest
from ..format.spread import Placement, up_for
from ..logs import get_logger
from ..layout import GatheredLayout, ManifestCommon, RankOutcome, RankReport, SaveLayout, SymbolicLayout
from ..runtime.gc_pause import FrozenOld, paused_gc
from ..runtime.memory import AnyBudget, HostPool, save_budget
from ..options import KeyScheme, SaveOptions
from ..planning import crc_blocks
from ..planning.pack import PackLimits, SavePlan
from ..results import IOStats, SaveResult
from ..storage import ObjectStore, split_uri
from ..storage.shape import Shape, save_sizes, shape_for
from .commit import CommitState, CommitStatus, commit, delete_quietly
from .decision import Fate, decision_key, learn_fate
from . import plan_cache
from .describe import LocalState, Mirror, Walked, describe_walked, walk
from .fingerprint import differing
from .fingerprint import digest as prints_digest
from .plan_cache import plan_made, reused_layout
from .records import Piece, chunk_records, rank_blobs
from .upload import refuse_unstageable, staged_parts, write_plan
from .store_check import BeforeSave, ask_before_save, overwrite_check, refuse_if, save_refusal

log = get_logger("objckpt.save")


@dataclass(frozen=True)
class Hello:
    """What every rank says in the first exchange of a save."""

    symbolic_digest: Optional[bytes]  # of its symbolic description (None: it has none)
    tree_digest: bytes  # of its non-tensor values
    exists: bool  # rank 0: a checkpoint is committed at the URI (asked only when overwrite is off)
    attempt: str  # rank 0: the new attempt id
    #: this rank could not describe its state (re-raised as its kind's class on every rank, see refusal_class)
    error: Optional[RankError]
    #: digest of the plain tensors' fingerprints (differs when some plain tensor differs between ranks)
    prints_digest: bytes = b""
    #: how far above the prefix this rank's spread root is (0: default key layout); must agree
    spread_up: int = 0
    #: the crc block this rank would choose for its chunks; the save uses the smallest
    crc_block: int = 0
    #: rank 0: why the save is refused on this store (it ignores If-None-Match, no single_writer); "": go on
    store_refused: str = ""
    #: rank 0: the store honours create-only writes, so a decision record can settle a commit
    #: that the ranks could not share (save.decision); on another store a survivor never deletes
    records_trusted: bool = True
    #: the attempt id of the save that made the plan this rank holds for its state's structure
    #: ("": none); the plan is reused when every rank names the same (save.plan_cache)
    plan_world: str = ""


@dataclass
class Prepared:
    """Everything phases 2 and 3 need; no reference to the caller's containers."""

    uri: str
    store: ObjectStore
    prefix: str
    rank: int
    world_size: int
    opts: SaveOptions
    attempt: str
    local: LocalState
    layout: SaveLayout
    plan: SavePlan
    #: the tensors the plan's chunks are cut from, by packing key, and what each one is
    tensors: dict[str, torch.Tensor]
    pieces: dict[str, Piece]
    blob_names: list[str]
    #: where this rank's objects go (under the prefix, or spread)
    place: Placement
    #: bytes per block crc, the same on every rank (the manifest records one)
    crc_block: int
    #: the store honours create-only writes (rank 0's verdict): a survivor of a lost rank may
    #: settle the commit by the decision record and delete; otherwise it never deletes
    records_trusted: bool = True
    stats: IOStats = field(default_factory=IOStats)
    t0: float = field(default_factory=time.perf_counter)
    #: per chunk of ``plan`` (in its order): its tensor's key and its global offsets (None: from ``pieces``)
    places: Optional[list[tuple[str, tuple[int, ...]]]] = None

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self.plan.blobs)

    @property
    def blob_keys(self) -> list[str]:
        return [self.place.key(n) for n in self.blob_names]

    @property
    def rank_files(self) -> tuple[str, ...]:
        """This rank's objects as the manifest names them (empty when spread: see SaveResult.files)."""
        if self.place.bucket:
            return ()
        index = [self.place.index_name(self.attempt)] if self.layout.writes_index else []
        return tuple(self.blob_names + index)

    @property
    def written_keys(self) -> list[str]:
        """Every object this rank writes (deleted if the save does not commit)."""
        index = [self.place.key(self.place.index_name(self.attempt))] if self.layout.writes_index else []
        return self.blob_keys + index


def _tree_digest(tree: Any) -> bytes:
    return hashlib.blake2b(json.dumps(tree, sort_keys=True).encode(), digest_size=20).digest()


def _check_replicated(local: LocalState, hellos: list[Hello], comm: Comm, uri: str) -> None:
    """Refuse (on every rank alike) plain tensors whose values differ between ranks:
    stored once as replicated, they would come back as one rank's values or a mix."""
    if all(h.prints_digest == hellos[0].prints_digest for h in hellos):
        return
    everyone: list[dict[str, int]] = comm.all_gather_object(local.fingerprints)
    bad = differing(everyone)
    if not bad:
        return
    groups: dict[int, list[int]] = {}
    for r, prints in enumerate(everyone):
        if bad[0] in prints:
            groups.setdefault(prints[bad[0]], []).append(r)
    shown = ", ".join(map(repr, bad[:10])) + (" ..." if len(bad) > 10 else "")
    raise UnsupportedValueError(
        f"save to {uri!r}: plain tensor(s) {shown} hold different values on different ranks "
        f"(key {bad[0]!r}: ranks {' vs '.join(str(g) for g in groups.values())}). A plain tensor counts as "
        "replicated and is stored once, so the ranks' values would be merged. Save per-rank values as an "
        "objckpt.Shard (e.g. Shard(t.unsqueeze(0), (world_size, *t.shape), (rank, *[0] * t.dim()))), "
        "under per-rank keys, or from each rank alone with no_dist=True to its own URI."
    )


def spread_up(uri: str, prefix: str, opts: SaveOptions) -> int:
    """How far above ``prefix`` the spread root lies (0: default layout).  ``spread_root``
    is a URI or path like the checkpoint's, naming an ancestor in the same bucket or
    directory tree."""
    if opts.key_layout != KeyScheme.SPREAD:
        return 0
    root_prefix = None
    if opts.spread_root is not None:
        scheme, root, root_prefix = split_uri(opts.spread_root)
        if (scheme, root) != split_uri(uri)[:2]:
            raise ValueError(f"spread_root {opts.spread_root!r} is not in the same store as {uri!r}")
    return up_for(prefix, root_prefix)


def _choose_layout(local: LocalState, hellos: list[Hello], comm: Comm) -> SaveLayout:
    """Symbolic when every rank reports the same description (DTensors and plain
    tensors, the common case): nothing more is exchanged.  Otherwise a second
    all_gather brings every rank's boxes (objckpt.Shard, layouts without a
    symbolic form)."""
    world = comm.world_size
    mine = local.symbolic
    if world > 1 and mine is not None and all(h.symbolic_digest == mine.digest for h in hellos):
        rank_trees = None
        if any(h.tree_digest != hellos[0].tree_digest for h in hellos):  # non-tensor values differ
            rank_trees = comm.all_gather_object(local.tree)
        return SymbolicLayout(mine, local.dtypes, local.aliases, local.tree, rank_trees)
    report = RankReport(local.metas, local.tree, local.aliases, local.dtypes)
    reports = comm.all_gather_object(report) if world > 1 else [report]
    if any(r.aliases != reports[0].aliases for r in reports):
        raise StateDictMismatchError("tied tensors differ between ranks; tie the same keys on every rank")
    return GatheredLayout(reports)


def prepare(state: Any, uri: str, st: ObjectStore, prefix: str, comm: Comm, opts: SaveOptions,
            mirror: Optional[Mirror] = None) -> Prepared:
    """Phase 1 (caller's thread): describe, exchange, plan.

    The first exchange is one all_gather of a :class:`Hello` per rank.  A rank
    that fails to describe its state still joins it with its error, so every
    rank raises together instead of waiting in a collective.  A state of the
    structure of an earlier save reuses that save's description and plan when
    every rank holds it (:mod:`objckpt.save.plan_cache`): the state is walked and
    its values hashed, the rest is not made again."""
    t0 = time.perf_counter()
    stats = IOStats()
    world = comm.world_size
    local: Optional[LocalState] = None
    up = 0
    local_exc: Optional[BaseException] = None
    err: Optional[RankError] = None
    exists = False
    refused = ""
    trusted = True  # rank 0: the store honours create-only writes (a decision record can settle a commit)
    walked: Optional[Walked] = None
    key: Optional[tuple[Any, ...]] = None
    entry: Optional[plan_cache.Entry] = None
    limits: Optional[PackLimits] = None
    join(comm, f"save to {uri!r}", opts.collective_timeout)
    try:
        opts = opts.checked()
        up = spread_up(uri, prefix, opts)
        # only a save that may not replace a checkpoint asks whether one is there (an
        # overwrite reads the old manifest once, at its commit, for the cleanup); asked on
        # the I/O thread while the state is described and copied, not after: an async
        # save's caller would wait for the round trip; when none is, whether the store honours
        # the conditional commit (store_check: probed once per store)
        ask_stats = IOStats()  # its own counters: it runs on the I/O thread meanwhile
        # (an overwrite of more than one rank asks the latter alone: its decision record,
        # save.decision, is a create-only write too)
        ask = None
        if comm.rank == 0 and not opts.overwrite:
            ask = ask_before_save(st, prefix, ask_stats)
        elif comm.rank == 0 and world > 1:
            ask = overwrite_check(st, prefix, ask_stats)
        # then the store's shape (decided once per store; after the question, so that a store
        # that does not answer is asked once): the sizes the plan packs to
        asked = _runtime.submit(_ask_then_shape(ask, st))
        walked = walk(state, opts.allow_pickle, mirror)
        before, shape = asked.result()
        limits = _limits(shape, st, opts)
        key = plan_cache.key_of(walked, comm, opts, limits)
        entry = plan_cache.PLANS.find(key)
        if entry is not None:
            local = entry.described.local_state(walked, comm)
        else:
            with paused_gc():  # an object or more per tensor, no cycle (see _planned_anew)
                local = describe_walked(walked, comm)
        if before is not None:
            exists = before.exists
            stats.add(0, ask_stats.requests)
            refused = "" if opts.overwrite else save_refusal(st, before.check, uri, opts.single_writer)
            trusted = before.check is not None and before.check.honoured
        stats.timings.add("describe", time.perf_counter() - t0)
    except Exception as e:
        if world == 1:
            raise
        local_exc, err = e, RankError.of(e)
    planned = entry.planned if entry is not None else None
    hello = Hello(
        prints_digest=prints_digest(local.fingerprints) if local is not None and world > 1 else b"",
        symbolic_digest=local.symbolic.digest if local is not None and local.symbolic is not None else None,
        tree_digest=_tree_digest(local.tree) if local is not None and world > 1 else b"",
        exists=exists, attempt=keys.new_attempt_id() if comm.rank == 0 else "", error=err, spread_up=up,
        crc_block=(entry.described.crc_wanted if entry is not None else _crc_block_wanted(local, opts))
        if local is not None else 0, store_refused=refused, records_trusted=trusted,
        plan_world=planned.world if planned is not None else "",
    )
    hellos: list[Hello] = comm.all_gather_object(hello) if world > 1 else [hello]
    failed = [(r, h.error.text) for r, h in enumerate(hellos) if h.error is not None]
    if failed:  # every rank raises the class of the first refusal (e.g. UnsupportedValueError)
        kind = next(h.error.kind for h in hellos if h.error is not None)
        raise refusal_class(kind, ObjckptError)(
            f"save to {uri!r} not started: " + "; ".join(f"rank {r}: {m}" for r, m in failed)
        ) from local_exc
    if local is None or walked is None or limits is None:  # unreachable: a failed describe is in ``failed``
        raise ObjckptError(f"save to {uri!r}: rank {comm.rank} has no description of its state")
    refuse_if(hellos[0].store_refused)  # ConditionalWriteIgnoredError on every rank, before anything is written
    if hellos[0].exists and not opts.overwrite:
        raise CheckpointExistsError(f"a checkpoint already exists at {uri!r}; pass overwrite=True to replace it")
    attempt = hellos[0].attempt
    if any(h.spread_up != hellos[0].spread_up for h in hellos):  # the manifest records one spread root
        raise ValueError(f"save to {uri!r}: the ranks passed different key_layout or spread_root options "
                         f"(spread root levels by rank: {[h.spread_up for h in hellos][:16]})")
    _check_replicated(local, hellos, comm, uri)
    if planned is not None and all(h.plan_world == planned.world for h in hellos):  # every rank holds this plan
        plan_cache.PLANS.count("hits")
        layout = reused_layout(planned, local, all(h.tree_digest == hellos[0].tree_digest for h in hellos), comm)
        tensors, pieces, plan = planned.cut(walked, local), planned.pieces, planned
    else:
        plan_cache.PLANS.count("described" if entry is not None else "misses")
        layout = _choose_layout(local, hellos, comm)
        plan = _planned_anew(layout, local, comm.rank, limits, attempt, min(h.crc_block for h in hellos))
        tensors = plan.cut(walked, local)
        pieces = plan.pieces
        described = entry.described if entry is not None else plan_cache.Described.of(local, hello.crc_block)
        plan_cache.PLANS.keep(key, plan_cache.Entry(described, plan))
    place = Placement(prefix, comm.rank, up, opts.spread_digits)
    names = [place.blob_name(attempt, b.index) for b in plan.writes.plan.blobs]
    stats.timings.add("plan", time.perf_counter() - t0 - stats.timings["describe"])
    return Prepared(uri, st, prefix, comm.rank, world, opts, attempt, local, layout, plan.writes.plan, tensors,
                    pieces, names, place, plan.crc_block, hellos[0].records_trusted, stats=stats, t0=t0,
                    places=plan.places)


def _planned_anew(layout: SaveLayout, local: LocalState, rank: int, limits: PackLimits, attempt: str,
                  crc_block: int) -> plan_cache.Planned:
    """This rank's plan when no cached one serves (the first save of a structure): its
    writes, their blob layout and the records' places, made with the cyclic collector
    paused.  They are several objects per tensor and no cycle, so the collector could
    free none of them, yet a first save of 3,200 tensors triggered ~90 extra collections
    of the young generations and a full one (~10-20 ms of a ~50 ms plan on the 2-core VM)."""
    with paused_gc():
        return plan_made(attempt, layout, local, layout.plan(rank, local.boxes, limits), crc_block)


async def _ask_then_shape(ask: Optional[Awaitable[BeforeSave]], st: ObjectStore) -> tuple[Optional[BeforeSave], Shape]:
    """Rank 0's question to the store (None: none), then the store's shape."""
    before = await ask if ask is not None else None
    return before, await shape_for(st)


def _limits(shape: Shape, st: ObjectStore, opts: SaveOptions) -> PackLimits:
    """The sizes this save packs to: its options, else the store's ``shape`` (by endpoint kind)."""
    blob_size, part_size = save_sizes(opts.blob_size, opts.part_size, shape)
    return PackLimits(blob_size, part_size, st.min_part_size, st.max_part_size)


def _crc_block_wanted(local: LocalState, opts: SaveOptions) -> int:
    """``opts.crc_block`` when given, else the block :func:`crc_blocks.choose` picks for
    the chunks this rank's boxes are stored as (the ranks then agree on the smallest)."""
    if opts.crc_block is not None:
        return opts.crc_block
    return crc_blocks.for_boxes((math.prod(shape) * meta.itemsize for meta in local.metas.values()
                                 for _, shape in meta.boxes), opts.part_size)


@dataclass(frozen=True)
class UploadOutcome:
    """Phase 2's result: what this rank reports to the others, and its own exception."""

    shared: RankOutcome
    exc: Optional[BaseException] = None

    @classmethod
    def failed(cls, what: str, exc: BaseException) -> "UploadOutcome":
        return cls(RankOutcome(error=RankError.of(exc, what)), exc)


async def upload(prep: Prepared, pool: HostPool, budget: AnyBudget, *, zero_copy: bool,
                 on_staged: Optional[Callable[[], None]] = None, stream: Any = None) -> UploadOutcome:
    """Phase 2 (I/O loop): this rank's blobs, then its chunk records.

    ``zero_copy`` (a synchronous save) uploads tensors from their own memory after
    checksumming it, so a tensor changed meanwhile would commit bytes that fail
    their crc at load: the tensors' version counters are compared before and after,
    and a change fails the save (:class:`TensorChangedError`) before anything commits."""
    before = _versions(prep.tensors) if zero_copy else {}
    t_up = time.perf_counter()
    staged_at = [t_up]

    def staged() -> None:  # stage: until every part is staged (a sync save stages while it uploads)
        staged_at[0] = time.perf_counter()
        if on_staged is not None:
            on_staged()

    try:
        # a part larger than a staging budget the caller gave: refused before anything is written
        refuse_unstageable(staged_parts(prep.plan, prep.tensors, zero_copy), budget, prep.uri,
                           prep.store.min_part_size)
        crcs = await write_plan(prep.store, prep.blob_keys, prep.plan, prep.tensors, pool, budget, prep.stats,
                                zero_copy=zero_copy, crc_block=prep.crc_block,
                                on_staged=staged if on_staged is not None else None, stream=stream)
        changed = sorted({prep.pieces[k].key for k, v in _versions(prep.tensors).items() if before.get(k, v) != v})
        if changed:
            raise TensorChangedError(
                f"save to {prep.uri!r}: tensor(s) {changed[:10]} were modified in place while the save read them; "
                "nothing was committed (save from a quiescent state, or use async_save, which copies first)")
    except Exception as e:
        return UploadOutcome.failed("", e)
    records = chunk_records(prep.plan, prep.pieces, crcs, prep.places)
    blobs = rank_blobs(prep.plan, prep.blob_names, prep.rank, prep.place.bucket)
    try:
        shared = await prep.layout.publish(records, blobs, prep.store, prep.place, prep.attempt, prep.rank,
                                           prep.stats)
    except Exception as e:
        return UploadOutcome.failed(f"publishing the chunk records of rank {prep.rank}: ", e)
    prep.stats.timings.add("stage", staged_at[0] - t_up)
    prep.stats.timings.add("upload", time.perf_counter() - staged_at[0])
    return UploadOutcome(shared)


def _versions(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """Each tensor's version counter (bumped by every in-place op on it or on a view
    of the same storage; not by writes through ``.data`` or raw pointers)."""
    out = {}
    for k, t in tensors.items():
        try:
            out[k] = t._version
        except RuntimeError:  # inference-mode tensors keep no counter
            continue
    return out


def gathered_manifest(layout: SaveLayout, wires: list[tuple[Any, ...]],
                      common: ManifestCommon) -> tuple[Optional[Manifest], list[Optional[RankError]]]:
    """Rank 0's part of the commit before its write: every rank's outcome rebuilt from
    the tuples it sent (:meth:`RankOutcome.wire`) and every rank's error; the manifest
    when none failed (else None).  65,536 outcomes at 65,536 ranks, with no cycles among
    them: the collector is paused meanwhile (its passes over a large heap cost more than
    the rebuild)."""
    with paused_gc():
        outcomes = [RankOutcome.from_wire(w) for w in wires]
        errors = [o.error for o in outcomes]
        if any(e is not None for e in errors):
            return None, errors
        return layout.manifest(outcomes, common), errors


def finish(prep: Prepared, comm: Comm, outcome: UploadOutcome) -> SaveResult:
    """Phase 3: exchange outcomes; rank 0 commits; every rank returns or raises alike."""
    st = prep.store
    if prep.world_size == 1 and outcome.exc is not None:
        delete_quietly(st, prep.written_keys)  # e.g. blobs of an abandoned lazy save
        raise outcome.exc
    commit_errors: list[BaseException] = []

    def decide(wires: list[tuple[Any, ...]]) -> tuple[Optional[CommitStatus], list[Optional[RankError]]]:
        m, errors = gathered_manifest(prep.layout, wires,
                                      ManifestCommon(prep.attempt, prep.opts.metadata, prep.crc_block))
        if m is None:
            return None, errors  # every rank raises below, from the same list
        m.spread_up = prep.place.up
        return commit(st, prep.prefix, m, prep.opts.overwrite, prep.uri, prep.written_keys, prep.stats,
                      commit_errors, decided_by_record=prep.world_size > 1), errors

    t_commit = time.perf_counter()
    try:
        status, errors = decide_on_root(comm, outcome.shared.wire(), decide)
    except DecisionNotShared as lost:  # a rank died in the commit window: learn the outcome, then act on it
        raise _after_lost_rank(prep, comm, lost) from lost
    except Exception:  # building or committing the manifest failed on rank 0: raised on every rank
        delete_quietly(st, prep.written_keys)
        raise
    if prep.world_size > 1 and prep.rank == 0:  # every rank knows the outcome: the record is not needed
        _runtime.run(_delete_record(st, decision_key(prep.prefix, prep.attempt)))
    failed = [(r, e.text) for r, e in enumerate(errors) if e is not None]
    if failed:
        delete_quietly(st, prep.written_keys)
        kind = next(e.kind for e in errors if e is not None)  # the class of the first failure, on every rank
        raise refusal_class(kind, ObjckptError)(
            f"save to {prep.uri!r} failed on {len(failed)} of {prep.world_size} rank(s), nothing committed: "
            + "; ".join(f"rank {r}: {m}" for r, m in failed)
        ) from outcome.exc
    if status is None:  # unreachable: rank 0 commits exactly when no rank failed
        raise ObjckptError(f"save to {prep.uri!r}: no commit status")
    if status.state != CommitState.OK:
        if prep.rank != 0 and status.state in (CommitState.FAILED_CLEAN, CommitState.EXISTS):
            delete_quietly(st, prep.written_keys)
        if status.state == CommitState.EXISTS:
            raise CheckpointExistsError(status.message)
        if commit_errors and prep.world_size == 1:
            raise commit_errors[0]
        raise refusal(status.error_kind, status.message)  # the class of rank 0's failure, on every rank
    prep.stats.timings.add("commit", time.perf_counter() - t_commit)
    res = SaveResult(prep.uri, prep.nbytes, time.perf_counter() - prep.t0, prep.stats.requests,
                     len(prep.local.dtypes), len(prep.plan.blobs), status.manifest_bytes, prep.stats.timings,
                     prep.rank_files)
    log.info("saved %s rank %d/%d: %d tensors, %d bytes in %d blob(s), %d requests, %.3f s (%s)", prep.uri,
             prep.rank, prep.world_size, res.tensors, res.bytes, res.blobs, res.requests, res.seconds,
             res.timings.describe())
    return res


async def _delete_record(st: ObjectStore, key: str) -> None:
    try:
        await st.delete([key])
    except Exception:  # noqa: BLE001 - a leftover of its attempt: gc removes it
        pass


def _after_lost_rank(prep: Prepared, comm: Comm, lost: DecisionNotShared) -> RankLostError:
    """The error this rank raises when the commit's collectives failed, after acting
    on the outcome.  Nothing that the manifest could name is deleted unless this
    rank knows the manifest was not and will not be written: rank 0 knows what it
    did; another rank learns it from storage (:func:`.decision.learn_fate`)."""
    st = prep.store
    if prep.rank == 0:
        fate, how = _root_fate(lost)
    else:
        learned = _runtime.run(learn_fate(st, prep.prefix, prep.attempt, prep.rank, trusted=prep.records_trusted))
        fate, how = learned.fate, learned.how
    if fate == Fate.NOT_COMMITTED:
        delete_quietly(st, prep.written_keys)
    lost_ranks = unanswered_ranks(comm, f"{prep.attempt}/commit")
    who = (f"rank(s) {', '.join(map(str, lost_ranks))} did not answer afterwards" if lost_ranks
           else "another rank died or the network between ranks failed")
    what = {
        Fate.COMMITTED: "the new checkpoint WAS committed and is whole; this rank kept its objects",
        Fate.NOT_COMMITTED: ("the save was NOT committed: the checkpoint at the URI is as it was before "
                             "this save, and this rank deleted its objects of the attempt"),
        Fate.UNKNOWN: ("whether the save was committed is unknown; this rank's objects of the attempt are "
                       "left in place (`objckpt gc` removes them once no manifest names them)"),
    }[fate]
    log.warning("save to %s: rank %d lost contact during the commit (%s): %s", prep.uri, prep.rank, how, what)
    return RankLostError(
        f"save to {prep.uri!r} (attempt {prep.attempt}): the ranks lost contact while {lost.phase or 'committing'} "
        f"({who}); {what} ({how}). Cause on rank {prep.rank}: {lost}",
        committed={Fate.COMMITTED: True, Fate.NOT_COMMITTED: False}.get(fate), lost_ranks=lost_ranks or ())


def _root_fate(lost: DecisionNotShared) -> tuple[Fate, str]:
    """Rank 0's own view: it knows whether it wrote the manifest."""
    if not lost.decided:
        return Fate.NOT_COMMITTED, "rank 0 never had every rank's report, so it did not commit"
    if lost.failure is not None:
        return Fate.NOT_COMMITTED, f"rank 0's commit failed ({type(lost.failure).__name__})"
    status, errors = lost.value if lost.value is not None else (None, [])
    if status is None:
        return Fate.NOT_COMMITTED, "a rank reported a failure, so rank 0 did not commit"
    if status.state == CommitState.OK:
        return Fate.COMMITTED, "rank 0 wrote the manifest"
    if status.state == CommitState.FAILED:
        return Fate.UNKNOWN, status.message
    return Fate.NOT_COMMITTED, status.message  # FAILED_CLEAN / EXISTS: commit() already deleted rank 0's objects


def save_now(state: Any, uri: str, st: ObjectStore, prefix: str, comm: Comm, opts: SaveOptions,
             pool: HostPool) -> SaveResult:
    """A synchronous save: all three phases in the caller's thread.  Contiguous
    CPU tensors upload from their own memory (the caller waits, so they cannot
    change); everything else stages within ``opts.staging_bytes`` (512 MiB by default).
    The program's objects stay out of the garbage collector's walks meanwhile
    (:class:`~objckpt.runtime.gc_pause.FrozenOld`: a save of many tensors makes as many
    objects as its manifest holds)."""
    frozen = FrozenOld()
    frozen.now()
    try:
        prep = prepare(state, uri, st, prefix, comm, opts)
        budget = save_budget(opts.staging_bytes)  # the save's one staging budget (SAVE_STAGING_BYTES by default)
        outcome = _runtime.run(upload(prep, pool, budget, zero_copy=True))
        return finish(prep, comm, outcome)
    finally:
        frozen.close()
