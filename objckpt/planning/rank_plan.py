"""One rank's part of a save plan, cached per layout (pure).

Two ways to know who writes what: from every rank's boxes, gathered
(:func:`plan_for_rank`: any layout, cost grows with ranks x tensors), or from a
symbolic description every rank shares (:func:`plan_for_rank_symbolic`: each
rank derives only its own pieces, cost grows with tensors).
"""
from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from typing import Any, Sequence

from ..format.manifest import Layout, Mesh
from ..storage import ObjectStore
from .layout import TensorDesc, assign_layouts, group_size, my_pieces
from .pack import SavePlan, TensorSpec, plan_save
from .shard import Box, TensorMeta, WriteItem, assign_writes


_PLAN_CACHE: "OrderedDict[bytes, Any]" = OrderedDict()
PLAN_CACHE_STATS = {"hits": 0, "misses": 0}


def _cached(digest: bytes, build: Any) -> Any:
    hit = _PLAN_CACHE.get(digest)
    if hit is not None:
        _PLAN_CACHE.move_to_end(digest)
        PLAN_CACHE_STATS["hits"] += 1
        return hit
    PLAN_CACHE_STATS["misses"] += 1
    out = _PLAN_CACHE[digest] = build()
    while len(_PLAN_CACHE) > 8:
        _PLAN_CACHE.popitem(last=False)
    return out


def _pack(items: Sequence[WriteItem], itemsizes: dict[str, int], st: ObjectStore, blob_size: int,
          part_size: int) -> SavePlan:
    specs = [TensorSpec(f"{it.key}\x00{i}", tuple(it.shape), itemsizes[it.key]) for i, it in enumerate(items)]
    part = max(part_size, st.min_part_size)
    return plan_save(specs, blob_bytes=blob_size, part_bytes=part, chunk_bytes=part_size,
                     max_part_bytes=st.max_part_size)


def plan_for_rank(metas: list[dict[str, TensorMeta]], rank: int, st: ObjectStore, blob_size: int,
                   part_size: int) -> tuple[list[WriteItem], SavePlan]:
    """This rank's writes and their blob layout from every rank's boxes; cached,
    because a training job saves the same layout again and again (the digest
    of the gathered metadata is the key)."""
    limits = (rank, blob_size, part_size, st.min_part_size, st.max_part_size)
    digest = hashlib.blake2b(pickle.dumps((metas, limits)), digest_size=20).digest()

    def build() -> tuple[list[WriteItem], SavePlan]:
        items = assign_writes(metas)[rank]
        sizes = {k: t.itemsize for m in metas for k, t in m.items()}
        return items, _pack(items, sizes, st, blob_size, part_size)

    return _cached(digest, build)


def plan_for_rank_symbolic(
    digest: bytes, descs: Sequence[TensorDesc], meshes: Sequence[Mesh], boxes: dict[str, Box], rank: int,
    st: ObjectStore, blob_size: int, part_size: int,
) -> tuple[dict[str, Layout], list[WriteItem], SavePlan]:
    """Every tensor's layout (the same on every rank) and this rank's writes.

    ``digest`` identifies the shared description (computed by the caller, who
    exchanged it); ``boxes`` are this rank's local boxes, which the pieces are
    rows of."""
    limits = (rank, blob_size, part_size, st.min_part_size, st.max_part_size)

    def build() -> tuple[dict[str, Layout], list[WriteItem], SavePlan]:
        layouts = assign_layouts(descs, meshes)
        own: list[WriteItem] = []
        shared: list[WriteItem] = []  # pieces of replicated cells: many ranks read them
        for t in descs:
            g = group_size(meshes[t.mesh].shape, t.placements)
            for p_off, p_shape in my_pieces(t.shape, meshes[t.mesh], layouts[t.key], rank):
                box = boxes[t.key]
                r0 = p_off[0] - box[0][0] if p_off else 0
                (own if g == 1 else shared).append(WriteItem(t.key, box, r0, r0 + (p_shape[0] if p_shape else 1)))
        # replicated pieces packed together after this rank's own shards, so a
        # reader that needs them all (every rank, for plain tensors) gets them in
        # one merged range instead of one small range per tensor
        items = own + shared
        sizes = {t.key: t.itemsize for t in descs}
        return layouts, items, _pack(items, sizes, st, blob_size, part_size)

    return _cached(hashlib.blake2b(digest + pickle.dumps(limits), digest_size=20).digest(), build)


def metas_itemsize(metas: list[dict[str, TensorMeta]], key: str) -> int:
    for m in metas:
        if key in m:
            return m[key].itemsize
    raise KeyError(key)
