"""The load pipeline: manifest -> template match -> resolve -> read plan -> execute.

:func:`load_into` fills a caller's template in place, from a read session
(:mod:`objckpt.load.session`: the store, the manifest, the stored keys; reads
without a template and ``inspect`` are the session's own).
Matching a template to the manifest happens here, before any tensor byte is
read, so a mismatch costs one GET and names every key it concerns.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import torch

from ..distributed.placements import Shard, local_part, local_view
from ..errors import BlobMissingError, ObjckptError, StateDictMismatchError
from ..format.dtypes import converts_between_floats, dtype_from_name, itemsize
from ..format.manifest import Manifest
from ..format.subtree import NOTHING, find
from ..format.tree import decode_tree, iter_leaves
from ..logs import get_logger
from ..options import LoadOptions
from ..results import IOStats, LoadResult
from ..runtime.gc_pause import FrozenOld
from ..runtime.memory import CAST_BATCH_BYTES
from ..state import Slot, StatefulValue, create_optimizer_state, find_stateful, template_slots
from ..storage import ObjectStore
from .collective import CollectiveReader
from . import prefault
from .fill import FillTarget
from .key_match import KeyCheck, check_key_match, reconcile, renamed_leaves
from .session import ReadSession, stored_key
from .writeback import hand_back

log = get_logger("objckpt.load")

@dataclass
class Match:
    """A template matched against a manifest: what to fill, and from which state-dict values."""

    targets: list[FillTarget]
    sources: list[Any]  # the state-dict value of each target: its placements give the replica group
    value_slots: list[Slot]
    n_tensors: int
    missing: list[str]
    unexpected: list[str]
    #: the tensors loaded with ``cast``: read through temporaries of the stored dtype
    casts: list["CastTarget"] = field(default_factory=list)
    #: the encoded checkpoint value of each value slot, by key
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class CastTarget:
    """A template tensor loaded with ``cast=True``: its pieces are read into a temporary
    of the stored dtype, which is then copied (converting) into it.  The temporary is
    made only when its batch is read (:func:`cast_batches`), so a load converting a
    whole state (bf16 checkpoint, fp32 model) never holds it all twice."""

    key: str  # the stored key
    dest: torch.Tensor  # the template's local tensor
    stored: torch.dtype
    pieces: tuple[tuple[Any, tuple[int, ...]], ...]  # (box, local offsets) of each piece
    source: Any  # the state-dict value (its placements give the replica group)

    @property
    def nbytes(self) -> int:
        return self.dest.numel() * itemsize(self.stored)

    def targets(self) -> tuple[torch.Tensor, list[FillTarget]]:
        """A new temporary, and the fill targets that land in it."""
        temp = torch.empty(tuple(self.dest.shape), dtype=self.stored, device=self.dest.device)
        return temp, [FillTarget(self.key, box, local_view(temp, box, offs)) for box, offs in self.pieces]


def cast_batches(casts: list[CastTarget], limit: Optional[int] = None) -> list[list[CastTarget]]:
    """``casts`` in order, cut into batches of temporaries up to ``limit`` bytes
    (:data:`CAST_BATCH_BYTES` when not given; a larger tensor alone in its batch)."""
    limit = CAST_BATCH_BYTES if limit is None else limit
    out: list[list[CastTarget]] = []
    size = 0
    for c in casts:
        if not out or size + c.nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(c)
        size += c.nbytes
    return out


def castable(have: torch.dtype, stored: torch.dtype) -> bool:
    """Whether ``load(..., cast=True)`` converts ``stored`` into ``have``: floating dtypes only
    (not complex, integer, bool, nor the packed fp4 pairs)."""
    return converts_between_floats(have) and converts_between_floats(stored)


def _under_value_leaves(keys: Iterable[str], leaves: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """Template keys that lie inside a tensor-free checkpoint leaf (a Stateful value inside a dict
    that held no tensor: the template walks down to it, the checkpoint stopped above), with
    their encoded values; and the checkpoint leaves they lie in."""
    out: dict[str, Any] = {}
    covered: set[str] = set()
    for key in keys:
        if key in leaves:
            continue
        i = key.rfind(".")
        while i > 0:
            parent = key[:i]
            if parent in leaves:
                node = find(leaves[parent], key[i + 1:])
                if node is not NOTHING:
                    out[key] = node
                    covered.add(parent)
                break
            i = key.rfind(".", 0, i)
    return out, covered


def match_template(state_dict: Any, m: Manifest, leaves: dict[str, Any], uri: str, strict: bool,
                   cast: bool = False, stateful: Optional[dict[str, StatefulValue]] = None) -> Match:
    """Pair every template leaf with the checkpoint, or raise naming what does not fit."""
    slots = list(template_slots(state_dict, stateful))
    tkeys = {s.key for s in slots}
    keymap = reconcile(tkeys, leaves)  # torch's wrapper prefixes (_orig_mod., module.) on one side only
    leaves = renamed_leaves(leaves, keymap)
    inside, covered = _under_value_leaves(tkeys, leaves)
    values = {**{k: leaves[k] for k in tkeys if k in leaves}, **inside}
    missing = [s.key for s in slots if s.key not in values]
    unexpected = [k for k in leaves if k not in tkeys and k not in covered]
    check_key_match(KeyCheck([s.key for s in slots if isinstance(s.value, (torch.Tensor, Shard))],
                             list(values), missing, unexpected, list(m.tensors),
                             list((stateful or {}).values()), keymap), uri, strict)
    problems: list[str] = []
    out = Match([], [], [], 0, missing, unexpected, values=values)
    seen: set[tuple] = set()
    for s in slots:
        if s.key not in values:
            continue
        is_t = isinstance(s.value, (torch.Tensor, Shard))
        ck = keymap.ckpt_key(s.key)
        in_ckpt_t = ck in m.tensors
        if is_t != in_ckpt_t:
            problems.append(f"{s.key!r}: {'tensor' if is_t else 'value'} in state dict, "
                            f"{'tensor' if in_ckpt_t else 'value'} in checkpoint")
            continue
        if not is_t:
            out.value_slots.append(s)
            continue
        e = m.tensors[ck]
        part = local_part(s.key, s.value)
        local = part.local
        stored = dtype_from_name(e.dtype, s.key)
        if tuple(part.shape) != e.shape or (part.dtype != stored and not (cast and castable(part.dtype, stored))):
            hint = ""
            if tuple(part.shape) == e.shape and castable(part.dtype, stored):
                hint = " (pass cast=True to convert between floating dtypes)"
            elif tuple(part.shape) == e.shape and cast:
                hint = (" (cast=True converts between floating dtypes only, e.g. float32 and bfloat16; not complex, "
                        "integer, bool or packed fp4 tensors)")
            problems.append(f"{s.key!r}: state dict has {part.dtype} {list(part.shape)}, checkpoint has "
                            f"{e.dtype} {list(e.shape)}{hint}")
            continue
        if local is not None and local.is_meta:
            problems.append(f"{s.key!r}: the state dict's tensor is on the meta device (no memory to load "
                            "into); allocate it first, e.g. model.to_empty(device=...)")
            continue
        if not part.pieces or part.local is None:
            continue  # this rank holds no part of it
        out.n_tensors += 1
        sk = stored_key(m, ck)
        if part.dtype != stored:  # cast=True: read into a temporary of the stored dtype, convert after
            ident = (local.device, local.data_ptr(), tuple(local.shape), tuple(local.stride()), sk, "cast")
            if ident not in seen or not local.numel():  # tied destination: fill once
                seen.add(ident)
                out.casts.append(CastTarget(sk, local, stored, tuple(
                    (box, offs) for (box, _), offs in zip(part.pieces, part.local_offsets)), s.value))
            continue
        for box, view in part.pieces:  # several for a strided DTensor: each a view of its local tensor
            ident = (view.device, view.data_ptr(), tuple(view.shape), tuple(view.stride()), sk, box)
            if ident in seen and view.numel():
                continue  # tied destination: fill once
            seen.add(ident)
            out.targets.append(FillTarget(sk, box, view))
            out.sources.append(s.value)
    if problems:
        raise StateDictMismatchError(f"cannot load {uri!r}: " + "; ".join(problems[:20]))
    return out


def load_into(state_dict: Any, session: ReadSession, reader: CollectiveReader, opts: LoadOptions) -> LoadResult:
    """Fill ``state_dict`` in place from ``session``'s checkpoint; ``reader`` reads directly or
    once per replica group.

    A rank loading alone starts over from the new manifest when the checkpoint is
    overwritten meanwhile (ranks loading together cannot agree on that cheaply: they
    raise, saying the checkpoint was replaced)."""
    tries = 0
    uri, st, prefix = session.uri, session.store, session.prefix
    stateful = find_stateful(state_dict)  # each Stateful value's state_dict(), taken once
    # A restarting job's template was just allocated: its large pieces are advised huge
    # pages where that pays (see prefault), before the manifest is fetched; a misspelt
    # OBJCKPT_HUGE_PAGES is reported here, before any request.
    faults = prefault.start(prefault.tensor_memory((s.value for s in template_slots(state_dict, stateful)),
                                                   prefault.smallest_used()))
    frozen = FrozenOld()
    try:
        while True:
            t0 = time.perf_counter()
            stats = IOStats()
            m = session.first(stats) if tries == 0 else session.refresh(stats)
            frozen.now()  # the manifest and the program's objects: out of the collector's walks until the end
            try:
                return _load_from(state_dict, stateful, uri, st, prefix, reader, opts, m, stats, t0, faults)
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


def _load_from(state_dict: Any, stateful: dict[str, StatefulValue], uri: str, st: ObjectStore, prefix: str,
               reader: CollectiveReader, opts: LoadOptions, m: Manifest, stats: IOStats, t0: float,
               faults: Optional[prefault.Prefault] = None) -> LoadResult:
    rank = reader.comm.rank
    tree = m.rank_trees[rank] if m.rank_trees and rank < len(m.rank_trees) else m.tree
    leaves = dict(iter_leaves(tree))
    with stats.timings.timed("plan"):
        create_optimizer_state(stateful, tree, m, opts.allow_pickle, repr(uri))
        match = match_template(state_dict, m, leaves, uri, opts.strict, opts.cast, stateful)
    if faults is not None:
        faults.cancel()  # the fill populates what is left in the order of its requests
    try:
        _fill_all(reader, st, prefix, m, match, stats, uri)
    except ObjckptError as e:
        _say_template_touched(e, match.n_tensors)
        raise
    for s in match.value_slots:
        if s.container is not None and not isinstance(s.container, tuple):
            s.container[s.index] = decode_tree(match.values[s.key], lambda k: None, allow_pickle=opts.allow_pickle,
                                               where=repr(uri))
    hand_back(stateful, uri)
    res = LoadResult(uri, stats.bytes, time.perf_counter() - t0, stats.requests, match.n_tensors, match.missing,
                     match.unexpected, reader.received_bytes, reader.strategy, stats.timings)
    log.info("loaded %s rank %d/%d: %d tensors, %d bytes, %d requests, %.3f s (%s; strategy %s)", uri, rank,
             reader.comm.world_size, res.tensors, res.bytes, res.requests, res.seconds, res.timings.describe(),
             res.strategy)
    return res


def _fill_all(reader: CollectiveReader, st: ObjectStore, prefix: str, m: Manifest, match: Match, stats: IOStats,
              uri: str) -> None:
    """Fill every target of ``match``, the cast ones through temporaries.

    Ranks reading together fill once, every temporary at a time (each collective step
    must be taken by every rank alike).  A rank reading alone fills the tensors that need
    no cast, then the cast ones in batches of :data:`CAST_BATCH_BYTES` (or what is left of
    the load's budget), so converting a whole state holds one batch of temporaries, not a
    second copy of the state.  The temporaries are held in the load's budget while they live."""
    if reader.active or not match.casts:
        batches = [match.casts]
    else:
        batches = [[]] + cast_batches(match.casts, reader.memory.share(CAST_BATCH_BYTES).nbytes)
    for i, batch in enumerate(batches):
        _fill_batch(reader, st, prefix, m, match, batch, i == 0, stats, uri)


def _fill_batch(reader: CollectiveReader, st: ObjectStore, prefix: str, m: Manifest, match: Match,
                batch: list[CastTarget], first: bool, stats: IOStats, uri: str) -> None:
    """One fill: ``batch``'s temporaries (and, ``first``, the targets needing no cast),
    then the conversions; the temporaries die on return."""
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
            reader.fill(st, prefix, m, targets, sources, stats, uri)
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
