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
