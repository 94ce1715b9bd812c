"""A store that accepts ``If-None-Match: *`` and ignores it is refused before a save writes
anything, unless ``single_writer=True`` (docs/reliability.md, "What objckpt requires of a store").

The lax store is real S3 over HTTP: moto behind a proxy that drops the header
(:class:`testkit.http_count.DropsIfNoneMatch`), which also counts every request.
"""
from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

import objckpt
from objckpt.errors import CheckpointExistsError, ConditionalWriteIgnoredError
from objckpt.save.store_check import PROBE_DIR
from objckpt.storage import open_store
from objckpt.testing.stores import CountingStore
from conftest import assert_same
from mp import run_multiprocess
from testkit.http_count import CountingProxy, DropsIfNoneMatch, Request


def _state(v: float = 1.0) -> dict[str, Any]:
    return {"w": torch.full((32, 8), v), "b": torch.arange(8.0) * v, "step": int(v)}


def _blank() -> dict[str, Any]:
    return {"w": torch.zeros(32, 8), "b": torch.zeros(8), "step": -1}


def _keys(endpoint: str, bucket: str) -> list[str]:
    """Every object in the bucket, asked of moto directly (not through the proxy)."""
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                      region_name="us-east-1")
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []))


def _probes(requests: list[Request]) -> list[Request]:
    """The probe's requests: its PUTs, and the DeleteObjects (a POST) that removes its object
    (where these tests use it, no other request deletes anything)."""
    return [r for r in requests if f"/{PROBE_DIR}/" in r.path or (r.method == "POST" and "delete" in r.query)]


def _refused(e: BaseException, proxy: CountingProxy) -> None:
    """The refusal: its own class (no CheckpointExistsError: nothing exists), naming the store
    and the setting that accepts it."""
    assert isinstance(e, ConditionalWriteIgnoredError) and not isinstance(e, CheckpointExistsError), repr(e)
    text = str(e)
    assert proxy.url in text and "ignores the condition" in text and "single_writer=True" in text, text
    assert "nothing written" in text, text


def test_plain_save_on_a_lax_store_is_refused_before_writing(moto_s3: tuple[str, dict[str, Any]],
                                                              moto_endpoint: str) -> None:
    """save and async_save refuse with ConditionalWriteIgnoredError; the bucket stays empty
    (the probe object is deleted), no blob PUT or multipart upload was sent, and the store
    is probed once: the async_save after the save makes no probe request."""
    bucket, opts = moto_s3
    with DropsIfNoneMatch(moto_endpoint) as proxy:
        lax = {**opts, "endpoint_url": proxy.url}
        uri = f"s3://{bucket}/run/ck"
        with pytest.raises(ConditionalWriteIgnoredError) as ei:
            objckpt.save(_state(), uri, storage_options=lax)
        _refused(ei.value, proxy)
        sent = proxy.requests
        assert [(r.method, r.status) for r in _probes(sent)] == [("PUT", 200), ("PUT", 200), ("POST", 200)], sent
        assert [r for r in sent if r.method in ("PUT", "POST") and r not in _probes(sent)] == [], sent
        assert _keys(moto_endpoint, bucket) == []
        proxy.reset()
        with pytest.raises(ConditionalWriteIgnoredError) as ei:
            objckpt.async_save(_state(), uri, storage_options=lax).result()
        _refused(ei.value, proxy)
        assert not _probes(proxy.requests) and not [r for r in proxy.requests if r.method in ("PUT", "POST")]
        assert _keys(moto_endpoint, bucket) == []
        # an overwrite writes its manifest unconditionally: nothing to refuse, nothing probed
        proxy.reset()
        objckpt.save(_state(2.0), uri, storage_options=lax, overwrite=True)
        assert not _probes(proxy.requests)
    st = _blank()
    objckpt.load(st, uri, storage_options=opts)
    assert_same(st, _state(2.0))


def test_single_writer_saves_on_a_lax_store_and_says_so_once(moto_s3: tuple[str, dict[str, Any]],
                                                              moto_endpoint: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """single_writer=True: the save commits and loads back; one log line names the store and
    the setting; the second save (async) neither probes nor logs again."""
    bucket, opts = moto_s3
    with DropsIfNoneMatch(moto_endpoint) as proxy, caplog.at_level(logging.WARNING, logger="objckpt"):
        lax = {**opts, "endpoint_url": proxy.url}
        objckpt.save(_state(3.0), f"s3://{bucket}/a", storage_options=lax, single_writer=True)
        assert len(_probes(proxy.requests)) == 3, proxy.requests
        proxy.reset()
        objckpt.async_save(_state(4.0), f"s3://{bucket}/b", storage_options=lax, single_writer=True).result()
        assert not _probes(proxy.requests)
    said = [r.getMessage() for r in caplog.records if "single_writer=True" in r.getMessage()]
    assert len(said) == 1 and proxy.url in said[0] and "ignores the condition" in said[0], said
    for name, v in (("a", 3.0), ("b", 4.0)):
        st = _blank()
        objckpt.load(st, f"s3://{bucket}/{name}", storage_options=opts)
        assert_same(st, _state(v))
    assert not [k for k in _keys(moto_endpoint, bucket) if PROBE_DIR in k]


def test_manager_refuses_a_lax_store_unless_single_writer(moto_s3: tuple[str, dict[str, Any]],
                                                          moto_endpoint: str) -> None:
    """CheckpointManager.save raises the refusal as itself (not "step already committed"),
    nothing is written and no step is indexed; with single_writer=True it saves, indexes
    and loads."""
    bucket, opts = moto_s3
    with DropsIfNoneMatch(moto_endpoint) as proxy:
        lax = {**opts, "endpoint_url": proxy.url}
        m = objckpt.CheckpointManager(f"s3://{bucket}/run", storage_options=lax, keep_last=2)
        with pytest.raises(ConditionalWriteIgnoredError) as ei:
            m.save(1, _state())
        _refused(ei.value, proxy)
        assert _keys(moto_endpoint, bucket) == [] and m.steps() == []
        m.close()
        m = objckpt.CheckpointManager(f"s3://{bucket}/run", storage_options=lax, keep_last=2, single_writer=True)
        m.save(1, _state(1.0))
        m.save(2, _state(2.0), metadata={"loss": 0.5})
        assert m.steps() == [1, 2] and m.latest_step() == 2
        st = _blank()
        m.load(st)
        assert_same(st, _state(2.0))
        m.close()
    assert not [k for k in _keys(moto_endpoint, bucket) if PROBE_DIR in k]


def _two_ranks(rank: int, world: int, uri: str, opts: dict[str, Any], endpoint: str, bucket: str) -> Any:
    import torch.distributed as dist

    refused, is_class = ("saved", ""), False
    try:
        objckpt.save(_state(float(rank + 1)), uri, storage_options=opts)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        refused, is_class = (type(e).__name__, str(e)), isinstance(e, ConditionalWriteIgnoredError)
    dist.barrier()
    left = _keys(endpoint, bucket) if rank == 0 else []
    dist.barrier()
    objckpt.save(_state(5.0), uri, storage_options=opts, single_writer=True)
    return refused, is_class, left


def test_two_ranks_both_raise_the_refusal(moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str) -> None:
    """2 gloo ranks: rank 0 probes (alone), both ranks raise ConditionalWriteIgnoredError with
    the same message, nothing is written; then both save with single_writer=True."""
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/mr"
    with DropsIfNoneMatch(moto_endpoint) as proxy:
        lax = {**opts, "endpoint_url": proxy.url}
        out = run_multiprocess(2, _two_ranks, uri, lax, moto_endpoint, bucket, timeout=240)
        probes = [r for r in proxy.requests if r.method == "PUT" and f"/{PROBE_DIR}/" in r.path]
    (r0, c0, left), (r1, c1, _) = out
    assert c0 and c1 and r0[0] == r1[0] == "ConditionalWriteIgnoredError", out
    assert r0[1] == r1[1] and proxy.url in r0[1] and "single_writer=True" in r0[1], out
    assert left == [], left
    assert len(probes) == 2, probes  # one probe (two creates), rank 0's, for both saves
    st = _blank()
    objckpt.load(st, uri, storage_options=opts)
    assert_same(st, _state(5.0))


class PutKeys(CountingStore):
    """Records the key of every whole-object PUT."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.put_keys: list[str] = []

    async def put(self, key: str, data: memoryview | bytes, *, if_absent: bool = False) -> None:
        self.put_keys.append(key)
        await super().put(key, data, if_absent=if_absent)


def test_an_honouring_store_is_probed_once_per_process(moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str,
                                                       tmp_path: Any) -> None:
    """moto honours the condition: the first save probes it (the second create answered 412),
    later saves to the same store do not; local files are never probed (link())."""
    bucket, opts = moto_s3
    with CountingProxy(moto_endpoint) as proxy:
        honest = {**opts, "endpoint_url": proxy.url}
        objckpt.save(_state(), f"s3://{bucket}/x", storage_options=honest)
        assert [(r.method, r.status) for r in _probes(proxy.requests)] == [("PUT", 200), ("PUT", 412),
                                                                            ("POST", 200)], proxy.requests
        proxy.reset()
        objckpt.save(_state(), f"s3://{bucket}/y", storage_options=honest)
        objckpt.async_save(_state(), f"s3://{bucket}/z", storage_options=honest).result()
        with objckpt.CheckpointManager(f"s3://{bucket}/run", storage_options=honest) as m:
            m.save(1, _state())
        assert not _probes(proxy.requests), proxy.requests
    local = PutKeys(open_store(str(tmp_path))[0])
    objckpt.save(_state(), str(tmp_path / "ck"), store=local)
    assert local.put_keys and not [k for k in local.put_keys if PROBE_DIR in k], local.put_keys
    assert _keys(moto_endpoint, bucket) and not [k for k in _keys(moto_endpoint, bucket) if PROBE_DIR in k]


def test_gc_removes_a_probe_object_a_killed_save_left(moto_s3: tuple[str, dict[str, Any]],
                                                      moto_endpoint: str) -> None:
    """A save killed between the probe's create and its delete leaves the probe object: gc
    removes it once past the grace period, and nothing else of that folder's shape."""
    from objckpt.ops.gc import collect_garbage
    from objckpt.runtime import loop as _runtime

    bucket, opts = moto_s3
    store, prefix = open_store(f"s3://{bucket}/run/ck", opts)
    stray = f"{prefix}/{PROBE_DIR}/probe-0123456789abcdef"
    mine = f"{prefix}/{PROBE_DIR}/notes.txt"  # not a probe's name: the user's
    for key in (stray, mine):
        _runtime.run(store.put(key, b"x"))
    young = _runtime.run(collect_garbage(store, "run"))  # default grace: 6 h
    assert young.deleted == [] and young.kept_young == 1, young
    report = _runtime.run(collect_garbage(store, "run", grace=0))
    assert report.deleted == [stray], report
    assert _keys(moto_endpoint, bucket) == [mine]
