"""Host mirrors: copy each tensor to host memory the moment the walk finds it.

The default ``async_save`` (no staging cap, not lazy) does not plan first and
copy after.  While it walks the state, it starts each tensor's copy into a
host *mirror* of that tensor: a pinned, reused buffer, with device copies
queued on a side stream. Describing the state and planning the writes then
run on the CPU while the DMA engine copies, and the call returns once the last
copy has completed. The mirrors are objckpt's own memory and nothing else
writes them until the upload is done, so the upload sends them as they are:
one copy in all, the D2H copy that has to happen anyway.

Mirrors are kept per (key, shape, dtype) and reused by the next save. A
mirror set serves one save at a time (a second save in flight uses the
pooled path). A process forked after they were made starts with none.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Optional

import torch

from ..runtime.memory import side_stream, want_pinned


class MirrorSet:
    """Host copies of one save's tensors; ``mirror`` is called per tensor during the walk."""

    def __init__(self) -> None:
        self._mirrors: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()
        self._pid = os.getpid()
        self._busy = False
        self._lock = threading.Lock()
        self.pin = want_pinned()
        self._stream: Any = None
        self._device: Optional[torch.device] = None
        self.nbytes = 0

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
        with self._lock:
            used = sum(m.numel() * m.element_size() for k, m in self._mirrors.items() if k in self._used)
            if self.nbytes - used > 2 * used:
                for k in [k for k in self._mirrors if k not in self._used]:
                    self.nbytes -= self._mirrors[k].numel() * self._mirrors[k].element_size()
                    del self._mirrors[k]
            self._busy = False

    def mirror(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """A host tensor that will hold ``t``'s values; the copy is started now."""
        ident = (key, tuple(t.shape), t.dtype)
        host = self._mirrors.get(ident)
        if host is None:
            host = torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=self.pin and t.is_cuda)
            self._mirrors[ident] = host
            self.nbytes += host.numel() * host.element_size()
        self._used.add(ident)
        src = t.detach() if t.requires_grad else t  # never recorded by autograd (no no_grad block per tensor)
        if src.is_cuda:
            if self._stream is None:
                self._device = src.device
                self._stream = side_stream(src.device)
                self._stream.wait_stream(torch.cuda.current_stream(src.device))  # values as of this call
            with torch.cuda.stream(self._stream):
                host.copy_(src, non_blocking=True)
        else:
            host.copy_(src)
        return host

    def wait(self) -> None:
        """Block until every device copy started by :meth:`mirror` has completed."""
        if self._stream is not None:
            self._stream.synchronize()


_set: Optional[MirrorSet] = None


def mirror_set() -> MirrorSet:
    """The process's mirror set (one: a second save in flight takes the pooled path)."""
    global _set
    if _set is None:
        _set = MirrorSet()
    return _set
