"""Pausing Python's cyclic garbage collector while metadata is decoded.

Why: decoding a manifest or rank index builds hundreds of thousands of small containers
(a model of 3,200 tensors: ~300,000), and every 700 allocations the collector runs; each
time enough has survived, it runs a full collection that walks every tracked object of
the process, the training's model, optimizer and libraries included.  Measured on the
2-core VM: a 1.2 MB manifest decoded in 90 ms with the collector on and 77-87 ms with it
off in a small process, and in 207 ms against ~80 when two decoded manifests were alive
(each new decode then triggered a full collection).  The decode creates no reference
cycles, so nothing it makes needs the collector: reference counting frees it all.

The pause is process-wide (the collector has one switch) and short (one decode), and
:func:`paused_gc` nests across threads: the collector is switched back on when the last
decode in flight ends, and only if it was on when the first began, so a program that
disabled it itself keeps it disabled.

The decoded manifest then lives as long as the load that uses it, and the objects the
load's planning makes push it into the oldest generation: one full collection per load,
walking the manifest and everything else the process holds (85 ms of a 320 ms load of
3,200 small tensors on the 2-core VM).  :class:`FrozenOld` moves every object that exists
once the manifest is decoded into the collector's permanent generation (``gc.freeze``)
for the rest of the load, and back (``gc.unfreeze``) when the load ends: the collector
still collects what the load makes, but never walks the manifest or the program's own
objects meanwhile, and when the load ends its manifest is freed by reference counting,
never having been pending for a full collection (the same load: 226-239 ms; CPython 3.13
and older with the GIL only: :data:`FREEZE_PAYS`).  A program
that froze objects itself (``gc.get_freeze_count()`` above zero, as before a fork) or
switched the collector off is left alone.

A process forked meanwhile (a DataLoader worker started while another thread decodes or
loads) starts with the collector on and no pause or freeze of its own to end: its parent's
threads do not exist in it.  Objects frozen at the fork stay frozen in the child, as
after a program's own ``gc.freeze()`` before forking (unfreezing them would write to every
inherited page).
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import sysconfig
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0
_switched_off = False


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic collection inside the block (reference counting goes on as ever)."""
    global _depth, _switched_off
    with _lock:
        if _depth == 0:
            _switched_off = gc.isenabled()
            if _switched_off:
                gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _switched_off:
                _switched_off = False
                gc.enable()


_frozen_depth = 0
_we_froze = False


#: where :class:`FrozenOld` freezes: CPython 3.13 and older with the GIL, whose ``gc.freeze``
#: and ``gc.unfreeze`` splice lists (constant time) and whose full collections walk the
#: whole heap.  Python 3.14's collector is incremental (no full-heap walks to avoid), and
#: its ``gc.freeze``, like a free-threaded build's, visits every object: there it would cost
#: what it saves, so nothing is frozen.
FREEZE_PAYS = sys.version_info < (3, 14) and not sysconfig.get_config_var("Py_GIL_DISABLED")


class FrozenOld:
    """One load's hold on :func:`gc.freeze` (see the module docstring): :meth:`now` once its
    manifest is decoded (again after a second manifest: it is frozen too), :meth:`close`
    when it ends.  Loads on several threads share the freeze; the last to end unfreezes."""

    def __init__(self) -> None:
        self._held = False

    def now(self) -> None:
        global _frozen_depth, _we_froze
        if not FREEZE_PAYS:
            return
        with _lock:
            if _frozen_depth == 0:
                _we_froze = gc.isenabled() and gc.get_freeze_count() == 0
            if _we_froze:
                gc.freeze()  # (again, when another load holds it: its objects since then join)
            if not self._held:
                _frozen_depth += 1
                self._held = True

    def close(self) -> None:
        global _frozen_depth, _we_froze
        with _lock:
            if not self._held:
                return
            self._held = False
            _frozen_depth -= 1
            if _frozen_depth == 0 and _we_froze:
                _we_froze = False
                gc.unfreeze()


def _after_fork_in_child() -> None:
    global _depth, _switched_off, _frozen_depth, _we_froze
    if _switched_off:
        gc.enable()
    _depth, _switched_off, _frozen_depth, _we_froze = 0, False, 0, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
