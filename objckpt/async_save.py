"""async_save: training resumes once the state is staged in host memory.

``async_save`` copies this rank's share of the state into reusable host
memory (pinned when CUDA is present; device copies on a side stream), then
returns; upload and commit continue in the background and the returned
:class:`SaveHandle` reports the outcome.  By default each tensor's copy starts
as soon as the walk of the state finds it, into a host mirror the upload then
sends as is (:mod:`objckpt.staging.mirror`), so describing and planning overlap
the copies; lazy saves, a ``staging_bytes`` cap, or a save overlapping the
previous one's upload stage part by part through the buffer pool.  With ``lazy=True`` it returns
at once and stages in the background while the caller runs forward/backward;
the caller must call :meth:`SaveHandle.wait_staged` before it mutates the
tensors (e.g. before ``optimizer.step()``).  A violation is detected through
the tensors' version counters: the save then fails and commits nothing.

Commits happen in call order.  In a process group, the outcome exchange and
commit run in a background thread over a gloo group created for objckpt (never
NCCL from a background thread).  The interpreter waits for saves in flight
before it exits (their threads are not daemons).
"""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Optional

import torch

from . import _runtime, saving
from .dist import Comm, LocalComm, TorchComm, get_comm
from .saving import SaveResult
from .staging.mirror import mirror_set, side_stream
from .staging.pool import default_pool
from .storage import ObjectStore

MiB = 1 << 20

_lock = threading.Lock()
_in_flight: list["SaveHandle"] = []
_gloo_groups: dict[Any, Any] = {}


class SaveHandle:
    """The outcome of one :func:`async_save`."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._staged = threading.Event()
        self._future: "concurrent.futures.Future[SaveResult]" = concurrent.futures.Future()
        self._violation: Optional[str] = None

    def wait_staged(self, timeout: Optional[float] = None) -> None:
        """Block until the state is in host memory (or staging failed); after this the
        caller may modify its tensors."""
        if not self._staged.wait(timeout):
            raise TimeoutError(f"async save to {self.uri!r}: staging not finished after {timeout} s")

    def staged(self) -> bool:
        return self._staged.is_set()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> SaveResult:
        """The :class:`SaveResult` once committed, or the background error."""
        return self._future.result(timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        return self._future.exception(timeout)


def _background_comm(comm: Comm, process_group: Any) -> Comm:
    """A gloo group over the same ranks, for collectives issued off the caller's thread.
    Created once per group, collectively, from the caller's thread."""
    if isinstance(comm, LocalComm):
        return comm
    import torch.distributed as dist

    key = process_group
    with _lock:
        group = _gloo_groups.get(key)
    if group is None:
        backend = dist.get_backend(process_group)
        if backend == "gloo":
            group = process_group if process_group is not None else dist.group.WORLD
        else:
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            group = dist.new_group(ranks=ranks, backend="gloo")
        with _lock:
            _gloo_groups[key] = group
    return TorchComm(group)


def wait_all(timeout: Optional[float] = None) -> None:
    """Wait for every save in flight to commit or fail."""
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


def _wait_for_room(max_in_flight: int) -> None:
    while True:
        with _lock:
            _in_flight[:] = [h for h in _in_flight if not h.done()]
            if len(_in_flight) < max_in_flight:
                return
            oldest = _in_flight[0]
        concurrent.futures.wait([oldest._future])


def _finish_mirrored(prep: saving.Prepared, mirrors: Any, bg_comm: Comm, uri: str) -> SaveHandle:
    """The state is in its host mirrors once their copies complete: return then,
    and upload straight from the mirrors (nothing else writes them meanwhile)."""
    handle = SaveHandle(uri)
    try:
        mirrors.wait()
    except BaseException:
        mirrors.release()
        raise
    handle._staged.set()
    pool = default_pool(max(prep.plan.max_part, 1))  # only for parts that are not plain host memory
    upload = _runtime.submit(saving.upload(prep, pool, zero_copy=True))
    upload.add_done_callback(lambda _: mirrors.release())
    _start_finisher(handle, prep, bg_comm, upload)
    return handle


def _start_finisher(handle: SaveHandle, prep: saving.Prepared, bg_comm: Comm, upload: Any) -> None:
    """Phase 3 in a thread of its own, after the previous save's commit (call order)."""
    with _lock:
        previous = _in_flight[-1] if _in_flight else None
        _in_flight.append(handle)

    def finisher() -> None:
        try:
            outcome = upload.result()
            if handle._violation and outcome[2] is None:
                err = RuntimeError(handle._violation)
                outcome = ([], [], f"RuntimeError: {handle._violation}", err)
            if previous is not None:  # commits happen in call order
                concurrent.futures.wait([previous._future])
            handle._future.set_result(saving.finish(prep, bg_comm, outcome))
        except BaseException as e:  # surfaces from handle.result()
            handle._future.set_exception(e)

    threading.Thread(target=finisher, name="objckpt-async-save", daemon=False).start()


def async_save(
    state_dict: Any,
    uri: str,
    *,
    storage_options: Optional[dict[str, Any]] = None,
    overwrite: bool = False,
    metadata: Optional[dict[str, Any]] = None,
    allow_pickle: bool = False,
    process_group: Any = None,
    lazy: bool = False,
    max_in_flight: int = 1,
    blob_size: int = 1 << 30,
    part_size: int = 16 * MiB,
    staging_bytes: Optional[int] = None,
    crc_block: int = 1 * MiB,
    store: Optional[ObjectStore] = None,
) -> SaveHandle:
    """Save like :func:`objckpt.save`, returning once the state is staged (at once
    with ``lazy=True``); see the module docstring for the contract.

    ``max_in_flight``: how many saves may stage and upload at once (a new call first
    waits for the oldest beyond that).  ``staging_bytes``: host memory for staging;
    by default this rank's whole share of the state, else staging and upload are
    pipelined part by part within the budget (and the call returns when the last
    part is staged).
    """
    from .api import _check_metadata, _open

    if max_in_flight < 1:
        raise ValueError("max_in_flight must be at least 1")
    _install_exit_hook()
    _wait_for_room(max_in_flight)
    comm = get_comm(process_group)
    bg_comm = _background_comm(comm, process_group)
    st, prefix = _open(uri, storage_options, store)
    # Default mode copies each tensor to its host mirror while the state is walked
    # and planned (staging/mirror.py); lazy saves, a staging cap, or a second save
    # while the mirrors still upload take the pooled part-by-part path below.
    mirrors = mirror_set() if not lazy and staging_bytes is None else None
    if mirrors is not None and not mirrors.acquire():
        mirrors = None
    try:
        prep = saving.prepare(state_dict, uri, st, prefix, comm, overwrite=overwrite, metadata=metadata,
                              allow_pickle=allow_pickle, blob_size=blob_size, part_size=part_size,
                              crc_block=crc_block, check_metadata=_check_metadata,
                              mirror=mirrors.mirror if mirrors is not None else None)
    except BaseException:
        if mirrors is not None:
            mirrors.wait()
            mirrors.release()
        raise
    if mirrors is not None:
        return _finish_mirrored(prep, mirrors, bg_comm, uri)
    max_part = max(prep.plan.max_part, 1)
    nparts = sum(len(b.parts) for b in prep.plan.blobs)
    # the budget buys slots of the largest part; by default one per part (buffers are
    # allocated at each part's own size, so memory is this rank's share of the state)
    budget = staging_bytes if staging_bytes is not None else max(max_part * nparts, max_part)
    pool = default_pool(max(budget, max_part))
    handle = SaveHandle(uri)

    sources = [t for t in prep.pieces.values()]
    versions = [t._version for t in sources]
    stream = None
    cuda = [t for t in sources if t.is_cuda]
    if cuda:
        stream = side_stream(cuda[0].device)
        stream.wait_stream(torch.cuda.current_stream(cuda[0].device))  # the values as of this call

    def on_staged() -> None:
        if lazy:
            changed = [k for (k, t), v in zip(prep.pieces.items(), versions) if t._version != v]
            if changed:
                handle._violation = (
                    f"tensor {prep.where[changed[0]][0]!r} was modified before wait_staged() returned; "
                    "the lazy async save is abandoned (call handle.wait_staged() before optimizer.step())"
                )
        handle._staged.set()

    upload = _runtime.submit(saving.upload(prep, pool, zero_copy=False, on_staged=on_staged, stream=stream))
    upload.add_done_callback(lambda _: handle._staged.set())  # a failed staging releases waiters too
    _start_finisher(handle, prep, bg_comm, upload)
    if not lazy:
        handle.wait_staged()
    return handle
