"""CheckpointManager over real gloo process groups: async DTensor saves, one latest step, restores resharded."""
from __future__ import annotations

from typing import Any

import torch

import objckpt
from mp import run_multiprocess


def full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(12, 6, generator=g), "emb": torch.randn(6, 10, generator=g)}


def _dstate(step: int, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    f = full(step)
    return {"w": distribute_tensor(f["w"], mesh, [Shard(0)]), "emb": distribute_tensor(f["emb"], mesh, [Shard(1)]),
            "step": step}


def _ranks(rank: int, world: int, root: str, opts: dict[str, Any], load_expected: int, steps: list[int]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    m = objckpt.CheckpointManager(root, keep_last=2, async_save=True, storage_options=opts)
    seen_before = m.latest_step()
    if load_expected:
        st = _dstate(0, mesh)
        m.load(st)  # the latest, saved at another world size
        want = _dstate(load_expected, mesh)
        assert st["step"] == load_expected
        for k in ("w", "emb"):
            assert torch.equal(st[k].to_local(), want[k].to_local()), (rank, k)
    for s in steps:
        m.save(s, _dstate(s, mesh), metadata={"world": world})
    m.wait()
    out = (seen_before, m.latest_step(), m.steps(), m.is_root)
    m.close()
    return out


def test_manager_on_2_then_3_ranks_then_1(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    root = f"s3://{bucket}/run"
    two = run_multiprocess(2, _ranks, root, opts, 0, [1, 2, 3])
    assert [r[:3] for r in two] == [(None, 3, [2, 3])] * 2  # every rank the same answer
    assert [r[3] for r in two] == [True, False]
    three = run_multiprocess(3, _ranks, root, opts, 3, [4, 5])
    assert [r[:3] for r in three] == [(3, 5, [4, 5])] * 3
    m = objckpt.CheckpointManager(root, storage_options=opts)
    st = {"w": torch.zeros(12, 6), "emb": torch.zeros(6, 10), "step": 0}
    m.load(st)
    assert st["step"] == 5 and all(torch.equal(st[k], full(5)[k]) for k in ("w", "emb"))
    assert [e.metadata for e in m.entries().steps] == [{"world": 3}, {"world": 3}]
    m.close()
