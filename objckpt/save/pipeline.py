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
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ..runtime import loop as _runtime
from ..distributed.comm import Comm, decide_on_root, refusal_class
from ..distributed.join import join
from ..errors import (CheckpointExistsError, ObjckptError, StateDictMismatchError, TensorChangedError,
                      UnsupportedValueError)
from ..format import keys
from ..format.spread import Placement, up_for
from ..logs import get_logger
from ..layout import GatheredLayout, ManifestCommon, RankOutcome, RankReport, SaveLayout, SymbolicLayout
from ..runtime.gc_pause import FrozenOld
from ..runtime.memory import AnyBudget, HostPool, save_budget
from ..options import KeyScheme, SaveOptions
from ..planning import crc_blocks
from ..planning.pack import PackLimits, SavePlan
from ..results import IOStats, SaveResult
from ..storage import ObjectStore, split_uri
from ..storage.shape import save_sizes, shape_for
from .commit import CommitState, CommitStatus, commit, delete_quietly
from .describe import LocalState, Mirror, describe_local
from .fingerprint import differing
from .fingerprint import digest as prints_digest
from .records import Piece, chunk_records, rank_blobs
from .upload import refuse_unstageable, staged_parts, write_plan

log = get_logger("objckpt.save")


@dataclass(frozen=True)
class Hello:
    """What every rank says in the first exchange of a save."""

    symbolic_digest: Optional[bytes]  # of its symbolic description (None: it has none)
    tree_digest: bytes  # of its non-tensor values
    exists: bool  # rank 0: a checkpoint is committed at the URI (asked only when overwrite is off)
    attempt: str  # rank 0: the new attempt id
    error: Optional[str]  # this rank could not describe its state
    #: the class name of that error (re-raised as that class on every rank, see refusal_class)
    error_kind: str = ""
    #: digest of the plain tensors' fingerprints (differs when some plain tensor differs between ranks)
    prints_digest: bytes = b""
    #: how far above the prefix this rank's spread root is (0: default key layout); must agree
    spread_up: int = 0
    #: the crc block this rank would choose for its chunks; the save uses the smallest
    crc_block: int = 0


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
    stats: IOStats = field(default_factory=IOStats)
    t0: float = field(default_factory=time.perf_counter)

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
    rank raises together instead of waiting in a collective."""
    t0 = time.perf_counter()
    stats = IOStats()
    world = comm.world_size
    local: Optional[LocalState] = None
    up = 0
    local_exc: Optional[BaseException] = None
    err: Optional[str] = None
    exists = False
    join(comm, f"save to {uri!r}", opts.collective_timeout)
    try:
        opts = opts.checked()
        up = spread_up(uri, prefix, opts)
        # only a save that may not replace a checkpoint asks whether one is there (an
        # overwrite reads the old manifest once, at its commit, for the cleanup); asked on
        # the I/O thread while the state is described and copied, not after: an async
        # save's caller would wait for the round trip
        asked = (_runtime.submit(st.head(keys.manifest_key(prefix)))
                 if comm.rank == 0 and not opts.overwrite else None)
        local = describe_local(state, opts.allow_pickle, comm, mirror)
        if asked is not None:
            exists = asked.result() is not None
            stats.add(0)
        stats.timings.add("describe", time.perf_counter() - t0)
    except Exception as e:
        if world == 1:
            raise
        local_exc, err = e, f"{type(e).__name__}: {e}"
    hello = Hello(
        error_kind=type(local_exc).__name__ if local_exc is not None else "",
        prints_digest=prints_digest(local.fingerprints) if local is not None and world > 1 else b"",
        symbolic_digest=local.symbolic.digest if local is not None and local.symbolic is not None else None,
        tree_digest=_tree_digest(local.tree) if local is not None and world > 1 else b"",
        exists=exists, attempt=keys.new_attempt_id() if comm.rank == 0 else "", error=err, spread_up=up,
        crc_block=_crc_block_wanted(local, opts) if local is not None else 0,
    )
    hellos: list[Hello] = comm.all_gather_object(hello) if world > 1 else [hello]
    failed = [(r, h.error) for r, h in enumerate(hellos) if h.error]
    if failed:  # every rank raises the class of the first refusal (e.g. UnsupportedValueError)
        kind = next(h.error_kind for h in hellos if h.error)
        raise refusal_class(kind, ObjckptError)(
            f"save to {uri!r} not started: " + "; ".join(f"rank {r}: {m}" for r, m in failed)
        ) from local_exc
    if local is None:  # unreachable: a failed describe is in ``failed``
        raise ObjckptError(f"save to {uri!r}: rank {comm.rank} has no description of its state")
    if hellos[0].exists and not opts.overwrite:
        raise CheckpointExistsError(f"a checkpoint already exists at {uri!r}; pass overwrite=True to replace it")
    attempt = hellos[0].attempt
    if any(h.spread_up != hellos[0].spread_up for h in hellos):  # the manifest records one spread root
        raise ValueError(f"save to {uri!r}: the ranks passed different key_layout or spread_root options "
                         f"(spread root levels by rank: {[h.spread_up for h in hellos][:16]})")
    _check_replicated(local, hellos, comm, uri)
    layout = _choose_layout(local, hellos, comm)
    shape = _runtime.run(shape_for(st))
    blob_size, part_size = save_sizes(opts.blob_size, opts.part_size, shape)
    limits = PackLimits(blob_size, part_size, st.min_part_size, st.max_part_size)
    writes = layout.plan(comm.rank, local.boxes, limits)
    tensors: dict[str, torch.Tensor] = {}
    pieces: dict[str, Piece] = {}
    for i, it in enumerate(writes.items):
        src = local.sources[it.key].view(it.box)
        pk = f"{it.key}\x00{i}"  # the packing key plan_save was given (see planning.pack.pack_items)
        tensors[pk] = src.reshape(1) if src.dim() == 0 else src[it.row_start : it.row_end]
        pieces[pk] = Piece(it.key, it.offsets)
    place = Placement(prefix, comm.rank, up, opts.spread_digits)
    names = [place.blob_name(attempt, b.index) for b in writes.plan.blobs]
    stats.timings.add("plan", time.perf_counter() - t0 - stats.timings["describe"])
    crc_block = min(h.crc_block for h in hellos)  # every rank computes the same
    return Prepared(uri, st, prefix, comm.rank, world, opts, attempt, local, layout, writes.plan, tensors, pieces,
                    names, place, crc_block, stats=stats, t0=t0)


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
        return cls(RankOutcome(error=f"{what}{type(exc).__name__}: {exc}"), exc)


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
    records = chunk_records(prep.plan, prep.pieces, crcs)
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


def finish(prep: Prepared, comm: Comm, outcome: UploadOutcome) -> SaveResult:
    """Phase 3: exchange outcomes; rank 0 commits; every rank returns or raises alike."""
    st = prep.store
    if prep.world_size == 1 and outcome.exc is not None:
        delete_quietly(st, prep.written_keys)  # e.g. blobs of an abandoned lazy save
        raise outcome.exc
    commit_errors: list[BaseException] = []

    def decide(outcomes: list[RankOutcome]) -> tuple[Optional[CommitStatus], list[Optional[str]]]:
        errors = [o.error for o in outcomes]
        if any(errors):
            return None, errors  # every rank raises below, from the same list
        m = prep.layout.manifest(outcomes, ManifestCommon(prep.attempt, prep.opts.metadata, prep.crc_block))
        m.spread_up = prep.place.up
        return commit(st, prep.prefix, m, prep.opts.overwrite, prep.uri, prep.written_keys, prep.stats,
                      commit_errors), errors

    t_commit = time.perf_counter()
    try:
        status, errors = decide_on_root(comm, outcome.shared, decide)
    except Exception:  # building or committing the manifest failed on rank 0: raised on every rank
        delete_quietly(st, prep.written_keys)
        raise
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        delete_quietly(st, prep.written_keys)
        kind = re.match(r"(\w+): ", failed[0][1] or "")  # the class of the first failure, on every rank
        raise refusal_class(kind.group(1) if kind else "", ObjckptError)(
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
        raise ObjckptError(status.message)
    prep.stats.timings.add("commit", time.perf_counter() - t_commit)
    res = SaveResult(prep.uri, prep.nbytes, time.perf_counter() - prep.t0, prep.stats.requests,
                     len(prep.local.dtypes), len(prep.plan.blobs), status.manifest_bytes, prep.stats.timings,
                     prep.rank_files)
    log.info("saved %s rank %d/%d: %d tensors, %d bytes in %d blob(s), %d requests, %.3f s (%s)", prep.uri,
             prep.rank, prep.world_size, res.tensors, res.bytes, res.blobs, res.requests, res.seconds,
             res.timings.describe())
    return res


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
