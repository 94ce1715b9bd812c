"""Storage backends behind one seam, and the URI -> store mapping.

``s3://bucket/prefix`` -> S3 (:mod:`.s3`), ``file:///dir`` or a plain path ->
local files, ``memory://name/prefix`` -> in-process (tests), any other
``proto://`` -> fsspec.  Stores are cached per (URI root, options) so a
training job reuses one connection pool across saves.

A URI is not parsed as a URL: everything after ``scheme://root/`` is the key
prefix, character for character.  ``#``, ``?``, ``%``, ``+``, spaces and
unicode are key characters (S3 keys may hold them, and the AWS CLI keeps them),
never a fragment, a query or an escape, so two different URIs never name one
checkpoint.  Control characters (C0, DEL) are refused (:func:`check_uri`).

An S3 store's settings are resolved from the environment and the AWS config
files when it is built, so the cache key of an S3 store also holds what those
settings were read from (``s3.env_state.environment_state``), read on every call: a
process that changes ``AWS_ENDPOINT_URL``, its keys, ``OBJCKPT_S3_DEADLINE_FLOOR``
or its config file between saves gets a new store, and the superseded one is closed.
"""
from __future__ import annotations

import asyncio
import atexit
import json
import os
import re
import threading
from typing import Any, Optional

from ..errors import InvalidURIError
from ..runtime import loop as _runtime
from .base import BlobWriter, ObjectInfo, ObjectStore, UploadInfo
from .local import LocalStore
from .memory import MemoryStore, namespace

__all__ = ["ObjectStore", "ObjectInfo", "UploadInfo", "BlobWriter", "check_uri", "open_store", "split_uri"]

_cache: dict[str, ObjectStore] = {}
# (scheme, root, options) -> the cache key now holding that store, so a store
# built under an older environment can be found and closed.
_current: dict[str, str] = {}
_cache_lock = threading.Lock()
_runtime.on_reset(_cache.clear)
_runtime.on_reset(_current.clear)

def env_fingerprint(scheme: str) -> Any:
    """The environment a store of ``scheme`` depends on, as the S3 configuration reads it
    (:func:`.s3.env_state.environment_state`: one list, beside the code that reads it)."""
    if scheme not in ("s3", "s3a"):
        return []
    from .s3.env_state import environment_state

    return environment_state()


#: a URI scheme (RFC 3986: a letter, then letters, digits, ``+``, ``-``, ``.``)
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


def check_uri(uri: str) -> None:
    """Refuse a URI or path holding a control character (C0 or DEL): ``urlsplit`` and
    browsers silently drop TAB, CR and LF, the OS refuses NUL, and a newline would split
    the one-URI-a-line listings; kept or dropped, it would let two spellings name one
    checkpoint or hide which one is meant."""
    bad = next((i for i, ch in enumerate(uri) if ord(ch) < 0x20 or ord(ch) == 0x7F), None)
    if bad is not None:
        raise InvalidURIError(
            f"{uri!r}: control character {uri[bad]!r} at position {bad}; a checkpoint URI or path may not "
            "hold tabs, newlines, NUL or other control characters (C0, DEL): choose a name without them")


def split_uri(uri: str) -> tuple[str, str, str]:
    """(scheme, root, prefix): root names the store (bucket, directory), prefix the checkpoint.

    Not a URL parse (see the module docstring): the prefix is everything after the root,
    ``#`` and ``?`` included, undecoded; :class:`InvalidURIError` for a control character
    or a malformed scheme."""
    check_uri(uri)
    if "://" not in uri:
        return "file", "/", os.path.abspath(os.path.expanduser(uri)).lstrip("/")
    scheme, rest = uri.split("://", 1)
    if not _SCHEME.fullmatch(scheme):
        raise InvalidURIError(f"{uri!r}: {scheme!r} is not a URI scheme (write s3://bucket/path, "
                              "file:///dir, or a plain path without '://')")
    scheme = scheme.lower()  # "fsspec+PROTO" forces the fsspec backend
    if scheme == "file":
        return "file", "/", rest.lstrip("/")
    root, _, path = rest.partition("/")
    return scheme, root, path.lstrip("/")


def open_store(uri: str, storage_options: Optional[dict[str, Any]] = None) -> tuple[ObjectStore, str]:
    """The store holding ``uri`` and the checkpoint's key prefix inside it."""
    opts = dict(storage_options or {})
    scheme, root, prefix = split_uri(uri)
    prefix = prefix.strip("/")
    if scheme in ("s3", "s3a") and not root:
        raise InvalidURIError(f"{uri!r}: an S3 URI needs a bucket (s3://bucket/path)")
    base_key = json.dumps([scheme, root, opts], sort_keys=True, default=str)
    cache_key = json.dumps([base_key, env_fingerprint(scheme)])
    stale: Optional[ObjectStore] = None
    with _cache_lock:
        store = _cache.get(cache_key)
        if store is None:
            store = _make(scheme, root, opts)
            _cache[cache_key] = store
            old_key = _current.get(base_key)
            if old_key is not None and old_key != cache_key:
                stale = _cache.pop(old_key, None)
        _current[base_key] = cache_key
    if stale is not None:
        _close_later(stale)
    return store, prefix


def _close_later(store: ObjectStore) -> None:
    """Close a superseded store on the background loop, without waiting for it:
    requests still in flight on it (another thread's save) keep their client."""
    loop = _runtime._loop
    if loop is None or not loop.is_running():
        return  # no client was ever opened on a loop that is gone

    async def close() -> None:
        try:
            await asyncio.sleep(1.0)  # let a save that already holds it start its requests
            await store.close()
        except Exception:
            pass

    asyncio.run_coroutine_threadsafe(close(), loop)


def _make(scheme: str, root: str, opts: dict[str, Any]) -> ObjectStore:
    if scheme == "file":
        return LocalStore(root)
    if scheme == "memory":
        return MemoryStore(namespace(root), name=root)
    if scheme in ("s3", "s3a"):
        from .s3 import S3Store

        return S3Store(root, **opts)
    from .fsspec_store import FsspecStore

    return FsspecStore(scheme.split("+", 1)[1] if scheme.startswith("fsspec+") else scheme, root, **opts)


def _close_all() -> None:
    """Close cached clients at exit so no connection pool is left unclosed."""
    stores = list(_cache.values())
    _cache.clear()
    if not stores or _runtime._loop is None or not _runtime._loop.is_running():
        return
    try:
        _runtime.run(_close_stores(stores), timeout=5)
    except Exception:
        pass


async def _close_stores(stores: list[ObjectStore]) -> None:
    for s in stores:
        try:
            await s.close()
        except Exception:
            pass


atexit.register(_close_all)
