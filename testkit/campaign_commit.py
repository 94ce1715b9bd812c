"""The commit window of a 2-rank save: a real SIGKILL of one rank at each point of
rank 0's commit.

Rank 0 of a multi-rank save commits in this order (objckpt.save.commit):
(overwrite: read the old manifest) -> create the attempt's decision record ->
PUT the manifest -> (overwrite: delete the old version's objects; fresh: read the
manifest back) -> share the outcome with every rank.  A :class:`WindowStore` on rank
0 watches those requests and, at ``point``, SIGKILLs the victim (rank 0 itself or
rank 1):

* ``before_record``: before the decision record is created (nothing decided);
* ``before_put``: after the record, before the manifest PUT;
* ``during_put``: with the manifest PUT in flight (victim rank 1: killed as the PUT
  starts; victim rank 0: killed a few event-loop turns after the PUT started, so it
  may or may not have landed);
* ``after_put``: the PUT answered (rank 0's reply lost when rank 0 is the victim);
* ``cleanup``: at the first request after the PUT: the old version's delete on an
  overwrite, the read-back of a fresh save.

The save is a ``save`` or an ``async_save`` (whose commit runs on its background thread,
over objckpt's own gloo group).

Rank 1 is killed and then waited for (gone or a zombie) before rank 0 goes on, except
``during_put``.  Afterwards (:func:`commit_kill_trial`) the URI must read as the old
checkpoint whole or the new one whole (a fresh save: the new one or none), every
survivor must have raised :class:`~objckpt.errors.RankLostError` saying what it
learned, consistent with what the URI holds, and gc (grace 0) must leave exactly what
the manifest names.
"""
from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from typing import Any, Optional, Sequence

from objckpt.storage.base import ObjectStore
from objckpt.testing.stores import CountingStore

from .campaign import FAILED, OK, Target, Trial, _after_crash, last_json, timed
from .campaign_ops import full_rank_state, run_ranks

POINTS = ("before_record", "before_put", "during_put", "after_put", "cleanup")


def process_gone(pid: int) -> bool:
    """The process is dead: no longer there, or a zombie its parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


class WindowStore(CountingStore):
    """Rank 0's store: SIGKILLs ``victim_pid`` at ``point`` of the commit (see the module docstring)."""

    def __init__(self, inner: ObjectStore, point: str, victim_pid: int) -> None:
        super().__init__(inner)
        self.point, self.victim_pid = point, victim_pid
        self.put_done = False
        self.fired = False

    def _kill(self, wait: bool = True) -> None:
        if self.fired:
            return
        self.fired = True
        os.kill(self.victim_pid, signal.SIGKILL)
        if self.victim_pid == os.getpid():
            time.sleep(60)  # never reached
        while wait and not process_gone(self.victim_pid):  # bounded by the kernel delivering the signal
            time.sleep(0.005)

    def _after_put_request(self) -> None:
        if self.put_done and self.point == "cleanup":
            self._kill()

    async def put(self, key: str, data: Any, *, if_absent: bool = False) -> None:
        if key.endswith("/decision.json") and self.point == "before_record":
            self._kill()
        if key.endswith("/manifest.json"):
            if self.point == "before_put":
                self._kill()
            if self.point == "during_put":
                if self.victim_pid != os.getpid():
                    self._kill(wait=False)
                else:
                    task = asyncio.ensure_future(super().put(key, data, if_absent=if_absent))
                    for _ in range(3):
                        await asyncio.sleep(0)
                    self._kill()
                    await task
            await super().put(key, data, if_absent=if_absent)
            self.put_done = True
            if self.point == "after_put":
                self._kill()
            return
        await super().put(key, data, if_absent=if_absent)

    async def get(self, key: str) -> bytes:
        self._after_put_request()
        return await super().get(key)

    async def delete(self, keys: Sequence[str]) -> None:
        self._after_put_request()
        await super().delete(keys)


def commit_rank(a: dict[str, Any]) -> dict[str, Any]:
    """One rank of a :func:`commit_kill_trial` (run by ``testkit.campaign_child commit_rank``)."""
    import objckpt
    from objckpt.errors import ObjckptError
    from objckpt.storage import open_store

    from .campaign_ops import gloo_rank, sharded_rank_state

    rank, world = a["rank"], a["world"]
    with open(os.path.join(a["dir"], f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    try:
        with gloo_rank(a):
            store = None
            if rank == 0:  # the rendezvous is done: every rank's pid file is there
                pids = [int(open(os.path.join(a["dir"], f"pid{r}")).read()) for r in range(world)]
                st, _ = open_store(a["uri"], a.get("opts") or {})
                store = WindowStore(st, a["point"], pids[a["victim"]])
            kw: dict[str, Any] = dict(storage_options=a.get("opts") or {}, store=store, overwrite=a["overwrite"],
                                      part_size=64 << 10, blob_size=96 << 10,
                                      collective_timeout=a.get("collective_timeout", 60.0))
            state = sharded_rank_state(a["seed"], world)
            if a.get("asynchronous"):  # the commit runs on the save's background thread and gloo group
                objckpt.async_save(state, a["uri"], **kw).result()
            else:
                objckpt.save(state, a["uri"], **kw)
    except Exception as e:  # noqa: BLE001 - the survivor reports what it raised
        return {"rank": rank, "saved": False, "error": f"{type(e).__name__}: {e}",
                "objckpt_error": isinstance(e, ObjckptError), "committed": getattr(e, "committed", "n/a"),
                "lost_ranks": list(getattr(e, "lost_ranks", ()))}
    return {"rank": rank, "saved": True}


def commit_kill_trial(target: Target, seed: int, point: str, victim: int, *, overwrite: bool = True,
                      asynchronous: bool = False, world: int = 2, timeout: float = 180.0) -> Trial:
    """A ``world``-rank save (over version ``seed``, or fresh; ``asynchronous``: an
    ``async_save``) with ``victim`` SIGKILLed at ``point``."""
    import objckpt

    params = {"target": target.kind, "seed": seed, "point": point, "victim": victim, "overwrite": overwrite,
              "asynchronous": asynchronous}

    def body() -> Trial:
        uri = target.uri(f"commit-{seed}-{point}-{victim}-{os.getpid()}-{time.time_ns()}")
        old, new = full_rank_state(seed), full_rank_state(seed + 1)
        if overwrite:
            objckpt.save(old, uri, storage_options=target.storage_options)
        with tempfile.TemporaryDirectory(prefix="objckpt-rdzv-") as rd:
            args = {"world": world, "rdzv": "file://" + os.path.join(rd, "store"), "dir": rd, "uri": uri,
                    "opts": target.storage_options, "seed": seed + 1, "victim": victim, "point": point,
                    "overwrite": overwrite, "asynchronous": asynchronous}
            procs, outs, hung = run_ranks("commit_rank", args, world, timeout)
        if hung:
            return Trial("commit", params, FAILED, f"rank(s) {hung} hung: {outs[hung[0]][-400:]}")
        if procs[victim].returncode != -signal.SIGKILL:
            return Trial("commit", params, FAILED, f"the victim was not killed (exit {procs[victim].returncode}): "
                                                   f"{outs[victim][-600:]}")
        versions = {seed: old, seed + 1: new} if overwrite else {seed + 1: new}
        outcome, detail, figures = _after_crash(uri, target.storage_options, versions, fresh=not overwrite)
        if outcome != OK:  # first what the URI holds: a lost checkpoint is the failure that matters
            return Trial("commit", params, outcome, f"{point}, rank {victim} killed: {detail}", faults=1,
                         extra=figures)
        holds_new = figures.get("version") == seed + 1
        said: list[Optional[bool]] = []
        for r, (p, out) in enumerate(zip(procs, outs)):
            if r == victim:
                continue
            res = last_json(out)
            if res is None or p.returncode != 0:
                return Trial("commit", params, FAILED, f"rank {r} exited {p.returncode}: {out[-600:]}")
            if res.get("saved"):
                return Trial("commit", params, FAILED, f"rank {r} reported success although rank {victim} died")
            if not res["error"].startswith("RankLostError") or victim not in res["lost_ranks"]:
                return Trial("commit", params, FAILED, f"rank {r} raised {res['error'][:400]!r} "
                                                       f"(lost ranks {res.get('lost_ranks')})")
            said.append(res["committed"])
        for s in said:  # what a survivor said must be what the URI holds (None: it said it could not tell)
            if s is not None and s != holds_new:
                return Trial("commit", params, FAILED, f"a survivor said committed={s} but the URI holds "
                                                       f"{'the new' if holds_new else 'no new'} checkpoint")
        figures["said"] = said
        return Trial("commit", params, outcome, f"{point}, rank {victim} killed; survivors said {said}; {detail}",
                     faults=1, extra=figures)

    return timed("commit", params, body)


def commit_kill_cases(n: int, seed: int = 0) -> list[tuple[str, int, bool, bool]]:
    """``n`` (point, victim, overwrite, asynchronous) cases covering every combination in turn."""
    combos = [(p, v, o, a) for a in (False, True) for o in (True, False) for v in (0, 1) for p in POINTS]
    return [combos[(seed + i) % len(combos)] for i in range(n)]
