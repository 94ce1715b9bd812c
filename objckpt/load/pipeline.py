"""The load pipeline: manifest -> template match -> resolve -> read plan -> execute.

:func:`load_into` fills a caller's template in place, from a read session
(:mod:`objckpt.load.session`: the store, the manifest, the stored keys; reads
without a template and ``inspect`` are the session's own).  The manifest, the
template's match (:mod:`.match`, before any tensor byte is read, so a mismatch
costs one GET and names every key it concerns) and the read plan are one
:class:`~objckpt.load.prepared.PreparedLoad`, made here or handed in.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

from ..errors import BlobMissingError, ObjckptError
from ..format.tree import decode_tree
from ..logs import get_logger
from ..options import LoadOptions
from ..results import IOStats, LoadResult
from ..runtime.gc_pause import FrozenOld
from ..runtime.memory import CAST_BATCH_BYTES
from ..state import find_stateful, template_slots
from ..storage import ObjectStore
from .collective import CollectiveReader
from . import prefault
from .match import CastTarget, Match, cast_batches, castable, match_template  # noqa: F401  (their home before)
from .prepared import PreparedLoad, ReadOptions, prepare
from .session import ReadSession
from .writeback import hand_back

log = get_logger("objckpt.load")

def load_into(state_dict: Any, session: ReadSession, reader: CollectiveReader, opts: LoadOptions,
              prepared: Optional[PreparedLoad] = None) -> LoadResult:
    """Fill ``state_dict`` in place from ``session``'s checkpoint; ``reader`` reads directly or
    once per replica group.  ``prepared``: this load prepared already (a tiered restore's plan
    prepared it to choose its sources): taken when the session's manifest is its manifest (held,
    or fetched with the same bytes), else the load is prepared here (:mod:`.prepared`).

    A rank loading alone starts over from the new manifest when the checkpoint is
    overwritten meanwhile (ranks loading together cannot agree on that cheaply: they
    raise, saying the checkpoint was replaced)."""
    tries = 0
    uri, st, prefix = session.uri, session.store, session.prefix
    rank, options = reader.comm.rank, ReadOptions(opts.strict, opts.cast, opts.allow_pickle,
                                                  opts.allow_optimizer_change)
    # each Stateful value's state_dict(), taken once (by the preparation, when there is one)
    stateful = prepared.stateful if prepared is not None else find_stateful(state_dict)
    # A restarting job's template was just allocated: its large pieces are advised huge
    # pages where that pays, its small ones populated while the metadata is read (see
    # prefault), before the manifest is fetched; a misspelt OBJCKPT_HUGE_PAGES is reported
    # here, before any request.
    slots = list(template_slots(state_dict, stateful))  # (the match takes them too)
    faults = prefault.begin(s.value for s in slots)
    frozen = FrozenOld()
    try:
        while True:
            t0 = time.perf_counter()
            stats = IOStats()
            expect = (prepared.raw, prepared.manifest) if prepared is not None else None
            m = session.first(stats, expect) if tries == 0 else session.refresh(stats)
            frozen.now()  # the manifest and the program's objects: out of the collector's walks until the end
            if prepared is None or tries or not prepared.serves(m, rank, options):
                with stats.timings.timed("plan"):
                    prepared = prepare(state_dict, session, rank, options, stateful, m,
                                       world_size=reader.comm.world_size, slots=None if tries else slots)
            if prepared.resolver is None:
                prepared.resolver = session.resolver
            try:
                return _load_from(state_dict, prepared, uri, st, prefix, reader, opts, stats, t0, faults)
            except BlobMissingError as e:
                replaced = session.replaced_since(e, tries)
                if replaced and reader.comm.world_size > 1:
                    e.args = (f"{e.args[0]} (the checkpoint was overwritten while it was loading: load again)",)
                if not replaced or reader.comm.world_size > 1:
                    raise
                tries += 1
    finally:
        frozen.close()
        if faults is not None:
            faults.close()


def _load_from(state_dict: Any, prepared: PreparedLoad, uri: str, st: ObjectStore, prefix: str,
               reader: CollectiveReader, opts: LoadOptions, stats: IOStats, t0: float,
               faults: Optional[prefault.Prefault] = None) -> LoadResult:
    rank, match = reader.comm.rank, prepared.match
    if faults is not None:
        faults.cancel()  # the fill populates what is left in the order of its requests
    try:
        _fill_all(reader, st, prefix, prepared, stats, uri)
    except ObjckptError as e:
        _say_template_touched(e, match.n_tensors)
        raise
    for s in match.value_slots:
        if s.container is not None and not isinstance(s.container, tuple):
            s.container[s.index] = decode_tree(match.values[s.key], lambda k: None, allow_pickle=opts.allow_pickle,
                                               where=repr(uri))
    hand_back(prepared.stateful, uri)
    res = LoadResult(uri, stats.bytes, time.perf_counter() - t0, stats.requests, match.n_tensors, match.missing,
                     match.unexpected, reader.received_bytes, reader.strategy, stats.timings)
    log.info("loaded %s rank %d/%d: %d tensors, %d bytes, %d requests, %.3f s (%s; strategy %s)", uri, rank,
             reader.comm.world_size, res.tensors, res.bytes, res.requests, res.seconds, res.timings.describe(),
             res.strategy)
    return res


def _fill_all(reader: CollectiveReader, st: ObjectStore, prefix: str, prepared: PreparedLoad, stats: IOStats,
              uri: str) -> None:
    """Fill every target of the prepared match, the cast ones through temporaries.

    Ranks reading together fill once, every temporary at a time (each collective step
    must be taken by every rank alike).  A rank reading alone fills the tensors that need
    no cast, then the cast ones in batches of :data:`CAST_BATCH_BYTES` (or what is left of
    the load's budget), so converting a whole state holds one batch of temporaries, not a
    second copy of the state.  The temporaries are held in the load's budget while they live."""
    casts = prepared.match.casts
    if reader.active or not casts:
        batches = [casts]
    else:
        batches = [[]] + cast_batches(casts, reader.memory.share(CAST_BATCH_BYTES).nbytes)
    for i, batch in enumerate(batches):
        _fill_batch(reader, st, prefix, prepared, batch, i == 0, stats, uri)


def _fill_batch(reader: CollectiveReader, st: ObjectStore, prefix: str, prepared: PreparedLoad,
                batch: list[CastTarget], first: bool, stats: IOStats, uri: str) -> None:
    """One fill: ``batch``'s temporaries (and, ``first``, the targets needing no cast),
    then the conversions; the temporaries die on return.  The fill of the targets alone
    executes the prepared read plan."""
    match = prepared.match
    targets = list(match.targets) if first else []
    sources = list(match.sources) if first else []
    temps: list[torch.Tensor] = []
    shown = ", ".join(repr(c.key) for c in batch[:3]) + (" ..." if len(batch) > 3 else "")
    with reader.memory.hold(sum(c.nbytes for c in batch), f"the cast temporaries of {shown}"):
        for c in batch:
            temp, pieces = c.targets()
            temps.append(temp)
            targets += pieces
            sources += [c.source] * len(pieces)
        if targets or reader.active:
            reader.fill(st, prefix, prepared.manifest, targets, sources, stats, uri, prepared=prepared)
        with torch.no_grad():
            for c, temp in zip(batch, temps):
                c.dest.copy_(temp)
        temps.clear()


def _say_template_touched(e: ObjckptError, n_tensors: int) -> None:
    """Tensors are filled in place as their bytes arrive, so a load that fails while
    reading may have overwritten some of the template's tensors: say so in the error
    (``template_modified``) rather than leave the caller to guess.  An error raised
    before any byte was read says so itself (``template_modified = False``)."""
    if getattr(e, "template_modified", None) is False:
        return
    note = (f"the template may be partially overwritten: some of its {n_tensors} tensor(s) may already hold "
            "checkpoint data (its non-tensor values are unchanged); load again or rebuild it")
    e.template_modified = True  # type: ignore[attr-defined]
    if e.args and isinstance(e.args[0], str) and note not in e.args[0]:
        e.args = (f"{e.args[0]} [{note}]",) + e.args[1:]
