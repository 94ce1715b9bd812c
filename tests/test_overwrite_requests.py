"""An overwrite reads the manifest it replaces once (real moto S3 over HTTP).

A save with ``overwrite=True`` used to HEAD the manifest while preparing (only a save
without overwrite needs to know whether one is there) and GET it again at the commit
(to delete the replaced checkpoint's blobs).  Now the GET at the commit is the only
request for the old manifest; the replaced blobs are still deleted.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

import objckpt
from objckpt.storage import open_store
from objckpt.storage.base import ObjectInfo
from objckpt.testing.stores import CountingStore


class KeyCounting(CountingStore):
    """Also records which keys were HEAD (CountingStore records the GETs' keys)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.heads: list[str] = []

    async def head(self, key: str) -> Optional[ObjectInfo]:
        self.heads.append(key)
        return await super().head(key)


def test_an_overwrite_fetches_the_old_manifest_once(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/ow/ck"
    real, prefix = open_store(uri, opts)
    manifest = f"{prefix}/manifest.json"
    objckpt.save({"w": torch.randn(64, 64)}, uri, storage_options=opts)
    store = KeyCounting(real)
    new = {"w": torch.randn(64, 64)}
    objckpt.save(new, uri, store=store, overwrite=True)
    asked = store.heads.count(manifest) + store.keys_read.count(manifest)
    assert asked == 1, (store.heads, store.keys_read)
    assert store.ops["delete"] == 1  # the replaced checkpoint's blobs, found in that one GET
    assert torch.equal(objckpt.read(uri, storage_options=opts)["w"], new["w"])
    # without overwrite the save still refuses an existing checkpoint up front, with one HEAD
    store = KeyCounting(real)
    try:
        objckpt.save(new, uri, store=store)
    except objckpt.CheckpointExistsError:
        pass
    else:
        raise AssertionError("a save without overwrite replaced a checkpoint")
    assert store.heads == [manifest] and store.ops["write_part"] == 0 and store.ops["put"] == 0
