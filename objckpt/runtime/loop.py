"""One background event loop for all of objckpt's I/O.

The library's core is async (many requests in flight from one thread); the
public API is synchronous.  Rather than keep two copies of every function, the
sync wrappers submit coroutines to a single long-lived loop running in a daemon
thread.  Storage clients are bound to that loop, so they are created once and
reused across saves.  After ``fork`` the child gets a fresh loop (threads do
not survive fork, and a client bound to the parent's loop must not be reused).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: Optional[asyncio.AbstractEventLoop] = None
_thread: Optional[threading.Thread] = None
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_aside: Optional[concurrent.futures.ThreadPoolExecutor] = None
_on_reset: list[Callable[[], None]] = []


def _start() -> asyncio.AbstractEventLoop:
    global _loop, _thread
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def runner() -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        loop.run_forever()

    t = threading.Thread(target=runner, name="objckpt-io", daemon=True)
    t.start()
    ready.wait()
    _loop, _thread = loop, t
    return loop


def loop() -> asyncio.AbstractEventLoop:
    """The background loop, started on first use."""
    with _lock:
        if _loop is None or _loop.is_closed():
            return _start()
        return _loop


def cpu_threads() -> int:
    """How many threads :func:`cpu_pool` runs (2 to 8: one per CPU)."""
    return max(2, min(8, os.cpu_count() or 2))


def cpu_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for memcpy and crc32c work (both release the GIL)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=cpu_threads(), thread_name_prefix="objckpt-cpu")
        return _pool


def aside_pool() -> concurrent.futures.ThreadPoolExecutor:
    """A few threads for setup work started ahead of need (a store's credential walk, a CA
    bundle's load), apart from :func:`cpu_pool`: whoever waits for such work may itself be
    a CPU-pool thread, and must not wait behind the copies queued there."""
    global _aside
    with _lock:
        if _aside is None:
            _aside = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="objckpt-aside")
        return _aside


def run(coro: Awaitable[T], timeout: Optional[float] = None) -> T:
    """Run ``coro`` on the background loop and wait for its result."""
    lp = loop()
    if threading.current_thread() is _thread:
        raise RuntimeError("objckpt's sync API cannot be called from its own I/O thread")
    fut = asyncio.run_coroutine_threadsafe(coro, lp)  # type: ignore[arg-type]
    try:
        return fut.result(timeout)
    except BaseException:
        fut.cancel()
        raise


def submit(coro: Awaitable[T]) -> "concurrent.futures.Future[T]":
    """Start ``coro`` on the background loop without waiting."""
    return asyncio.run_coroutine_threadsafe(coro, loop())  # type: ignore[arg-type]


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking CPU work (copies, checksums) off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(cpu_pool(), fn, *args)


async def gather_fail_fast(tasks: Sequence["asyncio.Future[object]"]) -> None:
    """Wait for every task; on the first error cancel the rest, wait for them, raise it."""
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for d in done:
                exc = d.exception()
                if exc is not None:
                    raise exc
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def on_reset(fn: Callable[[], None]) -> None:
    """Register a cache to clear when the loop is replaced (after fork)."""
    _on_reset.append(fn)


def _after_fork_in_child() -> None:
    global _loop, _thread, _pool, _aside, _lock
    _loop, _thread, _pool, _aside = None, None, None, None
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    for fn in _on_reset:
        fn()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
