"""One rank's part of a save plan, cached per layout (pure)."""
from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict

from ..storage import ObjectStore
from .pack import SavePlan, TensorSpec, plan_save
from .shard import TensorMeta, WriteItem, assign_writes


_PLAN_CACHE: "OrderedDict[bytes, tuple[list[WriteItem], SavePlan]]" = OrderedDict()
PLAN_CACHE_STATS = {"hits": 0, "misses": 0}


def plan_for_rank(metas: list[dict[str, TensorMeta]], rank: int, st: ObjectStore, blob_size: int,
                   part_size: int) -> tuple[list[WriteItem], SavePlan]:
    """This rank's writes and their blob layout; cached, because a training job saves
    the same layout again and again (the digest of the gathered metadata is the key)."""
    limits = (rank, blob_size, part_size, st.min_part_size, st.max_part_size)
    digest = hashlib.blake2b(pickle.dumps((metas, limits)), digest_size=20).digest()
    hit = _PLAN_CACHE.get(digest)
    if hit is not None:
        _PLAN_CACHE.move_to_end(digest)
        PLAN_CACHE_STATS["hits"] += 1
        return hit
    PLAN_CACHE_STATS["misses"] += 1
    items = assign_writes(metas)[rank]
    specs = []
    for i, it in enumerate(items):
        specs.append(TensorSpec(f"{it.key}\x00{i}", tuple(it.shape), metas_itemsize(metas, it.key)))
    part = max(part_size, st.min_part_size)
    plan = plan_save(specs, blob_bytes=blob_size, part_bytes=part, chunk_bytes=part_size,
                     max_part_bytes=st.max_part_size)
    _PLAN_CACHE[digest] = (items, plan)
    while len(_PLAN_CACHE) > 8:
        _PLAN_CACHE.popitem(last=False)
    return items, plan


def metas_itemsize(metas: list[dict[str, TensorMeta]], key: str) -> int:
    for m in metas:
        if key in m:
            return m[key].itemsize
    raise KeyError(key)


