"""Fork while an async_save is in flight: the child owns none of the parent's saves.

A DataLoader forks its workers (every epoch, by default) while the training
process may have a checkpoint upload in flight.  Each worker used to wait at
exit for the parent's save, whose threads do not exist in the child (they would
never finish it), printing "waiting for 1 checkpoint save(s) in flight" and
holding the epoch up until the DataLoader killed it (about 10 s per epoch).

Each scenario runs in a fresh interpreter (pytest's own process must not fork
with objckpt's threads running) with two saves in flight, a plain async_save and
a CheckpointManager's (whose worker waits for it to index the step), their
manifest writes held until the parent releases them, so both are certainly in
flight at every fork.
The checks are outcomes, not times: the children exit on their own with status
0, print nothing about saves in flight, start with a fresh objckpt runtime, and
the parent's save still commits and loads bit-exact afterwards.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

WAIT_MESSAGE = "checkpoint save(s) in flight before exit"

PRELUDE = textwrap.dedent(
    """
    import asyncio, json, multiprocessing, os, sys, threading
    import torch
    import objckpt
    from objckpt.storage.local import LocalStore

    gate = threading.Event()
    real_put = LocalStore.put

    async def held_put(self, key, data, *, if_absent=False):
        # every manifest write waits for the gate: the saves stay in flight
        if key.endswith("manifest.json"):
            while not gate.is_set():
                await asyncio.sleep(0.01)
        await real_put(self, key, data, if_absent=if_absent)

    LocalStore.put = held_put
    root = sys.argv[1]
    uri = os.path.join(root, "parent")
    state = {"w": torch.randn(256, 64, generator=torch.Generator().manual_seed(1)), "step": 3}
    # a manager's async save (its worker waits for the commit to index the step) and a plain one
    manager = objckpt.CheckpointManager(os.path.join(root, "run"), keep_last=2, async_save=True)
    manager.save(1, {"w": torch.ones(1000)})
    handle = objckpt.async_save(state, uri, max_in_flight=2)
    assert not handle.done()

    def finish_parent():
        gate.set()
        handle.result(timeout=60)
        out = {"w": torch.zeros(256, 64), "step": 0}
        objckpt.load(out, uri)
        assert torch.equal(out["w"], state["w"]) and out["step"] == 3, "parent's checkpoint differs"
        manager.wait()
        assert manager.latest_step() == 1, manager.steps()
        manager.close()
        print("PARENT-COMMITTED", flush=True)
    """
)

PROCESS_CHILD = PRELUDE + textwrap.dedent(
    """
    def child(report_path):
        gate.set()  # this process's copy of the gate: the child's own saves are not held
        from objckpt.runtime import loop as _runtime
        from objckpt.save import background
        from objckpt.errors import ForeignSaveError
        r = {"in_flight": len(background._in_flight), "loop": _runtime._loop is None,
             "pool": _runtime._pool is None}
        try:
            handle.result(timeout=5)
            r["foreign"] = "no error"
        except ForeignSaveError as e:
            r["foreign"] = "ForeignSaveError: " + str(e)
        except BaseException as e:
            r["foreign"] = type(e).__name__
        # the child's own saves work and do not queue behind the parent's
        own = {"x": torch.arange(10.0)}
        objckpt.async_save(own, os.path.join(root, "child-async")).result(timeout=60)
        objckpt.save(own, os.path.join(root, "child-sync"))
        got = {"x": torch.zeros(10)}
        objckpt.load(got, os.path.join(root, "child-async"))
        r["child_saves"] = torch.equal(got["x"], own["x"])
        with open(report_path, "w") as f:
            json.dump(r, f)

    def scenario():
        ctx = multiprocessing.get_context("fork")
        p = ctx.Process(target=child, args=(os.path.join(root, "report.json"),))
        p.start()
        p.join(60)
        assert not p.is_alive(), "the forked child did not exit (waiting for the parent's save?)"
        assert p.exitcode == 0, p.exitcode
        # a bare os.fork whose child exits through the interpreter's normal shutdown
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        for _ in range(600):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            threading.Event().wait(0.1)
        else:
            os.kill(pid, 9)
            raise AssertionError("os.fork child did not exit")
        assert os.waitstatus_to_exitcode(status) == 0

    if __name__ == "__main__":
        try:
            scenario()
        finally:
            gate.set()  # a failed check must not leave the parent waiting for its own save at exit
        finish_parent()
    """
)

DATALOADER = PRELUDE + textwrap.dedent(
    """
    import time
    from torch.utils.data import DataLoader, Dataset

    class Squares(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.tensor([float(i * i)])

    def scenario():
        loader = DataLoader(Squares(), batch_size=2, num_workers=2, multiprocessing_context="fork")
        for epoch in range(2):  # workers are forked anew each epoch
            t = time.perf_counter()
            total = sum(float(b.sum()) for b in loader)
            assert total == sum(i * i for i in range(8)), total
            print(f"EPOCH {epoch} {time.perf_counter() - t:.2f} s", flush=True)
        assert not handle.done(), "the save should still be held in flight"

    if __name__ == "__main__":
        try:
            scenario()
        finally:
            gate.set()
        finish_parent()
    """
)


def _run(script: str, tmp_path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "scenario.py"
    path.write_text(script)
    root = tmp_path / "ck"
    root.mkdir()
    return subprocess.run([sys.executable, str(path), str(root)], capture_output=True, text=True, timeout=240)


def test_forked_child_does_not_wait_for_parents_saves(tmp_path) -> None:
    r = _run(PROCESS_CHILD, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert WAIT_MESSAGE not in r.stderr, r.stderr[-3000:]
    assert "PARENT-COMMITTED" in r.stdout
    report = json.loads((tmp_path / "ck" / "report.json").read_text())
    assert report["in_flight"] == 0  # the parent's save is not the child's
    assert report["loop"] and report["pool"]  # a fresh event loop and thread pool in the child
    assert report["foreign"].startswith("ForeignSaveError: ") and "started by process" in report["foreign"]
    assert report["child_saves"] is True  # the child's own saves do not queue behind the parent's


def test_dataloader_workers_forked_during_async_save_exit_quietly(tmp_path) -> None:
    pytest.importorskip("torch.utils.data")
    r = _run(DATALOADER, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert WAIT_MESSAGE not in r.stderr, r.stderr[-3000:]
    assert r.stdout.count("EPOCH") == 2 and "PARENT-COMMITTED" in r.stdout

