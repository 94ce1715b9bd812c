"""A save that fails midway leaves no manifest and never harms older checkpoints."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import objckpt
from objckpt.storage import open_store
from objckpt.testing.stores import CountingStore, FaultyStore
from objckpt.runtime import loop as _runtime
from objckpt.format.manifest import Manifest, encode


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(256, 1024, generator=g) for i in range(12)}  # 12 MiB


def _keys(store: Any, prefix: str) -> list[str]:
    return [o.key for o in _runtime.run(store.list(prefix))]


@pytest.mark.parametrize("op, nth", [("write_part", 2), ("complete", 1), ("put", 1)])
def test_failed_save_on_s3_leaves_nothing(moto_s3: tuple[str, dict[str, Any]], op: str, nth: int) -> None:
    bucket, opts = moto_s3
    real, _ = open_store(f"s3://{bucket}", opts)
    good = _state(1)
    objckpt.save(good, f"s3://{bucket}/run/step-1", storage_options=opts)
    faulty = FaultyStore(real, op, nth)
    with pytest.raises(ConnectionError, match="injected"):
        objckpt.save(_state(2), f"s3://{bucket}/run/step-2", store=faulty, part_size=5 << 20, blob_size=6 << 20)
    # no manifest, no blob, no unfinished multipart upload at the failed path
    assert _keys(real, "run/step-2") == []
    assert _runtime.run(real.list_uploads("run/step-2")) == []
    with pytest.raises(objckpt.NotFoundError):
        objckpt.inspect(f"s3://{bucket}/run/step-2", storage_options=opts)
    back = objckpt.read(f"s3://{bucket}/run/step-1", storage_options=opts)
    assert all(torch.equal(back[k], good[k]) for k in good)


@pytest.mark.parametrize("op", ["write_part", "put"])
def test_failed_overwrite_keeps_old_checkpoint(moto_s3: tuple[str, dict[str, Any]], op: str) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/run/latest"
    real, _ = open_store(uri, opts)
    good = _state(3)
    objckpt.save(good, uri, storage_options=opts)
    before = sorted(_keys(real, "run/latest"))
    with pytest.raises(ConnectionError):
        objckpt.save(_state(4), uri, store=FaultyStore(real, op, 1), overwrite=True, part_size=5 << 20)
    assert sorted(_keys(real, "run/latest")) == before
    back = objckpt.read(uri, storage_options=opts)
    assert all(torch.equal(back[k], good[k]) for k in good)


def test_failed_overwrite_local_keeps_old(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    good = _state(5)
    objckpt.save(good, uri)
    real, _ = open_store(uri)
    with pytest.raises(ConnectionError):
        objckpt.save(_state(6), uri, store=FaultyStore(real, "write_part", 1), overwrite=True, part_size=1 << 20)
    back = objckpt.read(uri)
    assert all(torch.equal(back[k], good[k]) for k in good)
    assert len(list((tmp_path / "ck" / "blobs").iterdir())) == 1  # the failed attempt left no blob dir


def test_concurrent_commit_loses_cleanly(tmp_path: Any) -> None:
    """Two writers racing on one path: the second commit fails, its blobs are removed."""
    uri = str(tmp_path / "race")
    real, prefix = open_store(uri)

    class Racer(CountingStore):
        async def put(self, key: str, data: Any, *, if_absent: bool = False) -> None:
            if key.endswith("manifest.json") and not self.ops["raced"]:
                self.ops["raced"] += 1
                other = encode(Manifest(tensors={}, blobs=[], tree={}, attempt="someone-else"))
                await real.put(key, other, if_absent=True)  # someone else commits first
            await super().put(key, data, if_absent=if_absent)

    with pytest.raises(objckpt.CheckpointExistsError, match="another writer"):
        objckpt.save({"a": torch.ones(4)}, uri, store=Racer(real))
    keys = _keys(real, prefix)
    assert keys == [f"{prefix}/manifest.json"]


def test_server_side_error_over_http(fast_endpoint: str) -> None:
    """A non-retryable error injected in the fast S3 server (real HTTP) surfaces, nothing committed."""
    import urllib.request

    from conftest import make_bucket, s3_options

    bucket = make_bucket(fast_endpoint)
    opts = s3_options(fast_endpoint)
    req = urllib.request.Request(f"{fast_endpoint}/_objckpt/fail?op=UploadPart&count=1&status=400", method="POST")
    urllib.request.urlopen(req).read()
    with pytest.raises(objckpt.ObjckptError):
        objckpt.save(_state(7), f"s3://{bucket}/x", storage_options=opts, part_size=5 << 20)
    with pytest.raises(objckpt.NotFoundError):
        objckpt.inspect(f"s3://{bucket}/x", storage_options=opts)
    real, _ = open_store(f"s3://{bucket}", opts)
    assert _keys(real, "x") == []


def test_throttling_and_server_errors_are_retried(fast_endpoint: str) -> None:
    """503 SlowDown and 500 on parts and ranged GETs are retried with backoff; the result is exact."""
    import urllib.request

    from conftest import make_bucket, s3_options

    bucket = make_bucket(fast_endpoint)
    opts = s3_options(fast_endpoint)
    sd = _state(8)

    def fail(op: str, status: int, count: int) -> None:
        url = f"{fast_endpoint}/_objckpt/fail?op={op}&count={count}&status={status}"
        urllib.request.urlopen(urllib.request.Request(url, method="POST")).read()

    fail("UploadPart", 503, 2)
    fail("CompleteMultipartUpload", 500, 1)
    objckpt.save(sd, f"s3://{bucket}/r", storage_options=opts, part_size=5 << 20)
    fail("GetObject", 503, 3)
    back = objckpt.read(f"s3://{bucket}/r", storage_options=opts)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
