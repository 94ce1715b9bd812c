"""The subprocess side of the fault campaign: ``python -m testkit.campaign_child
<command> <json args>``; its last stdout line is a JSON result.

A subprocess because a trial must be able to SIGKILL a save, cap a hostile read's memory
(``RLIMIT_AS``) and time, and measure its peak RSS apart from the test runner's.

* ``save``: save ``make_state(seed)``; with ``kill_at`` the process SIGKILLs itself just
  before its ``kill_at``-th storage request (a crash at a random request count);
* ``read``: read a checkpoint (dead-endpoint timing);
* ``hostile``: run read / load / inspect / verify on a (hostile) checkpoint under a memory cap;
* ``op``: ``cp``, ``rm`` or ``prune`` (the library calls behind the commands) with the
  same ``kill_at`` (:mod:`testkit.campaign_ops`);
* ``rank_save``: one rank of a gloo group saving sharded state, ``kill_at`` on ``kill_rank``;
* ``commit_rank``: the same, with a rank killed at a point of rank 0's commit
  (:mod:`testkit.campaign_commit`).
"""
from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from typing import Any, Optional, Sequence

from objckpt.storage.base import BlobWriter, ObjectInfo, ObjectStore
from objckpt.testing.stores import CountingStore


class KillStore(CountingStore):
    """Counts every storage request of the wrapped store and SIGKILLs this process just
    before the ``kill_at``-th (1-based): what a crash (OOM kill, preemption) does, with
    requests in flight on other coroutines cut off mid-way."""

    def __init__(self, inner: ObjectStore, kill_at: int) -> None:
        super().__init__(inner)
        self.kill_at, self.count = kill_at, 0

    def _tick(self) -> None:
        self.count += 1
        if self.count >= self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    async def get(self, key: str) -> bytes:
        self._tick()
        return await super().get(key)

    async def get_range_into(self, key: str, offset: int, out: memoryview) -> None:
        self._tick()
        await super().get_range_into(key, offset, out)

    async def put(self, key: str, data: memoryview | bytes, *, if_absent: bool = False) -> None:
        self._tick()
        await super().put(key, data, if_absent=if_absent)

    async def head(self, key: str) -> Optional[ObjectInfo]:
        self._tick()
        return await super().head(key)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        self._tick()
        return await super().list(prefix)

    async def delete(self, keys: Sequence[str]) -> None:
        self._tick()
        await super().delete(keys)

    def open_writer(self, key: str, size: int, num_parts: int = 1) -> BlobWriter:
        w = super().open_writer(key, size, num_parts)
        outer = self

        class _K(BlobWriter):
            async def write_part(self, index: int, offset: int, data: memoryview) -> None:
                outer._tick()
                await w.write_part(index, offset, data)

            async def complete(self) -> None:
                outer._tick()
                await w.complete()

            async def abort(self) -> None:
                await w.abort()

        return _K()


def _peak_rss() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _error(e: BaseException) -> dict[str, Any]:
    from objckpt.errors import ObjckptError

    return {"error": f"{type(e).__module__}.{type(e).__name__}: {str(e)[:600]}",
            "objckpt_error": isinstance(e, ObjckptError)}


def cmd_save(a: dict[str, Any]) -> dict[str, Any]:
    import objckpt
    from objckpt.errors import CheckpointExistsError, PreconditionFailed
    from objckpt.storage import open_store

    from .campaign import make_state

    st, _ = open_store(a["uri"], a.get("opts") or {})
    store = KillStore(st, a["kill_at"]) if a.get("kill_at") else None
    try:
        for _ in range(a.get("repeat", 1)):
            objckpt.save(make_state(a["seed"]), a["uri"], storage_options=a.get("opts") or {}, store=store,
                         overwrite=a.get("overwrite", False), part_size=64 << 10, blob_size=96 << 10)
    except (CheckpointExistsError, PreconditionFailed) as e:
        return {"seed": a["seed"], "saved": False, "exists": True, "lost": str(e)[:300]}
    except Exception as e:  # noqa: BLE001
        return {"seed": a["seed"], "saved": False, **_error(e)}
    return {"seed": a["seed"], "saved": True}


def cmd_read(a: dict[str, Any]) -> dict[str, Any]:
    import objckpt

    t0 = time.perf_counter()
    try:
        objckpt.read(a["uri"], storage_options=a.get("opts") or {})
    except Exception as e:  # noqa: BLE001
        return {"seconds": time.perf_counter() - t0, **_error(e)}
    return {"seconds": time.perf_counter() - t0}


def cmd_hostile(a: dict[str, Any]) -> dict[str, Any]:
    """Each of read / inspect / verify / load on the checkpoint: the error (or none) it gave,
    and the CPU seconds it used (the work it did, whatever else runs on the machine).
    ``cpu_limit``: the CPU seconds this process may use in all (``RLIMIT_CPU``: SIGXCPU beyond)."""
    cap = int(a.get("memory_cap", 0))
    if cap:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    cpu = int(a.get("cpu_limit", 0))
    if cpu:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
    import torch

    import objckpt
    from objckpt.cli import main as cli_main

    uri = a["uri"]
    ops: dict[str, Any] = {
        "read": lambda: objckpt.read(uri),
        "inspect": lambda: objckpt.inspect(uri),
        "verify": lambda: cli_main(["verify", uri]),
        "load": lambda: objckpt.load({"w": torch.zeros(4, 4)}, uri, strict=False),
    }
    out: dict[str, Any] = {}
    for name in a.get("ops", list(ops)):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            ops[name]()
            r: dict[str, Any] = {"ok": True}
        except BaseException as e:  # noqa: BLE001 - MemoryError and RecursionError included
            r = _error(e)
        r["seconds"] = round(time.perf_counter() - t0, 3)
        r["cpu_s"] = round(time.process_time() - c0, 3)
        out[name] = r
    return {"ops": out, "peak_rss": _peak_rss()}


def cmd_op(a: dict[str, Any]) -> dict[str, Any]:
    """``cp`` SRC DST (overwrite), ``rm`` URI, or ``prune`` ROOT --keep-last K, killed before
    the ``kill_at``-th request to the store they change."""
    from objckpt.runtime import loop as _runtime
    from objckpt.ops.delete import delete_checkpoint
    from objckpt.manager.index import StepIndex
    from objckpt.manager.retention import RetentionPolicy
    from objckpt.manager.worker import apply_retention
    from objckpt.storage import open_store
    from objckpt.ops.copy import copy

    opts = a.get("opts") or {}
    uri = a["dst"] if a["op"] == "cp" else a["uri"]
    st, prefix = open_store(uri, opts)
    store = KillStore(st, a["kill_at"]) if a.get("kill_at") else st
    try:
        if a["op"] == "cp":
            copy(a["src"], a["dst"], storage_options=opts, overwrite=True, part_size=64 << 10, dst_store=store)
        elif a["op"] == "rm":
            _runtime.run(delete_checkpoint(store, prefix, uri))
        else:
            apply_retention(StepIndex(store, prefix), RetentionPolicy(keep_last=a["keep_last"]), uri, adopt=True)
    except Exception as e:  # noqa: BLE001
        return {"done": False, **_error(e)}
    return {"done": True}


def cmd_rank_save(a: dict[str, Any]) -> dict[str, Any]:
    """Rank ``rank`` of ``world`` (gloo, file rendezvous ``rdzv``) saves its shards of
    ``rank_state(seed)`` over ``uri``; on ``kill_rank`` SIGKILLed before request ``kill_at``."""
    import objckpt
    from objckpt.storage import open_store

    from .campaign_ops import gloo_rank, sharded_rank_state

    rank, world = a["rank"], a["world"]
    try:
        with gloo_rank(a):
            st, _ = open_store(a["uri"], a.get("opts") or {})
            store = KillStore(st, a["kill_at"]) if rank == a["kill_rank"] else None
            objckpt.save(sharded_rank_state(a["seed"], world), a["uri"], storage_options=a.get("opts") or {},
                         store=store, overwrite=a.get("overwrite", True), part_size=64 << 10, blob_size=96 << 10,
                         collective_timeout=a.get("collective_timeout", 30.0))
    except Exception as e:  # noqa: BLE001 - the survivor of a killed peer reports its error
        return {"rank": rank, "saved": False, **_error(e)}
    return {"rank": rank, "saved": True}


def main(argv: Sequence[str]) -> None:
    command, args = argv[0], json.loads(argv[1])
    from .campaign_commit import commit_rank

    fn = {"save": cmd_save, "read": cmd_read, "hostile": cmd_hostile, "op": cmd_op,
          "rank_save": cmd_rank_save, "commit_rank": commit_rank}[command]
    print(json.dumps(fn(args), default=repr), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: a hostile input may have left threads behind


if __name__ == "__main__":
    main(sys.argv[1:])
