"""The subprocess side of the fault campaign: ``python -m objckpt.testing.campaign_child
<command> <json args>``; its last stdout line is a JSON result.

A subprocess because a trial must be able to SIGKILL a save, cap a hostile read's memory
(``RLIMIT_AS``) and time, and measure its peak RSS apart from the test runner's.

* ``save``: save ``make_state(seed)``; with ``kill_at`` the process SIGKILLs itself just
  before its ``kill_at``-th storage request (a crash at a random request count);
* ``read``: read a checkpoint (dead-endpoint timing);
* ``hostile``: run read / load / inspect / verify on a (hostile) checkpoint under a memory cap.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from typing import Any, Optional, Sequence

from ..storage.base import BlobWriter, ObjectInfo, ObjectStore
from .stores import CountingStore


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
    from ..errors import ObjckptError

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
    """Each of read / inspect / verify / load on the checkpoint: the error (or none) it gave."""
    cap = int(a.get("memory_cap", 0))
    if cap:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
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
        t0 = time.perf_counter()
        try:
            ops[name]()
            r: dict[str, Any] = {"ok": True}
        except BaseException as e:  # noqa: BLE001 - MemoryError and RecursionError included
            r = _error(e)
        r["seconds"] = round(time.perf_counter() - t0, 3)
        out[name] = r
    return {"ops": out, "peak_rss": _peak_rss()}


def main(argv: Sequence[str]) -> None:
    command, args = argv[0], json.loads(argv[1])
    fn = {"save": cmd_save, "read": cmd_read, "hostile": cmd_hostile}[command]
    print(json.dumps(fn(args), default=repr), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: a hostile input may have left threads behind


if __name__ == "__main__":
    main(sys.argv[1:])
