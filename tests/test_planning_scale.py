"""Symbolic planning at scale: a mixture-of-experts layout saved on (dp, ep, tp) and read
into half as many ranks is covered exactly once and read only from the writers that
hold the wanted elements; and the per-rank queries do work in proportion to what they
return, not to the mesh (counted calls, not timings)."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from objckpt.format.manifest import Mesh, ShardSpec
from objckpt.planning import symbolic
from objckpt.planning.symbolic import TensorDesc, assign_shard_specs, cell_box, my_pieces, overlapping_pieces


def _moe(dp: int, ep: int, tp: int) -> tuple[list[TensorDesc], list[Mesh]]:
    """A small MoE state: stacked experts on (dp, ep, tp) (``Shard(0)`` over ep, FSDP
    ``Shard(1)`` over dp, expert-TP over tp), dense tensors on (dp * ep, tp), a plain
    tensor on every rank.  Uneven sizes, and more FSDP cells than router rows (empty cells)."""
    world = dp * ep * tp
    meshes = [Mesh((world,), tuple(range(world))), Mesh((dp * ep, tp), tuple(range(world))),
              Mesh((dp, ep, tp), tuple(range(world)))]
    descs = [
        TensorDesc("experts.w1", (6, 10, 4), 4, 2, ("S1", "S0", "S1")),
        TensorDesc("experts.w2", (6, 4, 10), 4, 2, ("S1", "S0", "S2")),
        TensorDesc("router.gate", (20, 4), 4, 1, ("S0", "R")),
        TensorDesc("norm", (7,), 4, 1, ("S0", "R")),  # 7 rows over 8 FSDP cells: one empty
        TensorDesc("attn.q", (13, 6), 2, 1, ("S0", "S0")),
        TensorDesc("attn.o", (6, 13), 2, 1, ("S0", "S1")),
        TensorDesc("step", (), 4, 0, ("R",)),
    ]
    return descs, meshes


@pytest.mark.parametrize("split_bytes", [4 << 20, 16])  # the defaults; and replicated cells split over replicas
def test_moe_plan_covers_every_element_once_and_half_world_reads_only_overlapping_writers(split_bytes: int) -> None:
    dp, ep, tp = 4, 2, 2
    descs, meshes = _moe(dp, ep, tp)
    lays = assign_shard_specs(descs, meshes, split_bytes=split_bytes, tiny_bytes=8)
    if split_bytes == 16:
        assert lays["router.gate"].split == 2  # the replica split is exercised
    world = dp * ep * tp
    written: dict[str, dict[int, list]] = {}
    for t in descs:
        count = torch.zeros(t.shape, dtype=torch.int32)
        written[t.key] = {r: my_pieces(t.shape, meshes[t.mesh], lays[t.key], r) for r in range(world)}
        for r, pieces in written[t.key].items():
            held = cell_box(t.shape, meshes[t.mesh].shape, t.placements, meshes[t.mesh].coordinate(r))
            for off, shp in pieces:
                # a rank writes only rows of what it holds
                assert all(h <= o and o + n <= h + hn for o, n, h, hn in zip(off, shp, *held)), (t.key, r)
                count[tuple(slice(o, o + n) for o, n in zip(off, shp))] += 1
        assert bool((count == 1).all()), f"{t.key}: elements written {count.unique().tolist()} times"
    # load into half as many ranks: dp halves, ep and tp stay
    lw = world // 2
    lmeshes = [Mesh((lw,), tuple(range(lw))), Mesh((dp // 2 * ep, tp), tuple(range(lw))),
               Mesh((dp // 2, ep, tp), tuple(range(lw)))]
    for t in descs:
        for lr in range(lw):
            box = cell_box(t.shape, lmeshes[t.mesh].shape, t.placements, lmeshes[t.mesh].coordinate(lr))
            got = overlapping_pieces(t.shape, meshes[t.mesh], lays[t.key], box)
            want = sorted((w, p) for w, ps in written[t.key].items() for p in ps
                          if _meets(p, box) and math.prod(box[1]))
            assert sorted((w, p) for w, p, _ in got) == want, (t.key, lr)  # the writers to fetch, and only those
            if not math.prod(box[1]):
                continue
            count = torch.zeros(box[1], dtype=torch.int32)
            for _, _, (off, shp) in got:
                count[tuple(slice(o - b, o - b + n) for o, b, n in zip(off, box[0], shp))] += 1
            assert bool((count == 1).all()), (t.key, lr)  # the intersections tile the wanted box once


def _meets(p: Any, box: Any) -> bool:
    return all(max(a, b) < min(a + m, b + n) for a, m, b, n in zip(p[0], p[1], box[0], box[1])) if p[1] else True


def _counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls = [0]
    real = getattr(symbolic, name)

    def counted(*a: Any) -> Any:
        calls[0] += 1
        return real(*a)

    monkeypatch.setattr(symbolic, name, counted)
    return calls


def test_overlap_query_on_a_65536_rank_mesh_does_not_walk_the_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load rank asks which stored pieces of a column-parallel tensor meet its box on an
    (8192, 8) FSDP x TP mesh: the answer comes from a few divisions per level, not from
    listing the 65,536 pieces of the dim (which every rank of the job would redo)."""
    mesh = Mesh((8192, 8), tuple(range(65536)))
    shape = (65536 * 3 + 5, 16)
    lay = ShardSpec(0, ("S0", "S0"))
    # the box a rank of a (4096, 8) mesh holds: it spans about two stored cells
    box = cell_box(shape, (4096, 8), ("S0", "S0"), (1234, 5))
    calls = _counting(monkeypatch, "chunk_piece")
    got = overlapping_pieces(shape, mesh, lay, box)
    assert calls[0] < 40, calls[0]
    writers = sorted(w for w, _, _ in got)
    # brute force over the mesh: every rank whose own cell meets the box
    want = sorted(r for r in range(65536)
                  if _meets(cell_box(shape, mesh.shape, lay.placements, mesh.coordinate(r)), box))
    assert writers == want and len(want) in (2, 3)
    assert sum(math.prod(i[1]) for _, _, i in got) == math.prod(box[1])


def test_my_pieces_of_a_tensor_split_over_65536_replicas_visits_only_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replicated tensor big enough to be split over every replica of a 65,536-rank group:
    each rank finds its one piece directly instead of walking the group's 65,536 pieces."""
    world = Mesh((65536,), tuple(range(65536)))
    shape = (65536 * 2 + 7, 16)  # 8.4 MB: split over the replicas
    lay = assign_shard_specs([TensorDesc("w", shape, 4, 0, ("R",))], [world])["w"]
    assert lay.split == 65536
    calls = _counting(monkeypatch, "piece_rows")
    rows = []
    for r in (0, 1, 7, 40000, 65535):
        (p,) = my_pieces(shape, world, lay, r)
        rows.append(p)
    assert calls[0] <= 5, calls[0]
    slot = lambda r: (r - lay.rot) % 65536  # noqa: E731
    for r, (off, shp) in zip((0, 1, 7, 40000, 65535), rows):
        i = slot(r)
        assert off == (shape[0] * i // 65536, 0) and shp == (shape[0] * (i + 1) // 65536 - off[0], 16)
    # the reader of one row range meets only the pieces holding it
    calls[0] = 0
    got = overlapping_pieces(shape, world, lay, ((1000, 0), (5, 16)))
    assert calls[0] < 10 and sum(math.prod(i[1]) for _, _, i in got) == 80
    assert [w for w, _, _ in got] == [(i + lay.rot) % 65536 for i in (500, 501, 502)]


def test_rank_outcomes_pickle_as_tuples_and_round_trip() -> None:
    """Outcomes pickle as plain tuples behind a constructor (200 bytes for a rank of one
    blob and an index, 343 as pickled dataclasses) and come back equal, building their
    objects only when read (the commit sends the bare tuples: the test below)."""
    import pickle

    from objckpt.format.manifest import Blob, Chunk, ChunkRecord, RankIndexRef
    from objckpt.distributed.comm import RankError
    from objckpt.layout.base import RankOutcome

    attempt = "20261122T000000-000000000000"
    sym = RankOutcome(blobs=[Blob(f"blobs/{attempt}/r65535-0000.bin", 182219524, 65535)],
                      index=RankIndexRef(f"blobs/{attempt}/r65535.index.json", 52972, 4023233417))
    spread = RankOutcome(blobs=[Blob(f"spread/{attempt}/r00001-0000.bin", 7, 1, "80")],
                         index=RankIndexRef(f"spread/{attempt}/r00001.index.json", 9, 3, "80"))
    gathered = RankOutcome(blobs=[Blob("blobs/a/r00000-0000.bin", 4, 0)],
                           records=[ChunkRecord("w", Chunk((0,), (1,), 0, 0, 4, 7, (1, 2)))])
    failed = RankOutcome(error=RankError.of(OSError("disk full")))
    for o in (sym, spread, gathered, failed):
        back = pickle.loads(pickle.dumps(o))
        assert back == o and o == back and isinstance(back, RankOutcome)
        assert (back.blobs, back.records, back.index, back.error) == (o.blobs, o.records, o.index, o.error)
        assert pickle.loads(pickle.dumps(back)) == o  # rank 0 may pass one on
    assert pickle.loads(pickle.dumps(failed)).error == RankError("OSError", "OSError: disk full")
    assert len(pickle.dumps(sym)) <= 220
    assert sym != failed and back.blobs is back.blobs


def test_commit_outcomes_travel_as_builtins_and_rebuild_on_rank_0() -> None:
    """The commit gathers each rank's outcome to rank 0 as :meth:`RankOutcome.wire`: tuples of
    builtins whose unpickling looks up no class (no GLOBAL opcode: a third of the time of the
    pickled outcome at 65,536 ranks), rebuilt equal by ``from_wire``."""
    import pickle
    import pickletools

    from objckpt.distributed.comm import RankError
    from objckpt.format.manifest import Blob, RankIndexRef
    from objckpt.layout.base import RankOutcome

    attempt = "20261122T000000-000000000000"
    sym = RankOutcome(blobs=[Blob(f"spread/{attempt}/r65535-0000.bin", 182219524, 65535, "80")],
                      index=RankIndexRef(f"spread/{attempt}/r65535.index.json", 52972, 4023233417, "80"))
    data = pickle.dumps(sym.wire())
    ops = {op.name for op, _, _ in pickletools.genops(data)}
    assert not ops & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "INST", "OBJ", "NEWOBJ"}, ops
    assert len(data) <= 200
    back = RankOutcome.from_wire(pickle.loads(data))
    assert back == sym and (back.blobs, back.index) == (sym.blobs, sym.index)
    failed = RankOutcome(error=RankError.of(OSError("disk full")))
    assert RankOutcome.from_wire(pickle.loads(pickle.dumps(failed.wire()))).error == failed.error


def test_strided_mesh_description_lists_the_permuted_ranks_once_per_mesh() -> None:
    """FSDP2 x TP (``_StridedShard``) tensors are described on the mesh with its dims
    permuted; listing that mesh's ranks costs O(ranks) (4 ms at 65,536), so it is done
    once per mesh and order, not once per tensor (thousands of tensors)."""
    from objckpt.distributed.placements import _unstride

    class FakeDeviceMesh:  # what _unstride reads of a DeviceMesh: its rank tensor
        def __init__(self, ranks: torch.Tensor) -> None:
            self.mesh = ranks

    mesh = FakeDeviceMesh(torch.arange(64).reshape(8, 8))
    first = _unstride((64, 4), mesh, ("S0/8", "S0"), id(mesh))
    second = _unstride((128, 16), mesh, ("S0/8", "S0"), id(mesh))
    assert first is not None and second is not None
    assert first.shape == (8, 8) and first.placements == ("S0", "S0")
    assert first.ranks == tuple(torch.arange(64).reshape(8, 8).t().flatten().tolist())  # "tp" outer, "dp" inner
    assert second.ranks is first.ranks and second.ident == first.ident


def test_strided_dim_order_checks_sampled_points_without_listing_the_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which order of FSDP2 x TP's mesh dims makes ``_StridedShard`` plain nested chunks is
    checked on sampled points of a 65,536-point mesh: only their pieces are computed,
    not the dim's 65,536 (once per tensor shape, on every rank of a cold process)."""
    from objckpt.planning import strided

    calls = [0]
    real = symbolic.chunk_piece

    def counted(*a: Any) -> Any:
        calls[0] += 1
        return real(*a)

    monkeypatch.setattr(symbolic, "chunk_piece", counted)
    monkeypatch.setattr(strided, "chunk_piece", counted)
    strided._dim_order.cache_clear()  # results are cached per (size, steps)
    order = strided._dim_order(8192 * 8 * 3, (strided.Step(8192, 8), strided.Step(8, 1)))
    assert order == (1, 0)  # "tp" outer, "dp" inner
    assert calls[0] < 2000, calls[0]


def test_empty_strided_box_asks_torch_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank holding nothing of a strided DTensor (an MoE router with fewer rows than FSDP
    cells) asks torch where its empty box starts once per shape and placements: torch's
    strided rule costs O(mesh size), ~50 ms a call at 65,536 ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from objckpt.distributed import placements

    calls: list[Any] = []
    real = placements._compute_local
    monkeypatch.setattr(placements, "_compute_local", lambda *a: calls.append(a) or real(*a))
    dist.init_process_group("fake", rank=61, world_size=64, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (8, 8), mesh_dim_names=("dp", "tp"))
        pl = [_StridedShard(0, split_factor=8), Shard(0)]
        boxes = []
        for _ in range(5):  # 5 rows over 64 points: rank 61 holds nothing
            x = DTensor.from_local(torch.empty((0, 4)), mesh, pl, run_check=False, shape=torch.Size((5, 4)),
                                   stride=(4, 1))
            part = placements.local_part("router", x)
            boxes.append(part.pieces[0][0])
        assert len(calls) == 1
        assert all(b == boxes[0] for b in boxes) and boxes[0][1][0] == 0 and boxes[0][0] == real(*calls[0])[0]
    finally:
        dist.destroy_process_group()
