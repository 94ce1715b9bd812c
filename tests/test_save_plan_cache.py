"""The save plan cache (objckpt.save.plan_cache): a save of the structure of an earlier save
reuses its description and plan; anything that changes the structure, the options or the
ranks plans anew; ranks that do not all hold the plan all plan anew; and what a hit writes
is what the miss path writes.  Work is bounded by counting calls, never by timing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch

import objckpt
from objckpt.checksum import crc32c
from objckpt.layout import GatheredLayout
from objckpt.save import pipeline, plan_cache
from objckpt.save.plan_cache import PLANS

from mp import run_multiprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(seed: int = 0, n: int = 24) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"layers": {str(i): {"w": torch.randn(3 + i, 5, generator=g), "b": torch.randn(3 + i, generator=g)}
                       for i in range(n)},
            "scalar": torch.tensor(float(seed)), "step": seed, "lr": [0.1, seed]}


class Calls:
    """How often the save described, chose a layout and planned (the work a hit skips)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = {"choose": 0, "plan": 0}

        def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*a: Any, **kw: Any) -> Any:
                self.n[name] += 1
                return fn(*a, **kw)
            return wrapper

        monkeypatch.setattr(pipeline, "_choose_layout", counted("choose", pipeline._choose_layout))
        monkeypatch.setattr(GatheredLayout, "plan", counted("plan", GatheredLayout.plan))

    def take(self) -> dict[str, int]:
        out, self.n = self.n, {"choose": 0, "plan": 0}
        return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and bool(
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    PLANS.clear()


def test_a_second_save_of_the_same_structure_chooses_and_plans_nothing(tmp_path: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(monkeypatch)
    first, second = _state(1), _state(2)  # the same structure, other values (tensors and plain values)
    objckpt.save(first, str(tmp_path / "a"))
    assert calls.take() == {"choose": 1, "plan": 1}
    res = objckpt.save(second, str(tmp_path / "b"))
    assert calls.take() == {"choose": 0, "plan": 0}
    assert PLANS.stats == {"hits": 1, "described": 0, "misses": 1}
    assert res.tensors == 2 * 24 + 1
    assert _same(objckpt.read(str(tmp_path / "b")), second)
    assert _same(objckpt.read(str(tmp_path / "a")), first)


def _grow(s: dict[str, Any]) -> None:
    s["layers"]["3"]["w"] = torch.randn(9, 5)


def _cast(s: dict[str, Any]) -> None:
    s["layers"]["3"]["b"] = s["layers"]["3"]["b"].double()


def _add(s: dict[str, Any]) -> None:
    s["layers"]["extra"] = torch.arange(7)


def _rename(s: dict[str, Any]) -> None:
    s["layers"]["renamed"] = s["layers"].pop("5")


def _tie(s: dict[str, Any]) -> None:
    s["layers"]["4"]["b2"] = s["layers"]["4"]["b"]  # the same tensor twice: stored once


def _transpose(s: dict[str, Any]) -> None:
    s["layers"]["2"]["w"] = torch.randn(5, 5).t()  # same key, shape and dtype, other strides


def _stateful(s: dict[str, Any]) -> None:
    s["layers"]["6"] = torch.nn.Linear(2, 3)  # a Stateful value: its state_dict's keys


@pytest.mark.parametrize("change", [_grow, _cast, _add, _rename, _tie, _transpose, _stateful])
def test_a_changed_structure_is_planned_anew_and_saved_as_it_is(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                                change: Callable[[dict[str, Any]], None]) -> None:
    calls = Calls(monkeypatch)
    objckpt.save(_state(1), str(tmp_path / "a"))
    objckpt.save(_state(2), str(tmp_path / "b"))
    assert calls.take() == {"choose": 1, "plan": 1}  # the second from the cache
    changed = _state(3)
    change(changed)
    objckpt.save(changed, str(tmp_path / "c"))
    assert calls.take()["choose"] == 1, "a changed structure must not reuse the plan"
    want = objckpt.read(str(tmp_path / "c"))
    expect = {k: (v.state_dict() if isinstance(v, torch.nn.Module) else v) for k, v in changed["layers"].items()}
    assert _same(want["layers"], expect) and want["step"] == 3
    m = objckpt.inspect(str(tmp_path / "c"))
    for key, entry in m.tensors.items():
        assert sum(c.length for c in entry.chunks) == (0 if entry.alias_of else entry.numel * torch.empty(
            0, dtype=getattr(torch, entry.dtype)).element_size()), key


@pytest.mark.parametrize("option", [{"part_size": 256}, {"crc_block": 64}, {"blob_size": 1024}])
def test_other_options_plan_anew(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, option: dict[str, int]) -> None:
    calls = Calls(monkeypatch)
    objckpt.save(_state(1), str(tmp_path / "a"))
    objckpt.save(_state(2), str(tmp_path / "b"), **option)  # type: ignore[arg-type]
    m = objckpt.inspect(str(tmp_path / "b"))
    if "crc_block" in option:
        assert m.crc_block == 64
    if "blob_size" in option:
        assert len(m.blobs) > 1
    assert _same(objckpt.read(str(tmp_path / "b")), _state(2))
    assert calls.take()["choose"] == 2
    objckpt.save(_state(3), str(tmp_path / "c"), **option)  # type: ignore[arg-type]
    assert calls.take()["choose"] == 0  # the second save's plan, with these options
    assert _same(objckpt.read(str(tmp_path / "c")), _state(3))


def test_the_cache_holds_a_few_entries_and_no_tensor(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import gc
    import weakref

    calls = Calls(monkeypatch)
    t = torch.randn(100)
    ref = weakref.ref(t)
    objckpt.save({"t": t}, str(tmp_path / "t"))
    del t
    gc.collect()
    assert ref() is None  # the cache kept no reference to the caller's tensor
    for i in range(plan_cache.DEFAULT_ENTRIES + 2):
        objckpt.save({"x": torch.zeros(i + 1)}, str(tmp_path / f"s{i}"))
    assert len(PLANS) == plan_cache.DEFAULT_ENTRIES
    calls.take()
    objckpt.save({"x": torch.ones(1)}, str(tmp_path / "again"))  # the oldest, evicted: planned anew
    assert calls.take()["choose"] == 1


def test_async_saves_reuse_the_plan_and_copy_the_values(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = Calls(monkeypatch)
    state = _state(1)
    objckpt.async_save(state, str(tmp_path / "a")).result()
    h = objckpt.async_save(state, str(tmp_path / "b"))
    want = {k: v.clone() for k, v in state["layers"]["0"].items()}
    for v in state["layers"]["0"].values():
        v.add_(1)  # after the call returned: the save holds the values as of the call
    h.result()
    assert calls.take() == {"choose": 1, "plan": 1}
    assert _same(objckpt.read(str(tmp_path / "b"))["layers"]["0"], want)


def test_plan_cache_off_by_environment(tmp_path: Any) -> None:
    code = ("import sys, torch, objckpt\n"
            "from objckpt.save.plan_cache import PLANS\n"
            "for i in range(3):\n"
            "    objckpt.save({'w': torch.full((4,), float(i))}, sys.argv[1] + f'/c{i}')\n"
            "print(PLANS.stats['hits'], PLANS.stats['misses'])\n")
    env = dict(os.environ, OBJCKPT_PLAN_CACHE="0", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "3"]
    env["OBJCKPT_PLAN_CACHE"] = "lots"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "bad")], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and "OBJCKPT_PLAN_CACHE" in out.stderr and "'lots'" in out.stderr


_SAVE_TWICE = """
import json, sys, torch, objckpt
from objckpt.save.plan_cache import PLANS
sys.path.insert(0, sys.argv[2])
from test_save_plan_cache import _state
for name, seed in json.loads(sys.argv[3]):
    objckpt.save(_state(seed, 40), sys.argv[1] + "/" + name)
print(json.dumps(PLANS.stats))
"""

_LOAD = """
import json, sys, torch, objckpt
sys.path.insert(0, sys.argv[2])
from test_save_plan_cache import _state, _same
want = _state(int(sys.argv[3]), 40)
tmpl = _state(99, 40)
objckpt.load(tmpl, sys.argv[1])
print(json.dumps(_same(tmpl, want)))
"""


def _py(code: str, *args: str) -> Any:
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _structure(m: Any) -> Any:
    """A manifest less what differs between two saves of the same state: attempt, time,
    blob names (they hold the attempt), and every crc (they follow the values)."""
    tensors = {k: (e.dtype, tuple(e.shape), e.alias_of, [(c.offsets, c.shape, c.blob, c.offset, c.length)
                                                            for c in e.chunks]) for k, e in m.tensors.items()}
    return (tensors, [(b.size, b.rank) for b in m.blobs], m.tree, m.metadata, m.world_size, m.crc_block,
            m.format_version)


def test_a_hit_writes_what_a_miss_writes_and_loads_bit_identical_in_a_new_process(tmp_path: Any) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    stats = _py(_SAVE_TWICE, str(tmp_path), here, json.dumps([["a", 1], ["hit", 2]]))
    assert stats == {"hits": 1, "described": 0, "misses": 1}
    stats = _py(_SAVE_TWICE, str(tmp_path), here, json.dumps([["miss", 2]]))  # a new process: no cache
    assert stats == {"hits": 0, "described": 0, "misses": 1}
    hit, miss = objckpt.inspect(str(tmp_path / "hit")), objckpt.inspect(str(tmp_path / "miss"))
    assert _structure(hit) == _structure(miss)
    same_crcs = [[(c.crc32c, c.block_crc32c) for c in e.chunks] for e in hit.tensors.values()]
    assert same_crcs == [[(c.crc32c, c.block_crc32c) for c in e.chunks] for e in miss.tensors.values()]
    assert _py(_LOAD, str(tmp_path / "hit"), here, "2") is True


# --------------------------------------------------------------------------- real ranks


def _ranks_state(rank: int, extra: bool, seed: int) -> dict[str, Any]:
    """Replicated tensors (every rank holds the same values) and, on rank 1 when ``extra``,
    a large tensor of its own: the replicated ones are then assigned to rank 0 to write
    (writers are balanced by bytes), so rank 0's plan follows rank 1's structure."""
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {f"rep{i}": torch.randn(200 + i, generator=g) for i in range(8)}
    if extra and rank == 1:
        state["own"] = objckpt.Shard(torch.full((20000,), float(seed)), (20000,), (0,))
    state["step"] = seed
    return state


def _disagreeing_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # rank 1 alternates between two structures; rank 0 keeps one.  Without the ranks agreeing
    # on the plan, rank 0 would reuse the plan made with rank 1's second structure while rank 1
    # reuses the one made with its first
    for i, extra in enumerate([True, False, True, True]):
        objckpt.save(_ranks_state(rank, extra, i), f"{root}/s{i}")
        out[f"s{i}"] = dict(PLANS.stats)
    if rank == 1:
        PLANS.clear()  # one rank lost its plans: every rank plans anew
    objckpt.save(_ranks_state(rank, True, 4), f"{root}/s4")
    out["s4"] = dict(PLANS.stats)
    if rank == 0:
        objckpt.save(_ranks_state(rank, True, 5), f"{root}/s5", no_dist=True)
    out["alone"] = dict(PLANS.stats)  # another world (this rank alone): not the group's plan
    return out


def test_ranks_that_do_not_all_hold_the_plan_all_plan_anew(tmp_path: Any) -> None:
    got = run_multiprocess(2, _disagreeing_ranks, str(tmp_path))
    hits = [[r[f"s{i}"]["hits"] for i in range(5)] for r in got]
    # s1: rank 1 changed (every rank plans); s2: rank 1 is back to its first structure, whose
    # plan it holds from s0, but rank 0's holds s1's: every rank plans; s3: every rank holds s2's;
    # s4: rank 1 cleared its cache (and its counts), so rank 0, holding s2's plan, plans anew too
    assert hits == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0]]
    assert got[1]["s4"] == {"hits": 0, "described": 0, "misses": 1}
    assert got[0]["s2"]["described"] == 2 and got[0]["s4"]["described"] == 3  # rank 0 kept its description
    assert got[0]["alone"]["misses"] == got[0]["s4"]["misses"] + 1
    for i in range(5):
        for rank in (0, 1):
            want = _ranks_state(rank, [True, False, True, True, True][i], i)
            got_back = objckpt.read(str(tmp_path / f"s{i}"))
            assert _same(got_back["rep3"], want["rep3"]) and got_back["step"] == i
            if "own" in want:  # rank 1's own key: in the manifest (not in rank 0's tree, which read() shows)
                chunks = objckpt.inspect(str(tmp_path / f"s{i}")).tensors["own"].chunks
                assert [c.crc32c for c in chunks] == [crc32c(want["own"].local.numpy().tobytes())]
    assert _same(objckpt.read(str(tmp_path / "s5"))["rep3"], _ranks_state(0, True, 5)["rep3"])


def _dtensor_saves(rank: int, world: int, root: str) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor

    flat, grid = init_device_mesh("cpu", (world,)), init_device_mesh("cpu", (1, world))
    full = torch.arange(48.0).reshape(8, 6)
    cases = [(flat, [DShard(0)]), (flat, [DShard(0)]), (flat, [DShard(1)]), (flat, [Replicate()]),
             (grid, [Replicate(), DShard(0)]), (grid, [Replicate(), DShard(0)])]
    hits = []
    for i, (mesh, placements) in enumerate(cases):
        objckpt.save({"w": distribute_tensor(full + i, mesh, placements), "step": i}, f"{root}/d{i}")
        hits.append(PLANS.stats["hits"])
    return hits


def test_dtensor_placements_and_meshes_are_part_of_the_structure(tmp_path: Any) -> None:
    got = run_multiprocess(2, _dtensor_saves, str(tmp_path))
    # the same placements again: a hit; other placements, another mesh: planned anew
    assert got == [[0, 1, 1, 1, 1, 2]] * 2
    for i in range(6):
        assert torch.equal(objckpt.read(str(tmp_path / f"d{i}"))["w"], torch.arange(48.0).reshape(8, 6) + i)
