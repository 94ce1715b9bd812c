"""FSDP2 x tensor parallel (torchtitan's 2-D layout): save on a 2x2 mesh, restore anywhere.

Real gloo processes, real moto S3 over HTTP, torch's own FSDP2 (``fully_shard``)
and tensor parallel (``ColwiseParallel`` / ``RowwiseParallel``): the column-wise
weights and their AdamW moments are DTensors with ``_StridedShard`` placements.
A checkpoint saved at ("dp", "tp") = 2x2 through ``get_state_dict`` is restored
into fresh processes at 1x4, 4x1 and 2x1 (world 2: two of them in a group of
their own) with ``set_state_dict``, and read by a
single process; a plain checkpoint goes back into a 2x2 model.
"""
from __future__ import annotations

import importlib
import pathlib
import sys
from typing import Any

import torch

import objckpt

from mp import run_multiprocess

BIG = (250, 64)  # rows that split unevenly over 4, over 2 and over 2x2


def recipe() -> Any:
    """examples/integrations/fsdp2_tp.py, the recipe docs/integrations.md shows (spawned
    children import it the same way: spawn passes ``sys.path`` on).  Its model: IN=6,
    HIDDEN=12 (HIDDEN divides by every tp size, as torch's TP needs; the second weight's
    6 rows over dp=4 are uneven for FSDP2).  Uneven strided shards: ``BIG`` here, and
    every size in tests/test_strided_pieces.py."""
    path = str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "integrations")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module("fsdp2_tp")


def full(v: Any) -> Any:
    """The whole tensor as a numpy array (sent between processes by value, not shared memory)."""
    from torch.distributed.tensor import DTensor

    return (v.full_tensor() if isinstance(v, DTensor) else v).detach().numpy().copy()


def same(a: torch.Tensor, b: Any) -> bool:
    """Bit for bit (and dtype) equality of a tensor and a :func:`full` array."""
    return bool(a.dtype == torch.from_numpy(b).dtype and torch.equal(a, torch.from_numpy(b)))


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    states: dict[str, Any] = osd["state"]  # type: ignore[assignment]
    return {"model": {k: full(v) for k, v in msd.items()},
            "optim": {fqn: {n: full(t) for n, t in st.items()} for fqn, st in states.items()}}


def big_global() -> torch.Tensor:
    return torch.arange(BIG[0] * BIG[1], dtype=torch.float32).reshape(BIG)


def as_dtensor(g: torch.Tensor, mesh: Any, placements: list[Any]) -> Any:
    """``g`` laid out as FSDP2 x TP lays its weights (torch's own splitting, left to right)."""
    from torch.distributed.tensor import DTensor

    t, coord = g, mesh.get_coordinate()
    for md, p in enumerate(placements):
        if hasattr(p, "_split_tensor"):
            t = p._split_tensor(t, mesh.size(md), with_padding=False)[0][coord[md]]
    return DTensor.from_local(t.contiguous(), mesh, placements, shape=g.shape, stride=g.stride(), run_check=False)


def save_2x2(rank: int, world: int, base: str, opts: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ex = recipe()
    mesh, model, opt = ex.build((2, 2))
    ex.train(model, opt, 0, 2)
    placements = {k: str(getattr(v, "placements", None)) for k, v in get_state_dict(model, opt)[0].items()}
    saved = full_state(model, opt)
    ex.save(model, opt, 2, f"{base}/train", opts)
    reference = ex.train(model, opt, 2, 3)  # the uninterrupted run
    big = as_dtensor(big_global(), mesh, [_StridedShard(0, split_factor=2), Shard(0)])
    objckpt.save({"big": big}, f"{base}/big", storage_options=opts, crc_block=512)
    # a genuinely strided layout: each rank holds several boxes (saved with listed chunks)
    from torch.distributed.device_mesh import init_device_mesh

    flat = init_device_mesh("cpu", (4,))
    odd = as_dtensor(big_global()[:22, :5].contiguous(), flat, [_StridedShard(0, split_factor=3)])
    objckpt.save({"odd": odd}, f"{base}/odd", storage_options=opts)
    return {"placements": placements, "saved": saved, "reference": reference} if rank == 0 else {}


def restore(shape: tuple[int, int], uri: str, opts: dict[str, Any], saved: dict[str, Any]) -> list[float]:
    """Fresh model and optimizer on ``shape``, restored from ``uri``; the next 3 losses."""
    ex = recipe()
    model, opt, step = ex.resume(shape, uri, opts)
    assert step == 2
    return check_and_train(model, opt, step, saved, shape)


def check_and_train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, saved: dict[str, Any],
                    shape: Any) -> list[float]:
    """The restored state equals the saved one bit for bit; then 3 more steps."""
    ex = recipe()
    now = full_state(model, opt)
    for k, t in saved["model"].items():
        assert same(torch.from_numpy(now["model"][k]), t), (shape, k)
    for fqn, st in saved["optim"].items():
        for n, t in st.items():
            assert same(torch.from_numpy(now["optim"][fqn][n]), t), (shape, fqn, n)
    return ex.train(model, opt, step, 3)


def _manifest_and_indexes(uri: str, opts: dict[str, Any], group: Any = None) -> int:
    """Bytes of the manifest and of every rank index: what a load may read besides tensor bytes."""
    r = objckpt.load({}, uri, storage_options=opts, strict=False, process_group=group)
    return r.bytes + sum(ri.size for ri in objckpt.inspect(uri, storage_options=opts, chunks=False).rank_indexes)


def load_big(mesh: Any, placements: list[Any], uri: str, opts: dict[str, Any], group: Any = None) -> None:
    """Load the 2x2 ``big`` tensor into ``placements``: exact values, and this rank
    reads at most 1.1x its share of bytes (plus manifest and rank indexes)."""
    dst = as_dtensor(torch.zeros(BIG), mesh, placements)
    res = objckpt.load({"big": dst}, uri, storage_options=opts, process_group=group)
    want = as_dtensor(big_global(), mesh, placements).to_local()
    assert torch.equal(dst.to_local(), want), placements
    share = want.numel() * 4
    limit = 1.1 * share + _manifest_and_indexes(uri, opts, group)
    assert 0 < res.bytes <= limit, (placements, res.bytes, share, limit)


def restore_4(rank: int, world: int, base: str, opts: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = {"1x4": restore((1, 4), f"{base}/train", opts, saved),
           "4x1": restore((4, 1), f"{base}/train", opts, saved),
           "back": restore((2, 2), f"{base}/plain", opts, saved)}
    flat = init_device_mesh("cpu", (4,))
    load_big(flat, [Shard(0)], f"{base}/big", opts)
    load_big(flat, [_StridedShard(0, split_factor=3)], f"{base}/big", opts)  # several boxes per rank
    out["recipe"] = recipe().main(f"{base}/recipe", opts)  # the recipe end to end, as torchrun runs it
    out["2x1"] = restore_2(rank, base, opts, saved)
    return out


def restore_2(rank: int, base: str, opts: dict[str, Any], saved: dict[str, Any]) -> list[float]:
    """World 2: ranks 0 and 1 on a 2x1 mesh, loading in their own process group (ranks 2
    and 3 only take part in creating the groups; a spawn of its own would cost seconds)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.distributed.tensor.placement_types import _StridedShard

    pair = dist.new_group([0, 1])
    mesh = DeviceMesh("cpu", torch.tensor([[0], [1]]), mesh_dim_names=("dp", "tp"))
    flat = DeviceMesh("cpu", torch.tensor([0, 1]))
    if rank >= 2:
        return []
    ex = recipe()  # ex.build with a mesh of part of the world
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(ex.IN, ex.HIDDEN), torch.nn.ReLU(), torch.nn.Linear(ex.HIDDEN, ex.IN))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model_sd, optim_sd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd, "step": 0}
    objckpt.load(state, f"{base}/train", storage_options=opts, process_group=pair)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load_big(flat, [Shard(0)], f"{base}/big", opts, pair)
    # a local shard that does not fit its placements (4 rows each): refused, naming the tensor
    bad = DTensor.from_local(torch.zeros(3, 4), flat, [_StridedShard(0, split_factor=2)], shape=torch.Size((8, 4)),
                             stride=(4, 1), run_check=False)
    try:
        objckpt.save({"fsdp_tp": bad}, f"{base}/bad", storage_options=opts, process_group=pair)
        raise AssertionError("a strided shard of the wrong shape was saved")
    except objckpt.ObjckptError as e:
        assert "'fsdp_tp'" in str(e) and "[3, 4]" in str(e) and "[4, 4]" in str(e), str(e)
    assert state["step"] == 2
    return check_and_train(model, opt, state["step"], saved, "2x1")


def _close(a: list[float], b: list[float]) -> bool:
    # A different mesh changes the order of reductions: TP all-reduces RowwiseParallel's
    # partial sums over another number of ranks, FSDP2 averages gradients over another
    # dp size. Restored state is bit-identical (asserted in restore()); the float32 losses
    # that follow may differ in the last bits, so they are compared to 1e-5 relative.
    return all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b)) and len(a) == len(b)


def test_fsdp2_tp_2x2_restores_into_1x4_4x1_2x1_single_process_and_back(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    base = f"s3://{bucket}/titan"
    first = run_multiprocess(4, save_2x2, base, opts)[0]
    assert "_StridedShard" in first["placements"]["0.weight"], first["placements"]

    m = objckpt.inspect(f"{base}/train", storage_options=opts, chunks=False)
    lay = m.tensors["model.0.weight"].layout
    assert lay is not None and lay.placements == ("S0", "S0")  # symbolic: plain Shard on the swapped mesh
    assert m.meshes[lay.mesh].ranks == (0, 2, 1, 3)  # ("tp", "dp") order of the (dp, tp) mesh

    saved = first["saved"]
    got = objckpt.read(f"{base}/train", storage_options=opts)  # one process, whole tensors
    for k, t in saved["model"].items():
        assert same(got["model"][k], t), k
    for fqn, st in saved["optim"].items():
        for n, t in st.items():
            assert same(got["optim"]["state"][fqn][n], t), (fqn, n)
    assert torch.equal(objckpt.read(f"{base}/odd", storage_options=opts)["odd"], big_global()[:22, :5])
    objckpt.save(got, f"{base}/plain", storage_options=opts)  # a plain single-process checkpoint

    out = run_multiprocess(4, restore_4, base, opts, saved)
    reference = first["reference"]
    assert out[0]["back"] == reference  # same 2x2 layout: bit for bit
    for name in ("1x4", "4x1"):
        assert _close(out[0][name], reference), (name, out[0][name], reference)
    assert _close(out[0]["recipe"], reference[:2]), (out[0]["recipe"], reference)
    assert _close(out[0]["2x1"], reference), (out[0]["2x1"], reference)
