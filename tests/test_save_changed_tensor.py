"""A tensor modified in place while a synchronous save reads it: the save must
fail before committing (the uploaded bytes may differ from the checksummed
ones), and the previous checkpoint must stay intact.

Deterministic: a store wrapper modifies the tensor when the first blob part is
written, i.e. after the crc of the part was computed, before the upload ends.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import objckpt
from objckpt.storage import open_store
from objckpt.storage.base import BlobWriter
from objckpt.testing.stores import CountingStore


class MutateOnWrite(CountingStore):
    """Adds 1 in place to ``victim`` on the first part or object written."""

    def __init__(self, inner: Any, victim: torch.Tensor) -> None:
        super().__init__(inner)
        self.victim, self.fired = victim, False

    def _fire(self) -> None:
        if not self.fired:
            self.fired = True
            self.victim.add_(1)

    async def put(self, key: str, data: Any, *, if_absent: bool = False) -> None:
        if "/blobs/" in key or key.startswith("blobs/"):
            self._fire()
        await super().put(key, data, if_absent=if_absent)

    def open_writer(self, key: str, size: int, num_parts: int = 1) -> BlobWriter:
        inner = super().open_writer(key, size, num_parts)
        outer = self

        class _W(BlobWriter):
            async def write_part(self, index: int, offset: int, data: memoryview) -> None:
                outer._fire()
                await inner.write_part(index, offset, data)

            async def write_part_views(self, index: int, offset: int, views: list,
                                       crc32c: Any = None) -> None:
                outer._fire()
                await inner.write_part_views(index, offset, views, crc32c=crc32c)

            async def complete(self) -> None:
                await inner.complete()

            async def abort(self) -> None:
                await inner.abort()

        return _W()


def test_tensor_changed_during_sync_save_fails_and_keeps_previous(local_or_s3: tuple[str, dict[str, Any]]) -> None:
    uri, opts = local_or_s3
    w = torch.arange(4096.0).reshape(64, 64)
    objckpt.save({"w": w, "step": 1}, uri, storage_options=opts)
    before = w.clone()
    store = MutateOnWrite(open_store(uri, opts or None)[0], w)
    with pytest.raises(objckpt.TensorChangedError, match="'w'"):
        objckpt.save({"w": w, "step": 2}, uri, storage_options=opts, overwrite=True, store=store)
    assert store.fired
    back = objckpt.read(uri, storage_options=opts)  # the previous checkpoint, whole
    assert torch.equal(back["w"], before) and back["step"] == 1


def test_untouched_tensors_save_normally_through_the_same_check(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    w = torch.ones(8, 8)
    w.add_(1)  # a version counter above zero before the save is fine
    objckpt.save({"w": w}, uri)
    assert torch.equal(objckpt.read(uri)["w"], w)
