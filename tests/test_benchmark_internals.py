"""The planning benchmarks call library internals (planning has no public API).

They import every one of them in ``benchmarks.planning_model.internals``; this
test runs the symbolic planning benchmark on a small world so a restructure of
the library that forgets to repoint them fails here, not on the next figure run.
"""
from __future__ import annotations

import pytest

pytest.importorskip("torch.testing._internal.distributed.fake_pg")


def test_planning_benchmark_runs_on_the_current_internals() -> None:
    from benchmarks import bench_planning
    from benchmarks.planning_model import internals

    ock = internals()
    assert ock.limits.part_size == 16 * (1 << 20)
    out = bench_planning.run(world=16, tp=8, load_ratio=0.5)
    assert out["tensors"] == 2892
    for side in ("save", "load"):
        assert out[side], side
    # every sample load rank found the writers it needs and planned reads for all its tensors
    assert all(r["indexes_fetched"] >= 1 and r["reads"] >= 2892 for r in out["load"].values())
    assert out["manifest_stored_bytes"] > 0


def test_planning_benchmark_moe_model_on_an_expert_parallel_mesh() -> None:
    """``--model moe-1t`` at a small world (2 of its layers): the experts lie on a
    (dp, ep, tp) mesh whose boxes are torch's own (``save_side`` checks them against
    ``compute_local_shape_and_global_offset``), the commit builds and encodes the
    manifest, and every sample load rank of the half-size world resolves all its
    tensors from a few writers' rank indexes."""
    from benchmarks import bench_planning

    out = bench_planning.run(world=64, tp=2, load_ratio=0.5, model="moe-1t", ep=4, fetch_samples=2, layers=2)
    assert out["meshes"] == [(64,), (32, 2), (8, 4, 2)] and out["ep"] == 4
    assert out["tensors"] == 100 and out["load_world"] == 32
    assert out["save"][0]["commit_s"] > 0 and out["manifest_stored_bytes"] > 0
    assert all(r["reads"] >= out["tensors"] for r in out["load"].values())
    assert 1 <= min(out["fetch_counts"].values()) and max(out["fetch_counts"].values()) <= 16
    assert out["fetch_fraction_max"] == max(out["fetch_counts"].values()) / 64
