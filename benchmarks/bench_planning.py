"""Planning cost of a multi-rank save and load, without any I/O, at scale.

    python -m benchmarks.bench_planning --worlds 64,256,1024,4096 --out /tmp/planning.json

The state is a 70B Llama-like transformer (80 layers, hidden 8192, 64 heads,
8 KV heads -> k/v out dim 1024, FFN 28672, vocab 128256, bf16 params) plus
Adam state (exp_avg, exp_avg_sq fp32 with the param's layout; ``step`` a 0-d
fp32 tensor, a plain tensor on every rank as FSDP2 keeps it): 2892 tensors.
The layout is FSDP x TP on a 2-d mesh (dp, tp), placements as DTensor
placements per mesh dim, sharded left to right as torch does:

* column-parallel (q, k, v, gate, up, lm_head) and the vocab-parallel
  embedding (torch's ``RowwiseParallel`` on ``nn.Embedding`` shards the
  weight's dim 0): ``[Shard(0), Shard(0)]`` -- dim 0 split over dp, then each
  dp piece over tp (torch.chunk sizes: ceil-sized, the last ones smaller or
  empty; an empty shard's offset is the dim's size, as in torch);
* row-parallel (o, down): ``[Shard(0), Shard(1)]``;
* RMSNorm weights (2 per layer + final): ``[Shard(0), Replicate()]``.

Real FSDP2 on top of a TP ``Shard(0)`` weight yields ``_StridedShard`` on the
dp dim (which objckpt rejects today); the plain nested ``Shard(0)`` layout is
what ``DTensor.redistribute`` gives and what is measured here.

Every world size runs in its own subprocess (clean peak RSS; a watchdog ends it
above ``--max-rss-gib``).  Per world it measures:

save
  * the per-rank metadata objckpt all-gathers (the payload of ``save()``'s
    first ``all_gather_object``: metas, tree, aliases, dtypes, ...): build time
    per rank (with torch's ``compute_local_shape_and_global_offset`` on a fake
    DeviceMesh, as ``objckpt.sharding.local_part`` does, and with this file's
    pure-Python equivalent), pickled bytes per rank, total, and the unpickle
    time of all ranks' payloads (what every rank does after the gather);
  * what ``planning.rank_plan.plan_for_rank`` (formerly ``api._plan_for_rank``) does on a cache miss, in pieces: the cache key
    (pickle + blake2b of all gathered metas, paid on hits too),
    ``assign_writes(metas)`` (``check_consistent`` separately) and
    ``plan_save`` of one rank's items (rank 0 and a middle rank);
  * every rank's chunk records (``plan_save`` for each rank, random crc32c,
    per-MiB block crcs for chunks over ``crc_block``), then the manifest JSON
    bytes and zstd bytes (``manifest.encode`` for small worlds; above
    ``--full-manifest-max-chunks`` the same JSON is streamed tensor by tensor,
    checked byte for byte against ``encode`` at the small worlds, then
    compressed as ``encode`` does), ``build_manifest`` + ``encode`` times where
    the whole manifest fits next to the gathered metadata; the records'
    pickled size and unpickle time (``save()``'s second ``all_gather_object``
    sends every rank's records to every rank).

load (target layout: ``--load-tp`` x (world * ``--load-ratio`` / load-tp))
  * ``manifest.decode`` of the compressed manifest (every loading rank does it);
  * per target rank (rank 0 and a middle rank), on the decoded manifest:
    ``check_coverage`` and ``ChunkIndex`` of every tensor
    (``engine.fill.fill_boxes`` builds both for every tensor a rank touches,
    i.e. all of them), ``ChunkIndex.overlapping`` for each of its boxes and
    ``plan_piece`` for each overlap.

dcp (``--dcp``, separate subprocess per world)
  * torch.distributed.checkpoint's ``DefaultSavePlanner.create_global_plan``
    on fake local plans with the same boxes (coordinator only), the pickled
    local plan per rank and the pickled ``Metadata``; per-rank load planning
    with ``create_read_items_for_chunk_list``.

Times are single runs (the large worlds take minutes), in CPU seconds of the
process by default (``--clock wall`` for perf_counter): the code measured is
single-threaded Python, and CPU time is robust to other processes and to
hypervisor steal on a shared machine.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import pickle
import platform
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

MiB = 1 << 20
GiB = 1 << 30

# objckpt's S3 defaults (api.save, storage.base.ObjectStore)
BLOB_SIZE = 1 << 30
PART_SIZE = 16 * MiB
CRC_BLOCK = 1 * MiB
MIN_PART = 5 * MiB
MAX_PART = 5 * GiB

Placement = tuple  # ("S", dim) or ("R",)
S0, S1, R = ("S", 0), ("S", 1), ("R",)
PLACEMENTS: dict[str, Optional[tuple[Placement, ...]]] = {
    "col": (S0, S0),  # q, k, v, gate, up, lm_head, embed (vocab-parallel)
    "row": (S0, S1),  # o, down
    "norm": (S0, R),  # RMSNorm weights
    "plain": None,  # Adam step: a plain 0-d tensor on every rank
}


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class TDef:
    key: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    kind: str


def llama_defs(layers: int = 80, hidden: int = 8192, heads: int = 64, kv_heads: int = 8, ffn: int = 28672,
               vocab: int = 128256) -> tuple[list[TDef], dict[str, Any]]:
    """Tensor definitions (state-dict keys as objckpt flattens them) and the nested state
    skeleton (tensor leaves are None) that ``save()`` would be given."""
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    params: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, hidden), "col")]
    for i in range(layers):
        p = f"model.layers.{i}."
        params += [
            (p + "self_attn.q_proj.weight", (hidden, hidden), "col"),
            (p + "self_attn.k_proj.weight", (kv, hidden), "col"),
            (p + "self_attn.v_proj.weight", (kv, hidden), "col"),
            (p + "self_attn.o_proj.weight", (hidden, hidden), "row"),
            (p + "mlp.gate_proj.weight", (ffn, hidden), "col"),
            (p + "mlp.up_proj.weight", (ffn, hidden), "col"),
            (p + "mlp.down_proj.weight", (hidden, ffn), "row"),
            (p + "input_layernorm.weight", (hidden,), "norm"),
            (p + "post_attention_layernorm.weight", (hidden,), "norm"),
        ]
    params += [("model.norm.weight", (hidden,), "norm"), ("lm_head.weight", (vocab, hidden), "col")]
    defs: list[TDef] = []
    model: dict[str, Any] = {}
    ostate: dict[str, Any] = {}
    for fqn, shape, kind in params:
        defs.append(TDef(f"model.{fqn}", shape, "bfloat16", 2, kind))
        model[fqn] = None
    for fqn, shape, kind in params:  # optimizer keys in the order get_state_dict gives them
        defs.append(TDef(f"optim.state.{fqn}.step", (), "float32", 4, "plain"))
        defs.append(TDef(f"optim.state.{fqn}.exp_avg", shape, "float32", 4, kind))
        defs.append(TDef(f"optim.state.{fqn}.exp_avg_sq", shape, "float32", 4, kind))
        ostate[fqn] = {"step": None, "exp_avg": None, "exp_avg_sq": None}
    group = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
             "foreach": None, "maximize": False, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": False, "params": [fqn for fqn, _, _ in params]}
    state = {"model": model, "optim": {"state": ostate, "param_groups": [group]}}
    return defs, state


def encoded_tree(state: dict[str, Any]) -> Any:
    """The JSON tree objckpt gathers and stores (tensor leaves -> {"$tensor": key})."""
    import torch

    from objckpt.format.tree import encode_tree

    leaf = torch.empty(0, device="meta")

    def fill(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: (leaf if v is None else fill(v)) for k, v in x.items()}
        if isinstance(x, list):
            return [fill(v) for v in x]
        return x

    return encode_tree(fill(state), lambda k, t: None)


# --------------------------------------------------------------------------- boxes


def local_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
              placements: Sequence[Placement]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local shape) of the shard at ``coord``: torch's
    ``compute_local_shape_and_global_offset`` for Shard/Replicate placements.

    Mesh dims shard left to right; each split is torch.chunk's (ceil-sized
    pieces, the last ones smaller or empty), relative to the piece left by the
    previous split of the same tensor dim.  An empty shard's offset on that dim
    is the dim's global size (torch returns ``arange(size, size + 1)[0]``).
    """
    local = list(global_shape)
    offs: dict[int, int] = {}
    for md, p in enumerate(placements):
        if p[0] != "S":
            continue
        d = p[1]
        n, r, cur = mesh_shape[md], coord[md], local[d]
        if cur % n == 0:
            size = cur // n
            start = size * r
        else:
            full = -(-cur // n)
            start = full * r
            size = max(0, min(cur, start + full) - start)
            start = min(cur, start)
        local[d] = size
        offs[d] = global_shape[d] if size == 0 else offs.get(d, 0) + start
    return tuple(offs.get(d, 0) for d in range(len(global_shape))), tuple(local)


def _torch_placements(pl: Sequence[Placement]) -> list:
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(p[1]) if p[0] == "S" else Replicate() for p in pl]


def verify_local_box(defs: list[TDef], big_mesh: tuple[int, int], sample_ranks: int = 8) -> dict[str, Any]:
    """Check ``local_box`` against torch: (1) exhaustively against the plain-data
    ``_compute_local_shape_and_global_offset`` on small meshes and awkward shapes;
    (2) against the public ``compute_local_shape_and_global_offset`` on a real
    DeviceMesh over the ``fake`` process group (every rank of two small meshes, and
    ``sample_ranks`` ranks of ``big_mesh`` on every tensor of the model)."""
    import itertools

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._utils import (
        _compute_local_shape_and_global_offset,
        compute_local_shape_and_global_offset,
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    n_plain = 0
    shapes = [(10, 6), (7, 5), (3, 9), (1, 4), (0, 3), (13, 2), (8, 8), (5,), (16, 3), (1,), (2, 17)]
    pls = [(S0, S0), (S0, S1), (S0, R), (R, S0), (S1, S0), (S1, S1), (R, R), (S1, R), (S0, S1)]
    for mesh in [(1, 1), (2, 2), (2, 3), (3, 2), (4, 2), (2, 4), (3, 5), (8, 8)]:
        for shape in shapes:
            for pl in pls:
                if any(p[0] == "S" and p[1] >= len(shape) for p in pl):
                    continue
                tpl = _torch_placements(pl)
                for coord in itertools.product(*(range(m) for m in mesh)):
                    ts, to = _compute_local_shape_and_global_offset(shape, mesh, list(coord), tpl)
                    mo, ms = local_box(shape, mesh, coord, pl)
                    assert (tuple(ts), tuple(to)) == (ms, mo), (shape, mesh, coord, pl, ts, to, ms, mo)
                    n_plain += 1

    def mesh_check(world: int, mesh: tuple[int, int], ranks: Sequence[int], cases: list[tuple[tuple, tuple]]) -> int:
        n = 0
        for rank in ranks:
            dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
            try:
                dm = init_device_mesh("cpu", mesh, mesh_dim_names=("dp", "tp"))
                coord = tuple(dm.get_coordinate())
                assert coord == (rank // mesh[1], rank % mesh[1])
                for shape, pl in cases:
                    ts, to = compute_local_shape_and_global_offset(shape, dm, _torch_placements(pl))
                    mo, ms = local_box(shape, mesh, coord, pl)
                    assert (tuple(ts), tuple(to)) == (ms, mo), (shape, mesh, rank, pl, ts, to, ms, mo)
                    n += 1
            finally:
                dist.destroy_process_group()
        return n

    small = [(s, pl) for s in [(10, 6), (7, 5), (3, 9), (13, 2)] for pl in [(S0, S0), (S0, S1), (S0, R)]]
    n_mesh = mesh_check(8, (2, 4), range(8), small) + mesh_check(12, (4, 3), range(12), small)
    model_cases = sorted({(d.shape, PLACEMENTS[d.kind]) for d in defs if PLACEMENTS[d.kind] is not None})
    world = big_mesh[0] * big_mesh[1]
    rng = random.Random(0)
    ranks = sorted({0, world - 1, world // 2, world // 2 + big_mesh[1] - 1} | {rng.randrange(world) for _ in range(sample_ranks)})
    n_model = mesh_check(world, big_mesh, ranks, model_cases)
    return {"plain_data_cases": n_plain, "fake_mesh_cases": n_mesh, "model_cases": n_model,
            "model_mesh": list(big_mesh), "model_ranks": ranks, "ok": True}


# --------------------------------------------------------------------------- helpers


def _rss() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _hwm() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _watchdog(limit: int) -> None:
    def run() -> None:
        while True:
            rss = _rss()
            if rss > limit:
                print(json.dumps({"error": f"rss {rss / GiB:.1f} GiB above the {limit / GiB:.1f} GiB limit"}),
                      flush=True)
                os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=run, daemon=True).start()


#: the clock every measurement uses: CPU seconds of this process by default (the
#: planning code is single-threaded Python, so on an idle machine CPU == wall; on a
#: shared or oversubscribed one CPU time leaves out other processes and steal).
_clock = time.process_time


def set_clock(name: str) -> None:
    global _clock
    _clock = time.process_time if name == "cpu" else time.perf_counter


class Timer:
    def __init__(self) -> None:
        self.t = 0.0

    def __enter__(self) -> "Timer":
        self._t0 = _clock()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.t += _clock() - self._t0


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- objckpt save side


def rank_metas(defs: list[TDef], mesh: tuple[int, int], rank: int) -> dict:
    """What ``api._collect_local`` reports for one rank: key -> TensorMeta (fresh
    tuples per tensor, as ``sharding.local_part`` builds them)."""
    from objckpt.planning.shard import TensorMeta

    coord = (rank // mesh[1], rank % mesh[1])
    out = {}
    for d in defs:
        pl = PLACEMENTS[d.kind]
        if pl is None:
            box = (tuple(0 for _ in d.shape), tuple(list(d.shape)))
        else:
            box = local_box(d.shape, mesh, coord, pl)
        out[d.key] = TensorMeta(d.dtype, tuple(list(d.shape)), d.itemsize, (box,))
    return out


def rank_metas_torch(defs: list[TDef], mesh: tuple[int, int], rank: int) -> tuple[dict, float]:
    """The same with torch's own function on a fake DeviceMesh (what a real rank runs);
    returns (metas, seconds spent computing them, mesh set-up excluded)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from objckpt.planning.shard import TensorMeta
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = mesh[0] * mesh[1]
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        dm = init_device_mesh("cpu", mesh, mesh_dim_names=("dp", "tp"))
        tpls = {k: (_torch_placements(v) if v is not None else None) for k, v in PLACEMENTS.items()}
        out = {}
        t0 = _clock()
        for d in defs:
            pl = tpls[d.kind]
            if pl is None:
                box = (tuple(0 for _ in d.shape), tuple(d.shape))
            else:
                shape, offsets = compute_local_shape_and_global_offset(d.shape, dm, pl)
                box = (tuple(int(o) for o in offsets), tuple(int(s) for s in shape))
            out[d.key] = TensorMeta(d.dtype, tuple(int(x) for x in d.shape), d.itemsize, (box,))
        return out, _clock() - t0
    finally:
        dist.destroy_process_group()


class _Store:
    """Just the limits ``_plan_for_rank`` reads from a store (S3's)."""

    min_part_size = MIN_PART
    max_part_size = MAX_PART


def _objckpt_fns() -> dict[str, Any]:
    """The objckpt functions measured, wherever this version keeps them."""
    try:  # since the split of api.py
        from objckpt.engine.commit import build_manifest
        from objckpt.engine.fill import check_coverage
        from objckpt.planning import rank_plan

        return {"build_manifest": build_manifest, "check_coverage": check_coverage,
                "plan_for_rank": rank_plan.plan_for_rank, "plan_cache": rank_plan._PLAN_CACHE,
                "metas_itemsize": rank_plan.metas_itemsize}
    except ImportError:
        from objckpt import api

        return {"build_manifest": api._build_manifest, "check_coverage": api._check_coverage,
                "plan_for_rank": api._plan_for_rank, "plan_cache": api._PLAN_CACHE,
                "metas_itemsize": api.metas_itemsize}


def specs_for(items: list, metas: list) -> list:
    from objckpt.planning.pack import TensorSpec

    metas_itemsize = _objckpt_fns()["metas_itemsize"]

    return [TensorSpec(f"{it.key}\x00{i}", tuple(it.shape), metas_itemsize(metas, it.key)) for i, it in enumerate(items)]


def plan_rank(items: list, metas: list):
    from objckpt.planning.pack import plan_save

    return plan_save(specs_for(items, metas), blob_bytes=BLOB_SIZE, part_bytes=max(PART_SIZE, MIN_PART),
                     chunk_bytes=PART_SIZE, max_part_bytes=MAX_PART)


def chunk_records(items: list, plan: Any, rng: random.Random) -> list[tuple]:
    """What ``save()`` sends in its second all_gather: (key, offsets, shape, blob, offset,
    length, crc32c, block crcs) per chunk, crcs random."""
    where = {f"{it.key}\x00{i}": (it.key, it.offsets) for i, it in enumerate(items)}
    out = []
    for c in plan.chunks:
        key, base = where[c.key]
        offs = tuple(b + o for b, o in zip(base, c.offsets))
        nb = -(-c.length // CRC_BLOCK) if c.length > CRC_BLOCK else 0
        blocks = tuple(rng.getrandbits(32) for _ in range(nb))
        out.append((key, offs, c.shape, c.blob, c.offset, c.length, rng.getrandbits(32), blocks))
    return out


def stream_manifest(header: dict[str, Any], tensors: Any, tree: Any, crc_block: int, zc: Any) -> tuple[int, int]:
    """JSON bytes (as ``manifest.encode`` writes them) and zstd bytes of a manifest
    whose tensor entries (key, json-able dict) come from the iterator ``tensors``."""
    dumps = lambda o: json.dumps(o, separators=(",", ":"), allow_nan=False)  # noqa: E731
    raw = 0
    comp = 0

    def put(s: str) -> None:
        nonlocal raw, comp
        b = s.encode()
        raw += len(b)
        comp += len(zc.compress(b))

    put(dumps(header)[:-1] + ',"tensors":{')
    first = True
    for k, d in tensors:
        put(("" if first else ",") + dumps(k) + ":" + dumps(d))
        first = False
    tail = '},"tree":' + dumps(tree)
    if crc_block:
        tail += ',"crc_block":' + str(crc_block)
    put(tail + "}")
    comp += len(zc.flush())
    return raw, comp


def run_objckpt(world: int, args: argparse.Namespace) -> dict[str, Any]:
    import zstandard

    from objckpt import __version__ as objckpt_version
    from objckpt.format import layout
    from objckpt.format.manifest import Chunk, _chunk_to_json, decode, encode
    from objckpt.planning.shard import assign_writes, check_consistent

    fns = _objckpt_fns()
    res: dict[str, Any] = {"world": world}
    defs, state = llama_defs()
    tp = args.tp
    mesh = (world // tp, tp)
    res["mesh"] = list(mesh)
    res["tensors"] = len(defs)
    res["params"] = sum(math.prod(d.shape) for d in defs if d.key.startswith("model."))
    res["state_bytes"] = sum(math.prod(d.shape) * d.itemsize for d in defs)
    tree = encoded_tree(state)
    dtypes = {d.key: d.dtype for d in defs}
    attempt = layout.new_attempt_id()
    mid = world // 2 + tp // 2  # a rank in the middle of the mesh, mid-way along tp
    sample = [0, mid]

    # -- 1. per-rank metadata: build, pickle, unpickle (what all_gather_object does)
    t_build, t_pickle, t_unpickle = Timer(), Timer(), Timer()
    sizes = []
    metas: list[dict] = []
    for r in range(world):
        with t_build:
            m = rank_metas(defs, mesh, r)
            payload = (m, tree, {}, dtypes, False, attempt if r == 0 else "", None)
        with t_pickle:
            blob = pickle.dumps(payload)
        sizes.append(len(blob))
        with t_unpickle:
            got = pickle.loads(blob)
        metas.append(got[0])
        del blob, got, payload, m
    for r in sample:  # the harness's boxes are torch's boxes
        tm, _ = rank_metas_torch(defs, mesh, r)
        assert tm == metas[r], f"rank {r}: torch boxes differ"
    _, t_torch = rank_metas_torch(defs, mesh, 0)
    res["meta"] = {
        "build_s_per_rank_python": t_build.t / world,
        "build_s_per_rank_torch_fn": t_torch,
        "pickle_s_per_rank": t_pickle.t / world,
        "unpickle_s_all_ranks": t_unpickle.t,
        "bytes_per_rank_mean": sum(sizes) / world,
        "bytes_per_rank_max": max(sizes),
        "bytes_total": sum(sizes),
        "bytes_moved_per_rank_padded": max(sizes) * world,  # all_gather_object pads to the largest
        "boxes_total": sum(len(t.boxes) for m in metas for t in m.values()),
        "rss_after_gather": _rss(),
    }
    _log(f"world {world}: metadata built ({sum(sizes) / MiB:.1f} MiB pickled), rss {_rss() / GiB:.2f} GiB")

    # -- 2. save planning, as _plan_for_rank does on a cache miss
    limits = (0, BLOB_SIZE, PART_SIZE, MIN_PART, MAX_PART)
    with Timer() as t_digest:
        hashlib.blake2b(pickle.dumps((metas, limits)), digest_size=20).digest()
    with Timer() as t_check:
        check_consistent(metas)
    with Timer() as t_assign:
        out = assign_writes(metas)
    save = {"cache_key_s": t_digest.t, "check_consistent_s": t_check.t, "assign_writes_s": t_assign.t,
            "write_items_total": sum(len(o) for o in out), "ranks": {}}
    for r in sample:
        with Timer() as t_specs:
            specs = specs_for(out[r], metas)
        from objckpt.planning.pack import plan_save

        with Timer() as t_pack:
            plan = plan_save(specs, blob_bytes=BLOB_SIZE, part_bytes=max(PART_SIZE, MIN_PART), chunk_bytes=PART_SIZE,
                             max_part_bytes=MAX_PART)
        save["ranks"][r] = {"items": len(out[r]), "specs_s": t_specs.t, "plan_save_s": t_pack.t,
                            "chunks": len(plan.chunks), "blobs": len(plan.blobs),
                            "bytes": sum(b.size for b in plan.blobs)}
    save["per_rank_s"] = t_assign.t + max(v["specs_s"] + v["plan_save_s"] for v in save["ranks"].values())
    save["per_rank_s_with_cache_key"] = save["per_rank_s"] + t_digest.t
    if world <= args.plan_for_rank_max_world:  # the real function, once, cache cleared
        fns["plan_cache"].clear()
        with Timer() as t_pfr:
            items, plan = fns["plan_for_rank"](metas, 0, _Store(), BLOB_SIZE, PART_SIZE)
        save["plan_for_rank_miss_s"] = t_pfr.t
        with Timer() as t_hit:
            fns["plan_for_rank"](metas, 0, _Store(), BLOB_SIZE, PART_SIZE)
        save["plan_for_rank_hit_s"] = t_hit.t
        fns["plan_cache"].clear()
        del items, plan
    save["rss_after_assign"] = _rss()
    res["save"] = save
    _log(f"world {world}: assign_writes {t_assign.t:.2f}s (check {t_check.t:.2f}s, key {t_digest.t:.2f}s), "
         f"rss {_rss() / GiB:.2f} GiB")

    # -- 3. every rank's chunk records (the second all_gather_object) -> manifest
    rng = random.Random(world)
    t_rpickle, t_runpickle = Timer(), Timer()
    rec_sizes = []
    with Timer() as t_all_pack:
        results = []
        for r in range(world):
            plan = plan_rank(out[r], metas)
            recs = chunk_records(out[r], plan, rng)
            names = [layout.blob_name(attempt, r, b.index) for b in plan.blobs]
            mine = (recs, [(n, b.size) for n, b in zip(names, plan.blobs)], None)
            with t_rpickle:
                blob = pickle.dumps(mine)
            rec_sizes.append(len(blob))
            with t_runpickle:
                results.append(pickle.loads(blob))
            del blob, mine, recs
            out[r] = None  # type: ignore[call-overload]
    del out
    n_chunks = sum(len(x[0]) for x in results)
    man: dict[str, Any] = {"chunks": n_chunks, "blobs": sum(len(x[1]) for x in results),
                           "plan_save_all_ranks_s": t_all_pack.t - t_rpickle.t - t_runpickle.t,
                           "chunks_with_block_crcs": sum(1 for x in results for c in x[0] if c[7]),
                           "block_crcs": sum(len(c[7]) for x in results for c in x[0]),
                           "empty_chunks": sum(1 for x in results for c in x[0] if c[5] == 0),
                           "records_pickled_bytes_per_rank_mean": sum(rec_sizes) / world,
                           "records_pickled_bytes_total": sum(rec_sizes),
                           "records_unpickle_s_all_ranks": t_runpickle.t}
    _log(f"world {world}: {n_chunks} chunks, rss {_rss() / GiB:.2f} GiB")

    full = n_chunks <= args.full_manifest_max_chunks
    want_decode = n_chunks <= args.decode_max_chunks
    m = None
    data = b""
    if full:
        gathered = [(metas[r], tree, {}, dtypes, False, attempt, None) for r in range(world)]
        with Timer() as t_bm:
            m = fns["build_manifest"](gathered, results, attempt, {}, CRC_BLOCK, world)
        del gathered
        man["build_manifest_s"] = t_bm.t
        with Timer() as t_enc:
            data = encode(m)
        man["encode_s"] = t_enc.t
        raw_json = encode(m, compress=False)
        man["json_bytes_encode"] = len(raw_json)
        man["zstd_bytes_encode"] = len(data)
        del raw_json
    del metas
    gc.collect()

    # The same JSON streamed tensor by tensor (exact: checked against encode() when both
    # run), so the large worlds need not hold metas, Chunk objects and JSON dicts at once.
    by_key: dict[str, list] = {d.key: [] for d in defs}
    blobs_meta = []
    for rank, (recs, rblobs, _) in enumerate(results):
        base = len(blobs_meta)
        blobs_meta.extend({"name": n, "size": s, "rank": rank} for n, s in rblobs)
        for key, offs, shape, b, off, length, total, blocks in recs:
            by_key[key].append((tuple(offs), tuple(shape), base + b, off, length, total, tuple(blocks)))
        results[rank] = None  # type: ignore[call-overload]
    del results
    gc.collect()
    header = {"format": "objckpt", "format_version": 1, "writer": m.writer if m else f"objckpt {objckpt_version}",
              "created": m.created if m else time.time(), "attempt": attempt, "world_size": world,
              "metadata": {}, "blobs": blobs_meta}
    dtype_of = {d.key: d for d in defs}
    keep = want_decode and not full
    pieces: list[bytes] = []

    class _Keep:  # streamed zstd, and the raw pieces when they are decoded afterwards
        def __init__(self) -> None:
            self.z = zstandard.ZstdCompressor(level=3).compressobj()

        def compress(self, b: bytes) -> bytes:
            if keep:
                pieces.append(b)
            return self.z.compress(b)

        def flush(self) -> bytes:
            return self.z.flush()

    def entries():
        for key in by_key:
            d = dtype_of[key]
            recs = by_key[key]
            recs.sort(key=lambda c: c[0])
            yield key, {"dtype": d.dtype, "shape": list(d.shape),
                        "chunks": [_chunk_to_json(Chunk(*c)) for c in recs]}
            by_key[key] = []

    with Timer() as t_stream:
        raw, comp = stream_manifest(header, entries(), tree, CRC_BLOCK, _Keep())
    by_key.clear()
    man["json_bytes"] = raw
    man["zstd_bytes_streamed"] = comp
    if full:
        assert raw == man["json_bytes_encode"], (raw, man["json_bytes_encode"])
        man["zstd_bytes"] = man["zstd_bytes_encode"]
    man["json_bytes_per_chunk"] = raw / max(n_chunks, 1)
    man["stream_s"] = t_stream.t
    if keep:  # encode()'s compression of exactly this JSON, then decode it as a loader would
        raw_json = b"".join(pieces)
        pieces.clear()
        assert len(raw_json) == raw
        with Timer() as t_z:
            data = zstandard.ZstdCompressor(level=3).compress(raw_json)
        man["zstd_bytes"] = len(data)
        man["zstd_compress_s"] = t_z.t
        with Timer() as t_parse:
            json.loads(raw_json)
        man["json_loads_s"] = t_parse.t
        del raw_json
    elif full:
        with Timer() as t_parse:
            json.loads(zstandard.ZstdDecompressor().decompress(data, max_output_size=1 << 34))
        man["json_loads_s"] = t_parse.t
    else:
        man["zstd_bytes"] = comp
    del m
    gc.collect()
    _log(f"world {world}: manifest {raw / 1e6:.1f} MB JSON, {man['zstd_bytes'] / 1e6:.1f} MB zstd, "
         f"rss {_rss() / GiB:.2f} GiB")

    # -- 4. load: decode (every loading rank does), then what fill_boxes plans per rank
    ltp = args.load_tp
    lworld = max(ltp, int(world * args.load_ratio))
    lmesh = (lworld // ltp, ltp)
    lsample = [0, lworld // 2 + ltp // 2]
    load: dict[str, Any] = {"world": lworld, "mesh": list(lmesh), "ranks": {}}
    if data:
        gc0 = sum(s["collections"] for s in gc.get_stats())
        with Timer() as t_dec:
            m2 = decode(data)
        man["decode_s"] = t_dec.t
        man["decode_gc_collections"] = sum(s["collections"] for s in gc.get_stats()) - gc0
        man["rss_after_decode"] = _rss()
        del data
        assert len(m2.tensors) == len(defs)
        for r in lsample:
            load["ranks"][r] = plan_load_rank(m2, defs, lmesh, r, fns["check_coverage"])
        del m2
        gc.collect()
        load["per_rank_s"] = max(v["per_rank_s"] for v in load["ranks"].values())
        load["per_rank_queries_only_s"] = max(v["overlapping_s"] + v["plan_piece_s"] for v in load["ranks"].values())
        load["per_rank_with_decode_s"] = load["per_rank_s"] + man["decode_s"]
    res["manifest"] = man
    res["load"] = load
    res["peak_rss"] = _hwm()
    return res


def plan_load_rank(m: Any, defs: list[TDef], lmesh: tuple[int, int], rank: int, check_coverage: Any) -> dict[str, Any]:
    """What ``engine.fill.fill_boxes`` computes before any read, for one target rank
    holding one box of every tensor: per tensor check_coverage + ChunkIndex (built for
    every key the rank touches), overlapping(box), plan_piece per overlap."""
    from objckpt.planning.reshard import ChunkIndex, plan_piece

    ltp = lmesh[1]
    coord = (rank // ltp, rank % ltp)
    st = {"boxes": 0, "overlaps": 0, "ranges": 0, "fetch_bytes": 0, "want_bytes": 0}
    t_cov = t_idx = t_ov = t_pp = 0.0
    gc0 = sum(s["collections"] for s in gc.get_stats())
    for d in defs:
        pl = PLACEMENTS[d.kind]
        box = (tuple(0 for _ in d.shape), tuple(d.shape)) if pl is None else local_box(d.shape, lmesh, coord, pl)
        entry = m.tensors[d.key]
        t0 = _clock()
        check_coverage(entry)
        t1 = _clock()
        index = ChunkIndex(entry.chunks)
        t2 = _clock()
        ov = index.overlapping(box)
        t3 = _clock()
        pieces = [plan_piece(c, inter, d.itemsize, m.crc_block, True) for c, inter in ov]
        t4 = _clock()
        t_cov += t1 - t0
        t_idx += t2 - t1
        t_ov += t3 - t2
        t_pp += t4 - t3
        st["boxes"] += 1
        st["overlaps"] += len(ov)
        st["ranges"] += sum(len(p.ranges) for p in pieces)
        st["fetch_bytes"] += sum(e - s for p in pieces for s, e in p.ranges)
        st["want_bytes"] += math.prod(box[1]) * d.itemsize
    st.update({"check_coverage_all_s": t_cov, "index_all_s": t_idx, "overlapping_s": t_ov, "plan_piece_s": t_pp,
               "per_rank_s": t_cov + t_idx + t_ov + t_pp,
               "gc_collections": sum(s["collections"] for s in gc.get_stats()) - gc0})
    return st


# --------------------------------------------------------------------------- DCP


def run_dcp(world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    res: dict[str, Any] = {"world": world}
    defs, state = llama_defs()
    tp = args.tp
    mesh = (world // tp, tp)
    dts = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    # non-tensor leaves DCP flattens into BYTE_IO items (param_groups values)
    group = state["optim"]["param_groups"][0]
    byte_keys = [f"optim.param_groups.0.{k}" for k in group]
    mapping = {d.key: tuple(d.key.split(".")) for d in defs}
    mapping.update({k: tuple(k.split(".")) for k in byte_keys})

    def local_plan(rank: int) -> SavePlan:
        coord = (rank // tp, rank % tp)
        items = []
        for d in defs:
            pl = PLACEMENTS[d.kind]
            props = TensorProperties(dtype=dts[d.dtype])
            if pl is None:
                offs = torch.Size([0] * len(d.shape))
                items.append(WriteItem(index=MetadataIndex(d.key, offs), type=WriteItemType.TENSOR,
                                       tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offs, torch.Size(d.shape)),
                                                                   properties=props, size=torch.Size(d.shape))))
                continue
            o, s = local_box(d.shape, mesh, coord, pl)
            offs = torch.Size(o)
            items.append(WriteItem(index=MetadataIndex(d.key, offs), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offs, torch.Size(s)),
                                                               properties=props, size=torch.Size(d.shape))))
        for k in byte_keys:
            items.append(WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO))
        return SavePlan(items, planner_data=dict(mapping))

    t_build, t_pickle, t_unpickle = Timer(), Timer(), Timer()
    sizes = []
    plans = []
    for r in range(world):
        with t_build:
            p = local_plan(r)
        with t_pickle:
            b = pickle.dumps(p)
        sizes.append(len(b))
        with t_unpickle:
            plans.append(pickle.loads(b))
        del b, p
    res["local_plan"] = {"build_s_per_rank": t_build.t / world, "pickled_bytes_per_rank": sizes[0],
                         "pickled_bytes_total": sum(sizes), "unpickle_s_all_ranks": t_unpickle.t}
    _log(f"dcp world {world}: local plans built, rss {_rss() / GiB:.2f} GiB")
    planner = DefaultSavePlanner()
    with Timer() as t_global:
        global_plan, md = planner.create_global_plan(plans)
    del plans
    res["create_global_plan_s"] = t_global.t
    res["items_after_dedup"] = sum(len(p.items) for p in global_plan)
    with Timer() as t_mdp:
        mdb = pickle.dumps(md)
    res["metadata_pickled_bytes"] = len(mdb)
    res["metadata_pickle_s"] = t_mdp.t
    with Timer() as t_mdu:
        md = pickle.loads(mdb)
    res["metadata_unpickle_s"] = t_mdu.t
    del mdb, global_plan
    # load: per target rank, DCP's resharding for each of its boxes
    ltp = args.load_tp
    lworld = max(ltp, int(world * args.load_ratio))
    lmesh = (lworld // ltp, ltp)
    load = {}
    for r in [0, lworld // 2 + ltp // 2]:
        coord = (r // ltp, r % ltp)
        n = 0
        with Timer() as t_load:
            for d in defs:
                pl = PLACEMENTS[d.kind]
                o, s = ((tuple(0 for _ in d.shape), d.shape) if pl is None else local_box(d.shape, lmesh, coord, pl))
                tmd = md.state_dict_metadata[d.key]
                n += len(create_read_items_for_chunk_list(d.key, tmd, [ChunkStorageMetadata(torch.Size(o), torch.Size(s))]))
        load[r] = {"s": t_load.t, "read_items": n}
    res["load"] = {"world": lworld, "ranks": load, "per_rank_s": max(v["s"] for v in load.values())}
    assert not any(isinstance(v, BytesStorageMetadata) for k, v in md.state_dict_metadata.items() if k in mapping
                   and k not in byte_keys)
    res["peak_rss"] = _hwm()
    return res


# --------------------------------------------------------------------------- driver


def _child(args: argparse.Namespace) -> None:
    set_clock(args.clock)
    _watchdog(int(args.max_rss_gib * GiB))
    fn = run_dcp if args.child == "dcp" else run_objckpt
    t0 = time.perf_counter()
    res = fn(args.world, args)
    res["wall_s"] = time.perf_counter() - t0
    print(json.dumps(res, default=str), flush=True)


def _spawn(kind: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.bench_planning", "--child", kind, "--world", str(world),
           "--tp", str(args.tp), "--clock", args.clock, "--load-tp", str(args.load_tp), "--load-ratio", str(args.load_ratio),
           "--max-rss-gib", str(args.max_rss_gib),
           "--full-manifest-max-chunks", str(args.full_manifest_max_chunks),
           "--decode-max-chunks", str(args.decode_max_chunks),
           "--plan-for-rank-max-world", str(args.plan_for_rank_max_world)]
    _log(f"{kind} world {world}: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"world": world, "error": f"not reached: over the {args.timeout:.0f} s limit"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"world": world, "error": f"exit {p.returncode}, no result"}
    res = json.loads(lines[-1])
    res.setdefault("world", world)
    res["process_wall_s"] = time.perf_counter() - t0
    return res


def _fmt_s(x: Optional[float]) -> str:
    return "-" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def table(rows: list[dict[str, Any]], dcp: dict[int, dict[str, Any]]) -> str:
    cols = ["world (dp x tp)", "tensors", "boxes gathered", "chunks", "save plan s/rank: assign_writes + plan_save",
            "cache key s/rank", "unpickle gathered metadata s/rank", "metadata kB/rank (pickled)",
            "metadata MB total (each rank receives)", "manifest JSON MB", "zstd MB", "build_manifest + encode s (rank 0)",
            "load world (dp x tp)", "decode s/rank", "load plan s/rank: coverage+index + queries", "peak RSS GiB",
            "DCP create_global_plan s (rank 0 only)", "DCP load plan s/rank"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        w = r["world"]
        d = dcp.get(w, {})
        if "error" in r:
            out.append(f"| {w} | {r['error']} |" + " |" * (len(cols) - 2))
            continue
        s, m, ld, mt = r["save"], r["manifest"], r["load"], r["meta"]
        pk = max(v["specs_s"] + v["plan_save_s"] for v in s["ranks"].values())
        lr = max(ld.get("ranks", {}).values(), key=lambda v: v["per_rank_s"], default=None)
        enc = (f"{_fmt_s(m['build_manifest_s'])} + {_fmt_s(m['encode_s'])}" if "encode_s" in m else "-")
        cells = [
            f"{w} ({r['mesh'][0]}x{r['mesh'][1]})", str(r["tensors"]), f"{mt['boxes_total']:,}", f"{m['chunks']:,}",
            f"{_fmt_s(s['per_rank_s'])} ({_fmt_s(s['assign_writes_s'])} + {pk:.3f})", _fmt_s(s["cache_key_s"]),
            _fmt_s(mt["unpickle_s_all_ranks"]), f"{mt['bytes_per_rank_mean'] / 1e3:.0f}",
            f"{mt['bytes_total'] / 1e6:.0f}", f"{m['json_bytes'] / 1e6:.1f}", f"{m['zstd_bytes'] / 1e6:.1f}", enc,
            f"{ld['world']} ({ld['mesh'][0]}x{ld['mesh'][1]})", _fmt_s(m.get("decode_s")),
            "-" if lr is None else (f"{_fmt_s(lr['per_rank_s'])} ({_fmt_s(lr['check_coverage_all_s'] + lr['index_all_s'])}"
                                    f" + {lr['overlapping_s'] + lr['plan_piece_s']:.3f})"),
            f"{r['peak_rss'] / GiB:.1f}", _fmt_s(d.get("create_global_plan_s")),
            _fmt_s(d.get("load", {}).get("per_rank_s")),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description="objckpt planning cost at scale (no I/O), one subprocess per world")
    ap.add_argument("--worlds", default="64,256,1024,4096")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--load-tp", type=int, default=4)
    ap.add_argument("--load-ratio", type=float, default=0.5, help="load world = save world x this")
    ap.add_argument("--dcp", default="64,256,1024", help="worlds for the DCP comparison ('' for none)")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: process CPU seconds (robust on a shared machine); wall: perf_counter")
    ap.add_argument("--max-rss-gib", type=float, default=16.0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per world subprocess")
    ap.add_argument("--full-manifest-max-chunks", type=int, default=2_000_000,
                    help="above this, the manifest is streamed instead of built whole (encode/decode not timed)")
    ap.add_argument("--decode-max-chunks", type=int, default=8_000_000,
                    help="above this, the manifest is not decoded and the load side not measured")
    ap.add_argument("--plan-for-rank-max-world", type=int, default=1024,
                    help="also time plan_for_rank itself (miss and hit) up to this world")
    ap.add_argument("--no-verify", dest="verify", action="store_false", help="skip the box check against torch")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    ap.add_argument("--child", choices=["objckpt", "dcp"], help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return
    worlds = [int(w) for w in args.worlds.split(",") if w]
    dcp_worlds = [int(w) for w in args.dcp.split(",") if w]
    set_clock(args.clock)
    report: dict[str, Any] = {"argv": sys.argv, "clock": args.clock, "python": platform.python_version(), "cpus": os.cpu_count(),
                              "machine": platform.machine()}
    try:
        import torch

        report["torch"] = torch.__version__
    except ImportError:
        pass
    if args.verify:
        defs, _ = llama_defs()
        big = max(worlds)
        report["verify_boxes"] = verify_local_box(defs, (big // args.tp, args.tp))
        _log(f"boxes match torch: {report['verify_boxes']}")
    rows, dcp = [], {}
    for w in worlds:
        r = _spawn("objckpt", w, args)
        rows.append(r)
        _log(json.dumps(r, default=str)[:2000])
    for w in dcp_worlds:
        d = _spawn("dcp", w, args)
        dcp[w] = d
        _log(json.dumps(d, default=str)[:2000])
    report["objckpt"] = rows
    report["dcp"] = list(dcp.values())
    report["table"] = table(rows, dcp)
    print(report["table"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
