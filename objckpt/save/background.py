"""async_save: training resumes once the state is staged in host memory.

``async_save`` copies this rank's share of the state into reusable host
memory (pinned when CUDA is present; device copies on a side stream), then
returns; upload and commit continue in the background and the returned
:class:`SaveHandle` reports the outcome.  By default each tensor's copy starts
as soon as the walk of the state finds it, into a host mirror the upload then
sends as is (:mod:`objckpt.save.mirrors`), so describing and planning overlap
the copies; lazy saves, a ``staging_bytes`` cap, or a save overlapping the
previous one's upload stage part by part through the buffer pool.  With ``lazy=True`` it returns
at once and stages in the background while the caller runs forward/backward;
the caller must call :meth:`SaveHandle.wait_staged` before it mutates the
tensors (e.g. before ``optimizer.step()``).  A violation is detected through
the tensors' version counters: the save then fails and commits nothing.

Commits happen in call order.  In a process group, the outcome exchange and
commit run in a background thread over a gloo group created for objckpt (never
NCCL from a background thread).  The interpreter waits for saves in flight
before it exits (their threads are joined at exit).

A save belongs to the process that started it.  A forked child (a DataLoader
worker, forked anew every epoch by default) inherits the list of saves in
flight but not the threads that finish them: it forgets them at fork, so its
exit does not wait for (and print about) the parent's saves, its own saves do
not queue behind them, and a parent's :class:`SaveHandle` asked for its outcome
in the child raises :class:`~objckpt.errors.ForeignSaveError` instead of
blocking forever.  The parent's saves commit as if no fork happened.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any, Optional

import torch

from ..runtime.gc_pause import FrozenOld
from ..runtime import loop as _runtime
from ..distributed.comm import Comm
from ..errors import ForeignSaveError
from ..runtime.memory import Budget, host_pool, save_budget, side_stream
from ..options import SaveOptions
from ..results import SaveResult
from ..storage import ObjectStore
from . import pipeline
from .mirrors import MirrorSet, mirror_set

_lock = threading.Lock()
_in_flight: list["SaveHandle"] = []


class SaveHandle(concurrent.futures.Future[SaveResult]):
    """The outcome of one :func:`async_save`: a :class:`concurrent.futures.Future` of its
    :class:`SaveResult`, so it works wherever a future is expected
    (``concurrent.futures.wait`` / ``as_completed``, ``add_done_callback``,
    ``asyncio.wrap_future``).

    A save cannot be called back once started (its staging and upload are under way
    on other threads, and on other ranks): the handle is *running* from the start, so
    :meth:`cancel` returns False and :meth:`cancelled` is False, as for any running
    future; the save commits or fails, and a committed step is undone by deleting it.
    ``result()`` / ``exception()`` raise :class:`~objckpt.errors.ForeignSaveError` in a
    forked child (see the module docstring)."""

    def __init__(self, uri: str) -> None:
        super().__init__()
        self.uri = uri
        self._staged = threading.Event()
        self._violation: Optional[str] = None
        self._pid = os.getpid()
        self.set_running_or_notify_cancel()  # running: not cancellable, as the save is not

    @property
    def _future(self) -> "SaveHandle":
        """The future that completes with the save (the handle itself; kept for the code
        that waits on ``handle._future``)."""
        return self

    def __repr__(self) -> str:
        return f"<SaveHandle {self.uri!r} {self._state.lower()}>"

    def _check_owner(self) -> None:
        """In a forked child the threads that would finish this save do not exist."""
        if os.getpid() != self._pid:
            raise ForeignSaveError(
                f"async save to {self.uri!r} was started by process {self._pid}, not this one ({os.getpid()}, "
                "forked from it): its outcome is known only there (it commits as usual)")

    def wait_staged(self, timeout: Optional[float] = None) -> None:
        """Block until the state is in host memory (or staging failed); after this the
        caller may modify its tensors."""
        self._check_owner()
        if not self._staged.wait(timeout):
            raise TimeoutError(f"async save to {self.uri!r}: staging not finished after {timeout} s")

    def staged(self) -> bool:
        return self._staged.is_set()

    def cancel(self) -> bool:
        """Always False: a save that started cannot be recalled (it commits or fails)."""
        return False

    def result(self, timeout: Optional[float] = None) -> SaveResult:
        """The :class:`SaveResult` once committed, or the background error
        (``TimeoutError`` when ``timeout`` seconds pass first)."""
        self._check_owner()
        return super().result(timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """The background error once finished, None once committed."""
        self._check_owner()
        return super().exception(timeout)


def wait_all(timeout: Optional[float] = None) -> None:
    """Wait for every save in flight that this process started to commit or fail."""
    with _lock:
        pending = [h._future for h in _in_flight]
    concurrent.futures.wait(pending, timeout=timeout)


_exit_hook_installed = False


def _install_exit_hook() -> None:
    """At interpreter exit, finish saves in flight before the thread pools they use
    shut down (threading's exit hooks run last-registered first, so this one runs
    before concurrent.futures refuses new work)."""
    global _exit_hook_installed
    if _exit_hook_installed:
        return
    _exit_hook_installed = True
    register = getattr(threading, "_register_atexit", None)

    def hook() -> None:
        with _lock:
            n = sum(1 for h in _in_flight if not h.done())
        if n:
            import sys

            print(f"objckpt: waiting for {n} checkpoint save(s) in flight before exit", file=sys.stderr)
            wait_all()

    if register is not None:
        register(hook)
    else:  # pragma: no cover - very old Python
        import atexit

        atexit.register(hook)


#: the threads that finish saves (phase 3), kept from one save to the next (see _finisher_pool)
_finishers: Optional[concurrent.futures.ThreadPoolExecutor] = None
#: at most this many saves are finished at once; more wait in the pool's queue, in call order
FINISHER_THREADS = 64


def _finisher_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads kept between saves to finish them.  A thread started for each save made
    ``async_save`` wait until the new thread first ran (``Thread.start`` waits for it):
    ~3 ms a save on a loaded 2-core machine, 11% of the stall of a 512 MiB share.  A
    finisher waits for the one before it (commits in call order); the pool runs its work
    in the order given, so a queued finisher never holds up one it waits for.  Its threads
    are joined at interpreter exit like the non-daemon threads they replace."""
    global _finishers
    with _lock:
        if _finishers is None:
            _finishers = concurrent.futures.ThreadPoolExecutor(FINISHER_THREADS,
                                                               thread_name_prefix="objckpt-async-save")
        return _finishers


def _after_fork_in_child() -> None:
    """Forget the parent's saves (see the module docstring) and its finishing threads; a
    new lock, in case another thread of the parent held this one at the fork."""
    global _lock, _finishers
    _lock = threading.Lock()
    _in_flight.clear()
    _finishers = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _wait_for_room(max_in_flight: int) -> None:
    while True:
        with _lock:
            _in_flight[:] = [h for h in _in_flight if not h.done()]
            if len(_in_flight) < max_in_flight:
                return
            oldest = _in_flight[0]
        concurrent.futures.wait([oldest._future])


def _finish_mirrored(prep: pipeline.Prepared, mirrors: MirrorSet, bg_comm: Comm, uri: str) -> SaveHandle:
    """The state is in its host mirrors once their copies complete: return then,
    and upload straight from the mirrors (nothing else writes them meanwhile)."""
    handle = SaveHandle(uri)
    try:
        mirrors.wait()
    except BaseException:
        mirrors.release()
        raise
    handle._staged.set()
    budget = Budget(max(prep.plan.max_part, 1))  # only for parts that are not plain host memory
    upload = _runtime.submit(pipeline.upload(prep, host_pool(), budget, zero_copy=True))
    upload.add_done_callback(lambda _: mirrors.release())
    _start_finisher(handle, prep, bg_comm, upload)
    return handle


def _start_finisher(handle: SaveHandle, prep: pipeline.Prepared, bg_comm: Comm,
                    upload: "concurrent.futures.Future[pipeline.UploadOutcome]") -> None:
    """Phase 3 on a finishing thread, after the previous save's commit (call order)."""
    with _lock:
        previous = _in_flight[-1] if _in_flight else None
        _in_flight.append(handle)

    def finisher() -> None:
        try:
            outcome = upload.result()
            if handle._violation and outcome.shared.error is None:
                outcome = pipeline.UploadOutcome.failed("", RuntimeError(handle._violation))
            if previous is not None:  # commits happen in call order
                concurrent.futures.wait([previous._future])
            handle._future.set_result(pipeline.finish(prep, bg_comm, outcome))
        except BaseException as e:  # surfaces from handle.result()
            handle._future.set_exception(e)

    try:
        _finisher_pool().submit(finisher)
    except RuntimeError:  # the interpreter is shutting down (a save from an atexit handler): a thread as before
        threading.Thread(target=finisher, name="objckpt-async-save", daemon=False).start()


def start_save(state_dict: Any, uri: str, st: ObjectStore, prefix: str, comm: Comm, bg_comm: Comm,
               opts: SaveOptions, *, lazy: bool, max_in_flight: int) -> SaveHandle:
    """Stage this rank's share of ``state_dict`` and upload it in the background
    (see the module docstring for the contract); ``bg_comm`` runs phase 3."""
    if max_in_flight < 1:
        raise ValueError("max_in_flight must be at least 1")
    _install_exit_hook()
    _wait_for_room(max_in_flight)
    # Default mode copies each tensor to its host mirror while the state is walked
    # and planned (save/mirrors.py); lazy saves, a staging cap, or a second save
    # while the mirrors still upload take the pooled part-by-part path below.
    mirrors: Optional[MirrorSet] = mirror_set() if not lazy and opts.staging_bytes is None else None
    if mirrors is not None and not mirrors.acquire():
        mirrors = None
    frozen = FrozenOld()  # the walk and the plan make an object per tensor: the program's stay out of the GC's walks
    frozen.now()
    try:
        prep = pipeline.prepare(state_dict, uri, st, prefix, comm, opts,
                                mirror=mirrors.mirror if mirrors is not None else None)
    except BaseException:
        if mirrors is not None:
            mirrors.wait()
            mirrors.release()
        raise
    finally:
        frozen.close()
    if mirrors is not None:
        return _finish_mirrored(prep, mirrors, bg_comm, uri)
    max_part = max(prep.plan.max_part, 1)
    nparts = sum(len(b.parts) for b in prep.plan.blobs)
    # the budget buys slots of the largest part; by default one per part (buffers are
    # allocated at each part's own size, so memory is this rank's share of the state)
    # (``staging_bytes`` given: a hard limit, a larger part refused before anything is written)
    budget = save_budget(opts.staging_bytes, default=max(max_part * nparts, max_part))
    handle = SaveHandle(uri)

    sources = list(prep.tensors.values())
    versions = [t._version for t in sources]
    stream = None
    cuda = [t for t in sources if t.is_cuda]
    if cuda:
        stream = side_stream(cuda[0].device)
        stream.wait_stream(torch.cuda.current_stream(cuda[0].device))  # the values as of this call

    def on_staged() -> None:
        if lazy:
            changed = [k for (k, t), v in zip(prep.tensors.items(), versions) if t._version != v]
            if changed:
                handle._violation = (
                    f"tensor {prep.pieces[changed[0]].key!r} was modified before wait_staged() returned; "
                    "the lazy async save is abandoned (call handle.wait_staged() before optimizer.step())"
                )
        handle._staged.set()

    upload = _runtime.submit(pipeline.upload(prep, host_pool(), budget, zero_copy=False, on_staged=on_staged,
                                             stream=stream))
    upload.add_done_callback(lambda _: handle._staged.set())  # a failed staging releases waiters too
    _start_finisher(handle, prep, bg_comm, upload)
    if not lazy:
        handle.wait_staged()
    return handle
