"""A tiered restore prepares its load once (objckpt.load.prepared): the chosen step's manifest
decoded once, each Stateful value's ``state_dict()`` called once, the template matched once
and the rank's reads planned once; the restore plan takes its reads from that preparation and
the load itself reuses it.  A rank on a replaced node (its folder empty: source ``peer``)
does the same once it has received the manifest from its peer.  Counted by wrapping the
functions that do each piece of work wherever objckpt's modules hold them."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import objckpt
from mp import run_multiprocess

#: what is counted: (module, function name) -> the counter's name
COUNTED = {("objckpt.format.manifest", "decode"): "decodes",
           ("objckpt.load.pipeline", "match_template"): "matches",
           ("objckpt.load.fill", "plan_fill"): "plans",
           ("objckpt.load.needs", "load_reads"): "plans"}


class Counted:
    """A Stateful value holding this rank's rows of a tensor, whose ``state_dict()`` calls are counted."""

    def __init__(self, fill: float, rank: int = 0, world: int = 1) -> None:
        rows = 8 // world
        self.w = objckpt.Shard(torch.full((rows, 5), fill + rank), (8, 5), (rows * rank, 0))
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        self.calls += 1
        return {"w": self.w}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.w = sd["w"]


def count_work() -> tuple[dict[str, int], Callable[[], None]]:
    """Counters of the work in :data:`COUNTED`, and a function that undoes the wrapping."""
    counts = {name: 0 for name in COUNTED.values()}
    undo: list[tuple[Any, str, Any]] = []
    for (modname, fname), name in COUNTED.items():
        mod = sys.modules.get(modname)
        real = getattr(mod, fname, None) if mod is not None else None
        if real is None:
            continue

        def counting(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            counts[_name] += 1
            return _real(*a, **kw)

        for m in [m for k, m in list(sys.modules.items()) if k.startswith("objckpt") and m is not None]:
            for attr, v in list(vars(m).items()):
                if v is real:
                    undo.append((m, attr, v))
                    setattr(m, attr, counting)

    def restore() -> None:
        for m, attr, v in reversed(undo):
            setattr(m, attr, v)

    return counts, restore


def _manager(root: str, local: str, replicas: int, node: Any = None) -> objckpt.CheckpointManager:
    return objckpt.CheckpointManager(root, tier=objckpt.TierSettings(local_dir=local, replicas=replicas,
                                                                     persist_every=None, local_keep=3),
                                     node_override=node)


def test_a_local_restore_prepares_its_load_once(tmp_path: Path) -> None:
    root, local = str(tmp_path / "root"), str(tmp_path / "local")
    with _manager(root, local, replicas=0) as m:
        for s in (1, 2):
            m.save(s, {"model": Counted(float(s)), "step": s})
        m.wait()
    counts, restore = count_work()
    try:
        model = Counted(0.0)
        with _manager(root, local, replicas=0) as fresh:  # a restarted job
            res = fresh.load({"model": model, "step": -1})
    finally:
        restore()
    assert res.step == 2 and res.source == "local" and torch.equal(model.w.local, torch.full((8, 5), 2.0))
    assert {**counts, "state_dict": model.calls} == {"decodes": 1, "matches": 1, "plans": 1, "state_dict": 1}


def _save(rank: int, world: int, base: str, replicas: int) -> None:
    with _manager(base + "/root", base + "/{node}", replicas, f"n{rank}") as m:
        for s in (1, 2):
            m.save(s, {"model": Counted(float(s), rank, world), "step": s})
        m.wait()


def _restore(rank: int, world: int, base: str, replicas: int) -> dict[str, Any]:
    counts, restore = count_work()
    model = Counted(-100.0, rank, world)
    state = {"model": model, "step": -1}
    with _manager(base + "/root", base + "/{node}", replicas, f"n{rank}") as m:
        res = m.load(state)
    restore()
    ok = torch.equal(model.w.local, torch.full((4, 5), float(rank + 2))) and state["step"] == 2
    return {"source": res.source, "received": res.received_bytes, "ok": ok, **counts, "state_dict": model.calls}


@pytest.mark.parametrize("case", ["healthy", "replaced"])
def test_two_nodes_restore_preparing_each_ranks_load_once(tmp_path: Path, case: str) -> None:
    """``healthy``: no replicas, so each node's folder holds its own ranks' blobs only (not the
    whole step): each rank's reads say it is ``local``, and no byte moves between them.
    ``replaced``: one replica each, then node n1's folder is lost: its rank is ``peer`` and
    learns the manifest, then the blobs it reads, from n0."""
    base = str(tmp_path)
    replicas = 0 if case == "healthy" else 1
    run_multiprocess(2, _save, base, replicas)
    if case == "replaced":
        shutil.rmtree(tmp_path / "n1")
    got = run_multiprocess(2, _restore, base, replicas)
    want = ["local", "local"] if case == "healthy" else ["local", "peer"]
    assert [g["source"] for g in got] == want and all(g["ok"] for g in got), got
    assert (sum(g["received"] for g in got) == 0) == (case == "healthy"), got
    for g in got:
        assert {k: g[k] for k in ("decodes", "matches", "plans", "state_dict")} == {
            "decodes": 1, "matches": 1, "plans": 1, "state_dict": 1}, got
