"""One TLS context per CA bundle (and its version), shared by every store of the process.

Loading a CA bundle costs 13-30 ms (certifi's ~150 certificates).  The settings check a
bundle given to them when the store opens (:mod:`.config`, so that a missing or broken one
is an error naming its source) and the own HTTP path (:mod:`.direct`) needs a context to
connect: both take it from here, so a bundle is loaded once per file version, not once to
check and again per store.  :func:`prepare` loads one on a worker thread ahead of need
(the store's opening starts it for an https endpoint, so the first request's connection
finds it ready).  It also says what a handshake answered in plain text means
(:func:`not_tls_reason`): an https:// URL for a plain HTTP port, an error naming the
http:// URL (:func:`plain_http_error`, raised by :mod:`.send` on either transport).
"""
from __future__ import annotations

import concurrent.futures
import os
import ssl
import threading
from typing import Optional
from urllib.parse import urlsplit, urlunsplit

from ...errors import PlainHttpEndpointError
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


#: OpenSSL's reasons when the answer to a ClientHello is not TLS at all: a plain HTTP
#: server's "HTTP/1.1 400 ..." read as a TLS record (the wording varies with OpenSSL's version)
_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"})


def _causes(e: Optional[BaseException]) -> list[BaseException]:
    """``e`` and what it wraps: its cause and context, botocore's ``kwargs["error"]`` and
    aiohttp's ``os_error`` (botocore's SSLError wraps aiohttp's, which wraps ssl's)."""
    out: list[BaseException] = []
    todo = [e]
    while todo and len(out) < 16:
        x = todo.pop()
        if x is None or any(x is y for y in out):
            continue
        out.append(x)
        kwargs = getattr(x, "kwargs", None)
        todo += [x.__cause__, x.__context__, getattr(x, "os_error", None),
                 kwargs.get("error") if isinstance(kwargs, dict) else None]
    return out


def not_tls_reason(e: BaseException) -> Optional[str]:
    """OpenSSL's reason (``WRONG_VERSION_NUMBER``...) when ``e``, on either S3 transport, is a
    TLS handshake that got an answer that is not TLS (an https:// URL for a plain HTTP
    port); None for anything else (an untrusted certificate, a reset, a timeout)."""
    for x in _causes(e):
        reason = getattr(x, "reason", None) if isinstance(x, ssl.SSLError) else None
        if reason in _NOT_TLS:
            return str(reason)
    return None


def plain_http_error(what: str, endpoint: str, url: Optional[str], source: str,
                     reason: str) -> PlainHttpEndpointError:
    """The error for a request to an https:// endpoint that answered in plain text
    (:func:`not_tls_reason`): it names the endpoint and, for a custom endpoint (``url``,
    from ``source``), the http:// URL of the same port to set instead."""
    said = f"S3 {what} at {endpoint}: the TLS handshake got an answer that is not TLS (OpenSSL: {reason})"
    if not url:  # AWS's own endpoint speaks TLS: what answered is in between
        return PlainHttpEndpointError(f"{said}: something between this machine and the endpoint (a proxy, a "
                                      "captive portal) answers in plain HTTP; not retried")
    parts = urlsplit(url)
    netloc = parts.netloc if parts.port is not None else f"{parts.netloc}:443"  # the same port, without TLS
    plain = urlunsplit(("http", netloc, parts.path, parts.query, parts.fragment))
    return PlainHttpEndpointError(
        f"{said}: the endpoint serves plain HTTP on that port, not HTTPS. Set endpoint_url to {plain!r} "
        f"(now {url!r}, from {source}), or give the port that serves HTTPS; not retried")


def _forget() -> None:
    """After fork: a context being made by a thread of the parent would never be finished."""
    with _lock:
        for k, v in list(_made.items()):
            if not v.done():
                del _made[k]


_runtime.on_reset(_forget)
