"""One TLS context per CA bundle (and its version), shared by every store of the process.

Loading a CA bundle costs 13-30 ms (certifi's ~150 certificates).  The settings check a
bundle given to them when the store opens (:mod:`.config`, so that a missing or broken one
is an error naming its source) and the own HTTP path (:mod:`.direct`) needs a context to
connect: both take it from here, so a bundle is loaded once per file version, not once to
check and again per store.  :func:`prepare` loads one on a worker thread ahead of need
(the store's opening starts it for an https endpoint, so the first request's connection
finds it ready).
"""
from __future__ import annotations

import concurrent.futures
import os
import ssl
import threading
from typing import Optional

from ...runtime import loop as _runtime

_lock = threading.Lock()
#: (CA path, verify, the path's version) -> the context, made or being made
_made: dict[tuple[Optional[str], bool, Optional[tuple[int, int]]], "concurrent.futures.Future[ssl.SSLContext]"] = {}


def _version(cafile: Optional[str]) -> Optional[tuple[int, int]]:
    if not cafile:
        return None
    try:
        st = os.stat(cafile)
    except OSError:
        return None  # the build says why
    return st.st_mtime_ns, st.st_size


def _slot(cafile: Optional[str], verify: bool) -> tuple["concurrent.futures.Future[ssl.SSLContext]", bool]:
    """The future holding this context, and whether the caller must build it."""
    key = (cafile, verify, _version(cafile))
    with _lock:
        got = _made.get(key)
        if got is not None:
            return got, False
        fut: "concurrent.futures.Future[ssl.SSLContext]" = concurrent.futures.Future()
        _made[key] = fut
        return fut, True


def _build(fut: "concurrent.futures.Future[ssl.SSLContext]", cafile: Optional[str], verify: bool) -> None:
    try:
        ctx = ssl.create_default_context(capath=cafile) if cafile and os.path.isdir(cafile) else \
            ssl.create_default_context(cafile=cafile)
        if not verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
    except BaseException as e:  # noqa: BLE001 - given to every waiter; not kept (a fixed file is tried again)
        with _lock:
            for k, v in list(_made.items()):
                if v is fut:
                    del _made[k]
        fut.set_exception(e)
        return
    fut.set_result(ctx)


def context(cafile: Optional[str], verify: bool = True) -> ssl.SSLContext:
    """The client context trusting ``cafile`` (a file or a directory; None: the system's
    default), hostname and chain checked unless ``verify`` is False; OSError or
    ssl.SSLError when the bundle cannot be used."""
    fut, mine = _slot(cafile, verify)
    if mine:
        _build(fut, cafile, verify)
    return fut.result()


def prepare(cafile: Optional[str], verify: bool = True) -> None:
    """Start loading that context on a worker thread unless it is loaded or loading."""
    fut, mine = _slot(cafile, verify)
    if mine:
        _runtime.aside_pool().submit(_build, fut, cafile, verify)


def _forget() -> None:
    """After fork: a context being made by a thread of the parent would never be finished."""
    with _lock:
        for k, v in list(_made.items()):
            if not v.done():
                del _made[k]


_runtime.on_reset(_forget)
