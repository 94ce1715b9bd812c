"""Saves whose tensors come from a source: DCP's write items, a converter's stream.

:func:`objckpt.save` describes a state dict itself.  A source instead says up
front what it will write, as :class:`SourcePiece` specs (a tensor's key, dtype,
the piece's shape and where it sits in the whole tensor), then hands over each
piece's bytes when they are due: all at once from memory (:func:`upload_pieces`,
the DCP plugin's ranks: parallel parts, uploaded from the tensors' own memory
where they allow it) or one tensor at a time in plan order
(:func:`stream_pieces`, the converters: about one tensor plus a few parts in
memory).  Either way the pieces are packed, checksummed and recorded exactly as
a rank of ``objckpt.save`` packs its writes (:func:`~objckpt.planning.pack.pack_items`,
:mod:`.records`), and :func:`commit_pieces` has the layout build the manifest from
every rank's outcome (:func:`objckpt.layout.sourced_manifest`) and commits it last
and conditionally (:mod:`.commit`).  A source builds no chunk and no manifest, and
commits nothing itself: a format change is made here, once, for every writer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch

from ..runtime import loop as _runtime
from ..errors import CheckpointExistsError, ObjckptError, UnsupportedFormatError, UnsupportedValueError
from ..format import keys
from ..format.dtypes import dtype_name, itemsize
from ..format.spread import Placement
from ..layout import ManifestCommon, RankOutcome, sourced_manifest
from ..runtime.memory import Budget, host_pool
from ..planning import crc_blocks
from ..planning.pack import ChunkPlan, PackLimits, SavePlan, pack_items
from ..results import IOStats
from ..storage import ObjectStore
from ..storage.shape import save_sizes, shape_for
from .commit import CommitState, commit, delete_quietly
from .records import Piece, chunk_records, rank_blobs
from .streamed import write_plan_in_order
from .upload import ChunkCrc, write_plan


@dataclass
class SourcePiece:
    """A piece of a tensor a source will hand over: the tensor's key in the checkpoint,
    its dtype, the piece's shape, and the global offsets of its first element (empty:
    the origin; a whole tensor is the piece at the origin of its own shape)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class SourceTarget:
    """Where one rank of a sourced save writes: ``store`` and ``prefix`` (of ``uri``),
    the save attempt its blob names carry, and the rank."""

    store: ObjectStore
    prefix: str
    uri: str
    attempt: str
    rank: int = 0


@dataclass(frozen=True)
class PackSizes:
    """Blob and part sizes as :func:`objckpt.save` takes them (None: by the endpoint's shape)."""

    blob_size: Optional[int] = None
    part_size: Optional[int] = None


def refuse_existing(store: ObjectStore, prefix: str, uri: str, overwrite: bool,
                    hint: str = "pass overwrite=True to replace it") -> None:
    """Raise :class:`CheckpointExistsError` before anything is uploaded when a checkpoint
    is committed at ``uri`` and ``overwrite`` is off."""
    if not overwrite and _runtime.run(store.head(keys.manifest_key(prefix))) is not None:
        raise CheckpointExistsError(f"a checkpoint already exists at {uri!r}; {hint}")


def crc_block_for(nbytes: Iterable[int], crc_block: Optional[int], part_size: Optional[int]) -> int:
    """``crc_block`` when given, else the block ``objckpt.save`` would choose for pieces of
    ``nbytes`` bytes (:func:`objckpt.planning.crc_blocks.for_boxes`; the manifest
    records one block, so a multi-rank source chooses it from every rank's pieces)."""
    if crc_block is not None:
        return crc_block
    return crc_blocks.for_boxes(nbytes, part_size)


@dataclass(frozen=True)
class _Packed:
    """One rank's pieces laid out in blobs: the plan, each packing key's piece, blob names."""

    plan: SavePlan
    pieces: dict[str, Piece]
    specs: dict[str, SourcePiece]
    names: list[str]
    blob_keys: list[str]

    def outcome(self, target: SourceTarget, crcs: Mapping[ChunkPlan, ChunkCrc]) -> RankOutcome:
        return RankOutcome(blobs=rank_blobs(self.plan, self.names, target.rank),
                           records=chunk_records(self.plan, self.pieces, crcs))


def _pack(target: SourceTarget, pieces: Sequence[SourcePiece], sizes: PackSizes) -> _Packed:
    for p in pieces:
        dtype_name(p.dtype, p.key)  # refuse dtypes the format has no name for, naming the key
    st = target.store
    blob_size, part_size = save_sizes(sizes.blob_size, sizes.part_size, _runtime.run(shape_for(st)))
    limits = PackLimits(blob_size, part_size, st.min_part_size, st.max_part_size)
    plan = pack_items(pieces, {p.key: itemsize(p.dtype) for p in pieces}, limits)
    pks = [f"{p.key}\x00{i}" for i, p in enumerate(pieces)]  # the packing keys pack_items gave
    place = Placement(target.prefix, target.rank)
    names = [place.blob_name(target.attempt, b.index) for b in plan.blobs]
    return _Packed(plan, {pk: Piece(p.key, p.offsets or (0,) * len(p.shape)) for pk, p in zip(pks, pieces)},
                   dict(zip(pks, pieces)), names, [place.key(n) for n in names])


def _checked(spec: SourcePiece, t: Any) -> torch.Tensor:
    """``t`` when it is the tensor ``spec`` announced (a mismatch would store wrong bytes)."""
    if not isinstance(t, torch.Tensor):
        raise UnsupportedValueError(f"the source handed over {type(t).__name__} for {spec.key!r}, not a tensor")
    if t.dtype != spec.dtype or tuple(t.shape) != tuple(spec.shape):
        raise UnsupportedFormatError(f"source tensor {spec.key!r} is {t.dtype} {list(t.shape)}, but the source "
                                     f"announced {spec.dtype} {list(spec.shape)}")
    return t.detach()


def upload_pieces(target: SourceTarget, pieces: Sequence[SourcePiece], tensors: Sequence[torch.Tensor], *,
                  sizes: PackSizes, crc_block: int, stats: IOStats, staging_bytes: int) -> RankOutcome:
    """Upload ``tensors`` (one per piece, in memory) as this rank's blobs, all parts in
    parallel within ``staging_bytes`` of staging; returns the rank's blobs and records.
    On failure nothing of this rank stays in the store."""
    packed = _pack(target, pieces, sizes)
    by_pk = {pk: _checked(packed.specs[pk], t) for pk, t in zip(packed.pieces, tensors)}
    crcs = _runtime.run(write_plan(target.store, packed.blob_keys, packed.plan, by_pk, host_pool(),
                                   Budget(staging_bytes), stats, zero_copy=True, crc_block=crc_block))
    return packed.outcome(target, crcs)


def stream_pieces(target: SourceTarget, pieces: Sequence[SourcePiece], load: Callable[[str], torch.Tensor], *,
                  sizes: PackSizes, crc_block: int, stats: IOStats, window: int = 2,
                  release: Optional[Callable[[str], None]] = None) -> RankOutcome:
    """Upload the pieces (whole tensors, keys unique) in order, asking ``load(key)`` for
    each when its bytes are due and ``release(key)`` once they are staged
    (:func:`.streamed.write_plan_in_order`); returns the rank's blobs and records."""
    packed = _pack(target, pieces, sizes)

    def get(pk: str) -> torch.Tensor:
        return _checked(packed.specs[pk], load(packed.pieces[pk].key))

    def drop(pk: str) -> None:
        if release is not None:
            release(packed.pieces[pk].key)

    crcs = write_plan_in_order(target.store, packed.blob_keys, packed.plan, get, drop, stats, crc_block=crc_block,
                               window=window)
    return packed.outcome(target, crcs)


def commit_pieces(target: SourceTarget, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                  outcomes: list[RankOutcome], tree: Any, *, metadata: dict[str, Any], crc_block: int,
                  overwrite: bool, stats: IOStats) -> int:
    """Rank 0: the manifest of every rank's outcome (``tensors``: key -> dtype and whole
    shape; ``tree``: the encoded tree naming them), committed last and conditionally.
    Returns its size.  A manifest that cannot be built deletes every rank's blobs; a
    commit that fails raises as :func:`objckpt.save` does (:class:`CheckpointExistsError`
    when another writer committed first)."""
    st, prefix = target.store, target.prefix
    written = _written(prefix, outcomes)
    try:
        heads = {k: (dtype_name(d, k), tuple(s)) for k, (d, s) in tensors.items()}
        m = sourced_manifest(heads, outcomes, tree, ManifestCommon(target.attempt, dict(metadata), crc_block))
    except Exception:
        delete_quietly(st, written)  # nothing will reference them
        raise
    errors: list[BaseException] = []
    status = commit(st, prefix, m, overwrite, target.uri, written, stats, errors)
    if status.state == CommitState.EXISTS:
        raise CheckpointExistsError(status.message)
    if status.state != CommitState.OK:
        raise ObjckptError(status.message) from (errors[0] if errors else None)
    return status.manifest_bytes


def abandon_pieces(store: ObjectStore, prefix: str, outcomes: Sequence[RankOutcome]) -> None:
    """Delete every rank's blobs of a sourced save that will not commit (what fails is left for gc)."""
    delete_quietly(store, _written(prefix, outcomes))


def _written(prefix: str, outcomes: Sequence[RankOutcome]) -> list[str]:
    return [Placement(prefix, b.rank).key(b.name) for o in outcomes for b in o.blobs]
