"""SaveHandle is a concurrent.futures.Future: wait(), as_completed(), add_done_callback(),
exception(), cancel() (a running save cannot be cancelled), asyncio.wrap_future (moto S3 over HTTP)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

import pytest
import torch

import objckpt
from objckpt.results import SaveResult
from objckpt.save.background import SaveHandle
from objckpt.storage.memory import MemoryStore
from objckpt.testing.stores import FaultyStore


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, generator=g), "step": step}


def test_manager_handles_work_as_futures(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    called: list[tuple[SaveHandle, str]] = []
    lock = threading.Lock()
    with objckpt.CheckpointManager(f"s3://{bucket}/run", async_save=True, storage_options=opts) as m:
        handles = []
        for step in (1, 2, 3):
            h = m.save(step, _state(step))
            assert isinstance(h, concurrent.futures.Future) and isinstance(h, SaveHandle)
            assert h.cancel() is False and not h.cancelled()  # a save cannot be recalled
            h.add_done_callback(lambda f: called.append((f, threading.current_thread().name)))  # type: ignore[arg-type]
            handles.append(h)
        done, not_done = concurrent.futures.wait(handles, timeout=60)
        assert done == set(handles) and not not_done
        assert m.latest_step() == 3  # a committed save is indexed before a reader answers
        assert set(concurrent.futures.as_completed(handles, timeout=60)) == set(handles)
        for h in handles:
            assert h.done() and not h.running() and h.exception() is None and not h.cancelled()
            assert isinstance(h.result(timeout=0), SaveResult) and h.result().uri == h.uri
            assert h.cancel() is False
        with lock:
            assert sorted(f.uri for f, _ in called) == [h.uri for h in handles]
        late: list[SaveHandle] = []
        handles[0].add_done_callback(late.append)  # type: ignore[arg-type]
        assert late == [handles[0]]  # already done: called at once, as for any future

        async def awaited() -> SaveResult:
            h = m.save(4, _state(4))
            assert h is not None
            return await asyncio.wrap_future(h)

        assert asyncio.run(awaited()).uri.endswith("step-0000000004")
        assert repr(handles[0]) == f"<SaveHandle {handles[0].uri!r} finished>"


def test_failed_save_reports_through_the_future_interface() -> None:
    store = FaultyStore(MemoryStore(), "complete")
    h = objckpt.async_save(_state(1), "memory://b/ck", store=store)
    done, _ = concurrent.futures.wait([h], timeout=60, return_when=concurrent.futures.FIRST_EXCEPTION)
    assert done == {h}
    err = h.exception(timeout=0)
    assert err is not None and "injected fault" in str(err)
    with pytest.raises(type(err)):
        h.result()
    assert [f for f in concurrent.futures.as_completed([h])] == [h]
    assert h.cancel() is False and not h.cancelled()
