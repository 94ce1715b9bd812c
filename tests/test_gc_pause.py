"""The cyclic garbage collector is paused while a manifest or rank index is decoded
(objckpt.runtime.gc_pause): no collection runs inside the decode (at most one of the young
generation when it ends, where hundreds would without the pause), the collector is on again
after it (also after a failed decode, and after decodes in flight on several threads end),
and a program that switched the collector off itself finds it off."""
from __future__ import annotations

import gc
import threading
from typing import Any, Iterator

import pytest
import torch

import objckpt
from objckpt.errors import CorruptCheckpointError
from objckpt.format import manifest as _manifest
from objckpt.runtime.gc_pause import FREEZE_PAYS, FrozenOld, paused_gc


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """Each cyclic collection that starts, by generation; a low threshold so a decode of
    thousands of objects would trigger many."""
    seen: list[int] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    before = gc.get_threshold()
    gc.set_threshold(50, 2, 2)
    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*before)


@pytest.fixture(scope="module")
def manifest_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    d = tmp_path_factory.mktemp("ck")
    objckpt.save({f"layers.{i}.w": torch.zeros(300) for i in range(400)}, str(d / "ck"), crc_block=64)
    return (d / "ck" / "manifest.json").read_bytes()


def test_a_manifest_decodes_without_a_collection_and_the_collector_is_on_after(
        manifest_bytes: bytes, collections: list[int]) -> None:
    assert gc.isenabled()
    [gc.collect() for _ in range(3)]
    collections.clear()
    m = _manifest.decode(manifest_bytes, "ck")
    assert len(m.tensors) == 400
    # none inside; at most the one the first allocation after it starts (of the young objects)
    assert len(collections) <= 1 and 2 not in collections and gc.isenabled()
    _ = [[i] for i in range(2000)]  # the collector runs again after the decode
    assert collections


def test_a_failed_decode_switches_the_collector_back_on(manifest_bytes: bytes) -> None:
    bad = manifest_bytes[:-40] + b"}"
    with pytest.raises(CorruptCheckpointError):
        _manifest.decode(bad, "ck")
    assert gc.isenabled()


def test_a_collector_the_program_switched_off_stays_off(manifest_bytes: bytes) -> None:
    gc.disable()
    try:
        _manifest.decode(manifest_bytes, "ck")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_pauses_on_several_threads_end_with_the_last(manifest_bytes: bytes) -> None:
    inside, release = threading.Barrier(3), threading.Event()
    states: list[bool] = []

    def hold() -> None:
        with paused_gc():
            inside.wait()
            release.wait()

    first = threading.Thread(target=hold)
    second = threading.Thread(target=hold)
    first.start()
    second.start()
    inside.wait()
    states.append(gc.isenabled())  # both inside: off
    release.set()
    first.join()
    second.join()
    states.append(gc.isenabled())  # both out: on again
    assert states == [False, True]
    with paused_gc():  # nested on one thread
        with paused_gc():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_rank_index_decodes_without_a_collection(collections: list[int]) -> None:
    from objckpt.format import rank_index
    from objckpt.format.manifest import Chunk, ChunkRecord

    recs = [ChunkRecord(f"t{i}", Chunk((0,), (16,), 0, 64 * i, 64, i, (i, i + 1))) for i in range(2000)]
    data = rank_index.encode("a", 0, recs)
    [gc.collect() for _ in range(3)]
    collections.clear()
    got = rank_index.decode(data, "idx", attempt="a", rank=0, blobs=[0], blob_sizes=[64 * 2000], crc_block=32)
    assert len(got) == 2000 and got["t7"][(0,)].block_crc32c == (7, 8)
    assert len(collections) <= 1 and 2 not in collections and gc.isenabled()


class _Probe:
    """A Stateful value that notes the collector's frozen count while the load hands it its state."""

    def __init__(self) -> None:
        self.w = torch.zeros(8)
        self.seen: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen.append(gc.get_freeze_count())
        self.w = sd["w"]


@pytest.fixture
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    uri = str(tmp_path_factory.mktemp("frozen") / "ck")
    objckpt.save({"probe": {"w": torch.arange(8.0)}, **{f"t{i}": torch.full((4,), float(i)) for i in range(50)}}, uri)
    return uri


def _template() -> dict[str, Any]:
    return {"probe": _Probe(), **{f"t{i}": torch.zeros(4) for i in range(50)}}


needs_freeze = pytest.mark.skipif(not FREEZE_PAYS, reason="this Python's gc.freeze visits every object: not used")


@needs_freeze
def test_a_load_keeps_the_older_objects_frozen_while_it_runs_and_unfreezes_them_after(saved: str) -> None:
    assert gc.get_freeze_count() == 0
    st = _template()
    objckpt.load(st, saved)
    assert st["probe"].seen and st["probe"].seen[0] > 1000  # the manifest and the program: frozen inside
    assert torch.equal(st["probe"].w, torch.arange(8.0)) and torch.equal(st["t7"], torch.full((4,), 7.0))
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_a_failed_load_unfreezes_too(saved: str) -> None:
    st = _template()
    st["t3"] = torch.zeros(5)  # the wrong shape: refused
    with pytest.raises(objckpt.ObjckptError, match="t3"):
        objckpt.load(st, saved)
    assert gc.get_freeze_count() == 0


def test_a_program_that_froze_its_own_objects_keeps_exactly_those_frozen(saved: str) -> None:
    gc.freeze()  # as a program does before forking workers
    try:
        mine = gc.get_freeze_count()
        st = _template()
        objckpt.load(st, saved)
        # nothing more frozen by the load, nothing of the program's unfrozen (a frozen object
        # that dies meanwhile leaves the count)
        assert len(st["probe"].seen) == 1 and mine - 100 < st["probe"].seen[0] <= mine
        assert mine - 100 < gc.get_freeze_count() <= mine
    finally:
        gc.unfreeze()


def test_loads_on_two_threads_leave_nothing_frozen(saved: str) -> None:
    errors: list[BaseException] = []

    def one() -> None:
        try:
            for _ in range(5):
                st = _template()
                objckpt.load(st, saved)
                assert torch.equal(st["t9"], torch.full((4,), 9.0))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == [] and gc.get_freeze_count() == 0


class _SaveProbe:
    """A Stateful value that notes the collector's frozen count when a save asks for its state."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        self.seen.append(gc.get_freeze_count())
        return {"w": torch.arange(6.0)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


@needs_freeze
def test_a_save_keeps_the_older_objects_frozen_while_it_runs(tmp_path_factory: pytest.TempPathFactory) -> None:
    probe = _SaveProbe()
    uri = str(tmp_path_factory.mktemp("save") / "ck")
    objckpt.save({"probe": probe, "t": torch.ones(3)}, uri)
    assert probe.seen and probe.seen[0] > 1000 and gc.get_freeze_count() == 0
    assert torch.equal(objckpt.read(uri)["probe"]["w"], torch.arange(6.0))
    with pytest.raises(objckpt.ObjckptError):  # a failed save unfreezes too
        objckpt.save({"probe": probe, "t": torch.ones(3)}, uri)  # exists: refused
    assert gc.get_freeze_count() == 0


def test_a_first_save_describes_and_plans_without_a_collection(
        tmp_path: Any, collections: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The first save of a structure (the save plan cache's miss) describes its tensors and
    plans their writes with the collector paused: objects per tensor, no cycle among them."""
    from objckpt.layout import GatheredLayout
    from objckpt.save import pipeline, plan_cache

    inside: dict[str, int] = {}

    def counted(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            n = len(collections)
            out = real(*args, **kwargs)
            inside[name] = len(collections) - n
            return out
        return call

    monkeypatch.setattr(pipeline, "describe_walked", counted("describe", pipeline.describe_walked))
    monkeypatch.setattr(pipeline, "plan_made", counted("plan_made", pipeline.plan_made))
    monkeypatch.setattr(GatheredLayout, "plan", counted("layout.plan", GatheredLayout.plan))
    misses = plan_cache.PLANS.stats["misses"]
    state = {f"first-save.{i}.w": torch.full((8,), float(i)) for i in range(2000)}
    objckpt.save(state, str(tmp_path / "ck"))
    assert plan_cache.PLANS.stats["misses"] == misses + 1
    assert inside == {"describe": 0, "layout.plan": 0, "plan_made": 0} and gc.isenabled()
    assert collections  # the collector ran around them (threshold 50)
    assert torch.equal(objckpt.read(str(tmp_path / "ck"))["first-save.1999.w"], torch.full((8,), 1999.0))


def test_a_child_forked_during_a_pause_has_the_collector_on_and_nothing_to_end() -> None:
    """A worker forked while a decode holds the pause (another thread) must not inherit a
    collector switched off for good."""
    import os

    with paused_gc():
        frozen = FrozenOld()
        frozen.now()
        try:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: report, then leave at once
                ok = gc.isenabled()
                with paused_gc():
                    pass
                ok = ok and gc.isenabled()
                os.write(w, b"1" if ok else b"0")
                os._exit(0)
            os.close(w)
            got = os.read(r, 1)
            os.close(r)
            os.waitpid(pid, 0)
            assert not gc.isenabled()  # the parent's pause goes on
        finally:
            frozen.close()
    assert got == b"1" and gc.isenabled() and gc.get_freeze_count() == 0


def test_where_freezing_does_not_pay_nothing_is_frozen(saved: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python 3.14 (incremental collector) and free-threaded builds: gc.freeze visits every
    object, so loads freeze nothing and still load."""
    import objckpt.runtime.gc_pause as gp

    monkeypatch.setattr(gp, "FREEZE_PAYS", False)
    st = _template()
    objckpt.load(st, saved)
    assert st["probe"].seen == [0] and torch.equal(st["t3"], torch.full((4,), 3.0))
    assert gc.get_freeze_count() == 0
