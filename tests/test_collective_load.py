"""Collective loads (read_strategy): replica groups read each byte once.

Pure planning first (batches, byte-balanced shares, cost model), then real
gloo process groups of 4 CPU ranks: a replicated model on moto S3, a 2x2
DP x TP mesh, injected failures; the NCCL case needs two GPUs.
"""
from __future__ import annotations

import hashlib
import math
import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import objckpt
from objckpt.planning.collective_plan import ALIGN, HEADER, CostModel, ItemSize, batches, plan_group, split_shares

from mp import run_multiprocess

STRATEGIES = ("direct", "broadcast", "allgather", "auto")

# --------------------------------------------------------------------------- pure planning


def _covered(pieces: list[tuple[int, ...]], sizes: list[ItemSize]) -> dict[int, list[tuple[int, int]]]:
    rows: dict[int, list[tuple[int, int]]] = {}
    for p in pieces:
        rows.setdefault(p[0], []).append((p[1], p[2]))
    for i, spans in rows.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == sizes[i].rows, (i, spans)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (i, spans)  # no gap, no overlap
    return rows


def test_batches_respect_the_cap_and_cover_every_row_once() -> None:
    sizes = [ItemSize(10, 100), ItemSize(1, 4), ItemSize(0, 8), ItemSize(5, 1000), ItemSize(1, 9000)]
    bs = batches(sizes, 2500)
    for b in bs:
        n = sum((hi - lo) * sizes[i].row_bytes for i, lo, hi in b)
        assert n <= 2500 or (len(b) == 1 and b[0][2] - b[0][1] == 1), b  # a lone row may exceed it
    got = _covered([p for b in bs for p in b], sizes)
    assert set(got) == {0, 1, 3, 4}  # the empty item is skipped
    assert bs[-1] == [(4, 0, 1)]  # the 9000-byte row alone
    with pytest.raises(ValueError):
        batches(sizes, 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 300)), min_size=1, max_size=8), st.integers(2, 9),
       st.sampled_from([0, 100, 1000]))
def test_shares_are_contiguous_balanced_and_exact(items: list[tuple[int, int]], k: int, snap: int) -> None:
    sizes = [ItemSize(r, b) for r, b in items]
    pieces = [(i, 0, s.rows) for i, s in enumerate(sizes)]
    shares = split_shares(pieces, sizes, k, snap)
    _covered(shares, sizes)
    owners = [o for *_, o in shares]
    assert owners == sorted(owners) and set(owners) <= set(range(k))  # contiguous, in member order
    total = sum(s.nbytes for s in sizes)
    per = [0] * k
    for i, lo, hi, o in shares:
        per[o] += (hi - lo) * sizes[i].row_bytes
    assert max(per) <= total / k + max(s.row_bytes for s in sizes) + 2 * snap + 1e-9, (per, total)


def test_shares_snap_to_tensor_boundaries() -> None:
    sizes = [ItemSize(10, 100), ItemSize(10, 100), ItemSize(1, 400)]  # 2400 bytes: the ideal cut at 1200
    pieces = [(i, 0, s.rows) for i, s in enumerate(sizes)]
    assert split_shares(pieces, sizes, 2) == [(0, 0, 10, 0), (1, 0, 2, 0), (1, 2, 10, 1), (2, 0, 1, 1)]
    assert split_shares(pieces, sizes, 2, snap=200) == [(0, 0, 10, 0), (1, 0, 10, 1), (2, 0, 1, 1)]


def test_plan_group_broadcast_rotates_reader_and_packs_aligned() -> None:
    sizes = [ItemSize(64, 256), ItemSize(1, 6), ItemSize(300, 2), ItemSize(4096, 1024)]
    plan = plan_group(sizes, 3, "broadcast", cap=40 << 10, solo_bytes=16 << 10)
    assert [b.reader for b in plan] == [i % 3 for i in range(len(plan))]
    _covered([(p.item, p.lo, p.hi) for b in plan for p in b.pieces], sizes)
    for b in plan:
        assert all(p.owner == b.reader for p in b.pieces)
        packed = sorted((p.offset, p.offset + p.nbytes) for p in b.pieces if not p.solo)
        assert all(a % ALIGN == 0 and a >= HEADER for a, _ in packed)
        assert all(x[1] <= y[0] for x, y in zip(packed, packed[1:]))  # no overlap
        assert b.slot % ALIGN == 0 and (not packed or packed[-1][1] <= b.slot)
        assert all(p.nbytes >= 16 << 10 for p in b.pieces if p.solo)


def test_plan_group_allgather_balances_each_batch() -> None:
    sizes = [ItemSize(1000, 512), ItemSize(7, 4), ItemSize(123, 96)]
    plan = plan_group(sizes, 4, "allgather", cap=128 << 10, solo_bytes=8 << 10, snap=0)
    assert all(b.reader is None for b in plan)
    for b in plan:
        per = [0] * 4
        for p in b.pieces:
            per[p.owner] += p.nbytes
        assert max(per) - min(per) <= 2 * 512, per
    with pytest.raises(ValueError):
        plan_group(sizes, 1, "allgather", cap=1 << 20)
    with pytest.raises(ValueError):
        plan_group(sizes, 2, "direct", cap=1 << 20)


def test_cost_model_reproduces_orbax_and_prefers_direct_when_small() -> None:
    m = CostModel()
    for k, want in ((2, 0.79), (32, 4.9)):  # orbax: single-reader broadcast vs direct reads
        est = m.estimate(k, 10 << 30, 1)
        assert est["direct"] / est["broadcast"] == pytest.approx(want, rel=0.05), (k, est)
    assert m.choose(4, 1 << 30, 4) == "allgather"
    assert m.choose(4, 100 << 10, 1) == "direct"  # latency dominates
    assert m.choose(4, 400 << 10, 1, n_items=100) == "allgather"  # but not 100 small tensors read by every rank
    assert m.choose(1, 1 << 30, 4) == "direct"
    # a slow interconnect and fast storage: reading directly wins again
    assert CostModel(network_gbps=(("gloo", 0.1),)).choose(4, 1 << 30, 4) == "direct"


def test_single_process_reads_directly(tmp_path: Any) -> None:
    uri = str(tmp_path / "one")
    objckpt.save({"w": torch.arange(12.0).reshape(3, 4)}, uri)
    t = {"w": torch.zeros(3, 4)}
    res = objckpt.load(t, uri, read_strategy="allgather")
    assert res.strategy == "direct" and res.received_bytes == 0 and torch.equal(t["w"], torch.arange(12.0).reshape(3, 4))
    with pytest.raises(ValueError, match="read_strategy"):
        objckpt.load(t, uri, read_strategy="scatter")


# --------------------------------------------------------------------------- multi-rank helpers

REPLICATED: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "emb": ((1024, 512), torch.float32),  # 2 MiB
    "mlp": ((512, 700), torch.bfloat16),
    "pos": ((3000,), torch.int64),
    "scale": ((), torch.float64),
    "mask": ((37, 5), torch.bool),
    "empty": ((0, 4), torch.float32),
    "odd": ((333, 7), torch.float16),
}


def full(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    t = torch.randn(shape, generator=g) * 100
    return t > 0 if dtype == torch.bool else t.to(dtype)


def replicated_state() -> dict[str, Any]:
    state: dict[str, Any] = {k: full(k, s, d) for k, (s, d) in REPLICATED.items()}
    state["tied"] = state["emb"]  # stored once, loaded into two keys
    state["step"] = 7
    return state


def zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = out["emb"] if k == "tied" else torch.zeros_like(v)
        else:
            out[k] = 0
    return out


def digest(state: dict[str, Any]) -> str:
    h = hashlib.sha1()
    for k in sorted(state):
        v = state[k]
        if hasattr(v, "to_local"):
            v = v.to_local()
        if isinstance(v, torch.Tensor):
            h.update(k.encode() + v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr((k, v)).encode())
    return h.hexdigest()


def _counting(uri: str, opts: dict[str, Any]) -> Any:
    from objckpt.storage import open_store
    from objckpt.testing.stores import CountingStore

    return CountingStore(open_store(uri, opts)[0])


def _record(res: objckpt.LoadResult, counting: Any, state: dict[str, Any]) -> dict[str, Any]:
    return {"bytes": res.bytes, "ranged": sum(n for *_, n in counting.ranges), "requests": res.requests,
            "received": res.received_bytes, "strategy": res.strategy, "digest": digest(state)}


# --------------------------------------------------------------------------- replicated model, moto S3


def load_replicated(rank: int, world: int, uri: str, opts: dict[str, Any]) -> dict[str, Any]:
    from objckpt.load import collective as fanout
    from objckpt.planning.collective_plan import CostModel

    src = replicated_state()
    # free collectives, so that "auto" picks one even for this small state
    fanout.COST_MODEL = CostModel(latency_s=(("gloo", 0.0),))
    out: dict[str, Any] = {}
    for solo in (4 << 20, 64 << 10):  # default: all pieces packed; small: large pieces broadcast in place
        fanout.SOLO_BYTES = solo
        for strategy in STRATEGIES if solo > 1 << 20 else ("broadcast", "allgather"):
            tmpl = zeros_like_state(src)
            counting = _counting(uri, opts)
            res = objckpt.load(tmpl, uri, store=counting, read_strategy=strategy, collective_bytes=1 << 20)
            assert tmpl["tied"] is tmpl["emb"]
            rec = _record(res, counting, tmpl)
            rec["same"] = rec["digest"] == digest(src)
            out[f"{strategy}/{solo}"] = rec
    return out


def test_replicated_model_reads_one_copy_from_s3(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/rep"
    objckpt.save(replicated_state(), uri, storage_options=opts, part_size=256 << 10, crc_block=4096)
    one_copy = sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in REPLICATED.values())
    per_rank = run_multiprocess(4, load_replicated, uri, opts, timeout=120)
    for run in per_rank[0]:
        recs = [r[run] for r in per_rank]
        assert all(r["same"] for r in recs), run  # every rank, bit for bit
        assert len({r["digest"] for r in recs}) == 1
        ranged = sum(r["ranged"] for r in recs)
        manifests = sum(r["bytes"] - r["ranged"] for r in recs)
        strategy = run.split("/")[0]
        if strategy == "direct":
            assert ranged >= 4 * one_copy and all(r["received"] == 0 for r in recs)
        else:
            assert ranged <= 1.05 * one_copy, (run, ranged, one_copy)  # one copy per group
            assert manifests <= 4 * 64 << 10
            assert {r["strategy"] for r in recs} == {"allgather" if strategy == "auto" else strategy}
            assert all(r["received"] > 0 for r in recs)


# --------------------------------------------------------------------------- 2 x 2 mesh (DP x TP), local files

MESH: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w": ((512, 256), torch.float32),  # [Replicate, Shard(0)]: DP groups {0,2} {1,3}
    "v": ((90, 33), torch.bfloat16),  # [Shard(1), Replicate]: groups {0,1} {2,3}
    "g": ((64, 48), torch.float32),  # [Shard(0), Shard(1)]: no replicas
    "r": ((17, 3), torch.float64),  # [Replicate, Replicate]: the whole world
    "b": ((100,), torch.float32),  # plain: the whole world
}


def mesh_template(mesh: Any, keys: Any = None) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    pl = {"w": [Replicate(), Shard(0)], "v": [Shard(1), Replicate()], "g": [Shard(0), Shard(1)],
          "r": [Replicate(), Replicate()]}
    out: dict[str, Any] = {}
    for k, (s, d) in MESH.items():
        if keys is None or k in keys:
            z = torch.zeros(s, dtype=d)
            out[k] = distribute_tensor(z, mesh, pl[k]) if k in pl else z
    return out


def load_mesh(rank: int, world: int, uri: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from objckpt.load import collective as fanout
    from objckpt.planning.collective_plan import CostModel

    fanout.SOLO_BYTES = 32 << 10
    fanout.COST_MODEL = CostModel(latency_s=(("gloo", 0.0),))  # so that "auto" goes collective here too
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        tmpl = mesh_template(mesh)
        counting = _counting(uri, {})
        res = objckpt.load(tmpl, uri, store=counting, read_strategy=strategy, collective_bytes=128 << 10)
        rec = _record(res, counting, tmpl)
        rec["same"] = all(torch.equal(tmpl[k].full_tensor() if hasattr(tmpl[k], "full_tensor") else tmpl[k],
                                      full(k, *MESH[k])) for k in MESH)
        out[strategy] = rec
        # "w" alone: what each DP group fetches for its TP shard
        only_w = mesh_template(mesh, {"w"})
        counting = _counting(uri, {})
        res = objckpt.load(only_w, uri, store=counting, read_strategy=strategy, strict=False,
                           collective_bytes=128 << 10)
        out[f"w/{strategy}"] = _record(res, counting, only_w)
    # rank 3 lacks "b": the plain-tensor group falls back to direct reads, the mesh groups stay collective
    tmpl = mesh_template(mesh, None if rank != 3 else {"w", "v", "g", "r"})
    res = objckpt.load(tmpl, uri, strict=False, read_strategy="allgather")
    out["uneven"] = {"strategy": res.strategy,
                     "same": all(torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, full(k, *MESH[k]))
                                 for k, v in tmpl.items())}
    return out


def test_2x2_mesh_each_dp_group_reads_its_tp_shard_once(tmp_path: Any) -> None:
    uri = str(tmp_path / "mesh")
    objckpt.save({k: full(k, s, d) for k, (s, d) in MESH.items()}, uri, part_size=64 << 10, crc_block=4096)
    per_rank = run_multiprocess(4, load_mesh, uri, timeout=120)
    for strategy in STRATEGIES:
        recs = [r[strategy] for r in per_rank]
        assert all(r["same"] for r in recs), strategy
        assert len({r["digest"] for r in recs}) == 4  # "g" is sharded over both dims: every rank differs
    # the same local shards whatever the strategy
    for rank in range(4):
        assert len({per_rank[rank][s]["digest"] for s in STRATEGIES}) == 1
    shard = 256 * 256 * 4  # one TP shard of "w"
    for strategy in STRATEGIES:
        w = [r[f"w/{strategy}"]["ranged"] for r in per_rank]
        for group in ((0, 2), (1, 3)):
            got = sum(w[i] for i in group)
            if strategy == "direct":
                assert got >= 2 * shard
            else:
                assert got <= 1.05 * shard, (strategy, group, got)
    assert {r["w/broadcast"]["strategy"] for r in per_rank} == {"broadcast"}
    assert {r["w/auto"]["strategy"] for r in per_rank} == {"allgather"}
    for r in per_rank:
        assert r["uneven"]["same"] and r["uneven"]["strategy"] == "allgather+direct"


# --------------------------------------------------------------------------- failures


def load_failing(rank: int, world: int, uri: str) -> dict[str, str]:
    from objckpt.storage import open_store
    from objckpt.testing.stores import FaultyStore

    out: dict[str, str] = {}
    src = replicated_state()
    for strategy in ("broadcast", "allgather"):
        store = FaultyStore(open_store(uri)[0], "get_range", 1) if rank == 1 else None
        try:
            objckpt.load(zeros_like_state(src), uri, store=store, read_strategy=strategy, collective_bytes=512 << 10)
            out[strategy] = "no error"
        except objckpt.ObjckptError as e:
            out[strategy] = f"{type(e).__name__}: {e}"
    # a rank that fails before any collective (template mismatch) still releases the others
    tmpl = zeros_like_state(src)
    if rank == 2:
        tmpl["emb"] = torch.zeros(1024, 511)
    try:
        objckpt.load(tmpl, uri, read_strategy="auto")
        out["early"] = "no error"
    except objckpt.ObjckptError as e:
        kinds = "+".join(c.__name__ for c in (objckpt.StateDictMismatchError, objckpt.CollectiveLoadError)
                         if isinstance(e, c))
        out["early"] = f"{kinds}: {e}"
    # a direct read (objckpt.Shard: no replica information) failing inside a collective load
    store = FaultyStore(open_store(uri)[0], "get_range", 1) if rank == 3 else None
    tmpl = zeros_like_state(src)
    tmpl["mlp"] = objckpt.Shard(torch.zeros(128, 700, dtype=torch.bfloat16), (512, 700), (128 * rank, 0))
    try:
        objckpt.load(tmpl, uri, store=store, read_strategy="allgather")
        out["direct"] = "no error"
    except objckpt.ObjckptError as e:
        out["direct"] = f"{type(e).__name__}: {e}"
    # afterwards the process group still works: nothing was left half-done
    tmpl = zeros_like_state(src)
    objckpt.load(tmpl, uri, read_strategy="allgather")
    out["after"] = str(digest(tmpl) == digest(src))
    return out


def test_a_failed_read_on_one_rank_makes_every_rank_raise(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save(replicated_state(), uri, part_size=256 << 10, crc_block=4096)
    per_rank = run_multiprocess(4, load_failing, uri, timeout=90)  # a hang fails here
    for rank, out in enumerate(per_rank):
        for strategy in ("broadcast", "allgather"):
            msg = out[strategy]
            assert msg.startswith("CollectiveLoadError") and "rank(s) [1]" in msg, (rank, msg)
            assert "injected fault" in msg and "object " in msg and "reading tensor(s)" in msg, msg
        # every rank, the refusing one too, raises the refusing rank's class (and a CollectiveLoadError)
        assert out["early"].startswith("StateDictMismatchError+CollectiveLoadError:"), out["early"]
        assert "rank(s) [2]" in out["early"], out["early"]
        assert "'emb'" in out["early"]
        assert "rank(s) [3]" in out["direct"] and "'mlp'" in out["direct"], out["direct"]
        assert out["after"] == "True"


# --------------------------------------------------------------------------- CUDA


def load_on_gpu(rank: int, world: int, uri: str) -> dict[str, bool]:
    src = replicated_state()
    out = {}
    for strategy in STRATEGIES:
        tmpl = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in zeros_like_state(src).items()}
        tmpl["tied"] = tmpl["emb"]
        res = objckpt.load(tmpl, uri, read_strategy=strategy, collective_bytes=1 << 20)
        out[strategy] = digest({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in tmpl.items()}) == digest(src)
        out[f"{strategy}/strategy"] = res.strategy  # type: ignore[assignment]
    return out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs CUDA with at least 2 devices (NCCL ranks need one device each)")
def test_nccl_collective_load_into_gpu_tensors(tmp_path: Any) -> None:
    uri = str(tmp_path / "gpu")
    objckpt.save(replicated_state(), uri, part_size=256 << 10, crc_block=4096)
    world = min(torch.cuda.device_count(), 4)
    for out in run_multiprocess(world, load_on_gpu, uri, timeout=120, backend="nccl"):
        assert all(v for k, v in out.items() if "/" not in k), out
        assert out["broadcast/strategy"] == "broadcast" and out["allgather/strategy"] == "allgather"


def load_gloo_into_gpu(rank: int, world: int, uri: str) -> dict[str, bool]:
    return load_on_gpu(rank, world, uri)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gloo_collective_load_into_gpu_tensors(tmp_path: Any) -> None:
    """gloo moves host buffers; destinations on the GPU are filled by copies."""
    uri = str(tmp_path / "gpu")
    objckpt.save(replicated_state(), uri, part_size=256 << 10, crc_block=4096)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for out in run_multiprocess(2, load_gloo_into_gpu, uri, timeout=120):
        assert all(v for k, v in out.items() if "/" not in k), out


# --------------------------------------------------------------------------- cast=True across ranks

def load_cast(rank: int, world: int, uri: str) -> dict[str, bool]:
    """Rank 1 converts every tensor (a bf16 template), rank 0 none: ranks reading together
    still take the same collective steps; reading alone, rank 1 goes in small batches."""
    from objckpt.load import pipeline

    pipeline.CAST_BATCH_BYTES = 64 << 10  # several batches for this state
    src = {f"p{i}": torch.arange(i, i + 96 * 128, dtype=torch.float32).reshape(96, 128) / 7 for i in range(5)}
    dtype = torch.bfloat16 if rank == 1 else torch.float32
    out = {}
    for strategy in ("broadcast", "allgather", "direct"):
        tmpl = {k: torch.zeros(v.shape, dtype=dtype) for k, v in src.items()}
        res = objckpt.load(tmpl, uri, read_strategy=strategy, cast=True)
        out[strategy] = all(torch.equal(tmpl[k], v.to(dtype)) for k, v in src.items()) and res.tensors == 5
    return out


def test_cast_on_one_rank_of_a_collective_load(tmp_path: Any) -> None:
    src = {f"p{i}": torch.arange(i, i + 96 * 128, dtype=torch.float32).reshape(96, 128) / 7 for i in range(5)}
    uri = str(tmp_path / "ck")
    objckpt.save(src, uri)
    per_rank = run_multiprocess(2, load_cast, uri, timeout=120)
    assert per_rank == [{"broadcast": True, "allgather": True, "direct": True}] * 2


def load_with_bad_setting_on_rank_1(rank: int, world: int, uri: str) -> str:
    """Rank 1 alone has a misspelt ``OBJCKPT_HUGE_PAGES``: both ranks raise, neither waits
    for the process group's timeout."""
    if rank == 1:
        os.environ["OBJCKPT_HUGE_PAGES"] = "maybe"
    tmpl = {"w": torch.zeros(64, 64)}
    try:
        objckpt.load(tmpl, uri, read_strategy="broadcast")
    except Exception as e:  # noqa: BLE001 - what each rank sees is the result
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_misspelt_huge_pages_setting_on_one_rank_fails_every_rank(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({"w": torch.ones(64, 64)}, uri)
    got = run_multiprocess(2, load_with_bad_setting_on_rank_1, uri, timeout=60)
    assert got[1].startswith("ValueError") and "OBJCKPT_HUGE_PAGES='maybe'" in got[1], got
    assert got[0] != "loaded" and "rank(s) [1]" in got[0] and "OBJCKPT_HUGE_PAGES" in got[0], got
