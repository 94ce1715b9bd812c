"""async_save: staged copies, background upload, ordering, failures, memory, exit."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

import objckpt
from objckpt.storage import open_store
from objckpt.testing.stores import CountingStore, FaultyStore

from mp import run_multiprocess


class SlowStore(CountingStore):
    """Delays every part upload, so saves stay in flight; records manifest commits."""

    def __init__(self, inner: Any, delay: float = 0.05, commits: list | None = None) -> None:
        super().__init__(inner)
        self.delay = delay
        self.commits = commits if commits is not None else []

    def open_writer(self, key: str, size: int, num_parts: int = 1) -> Any:
        w = super().open_writer(key, size, num_parts)
        delay = self.delay

        class _Slow(type(w)):  # type: ignore[misc]
            pass

        orig = w.write_part

        async def slow(index: int, offset: int, data: memoryview) -> None:
            await asyncio.sleep(delay)
            await orig(index, offset, data)

        w.write_part = slow  # type: ignore[method-assign]
        return w

    async def put(self, key: str, data: Any, *, if_absent: bool = False) -> None:
        await super().put(key, data, if_absent=if_absent)
        if key.endswith("manifest.json"):
            self.commits.append(key)


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(512, 256, generator=g), "b": torch.randn(256, generator=g), "step": seed}


def test_mutating_after_return_does_not_change_checkpoint(ckpt_uri: tuple[str, dict[str, Any]]) -> None:
    uri, opts = ckpt_uri
    sd = _state()
    ref = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
    h = objckpt.async_save(sd, uri, storage_options=opts)
    assert h.staged()
    sd["w"].mul_(-1)
    sd["b"].zero_()
    res = h.result(timeout=60)
    assert h.done() and res.tensors == 2
    back = objckpt.read(uri, storage_options=opts)
    assert torch.equal(back["w"], ref["w"]) and torch.equal(back["b"], ref["b"])


def test_lazy_mode_with_wait_staged(tmp_path: Any) -> None:
    real = open_store(str(tmp_path))[0]
    sd = _state(1)
    ref = sd["w"].clone()
    h = objckpt.async_save(sd, str(tmp_path / "lazy"), lazy=True, store=SlowStore(real, 0.02), part_size=64 << 10)
    # forward/backward would run here
    h.wait_staged(timeout=60)
    sd["w"].add_(1)  # optimizer.step() after wait_staged: allowed
    h.result(timeout=60)
    assert torch.equal(objckpt.read(str(tmp_path / "lazy"))["w"], ref)


def test_lazy_violation_is_reported_and_commits_nothing(tmp_path: Any) -> None:
    real = open_store(str(tmp_path))[0]
    sd = _state(2)
    # one staging buffer and slow uploads: staging cannot finish before the mutation below (the
    # largest part is 65 KiB, 'b' after w's last chunk; staging_bytes is a hard limit, one such part fits)
    h = objckpt.async_save(sd, str(tmp_path / "bad"), lazy=True, store=SlowStore(real, 0.2), part_size=64 << 10,
                           staging_bytes=128 << 10)
    sd["w"].add_(1)  # mutated before wait_staged: a torn checkpoint must not be committed
    with pytest.raises(RuntimeError, match=r"'w' was modified before wait_staged"):
        h.result(timeout=60)
    with pytest.raises(objckpt.NotFoundError):
        objckpt.inspect(str(tmp_path / "bad"))
    assert not any(p.is_file() for p in (tmp_path / "bad").rglob("*"))  # its blobs are gone too


@pytest.mark.parametrize("k", [2, 3])
def test_saves_in_flight_commit_in_order(tmp_path: Any, k: int) -> None:
    real = open_store(str(tmp_path))[0]
    commits: list[str] = []
    handles = []
    for i in range(k):
        # the first save is the slowest: later ones finish uploading first, yet commit after it
        store = SlowStore(real, 0.3 if i == 0 else 0.0, commits)
        handles.append(objckpt.async_save(_state(i), str(tmp_path / f"s{i}"), store=store, max_in_flight=k,
                                          part_size=64 << 10))
    assert not handles[0].done()
    for h in handles:
        h.result(timeout=60)
    assert [c.split("/")[-2] for c in commits] == [f"s{i}" for i in range(k)]
    for i in range(k):
        assert objckpt.read(str(tmp_path / f"s{i}"))["step"] == i


def test_background_failure_surfaces_and_leaves_no_manifest(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/async/fail"
    faulty = FaultyStore(open_store(uri, opts)[0], "write_part", 1)
    h = objckpt.async_save({"w": torch.randn(2048, 1024)}, uri, store=faulty, part_size=5 << 20)
    with pytest.raises(ConnectionError, match="injected"):
        h.result(timeout=60)
    assert isinstance(h.exception(), ConnectionError)
    with pytest.raises(objckpt.NotFoundError):
        objckpt.inspect(uri, storage_options=opts)


def test_staging_memory_stays_within_budget(tmp_path: Any) -> None:
    from objckpt.runtime.memory import host_pool

    part = 256 << 10
    budget = 3 * part
    sd = {f"t{i}": torch.randn(64, 1024) for i in range(12)}  # 12 parts of 256 KiB = 3 MiB
    host_pool().reset_peak()
    real = open_store(str(tmp_path))[0]
    h = objckpt.async_save(sd, str(tmp_path / "b"), store=SlowStore(real, 0.02), part_size=part,
                           staging_bytes=budget)
    h.result(timeout=60)
    pool = host_pool()
    assert 0 < pool.peak <= budget  # staging and upload pipelined part by part
    back = objckpt.read(str(tmp_path / "b"))
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_interpreter_exit_waits_for_save_in_flight(tmp_path: Any) -> None:
    script = textwrap.dedent(f"""
        import asyncio, torch, objckpt
        from objckpt.storage import open_store
        from objckpt.testing.stores import CountingStore

        class Slow(CountingStore):
            def open_writer(self, key, size, num_parts=1):
                w = super().open_writer(key, size, num_parts)
                orig = w.write_part
                async def slow(i, o, d):
                    await asyncio.sleep(0.3)
                    await orig(i, o, d)
                w.write_part = slow
                return w

        sd = {{"w": torch.arange(100000, dtype=torch.float32)}}
        h = objckpt.async_save(sd, {str(tmp_path / 'exit')!r}, store=Slow(open_store({str(tmp_path)!r})[0]),
                               part_size=64 << 10)
        assert not h.done()
        print("returned before upload finished", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "returned before upload finished" in out.stdout
    assert "waiting for 1 checkpoint save(s) in flight before exit" in out.stderr
    back = objckpt.read(str(tmp_path / "exit"))
    assert torch.equal(back["w"], torch.arange(100000, dtype=torch.float32))


def async_two_ranks(rank: int, world: int, uri: str) -> bool:
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    sd = {"w": distribute_tensor(full.clone(), mesh, [Shard(0)]), "rep": torch.ones(5), "step": 7}
    h = objckpt.async_save(sd, uri)
    sd["w"].to_local().zero_()  # training goes on
    h.result(timeout=60)
    tmpl = {"w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(0)]), "rep": torch.zeros(5), "step": 0}
    objckpt.load(tmpl, uri)
    return torch.equal(tmpl["w"].full_tensor(), full) and tmpl["step"] == 7


def test_async_save_two_ranks(tmp_path: Any) -> None:
    assert all(run_multiprocess(2, async_two_ranks, str(tmp_path / "mr")))
    assert objckpt.inspect(str(tmp_path / "mr")).world_size == 2


def test_mirror_set_reuses_copies_stays_busy_and_forgets_after_fork() -> None:
    from objckpt.save.mirrors import MirrorSet

    ms = MirrorSet()
    t = torch.arange(12000.0).reshape(3000, 4)
    assert ms.acquire() and not ms.acquire()  # one save at a time
    m1 = ms.mirror("w", t)
    ms.wait()
    assert torch.equal(m1, t) and m1.data_ptr() != t.data_ptr()
    ms.release()
    assert ms.acquire()
    t.add_(1)
    m2 = ms.mirror("w", t)  # the same buffer, refreshed (host copies run on threads: done once wait() returns)
    ms.wait()
    assert m2.data_ptr() == m1.data_ptr() and torch.equal(m2, t)
    ms.release()
    assert ms.acquire()
    ms.mirror("other", torch.zeros(10))  # a different, much smaller state: the unused "w" mirror goes
    ms.release()
    assert ms.nbytes == 10 * 4
    ms._pid = -1  # as if this process were a fork of the one that made them
    assert ms.acquire() and ms.nbytes == 0
    ms.release()


def test_default_async_save_copies_while_describing(tmp_path: Any) -> None:
    """The default mode uploads from its own copies: the values as of the call, whatever
    the caller does to its tensors afterwards; the next save reuses the copies."""
    from objckpt.save.mirrors import mirror_set

    state = {"a": torch.randn(64, 64), "b": torch.randn(10), "n": 3}
    ref = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    h = objckpt.async_save(state, str(tmp_path / "m"))
    state["a"].zero_()
    state["b"].fill_(7)
    h.result(timeout=60)
    back = objckpt.read(str(tmp_path / "m"))
    assert torch.equal(back["a"], ref["a"]) and torch.equal(back["b"], ref["b"]) and back["n"] == 3
    held = mirror_set().nbytes
    assert held >= (64 * 64 + 10) * 4
    objckpt.async_save(state, str(tmp_path / "m2")).result(timeout=60)
    assert mirror_set().nbytes == held  # reused, not grown
    assert torch.equal(objckpt.read(str(tmp_path / "m2"))["b"], torch.full((10,), 7.0))


def test_staging_copies_of_parameters_record_no_autograd_graph(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Parameters (requires_grad) are copied into the host mirrors outside autograd: no mirror
    requires grad or holds a graph back to the model, and the saved values are the model's."""
    from objckpt.save.mirrors import mirror_set

    model = torch.nn.Linear(7, 5)
    extra = {"buf": torch.arange(4.0)}  # a plain tensor next to them
    h = objckpt.async_save({"model": model.state_dict(keep_vars=True), **extra}, str(tmp_path / "ck"))
    h.result()
    mirrors = [m[0] for m in mirror_set()._mirrors.values()]
    assert mirrors and not any(m.requires_grad or m.grad_fn is not None for m in mirrors)
    back = objckpt.read(str(tmp_path / "ck"))
    assert torch.equal(back["model"]["weight"], model.weight.detach()) and torch.equal(back["buf"], extra["buf"])
