"""Kills in tiered checkpoints: a 2-node job (2 ranks, or 4 ranks two per node) training
with a local tier, one rank or two ranks SIGKILLed at once at a point of the tier's window,
then the whole job restarted (fresh processes, the same or another world size) and restored.

A trial (:func:`tier_kill_trial`) runs two phases of real gloo ranks (forked from a
forkserver that imported torch once), with node folders under a temporary directory and
the manager's root in S3 (moto or testkit's server, over HTTP):

1. **train**: steps 1..:data:`STEPS` saved (``persist_every=2``: steps 2 and 4 drain;
   ``local_keep=2``; ``replicas=1``; ``save`` or ``async_save``), values a function of the
   step only.  Before the save of step :data:`KILL_STEP` of the point a hook is armed in a
   function of the real code path (:data:`HOOKS`); the first rank allowed to fire it there
   SIGKILLs the victims, the others first, itself last when it is one (all at once: the
   others are gone before it goes on).  Each rank appends to ``confirmed-<rank>`` the steps
   the manager promised (docs/tiering.md, "Failure model"): a synchronous save's step once
   ``save()`` returned, an async save's once the next ``save()`` returned (its handle was
   waited for) or ``wait()`` did.  The survivors must end with an
   :class:`~objckpt.errors.ObjckptError` (or finish), within the phase's bound: a hang fails.
2. **restart**: ``load()`` into zeros, then two more saves (the second drains) and ``wait()``.

Invariants (each failure names its letter):

* (a) the restore gives exactly one saved step's values, bit-exact, never a mix;
* (b) it is not older than the newest step confirmed on every rank before the kill (the
  node folders are all kept), nor than a step committed in object storage;
* (c) every step whose manifest is in object storage reads bit-exact (crc-checked), after
  the kill and after the restart;
* (d) no step restorable before the restart (committed in object storage, or whose
  manifest is in some node's folder and whose files, across all node folders, read whole
  and bit-exact) is gone from every tier right after the restore;
* (e) the restarted job saves the next two steps and the second drains whole.

The kill points (``POINTS``): ``local_write`` (after a rank's first blob bytes reach its node
folder), ``before_spread`` (the local commit done, the metadata not sent to the other node),
``during_spread`` (a node's first rank, about to write the received metadata), ``replicate``
(after the first piece of a peer copy was written), ``drain_upload`` (after a rank's first
file reached S3), ``drain_commit`` (the drained manifest just PUT, before any rank learns it)
and ``retention`` (a node's first rank has just removed an old local step).
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .campaign import FAILED, OK, Trial, timed
from .campaign_commit import process_gone
from .procs import rank_context

POINTS = ("local_write", "before_spread", "during_spread", "replicate", "drain_upload", "drain_commit", "retention")
#: the step before whose save each point's hook is armed (2 and 4 drain; step 3's save is the
#: first after which retention removes a step)
KILL_STEP = {"local_write": 3, "before_spread": 3, "during_spread": 3, "replicate": 3, "drain_upload": 4,
             "drain_commit": 4, "retention": 3}
#: steps the first run saves
STEPS = 4
#: seconds any collective waits for a dead rank (the training's gloo group and objckpt's own)
COLLECTIVE_TIMEOUT = 20.0
#: (world, victims) of the kill configurations: one rank of two; both ranks of one node, one
#: rank on each node, both ranks of rank 0's node, of four ranks on two nodes
KILLS: tuple[tuple[int, tuple[int, ...]], ...] = ((2, (0,)), (2, (1,)), (4, (2, 3)), (4, (1, 2)), (4, (0, 1)))
ROWS, COLS = 8, 263


@dataclass(frozen=True)
class TierCase:
    """One trial's choice: where the kill lands, whose, and the restarted world size."""

    point: str
    asynchronous: bool
    world: int
    victims: tuple[int, ...]
    restart_world: int

    def label(self) -> str:
        return (f"{self.point}, {'async_save' if self.asynchronous else 'save'}, world {self.world}, "
                f"killed {list(self.victims)}, restart world {self.restart_world}")


def tier_kill_cases(n: int, seed: int = 0) -> list[TierCase]:
    """``n`` cases, round-robin: the point, the call and the kill configuration cycle with
    coprime periods (7, 2, 5), so any 70 in a row hold every combination once; every third
    restart changes the world size (4 -> 2, 2 -> 4)."""
    out = []
    for i in range(seed, seed + n):
        world, victims = KILLS[i % len(KILLS)]
        restart = (6 - world) if i % 3 == 2 else world
        out.append(TierCase(POINTS[i % len(POINTS)], bool(i % 2), world, victims, restart))
    return out


# --------------------------------------------------------------------------- values


def full_values(step: int) -> dict[str, Any]:
    """The whole state of ``step``: every byte depends on the step."""
    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(ROWS, COLS, generator=g), "b": torch.randn(29, generator=g, dtype=torch.float64),
            "step": step}


def rank_state(rank: int, world: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s view of :func:`full_values`: ``w`` row-sharded over ``world`` ranks."""
    import objckpt

    full = full_values(step)
    per = -(-ROWS // world)
    lo, hi = min(rank * per, ROWS), min((rank + 1) * per, ROWS)
    return {"w": objckpt.Shard(full["w"][lo:hi].clone(), (ROWS, COLS), (lo, 0)), "b": full["b"], "step": step}


def zero_state(rank: int, world: int) -> dict[str, Any]:
    st = rank_state(rank, world, 0)
    st["w"].local.zero_()
    st["b"] = torch.zeros_like(st["b"])
    st["step"] = -1
    return st


def values_step(st: dict[str, Any], rank: int, world: int) -> Optional[int]:
    """The step whose values ``st`` holds, every field bit-exact; None: a mix or wrong bytes."""
    step = st.get("step")
    if not isinstance(step, int) or step < 1:
        return None
    want = rank_state(rank, world, step)
    same = (torch.equal(st["w"].local.view(torch.int32), want["w"].local.view(torch.int32))
            and torch.equal(st["b"].view(torch.int64), want["b"].view(torch.int64)))
    return step if same else None


def node_of(rank: int, world: int) -> str:
    """Two nodes whatever the world size: the first half of the ranks on n0."""
    return f"n{rank * 2 // world}"


# --------------------------------------------------------------------------- the kill hook


def _first_ranks(world: int) -> set[int]:
    nodes = [node_of(r, world) for r in range(world)]
    return {nodes.index(n) for n in nodes}


def capable(point: str, world: int) -> set[int]:
    """The ranks whose code path passes the point's hook."""
    if point == "drain_commit":
        return {0}
    if point in ("during_spread", "retention"):
        return _first_ranks(world)
    return set(range(world))


def triggers(point: str, world: int, victims: tuple[int, ...]) -> list[int]:
    """Who fires the kill: a victim that reaches the point, else any rank that does (it
    kills the victims and goes on)."""
    can = capable(point, world)
    return sorted(can & set(victims)) or sorted(can)


class KillHook:
    """Fires once per job (an ``O_EXCL`` file): SIGKILLs every victim, itself last."""

    def __init__(self, a: dict[str, Any]) -> None:
        self.dir, self.rank, self.victims = a["dir"], a["rank"], list(a["victims"])
        self.may_fire = self.rank in a["triggers"]
        self.armed = False
        self.step = 0

    def fire(self, where: str) -> None:
        if not (self.armed and self.may_fire):
            return
        try:
            fd = os.open(os.path.join(self.dir, "fired"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return
        os.write(fd, json.dumps({"rank": self.rank, "step": self.step, "where": where}).encode())
        os.close(fd)
        pids = {r: int(Path(self.dir, f"pid{r}").read_text()) for r in self.victims}
        for r, pid in pids.items():
            if r != self.rank:
                os.kill(pid, signal.SIGKILL)
        for r, pid in pids.items():
            while r != self.rank and not process_gone(pid):  # bounded by the kernel delivering the signal
                time.sleep(0.005)
        if self.rank in pids:
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # never reached

    def install(self, point: str) -> None:
        """Wrap the point's function (module attributes: every caller looks them up)."""
        from objckpt.storage import local as store_local
        from objckpt.tier import drain as tier_drain
        from objckpt.tier import local as tier_local
        from objckpt.tier import transfer as tier_transfer

        def before(mod: Any, name: str) -> None:
            real = getattr(mod, name)

            def wrapped(*args: Any, **kw: Any) -> Any:
                self.fire(name)
                return real(*args, **kw)
            setattr(mod, name, wrapped)

        def after(mod: Any, name: str) -> None:
            real = getattr(mod, name)

            def wrapped(*args: Any, **kw: Any) -> Any:
                out = real(*args, **kw)
                self.fire(name)
                return out
            setattr(mod, name, wrapped)

        if point == "local_write":
            real_write = store_local._LocalWriter.write_part_views

            async def write_part_views(w: Any, *args: Any, **kw: Any) -> Any:
                out = await real_write(w, *args, **kw)
                self.fire("write_part_views")
                return out
            store_local._LocalWriter.write_part_views = write_part_views  # type: ignore[method-assign]
        elif point == "before_spread":
            before(tier_local, "spread_metadata")
        elif point == "during_spread":
            before(tier_local, "_fill_node_folder")
        elif point == "replicate":
            after(tier_transfer, "_write_piece")
        elif point == "drain_upload":
            after(tier_drain, "upload_file")
        elif point == "retention":
            after(tier_local, "delete_step")

    def install_on_store(self, point: str, store: Any) -> None:
        """``drain_commit``: on the manager's object store, right after a step's manifest PUT."""
        if point != "drain_commit":
            return
        real_put = store.put

        async def put(key: str, data: Any, *, if_absent: bool = False) -> None:
            await real_put(key, data, if_absent=if_absent)
            if key.endswith("/manifest.json"):
                self.fire("manifest put")
        store.put = put


# --------------------------------------------------------------------------- ranks


def _manager(a: dict[str, Any], rank: int, world: int) -> Any:
    import objckpt

    return objckpt.CheckpointManager(a["root"], local_dir=a["local"], replicas=1, persist_every=2, local_keep=2,
                                     node_override=node_of(rank, world), async_save=a["asynchronous"],
                                     storage_options=a["opts"])


def _error(e: BaseException) -> dict[str, Any]:
    from objckpt.errors import ObjckptError

    return {"error": f"{type(e).__name__}: {str(e)[:700]}", "objckpt_error": isinstance(e, ObjckptError)}


def train_rank(a: dict[str, Any]) -> dict[str, Any]:
    """Phase 1 on one rank: save steps 1..STEPS with the kill hook armed from the kill step."""
    rank, world = a["rank"], a["world"]
    hook = KillHook(a)
    hook.install(a["point"])
    log = open(os.path.join(a["dir"], f"confirmed-{rank}"), "a")

    def confirm(step: int) -> None:
        log.write(f"{step}\n")
        log.flush()

    try:
        with _manager(a, rank, world) as m:
            hook.install_on_store(a["point"], m.index.store)
            for s in range(1, STEPS + 1):
                hook.armed, hook.step = s >= a["kill_step"], s
                m.save(s, rank_state(rank, world, s))
                if not a["asynchronous"]:
                    confirm(s)
                elif s > 1:  # the save waited for the previous one's handle
                    confirm(s - 1)
            m.wait()
            confirm(STEPS)
    except Exception as e:  # noqa: BLE001 - a survivor reports what it raised
        return {"rank": rank, "done": False, **_error(e)}
    return {"rank": rank, "done": True}


def restart_rank(a: dict[str, Any]) -> dict[str, Any]:
    """Phase 2 on one rank: restore, list the node folder, save two more steps, wait."""
    import torch.distributed as dist

    from objckpt.tier import local as tier_local

    rank, world = a["rank"], a["world"]
    out: dict[str, Any] = {"rank": rank}
    try:
        with _manager(a, rank, world) as m:
            st = zero_state(rank, world)
            try:
                res = m.load(st)
            except Exception as e:  # noqa: BLE001
                return {**out, "phase": "restore", **_error(e)}
            out.update(restored=res.step, source=res.source, values=values_step(st, rank, world))
            dist.barrier()
            root = tier_local.resolve_dir(a["local"], node_of(rank, world))
            out["local_after_restore"] = tier_local.committed_steps(root, m.naming.parse)
            dist.barrier()
            try:
                for s in (res.step + 1, res.step + 2):
                    m.save(s, rank_state(rank, world, s))
                m.wait()
                out["steps"] = m.steps()
            except Exception as e:  # noqa: BLE001
                return {**out, "phase": "continue", **_error(e)}
    except Exception as e:  # noqa: BLE001
        return {**out, "phase": "close", **_error(e)}
    return out


RANK_FNS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"train": train_rank, "restart": restart_rank}


def _rank_entry(command: str, a: dict[str, Any]) -> None:
    """A forked rank: its pid file, the gloo group (file rendezvous, short timeout), the
    phase, its result file; then exits at once (a dead peer may hold up an orderly teardown)."""
    os.environ["OBJCKPT_COLLECTIVE_TIMEOUT"] = str(a["collective_timeout"])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    Path(a["dir"], f"pid{a['rank']}").write_text(str(os.getpid()))
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=a["rdzv"], rank=a["rank"], world_size=a["world"],
                                timeout=datetime.timedelta(seconds=a["collective_timeout"]))
        res = RANK_FNS[command](a)
    except BaseException as e:  # noqa: BLE001
        res = {"rank": a["rank"], "done": False, "crash": traceback.format_exc()[-1500:], **_error(e)}
    Path(a["dir"], f"result-{command}-{a['rank']}.json").write_text(json.dumps(res, default=repr))
    os._exit(0)


def _context() -> Any:
    return rank_context()


@dataclass
class Phase:
    """One phase's ranks: exit codes (-9: SIGKILLed), results (None: none written), hung ranks."""

    codes: list[Optional[int]]
    results: list[Optional[dict[str, Any]]]
    hung: list[int] = field(default_factory=list)


def run_phase(command: str, a: dict[str, Any], world: int, timeout: float) -> Phase:
    """``world`` ranks of ``command`` (``a`` plus each one's rank), bounded by ``timeout``
    seconds (a hang guard; nothing is judged by time)."""
    rd = tempfile.mkdtemp(prefix="objckpt-rdzv-", dir=a["dir"])
    args = {**a, "world": world, "rdzv": "file://" + os.path.join(rd, "store")}
    for r in range(world):
        Path(a["dir"], f"result-{command}-{r}.json").unlink(missing_ok=True)
    ctx = _context()
    procs = [ctx.Process(target=_rank_entry, args=(command, {**args, "rank": r}), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    hung = []
    for r, p in enumerate(procs):
        p.join(max(deadline - time.monotonic(), 0.1))
        if p.is_alive():
            hung.append(r)
            p.kill()
            p.join()
    results: list[Optional[dict[str, Any]]] = []
    for r in range(world):
        f = Path(a["dir"], f"result-{command}-{r}.json")
        results.append(json.loads(f.read_text()) if f.exists() else None)
    shutil.rmtree(rd, ignore_errors=True)
    return Phase([p.exitcode for p in procs], results, hung)


# --------------------------------------------------------------------------- judging


def _object_steps(root: str, opts: dict[str, Any]) -> list[int]:
    """Steps whose manifest is in object storage (indexed or not)."""
    from objckpt.runtime import loop as _runtime
    from objckpt.storage import open_store

    st, prefix = open_store(root, opts)
    out = []
    for o in _runtime.run(st.list(prefix + "/")):
        name = o.key[len(prefix) + 1:]
        if name.endswith("/manifest.json") and name.startswith("step-") and name.count("/") == 1:
            out.append(int(name.split("/")[0][5:]))
    return sorted(out)


def _same_full(got: dict[str, Any], step: int) -> bool:
    want = full_values(step)
    return (got.get("step") == step and torch.equal(got["w"].view(torch.int32), want["w"].view(torch.int32))
            and torch.equal(got["b"].view(torch.int64), want["b"].view(torch.int64)))


def _object_problems(root: str, opts: dict[str, Any], when: str) -> tuple[list[int], list[str]]:
    """(c): every step committed in object storage reads bit-exact."""
    import objckpt

    steps, problems = _object_steps(root, opts), []
    for s in steps:
        try:
            got = objckpt.read(f"{root}/step-{s:010d}", storage_options=opts)
        except Exception as e:  # noqa: BLE001
            problems.append(f"(c) {when}: step {s} is committed in object storage but does not read: "
                            f"{type(e).__name__}: {str(e)[:300]}")
            continue
        if not _same_full(got, s):
            problems.append(f"(c) {when}: step {s} in object storage is not step {s}'s values bit-exact")
    return steps, problems


def _node_dirs(local: str) -> list[Path]:
    return [Path(local.replace("{node}", n)) for n in ("n0", "n1")]


def local_whole_steps(local: str, work: str) -> dict[int, list[str]]:
    """Steps whose manifest is in some node folder and whose files, taken from whichever node
    folder has them, read whole and bit-exact: step -> the nodes holding its manifest."""
    import objckpt
    from objckpt.tier import local as tier_local

    found: dict[int, list[str]] = {}
    dirs = _node_dirs(local)
    for d in dirs:
        for s in tier_local.committed_steps(d, _parse):
            found.setdefault(s, []).append(d.parent.name)
    out = {}
    for s, holders in sorted(found.items()):
        name = f"step-{s:010d}"
        listed = tier_local.read_listed(dirs[int(holders[0][1:])] / name)
        if listed is None:
            continue
        data, _, files = listed
        tmp = Path(tempfile.mkdtemp(prefix="whole-", dir=work))
        try:
            (tmp / "manifest.json").write_bytes(data)
            for f in files.needed:
                if f == "manifest.json":
                    continue
                src = next((d / name / f for d in dirs if (d / name / f).is_file()), None)
                if src is None:
                    break
                (tmp / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, tmp / f)
            else:
                try:
                    if _same_full(objckpt.read(str(tmp)), s):
                        out[s] = holders
                except Exception:  # noqa: BLE001 - a torn copy: not whole
                    pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _parse(name: str) -> Optional[int]:
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def _confirmed(work: str, world: int) -> Optional[int]:
    """The newest step confirmed on every rank (None: none)."""
    sets = []
    for r in range(world):
        p = Path(work, f"confirmed-{r}")
        sets.append({int(x) for x in p.read_text().split()} if p.exists() else set())
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None


def tier_kill_trial(root: str, opts: dict[str, Any], case: TierCase, *, timeout: float = 150.0,
                    collective_timeout: float = COLLECTIVE_TIMEOUT) -> Trial:
    """One trial of ``case`` against the manager root ``root`` (fresh: nothing under it)."""
    params = {**asdict(case), "victims": list(case.victims)}

    def body() -> Trial:
        work = tempfile.mkdtemp(prefix="objckpt-campaign-tier")
        try:
            return _trial(work, root, opts, case, params, timeout, collective_timeout)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return timed("tier-kill", params, body)


def _trial(work: str, root: str, opts: dict[str, Any], case: TierCase, params: dict[str, Any],
           timeout: float, ct: float) -> Trial:
    a = {"dir": work, "root": root, "opts": opts, "local": os.path.join(work, "{node}", "ckpt"),
         "asynchronous": case.asynchronous, "point": case.point, "kill_step": KILL_STEP[case.point],
         "victims": list(case.victims), "triggers": triggers(case.point, case.world, case.victims),
         "collective_timeout": ct}
    extra: dict[str, Any] = {}

    def failed(why: str) -> Trial:
        return Trial("tier-kill", params, FAILED, f"{why} [{case.label()}]", faults=len(case.victims), extra=extra)

    one = run_phase("train", a, case.world, timeout)
    fired = Path(work, "fired")
    extra["fired"] = json.loads(fired.read_text()) if fired.exists() else None
    if one.hung:
        return failed(f"rank(s) {one.hung} hung after the kill (> {timeout:.0f} s): results {one.results}")
    not_killed = [r for r in case.victims if one.codes[r] != -signal.SIGKILL]
    if not_killed:
        return failed(f"setup: victim(s) {not_killed} not killed (the point was not reached; exit codes "
                      f"{one.codes}, results {one.results})")
    survivors = {}
    for r in range(case.world):
        if r in case.victims:
            continue
        res = one.results[r]
        if res is None or one.codes[r] != 0:
            return failed(f"survivor rank {r} exited {one.codes[r]} without a result")
        if not res.get("done") and not res.get("objckpt_error"):
            return failed(f"survivor rank {r} raised a built-in error: {res.get('error')} {res.get('crash', '')}")
        survivors[r] = res.get("error", "finished")
    extra["survivors"] = survivors
    confirmed = _confirmed(work, case.world)
    before_obj, problems = _object_problems(root, opts, "after the kill")
    whole = local_whole_steps(a["local"], work)
    restorable = sorted(set(whole) | set(before_obj))
    extra.update(confirmed=confirmed, object_after_kill=before_obj, local_whole_after_kill=whole)

    two = run_phase("restart", a, case.restart_world, timeout)
    if two.hung:
        return failed(f"the restarted rank(s) {two.hung} hung (> {timeout:.0f} s): results {two.results}")
    res = two.results
    if any(r is None for r in res):
        return failed(f"a restarted rank died (exit codes {two.codes})")
    errs = {r: x for r, x in enumerate(res) if x and x.get("error")}
    restored = {x.get("restored") for x in res if x}
    extra.update(restored=sorted(s for s in restored if s is not None), sources=[x.get("source") for x in res])
    if any(x.get("phase") == "restore" for x in errs.values()):
        problems.append(f"(a) the restore failed: {next(iter(errs.values()))['error']}")
    else:
        if len(restored) != 1:
            problems.append(f"(a) the ranks restored different steps: {[x.get('restored') for x in res]}")
        step = min(s for s in restored if s is not None)
        if any(x.get("values") != x.get("restored") for x in res):
            problems.append(f"(a) restored step {step} but the values are "
                            f"{[x.get('values') for x in res]} (None: a mix or wrong bytes)")
        floor = max([s for s in (confirmed,) if s is not None] + before_obj, default=None)
        if floor is not None and step < floor:
            problems.append(f"(b) restored step {step}, older than step {floor} (confirmed on every rank: "
                            f"{confirmed}; in object storage: {before_obj})")
        held = set(before_obj) | {s for x in res for s in x.get("local_after_restore", [])}
        lost = [s for s in restorable if s not in held]
        if lost:
            problems.append(f"(d) step(s) {lost} restorable before the restart (whole across the node folders: "
                            f"{sorted(whole)}; object: {before_obj}) are gone from every tier after restoring "
                            f"step {step}")
        if errs:
            r, x = next(iter(errs.items()))
            problems.append(f"(e) after restoring step {step} the job could not go on ({x.get('phase')}, rank {r}): "
                            f"{x['error']}")
        elif not all((step + 2) in (x.get("steps") or []) for x in res):
            problems.append(f"(e) step {step + 2} is not listed as drained: {[x.get('steps') for x in res]}")
    after_obj, more = _object_problems(root, opts, "after the restart")
    problems += more
    extra["object_after_restart"] = after_obj
    if problems:
        return failed("; ".join(problems))
    return Trial("tier-kill", params, OK, f"{case.label()}: fired {extra['fired']}; confirmed {confirmed}, restored "
                 f"{sorted(restored)} from {extra['sources']}; survivors: "
                 + "; ".join(f"rank {r}: {e[:160]}" for r, e in survivors.items()),
                 faults=len(case.victims), extra=extra)
