"""Storage backends behind one seam, and the URI -> store mapping.

``s3://bucket/prefix`` -> S3 (:mod:`.s3`), ``file:///dir`` or a plain path ->
local files, ``memory://name/prefix`` -> in-process (tests), any other
``proto://`` -> fsspec.  Stores are cached per (URI root, options) so a
training job reuses one connection pool across saves.

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
import threading
from typing import Any, Optional
from urllib.parse import urlsplit

from ..runtime import loop as _runtime
from .base import BlobWriter, ObjectInfo, ObjectStore, UploadInfo
from .local import LocalStore
from .memory import MemoryStore, namespace

__all__ = ["ObjectStore", "ObjectInfo", "UploadInfo", "BlobWriter", "open_store", "split_uri"]

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


def split_uri(uri: str) -> tuple[str, str, str]:
    """(scheme, root, prefix): root names the store (bucket, directory), prefix the checkpoint."""
    if "://" not in uri:
        return "file", "/", os.path.abspath(os.path.expanduser(uri)).lstrip("/")
    parts = urlsplit(uri)
    scheme = parts.scheme  # "fsspec+PROTO" forces the fsspec backend
    if scheme == "file":
        return "file", "/", (parts.netloc + parts.path).lstrip("/")
    return scheme, parts.netloc, parts.path.lstrip("/")


def open_store(uri: str, storage_options: Optional[dict[str, Any]] = None) -> tuple[ObjectStore, str]:
    """The store holding ``uri`` and the checkpoint's key prefix inside it."""
    opts = dict(storage_options or {})
    scheme, root, prefix = split_uri(uri)
    prefix = prefix.strip("/")
    if scheme in ("s3", "s3a") and not root:
        raise ValueError(f"{uri!r}: an S3 URI needs a bucket (s3://bucket/path)")
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
