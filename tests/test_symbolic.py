"""Symbolic layouts and format v2: pure rules against torch and brute force, then real ranks."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import objckpt
from objckpt.errors import CorruptCheckpointError
from objckpt.format import manifest as mf
from objckpt.format import tables
from objckpt.format.manifest import Mesh, ShardSpec
from objckpt.planning.symbolic import TensorDesc, assign_shard_specs, cell_box, my_pieces, overlapping_pieces

from mp import run_multiprocess


# --------------------------------------------------------------------------- pure rules


@st.composite
def layouts(draw: Any) -> tuple[tuple[int, ...], Mesh, tuple[str, ...]]:
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    mshape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    n = math.prod(mshape)
    ranks = tuple(draw(st.permutations(range(n))))
    choices = ["R"] + [f"S{d}" for d in range(ndim)]
    placements = tuple(draw(st.sampled_from(choices)) for _ in mshape)
    return shape, Mesh(mshape, ranks), placements


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_cell_box_is_torchs_rule(case: Any) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape, mesh, placements = case
    tp = [Replicate() if p == "R" else Shard(int(p[1:])) for p in placements]
    for flat in range(len(mesh.ranks)):
        coord = mesh.coordinate(mesh.ranks[flat])
        assert coord is not None
        lshape, goff = _compute_local_shape_and_global_offset(shape, mesh.shape, list(coord), tp)
        offs, lens = cell_box(shape, mesh.shape, placements, coord)
        assert tuple(lens) == tuple(lshape)
        if math.prod(lens):  # torch puts empty shards at odd offsets; nothing is stored for them
            assert tuple(offs) == tuple(goff)


@settings(max_examples=300, deadline=None)
@given(layouts(), st.integers(1, 5), st.integers(0, 7), st.data())
def test_pieces_tile_once_and_overlap_query_matches_brute_force(case: Any, split: int, rot: int, data: Any) -> None:
    shape, mesh, placements = case
    lay = ShardSpec(0, placements, split, rot)
    written = {r: my_pieces(shape, mesh, lay, r) for r in mesh.ranks}
    vol = sum(math.prod(p[1]) if p[1] else 1 for ps in written.values() for p in ps)
    assert vol == (math.prod(shape) if shape else 1)  # every element written exactly once (no overlap below)
    box_off = tuple(data.draw(st.integers(0, n)) for n in shape)
    box_shape = tuple(data.draw(st.integers(0, n - o)) for n, o in zip(shape, box_off))
    box = (box_off, box_shape)
    got = sorted((r, p) for r, p, _ in overlapping_pieces(shape, mesh, lay, box))
    brute = []
    for r, ps in written.items():
        for p in ps:
            inside = all(max(a, b) < min(a + m, b + n) for a, m, b, n in zip(p[0], p[1], box_off, box_shape))
            if inside and (math.prod(box_shape) if shape else 1):
                brute.append((r, p))
    assert got == sorted(brute)


def test_assign_shard_specs_splits_big_replicated_and_spreads_small() -> None:
    world = Mesh((16,), tuple(range(16)))
    descs = [TensorDesc("big", (1024, 1024), 4, 0, ("R",))]
    descs += [TensorDesc(f"small{i}", (100, 256), 4, 0, ("R",)) for i in range(16)]  # 100 KiB: spread
    descs += [TensorDesc(f"tiny{i}", (10,), 4, 0, ("R",)) for i in range(5)]  # all on slot 0
    lays = assign_shard_specs(descs, [world])
    assert lays["big"].split == 16
    assert sorted(lays[f"small{i}"].rot for i in range(16)) == sorted(list(range(8)) * 2)  # first 8 slots
    assert all(lays[f"tiny{i}"].rot == 0 for i in range(5))
    per_rank = {r: sum(math.prod(p[1]) for d in descs for p in my_pieces(d.shape, world, lays[d.key], r))
                for r in range(16)}
    assert sum(per_rank.values()) == 1024 * 1024 + 16 * 25600 + 50  # each element written once
    assert max(per_rank.values()) <= 1024 * 1024 // 16 + 2 * 25600 + 50


def _v2_manifest() -> mf.Manifest:
    mesh = Mesh((2, 2), (0, 1, 2, 3))
    t = mf.TensorEntry("w", "float32", (8, 4), layout=ShardSpec(0, ("S0", "R"), 2, 1))
    refs = [mf.RankIndexRef(f"blobs/a/r{r:05d}.index.json", 10 + r, r) for r in range(4)]
    return mf.Manifest({"w": t}, [mf.Blob("blobs/a/r00000-0000.bin", 64, 0)], {"w": {"__tensor__": "w"}},
                       attempt="a", world_size=4, meshes=[mesh], rank_indexes=refs, format_version=2)


def test_manifest_v2_round_trip_and_checks() -> None:
    import jsonschema

    m = _v2_manifest()
    data = mf.encode(m)
    schema = json.loads((Path(mf.__file__).with_name("manifest.schema.json")).read_text())
    jsonschema.Draft202012Validator(schema).validate(json.loads(data))
    back = mf.decode(data)
    assert back.format_version == 5 and back.meshes == m.meshes and back.rank_indexes == m.rank_indexes
    assert isinstance(json.loads(data)["rank_indexes"], dict)  # v5: a table of packed columns
    assert back.tensors["w"].layout == m.tensors["w"].layout and not back.tensors["w"].chunks
    obj = json.loads(data)
    for bad, what in [
        (lambda o: o["tensors"]["w"]["layout"].update(mesh=1), "layout malformed"),
        (lambda o: o["tensors"]["w"]["layout"].update(placements=["S2", "R"]), "placement"),
        (lambda o: o["tensors"]["w"]["layout"].update(placements=["R"]), "placements do not match"),
        (lambda o: o["meshes"][0].update(ranks=[0, 1, 2]), "mesh #0"),
        (lambda o: o["meshes"][0].update(ranks=[0, 1, 2, 9]), "rank >= world_size"),
        (lambda o: o.update(rank_indexes=tables.encode_indexes(m.rank_indexes[:3], "a")), "rank indexes"),
        (lambda o: o.update(format_version=1), "v2 tables in a v1 manifest"),
        (lambda o: [o.update(format_version=1, blobs=[{"name": "blobs/a/r00000-0000.bin", "size": 64, "rank": 0}]),
                    o.pop("meshes"), o.pop("rank_indexes")], "needs format v2"),
    ]:
        o = json.loads(json.dumps(obj))
        bad(o)
        with pytest.raises(CorruptCheckpointError, match=what):
            mf.decode(json.dumps(o).encode())


def test_rank_index_round_trip_and_checks() -> None:
    from objckpt.format import rank_index
    from objckpt.format.manifest import Chunk, ChunkRecord

    def rec(key: str, *fields: Any) -> ChunkRecord:
        return ChunkRecord(key, Chunk(*fields))

    recs = [rec("w", (0, 0), (4, 4), 0, 0, 64, 7, ()), rec("w", (4, 0), (4, 4), 1, 0, 64, 8, (1, 2)),
            rec("b", (), (), 0, 64, 4, 9, ())]
    data = rank_index.encode("a", 3, recs)
    kw = dict(attempt="a", rank=3, blobs=[5, 6], blob_sizes=[0, 0, 0, 0, 0, 128, 64], crc_block=32)
    got = rank_index.decode(data, "idx", **kw)  # type: ignore[arg-type]
    assert got["w"][(4, 0)].blob == 6 and got["w"][(4, 0)].block_crc32c == (1, 2) and got["b"][()].offset == 64
    with pytest.raises(CorruptCheckpointError, match="idx.*rank 3"):
        rank_index.decode(data, "idx", **{**kw, "rank": 2})  # type: ignore[arg-type]
    with pytest.raises(CorruptCheckpointError, match="'w': chunk record #1"):
        rank_index.decode(data, "idx", **{**kw, "blob_sizes": [0, 0, 0, 0, 0, 128, 32]})  # type: ignore[arg-type]
    bad = [rec("w", (0, 0), (4, 4), 2, 0, 64, 7, ())]  # the rank has only two blobs
    with pytest.raises(CorruptCheckpointError, match="chunk record #0"):
        rank_index.decode(rank_index.encode("a", 3, bad), "idx", **kw)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- real ranks

ROWS, COLS = 96, 40


def full(name: str, shape: tuple[int, ...] = (ROWS, COLS), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return (torch.randn(shape, generator=g) * 100).to(dtype)


def _state(rank: int, world: int, tag: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {
        "tp_only": distribute_tensor(full("tp_only" + tag), mesh["tp"], [Shard(1)]),  # TP slice under DP
        "grid": distribute_tensor(full("grid" + tag), mesh, [Shard(0), Shard(1)]),
        "dp_tp": distribute_tensor(full("dp_tp" + tag), mesh, [Replicate(), Shard(0)]),
        "nested": distribute_tensor(full("nested" + tag, dtype=torch.bfloat16), mesh, [Shard(0), Shard(0)]),
        "rep_big": full("rep_big" + tag, (1024, 1100)),  # > 4 MiB: split over the 4 replicas
        "rep_small": full("rep_small" + tag, (3,)),
        "step": torch.tensor(7.0),
        "seed": 1000 + rank,  # differs per rank: stored per rank
    }


def save_v2(rank: int, world: int, uri: str, opts: dict, tag: str, times: int = 1) -> tuple[int, int, list[str]]:
    from objckpt.save.plan_cache import PLANS

    for _ in range(times):  # the same layout again: the plan comes from the cache
        res = objckpt.save(_state(rank, world, tag), uri, storage_options=opts, overwrite=True,
                           part_size=64 << 10, crc_block=4096)
    return res.bytes, PLANS.stats["hits"], list(res.files)


def load_3(rank: int, world: int, uri: str, opts: dict) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from objckpt.storage import open_store
    from objckpt.testing.stores import CountingStore

    mesh = init_device_mesh("cpu", (world,))
    tmpl = {
        "grid": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)]),
        "dp_tp": torch.zeros(ROWS, COLS),
        "tp_only": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]),
        "nested": distribute_tensor(torch.zeros(ROWS, COLS, dtype=torch.bfloat16), mesh, [Shard(0)]),
        "rep_big": distribute_tensor(torch.zeros(1024, 1100), mesh, [Shard(0)]),
        "rep_small": torch.zeros(3),
        "step": torch.tensor(0.0),
        "seed": -1,
    }
    counting = CountingStore(open_store(uri, opts)[0])
    res = objckpt.load(tmpl, uri, store=counting)
    ok = {k: torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, full(k, *(
        ((1024, 1100),) if k == "rep_big" else ((3,),) if k == "rep_small" else ((ROWS, COLS), torch.bfloat16)
        if k == "nested" else ()))) for k, v in tmpl.items() if k not in ("step", "seed")}
    ok["step"] = float(tmpl["step"]) == 7.0
    held = sum((v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size()
               for k, v in tmpl.items() if isinstance(v, torch.Tensor))
    return {"ok": ok, "seed": tmpl["seed"], "read": res.bytes, "held": held,
            "indexes": sum(1 for k in counting.keys_read if k.endswith(".index.json"))}


def test_symbolic_save_is_v2_loads_anywhere_and_checks_indexes(moto_s3: Any) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/sym/ck"
    saved = run_multiprocess(4, save_v2, uri, opts, "")
    written = [b for b, _, _ in saved]
    m = objckpt.inspect(uri, storage_options=opts, chunks=False)
    assert m.format_version == (mf.PACKED_VERSION if m.crc_block else 3)  # indexes may pack block crcs
    assert len(m.rank_indexes) == 4 and m.rank_trees is not None
    # each rank's SaveResult names its blobs and then its rank index, as the manifest does
    from objckpt.tier.step_files import files_of

    assert [f for _, _, f in saved] == [files_of(m, r) for r in range(4)]
    assert all(f[-1] == m.rank_indexes[r].name for r, (_, _, f) in enumerate(saved))
    assert all(t.layout is not None for k, t in m.tensors.items())
    assert m.tensors["rep_big"].layout.split == 4  # type: ignore[union-attr]
    assert m.tensors["tp_only"].layout.placements == ("R", "S1")  # type: ignore[union-attr]
    stored = sum(full(k, *a).numel() * full(k, *a).element_size() for k, a in [
        ("grid", ()), ("dp_tp", ()), ("tp_only", ()), ("nested", ((ROWS, COLS), torch.bfloat16)), ("rep_big", ((1024, 1100),)),
        ("rep_small", ((3,),))]) + 4
    assert stored <= sum(written) <= stored + 64 * 64  # replicated tensors written once in total
    m_all = objckpt.inspect(uri, storage_options=opts)
    assert {m_all.blobs[c.blob].rank for c in m_all.tensors["rep_big"].chunks} == {0, 1, 2, 3}
    # one process, no process group; then 3 ranks in other layouts
    back = objckpt.read(uri, storage_options=opts)
    assert torch.equal(back["grid"], full("grid")) and torch.equal(back["rep_big"], full("rep_big", (1024, 1100)))
    assert back["seed"] == 1000
    for rank, r in enumerate(run_multiprocess(3, load_3, uri, opts)):
        assert all(r["ok"].values()), (rank, r["ok"])
        assert r["seed"] == 1000 + rank
        assert r["indexes"] <= 4
        assert r["read"] <= 1.1 * r["held"] + 32 * 4096 + 20_000, r  # + crc-block rounding, manifest, indexes

    # a damaged or missing rank index fails loudly, naming it
    import boto3

    s3 = boto3.client("s3", **opts)
    key = f"sym/ck/{m.rank_indexes[2].name}"
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=key, Body=body[:-1] + bytes([body[-1] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="r00002.index.json.*crc32c differs"):
        objckpt.read(uri, storage_options=opts)
    s3.delete_object(Bucket=bucket, Key=key)
    with pytest.raises(CorruptCheckpointError, match="r00002.index.json.*missing"):
        objckpt.read(uri, storage_options=opts)

    # overwriting removes the old attempt's blobs and index objects
    assert all(hits == 1 for _, hits, _ in run_multiprocess(4, save_v2, uri, opts, "b", 2))
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="sym/ck/")["Contents"]]
    m2 = objckpt.inspect(uri, storage_options=opts, chunks=False)
    assert not any(m.attempt in k for k in keys) and all(m2.attempt in k for k in keys if "blobs/" in k)
    assert torch.equal(objckpt.read(uri, ["grid"], storage_options=opts)["grid"], full("gridb"))
