"""The commit's outcome exchange: every rank's outcome reaches rank 0 only.

Real gloo ranks in their own processes (tests/mp.py) save to local files.  Each rank
counts the commit outcomes (:class:`~objckpt.layout.base.RankOutcome`, or their
``wire`` tuples) that torch.distributed hands it: rank 0 receives one per rank, every other rank none (an
all-gather made each of 65,536 ranks unpickle 65,536 of them: docs/s3-scale.md §6).
A rank whose upload fails still aborts the save on every rank, and the process group
is usable afterwards.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

import objckpt
from tests.mp import run_multiprocess


def _count_outcomes(received: dict[str, int]) -> Callable[[], None]:
    """Wrap torch.distributed's object collectives so that ``received[name]`` counts the
    RankOutcome objects each one hands this rank; returns the undo."""
    import torch.distributed as dist

    from objckpt.layout.base import RankOutcome

    saved = {n: getattr(dist, n) for n in ("all_gather_object", "gather_object", "broadcast_object_list")}

    def wrap(name: str) -> Any:
        inner = saved[name]

        def counted(*a: Any, **kw: Any) -> Any:
            out = inner(*a, **kw)
            lists = [x for x in list(a) + list(kw.values()) if isinstance(x, list)]
            received[name] = received.get(name, 0) + sum(_is_outcome(o) for lst in lists for o in lst)
            return out
        return counted

    def _is_outcome(o: Any) -> bool:  # an outcome, or its wire form (RankOutcome.wire: tuples of builtins)
        return isinstance(o, RankOutcome) or (type(o) is tuple and len(o) == 4 and type(o[0]) is tuple
                                              and type(o[1]) is list)

    for n in saved:
        setattr(dist, n, wrap(n))
    return lambda: [setattr(dist, n, f) for n, f in saved.items()] and None


def _save_and_count(rank: int, world: int, root: str, fail_rank: int) -> dict[str, Any]:
    from objckpt.storage import open_store
    from objckpt.testing.stores import FaultyStore

    uri = os.path.join(root, f"ck-{fail_rank}")
    state = {f"w{rank}": torch.full((64,), float(rank)), "shared": torch.arange(32, dtype=torch.float32)}
    store = FaultyStore(open_store(uri)[0], "write_part", 1) if rank == fail_rank else None
    received: dict[str, int] = {}
    undo = _count_outcomes(received)
    out: dict[str, Any] = {}
    try:
        objckpt.save(state, uri, store=store)
        out["error"] = ""
    except objckpt.ObjckptError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        undo()
    out["received"] = received
    # the group still works afterwards: every rank reaches the same next collective
    got: list[Any] = [None] * world
    torch.distributed.all_gather_object(got, rank)
    out["after"] = got
    if not out["error"]:
        tmpl = {f"w{rank}": torch.zeros(64), "shared": torch.zeros(32)}
        objckpt.load(tmpl, uri)
        out["loaded"] = bool(torch.equal(tmpl[f"w{rank}"], state[f"w{rank}"]) and torch.equal(tmpl["shared"],
                                                                                                state["shared"]))
    out["manifest"] = os.path.exists(os.path.join(root, f"ck-{fail_rank}", "manifest.json"))
    return out


def test_outcomes_reach_rank_0_only(tmp_path: Any) -> None:
    res = run_multiprocess(3, _save_and_count, str(tmp_path), -1)
    assert [r["error"] for r in res] == ["", "", ""], res
    assert all(r["loaded"] and r["manifest"] and r["after"] == [0, 1, 2] for r in res), res
    # rank 0 received each rank's outcome once; ranks 1 and 2 received none, by any collective
    assert sum(res[0]["received"].values()) == 3, res[0]["received"]
    assert [sum(r["received"].values()) for r in res[1:]] == [0, 0], [r["received"] for r in res]


def test_a_failing_ranks_outcome_still_aborts_the_commit_everywhere(tmp_path: Any) -> None:
    res = run_multiprocess(3, _save_and_count, str(tmp_path), 2)
    for r in res:  # every rank raises the same error, naming the failed rank; nothing was committed
        assert "failed on 1 of 3 rank(s), nothing committed" in r["error"] and "rank 2:" in r["error"], r
        assert "injected fault" in r["error"], r
        assert not r["manifest"] and r["after"] == [0, 1, 2], r
    assert len({r["error"] for r in res}) == 1, res
    assert sum(res[0]["received"].values()) == 3 and [sum(r["received"].values()) for r in res[1:]] == [0, 0], res
    # the failed attempt's blobs were deleted by every rank: nothing of it is left
    left = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "ck-2") for f in fs]
    assert not [p for p in left if "/blobs/" in p and not p.endswith(".json")], left
