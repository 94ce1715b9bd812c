"""Host mirrors: copy each tensor to host memory the moment the walk finds it.

The default ``async_save`` (no staging cap, not lazy) does not plan first and
copy after.  While it walks the state, it starts each tensor's copy into a
host *mirror* of that tensor: a pinned, reused buffer, with device copies
queued on a side stream. Describing the state and planning the writes then
run on the CPU while the DMA engine copies, and the call returns once the last
copy has completed. The mirrors are objckpt's own memory and nothing else
writes them until the upload is done, so the upload sends them as they are:
one copy in all, the D2H copy that has to happen anyway.

Host tensors are copied by threads, not by the walk: each copy is queued as
the walk finds its tensor, in batches of about :data:`COPY_BATCH_BYTES` handed
to :data:`COPY_THREADS` threads (one ``torch._foreach_copy_`` each, which
releases the GIL), so the walk, the checks and the plan go on while the memory
is copied, and the call returns once the last batch is done (:meth:`MirrorSet.wait`).
A state of 3,200 tensors of 64 KiB: the walk and the copies one after the other
took as long as both; side by side, as long as the longer.

Mirrors are kept per key (made again when its shape or dtype changed) and reused by the next save. A
mirror set serves one save at a time (a second save in flight uses the
pooled path). A process forked after they were made starts with none.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any, Optional

import torch

from ..runtime.loop import cpu_threads
from ..runtime.memory import side_stream, want_pinned

#: host copies are queued until a batch holds this many bytes (or :data:`COPY_BATCH_TENSORS` tensors)
COPY_BATCH_BYTES = 4 << 20
COPY_BATCH_TENSORS = 256

_copy_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_copy_lock = threading.Lock()


def _copiers() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that copy host mirrors (their own: never queued behind an upload's work)."""
    global _copy_pool
    with _copy_lock:
        if _copy_pool is None:
            _copy_pool = concurrent.futures.ThreadPoolExecutor(cpu_threads(), thread_name_prefix="objckpt-mirror")
        return _copy_pool


def _after_fork_in_child() -> None:
    global _copy_pool, _copy_lock
    _copy_pool, _copy_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _copy(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each (host, source) pair: one call for the batch where torch has it."""
    dst = [d for d, _ in pairs]
    src = [s for _, s in pairs]
    with torch.no_grad():  # (grad mode is per thread: a source that requires grad is never recorded)
        foreach = getattr(torch, "_foreach_copy_", None)
        if foreach is not None:
            try:
                foreach(dst, src)
                return
            except (RuntimeError, TypeError, NotImplementedError):  # an odd pair: copied one by one below
                pass
        for d, s in pairs:
            d.copy_(s)


class MirrorSet:
    """Host copies of one save's tensors; ``mirror`` is called per tensor during the walk."""

    def __init__(self) -> None:
        #: by key: the mirror, and its shape, dtype and size (a key's tensor may change shape
        #: between saves: its mirror is then made again)
        self._mirrors: dict[str, tuple[torch.Tensor, tuple, torch.dtype, int]] = {}
        self._used: set[str] = set()
        self._pid = os.getpid()
        self._busy = False
        self._lock = threading.Lock()
        self.pin = want_pinned()
        self._stream: Any = None
        self._device: Optional[torch.device] = None
        self.nbytes = 0
        self._batch: list[tuple[torch.Tensor, torch.Tensor]] = []  # host copies not yet handed to a thread
        self._batch_bytes = 0
        self._copies: list["concurrent.futures.Future[None]"] = []

    def acquire(self) -> bool:
        """Claim the set for one save; False while another save still uploads from it."""
        with self._lock:
            if os.getpid() != self._pid:  # forked: never reuse the parent's (pinned) memory
                self._mirrors, self._pid, self._busy, self.nbytes = {}, os.getpid(), False, 0
            if self._busy:
                return False
            self._busy = True
            self._used = set()
            self._stream, self._device = None, None
            return True

    def release(self) -> None:
        """The save is done with its mirrors.  Mirrors this save did not use are kept
        for the next one (a job may alternate between, say, a model and an optimizer
        save) unless they outweigh the used ones 2 to 1: then the state changed."""
        self._batch, self._batch_bytes = [], 0  # (a failed save: its queued copies are not needed)
        copies, self._copies = self._copies, []
        concurrent.futures.wait(copies)  # no thread still writes a mirror the next save is handed
        with self._lock:
            used = sum(m[3] for k, m in self._mirrors.items() if k in self._used)
            if self.nbytes - used > 2 * used:
                for k in [k for k in self._mirrors if k not in self._used]:
                    self.nbytes -= self._mirrors.pop(k)[3]
            self._busy = False

    def mirror(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """A host tensor that will hold ``t``'s values once :meth:`wait` returns; the copy
        is started (a device copy) or queued (a host copy: see the module docstring) now."""
        shape, dtype = t.shape, t.dtype
        got = self._mirrors.get(key)  # (by key alone: a str hashes at once, a shape does not)
        if got is None or got[1] != shape or got[2] != dtype:
            if got is not None:
                self.nbytes -= got[3]
            host = torch.empty(tuple(shape), dtype=dtype, pin_memory=self.pin and t.is_cuda)
            got = self._mirrors[key] = (host, shape, dtype, host.nbytes)
            self.nbytes += got[3]
        host = got[0]
        self._used.add(key)
        if t.is_cuda:
            src = t.detach() if t.requires_grad else t  # never recorded by autograd (no no_grad block per tensor)
            if self._stream is None:
                self._device = src.device
                self._stream = side_stream(src.device)
                self._stream.wait_stream(torch.cuda.current_stream(src.device))  # values as of this call
            with torch.cuda.stream(self._stream):
                host.copy_(src, non_blocking=True)
        else:
            self._batch.append((host, t))  # (copied under no_grad: see _copy)
            self._batch_bytes += got[3]
            if self._batch_bytes >= COPY_BATCH_BYTES or len(self._batch) >= COPY_BATCH_TENSORS:
                self._hand_over()
        return host

    def _hand_over(self) -> None:
        if self._batch:
            self._copies.append(_copiers().submit(_copy, self._batch))
            self._batch, self._batch_bytes = [], 0

    def wait(self) -> None:
        """Block until every copy started or queued by :meth:`mirror` has completed (the
        first failure raised once all are done: none is left writing a mirror)."""
        self._hand_over()
        copies, self._copies = self._copies, []
        if copies:
            concurrent.futures.wait(copies)
            for f in copies:
                f.result()
        if self._stream is not None:
            self._stream.synchronize()


_set: Optional[MirrorSet] = None


def mirror_set() -> MirrorSet:
    """The process's mirror set (one: a second save in flight takes the pooled path)."""
    global _set
    if _set is None:
        _set = MirrorSet()
    return _set
