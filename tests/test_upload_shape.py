"""The upload and read shape chosen per endpoint kind (objckpt.storage.shape).

Unit tests of the chooser (kinds from URL and Server header, one probe per
store, overrides), the shapes run end to end through save/load on an
in-memory store that says it is moto, and on real moto over HTTP: a save under
the moto shape writes single-PUT blobs only and round-trips bit for bit.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

import boto3
import pytest
import torch

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.options import SaveOptions
from objckpt.planning import crc_blocks
from objckpt.planning.pack import TensorSpec, plan_save
from objckpt.planning.ranges import Span, plan_requests
from objckpt.storage import open_store
from objckpt.storage.memory import MemoryStore
from objckpt.storage.s3 import S3Store
from objckpt.storage.shape import (MULTIPART, SINGLE_PUT, kind_from_server, kind_from_url, parse_kind, save_sizes,
                                   shape_for)
from conftest import assert_same

MiB = 1 << 20


# -- the chooser -----------------------------------------------------------------------------


@pytest.mark.parametrize("url, kind", [
    (None, "s3"), ("", "s3"), ("https://s3.us-east-1.amazonaws.com", "s3"),
    ("https://bucket.s3.cn-north-1.amazonaws.com.cn", "s3"),
    ("http://127.0.0.1:5000", None), ("http://localhost:9000", None), ("http://[::1]:5000", None),
    ("http://minio.internal:9000", None), ("moto:5000", None),
])
def test_kind_from_url(url: Optional[str], kind: Optional[str]) -> None:
    assert kind_from_url(url) == kind


@pytest.mark.parametrize("server, kind", [
    ("Werkzeug/3.1.9 Python/3.11.7", "moto"), ("werkzeug/2.3", "moto"), ("Python/3.11 aiohttp/3.14.5", "s3"),
    ("MinIO", "s3"), ("AmazonS3", "s3"), (None, "s3"), ("", "s3"),
])
def test_kind_from_server(server: Optional[str], kind: str) -> None:
    assert kind_from_server(server) == kind


def test_endpoint_kind_option_is_checked() -> None:
    assert parse_kind(None) == "auto" and parse_kind("MOTO") == "moto" and parse_kind("s3") == "s3"
    with pytest.raises(ValueError, match="endpoint_kind"):
        parse_kind("minio")
    with pytest.raises(ValueError, match="endpoint_kind"):
        S3Store("b", endpoint_url="http://127.0.0.1:1", endpoint_kind="fast")
    assert S3Store("b", endpoint_kind="moto").endpoint_kind == "moto"
    assert S3Store("b").endpoint_kind == "auto"


class _Refused(Exception):
    """Like botocore's ClientError: an HTTP error whose ``response`` carries the headers."""

    def __init__(self, server: str) -> None:
        super().__init__("403")
        self.response = {"ResponseMetadata": {"HTTPStatusCode": 403, "HTTPHeaders": {"server": server}}}


class _Client:
    def __init__(self, answer: Any) -> None:
        self.answer, self.calls = answer, 0

    async def head_bucket(self, Bucket: str) -> Any:  # noqa: N803 - botocore's name
        self.calls += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return {"ResponseMetadata": {"HTTPHeaders": {"server": self.answer}}}


class _FakeS3:
    """What shape_for reads of an S3Store: endpoint_kind, endpoint_url, bucket, server_header()
    (here answered the way the botocore transport reads a HeadBucket)."""

    def __init__(self, kind: str, url: Optional[str], answer: Any = "Werkzeug/3.1.9 Python/3.11.7") -> None:
        self.endpoint_kind, self.endpoint_url, self.bucket = kind, url, "b"
        self._client = _Client(answer)

    async def server_header(self, timeout: float) -> tuple[bool, Optional[str]]:
        try:
            r = await self._client.head_bucket(Bucket=self.bucket)
        except Exception as e:  # an HTTP error still names its server
            r = getattr(e, "response", None)
            if not isinstance(r, dict):
                return False, None
        return True, r["ResponseMetadata"]["HTTPHeaders"].get("server")


@pytest.mark.parametrize("kind, url, answer, shape, probes", [
    ("auto", "http://127.0.0.1:5000", "Werkzeug/3.1.9 Python/3.11.7", SINGLE_PUT, 1),  # local moto
    ("auto", "http://moto:5000", _Refused("Werkzeug/3.0.1 Python/3.12.1"), SINGLE_PUT, 1),  # a 403 names it too
    ("auto", "http://127.0.0.1:5000", "Python/3.11 aiohttp/3.14.5", MULTIPART, 1),  # objckpt's fast test server
    ("auto", "http://minio:9000", "MinIO", MULTIPART, 1),
    ("auto", "http://127.0.0.1:1", ConnectionRefusedError(), MULTIPART, 1),  # no answer: the safe shape
    ("auto", None, "Werkzeug/3.1.9", MULTIPART, 0),  # AWS: never probed
    ("auto", "https://s3.eu-west-1.amazonaws.com", "Werkzeug/3.1.9", MULTIPART, 0),
    ("s3", "http://127.0.0.1:5000", "Werkzeug/3.1.9", MULTIPART, 0),  # the option wins, no probe
    ("moto", "https://s3.eu-west-1.amazonaws.com", "AmazonS3", SINGLE_PUT, 0),
])
def test_shape_per_endpoint_kind_one_probe_per_store(kind: str, url: Optional[str], answer: Any, shape: Any,
                                                     probes: int) -> None:
    store = _FakeS3(kind, url, answer)
    assert asyncio.run(shape_for(store)) is shape
    assert asyncio.run(shape_for(store)) is shape  # remembered
    assert store._client.calls == probes


def test_stores_without_an_endpoint_keep_todays_shape() -> None:
    assert asyncio.run(shape_for(MemoryStore())) is MULTIPART
    assert MULTIPART.upload.blob_size == 1 << 30 and MULTIPART.upload.part_size == 16 * MiB


def test_explicit_save_sizes_win_one_by_one() -> None:
    assert SaveOptions().blob_size is None and SaveOptions().part_size is None
    assert save_sizes(None, None, SINGLE_PUT) == (16 * MiB, 16 * MiB)
    assert save_sizes(None, None, MULTIPART) == (1 << 30, 16 * MiB)
    assert save_sizes(64 * MiB, None, SINGLE_PUT) == (64 * MiB, 16 * MiB)
    assert save_sizes(None, 8 * MiB, MULTIPART) == (1 << 30, 8 * MiB)
    with pytest.raises(ValueError, match="blob_size must be positive"):
        SaveOptions(blob_size=0).checked()


# -- what each shape plans (pure) ------------------------------------------------------------


def _gpt_like() -> list[TensorSpec]:
    """Tensors of the sizes the benchmark state has: 180 MiB, 40 and 20 MiB MLPs, 3 MiB projections, tiny."""
    mb = 1 << 18  # fp32 elements per MiB
    specs = [TensorSpec("emb", (45 * 1024, 1024), 4)]
    for i in range(4):
        specs += [TensorSpec(f"h{i}.q", (3 * mb,), 4), TensorSpec(f"h{i}.up", (40, mb), 4),
                  TensorSpec(f"h{i}.down", (20, mb), 4), TensorSpec(f"h{i}.norm", (1024,), 4)]
    return specs


def test_single_put_shape_plans_one_part_per_blob_of_at_most_twice_the_size() -> None:
    u = SINGLE_PUT.upload
    plan = plan_save(_gpt_like(), blob_bytes=u.blob_size, part_bytes=max(u.part_size, 5 * MiB),
                     chunk_bytes=u.part_size)
    assert len(plan.blobs) > 10
    assert all(len(b.parts) == 1 for b in plan.blobs)  # every blob one PUT
    assert all(b.size < 2 * u.blob_size for b in plan.blobs)
    m = MULTIPART.upload
    multi = plan_save(_gpt_like(), blob_bytes=m.blob_size, part_bytes=m.part_size, chunk_bytes=m.part_size)
    assert len(multi.blobs) == 1 and len(multi.blobs[0].parts) > 10


def test_single_put_shape_reads_each_blob_with_one_request() -> None:
    spans = [Span("blob", off, 8 * MiB - 64, i) for i, off in enumerate(range(0, 40 * MiB, 8 * MiB))]
    r = SINGLE_PUT.read
    one = plan_requests(spans, merge_gap=r.merge_gap, max_request=r.max_request, split_above=r.split_above,
                        split_into=r.split_into)
    assert [(q.offset, q.length) for q in one] == [(0, 40 * MiB - 64)]
    big = [Span("old-1GiB-blob", 0, 1 << 30, 0)]  # a blob written by the multipart shape: still one GET
    assert len(plan_requests(big, merge_gap=r.merge_gap, max_request=r.max_request, split_above=r.split_above,
                             split_into=r.split_into)) == 1
    m = MULTIPART.read
    assert len(plan_requests(spans, merge_gap=m.merge_gap, max_request=m.max_request, split_above=m.split_above,
                             split_into=m.split_into)) == 3


# -- end to end on a store that says it is moto ----------------------------------------------


class _MotoLikeMemory(MemoryStore):
    """A memory store with moto's shape, recording every ranged read."""

    endpoint_kind = "moto"

    def __init__(self) -> None:
        super().__init__()
        self.ranges: list[tuple[str, int, int]] = []

    async def get_range(self, key: str, offset: int, length: int) -> bytes:
        self.ranges.append((key, offset, length))
        return await super().get_range(key, offset, length)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    # 16 + 16 + 8 MiB and a small one: 3 blobs under the moto shape (a blob closes at 16 MiB)
    return {"a": torch.randn(4 * MiB, generator=g), "b": torch.randn(2 * MiB, 2, generator=g),
            "c": torch.randn(2 * MiB, generator=g), "bias": torch.randn(7, generator=g), "step": 3}


def _blank(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in sd.items()}


def test_moto_shape_end_to_end_on_a_memory_store() -> None:
    store = _MotoLikeMemory()
    sd = _state()
    res = objckpt.save(sd, "memory://shape/ck", store=store)
    blobs = sorted(k for k in store.objects if k.endswith(".bin"))
    assert res.blobs == len(blobs) == 3
    assert [len(store.objects[k]) for k in blobs][:2] == [16 * MiB, 16 * MiB]
    out = _blank(sd)
    objckpt.load(out, "memory://shape/ck", store=store)
    assert_same(out, sd)
    assert sorted(k for k, _, _ in store.ranges) == blobs  # one GET per blob, each read whole
    assert all(off == 0 and n == len(store.objects[k]) for k, off, n in store.ranges)


# -- real moto over HTTP ---------------------------------------------------------------------


def _etags(s3: Any, bucket: str, prefix: str) -> dict[str, str]:
    objs = s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: o["ETag"].strip('"') for o in objs}


def test_moto_is_detected_and_gets_single_put_blobs(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/run/ck"
    store, _ = open_store(uri, opts)
    assert _runtime.run(shape_for(store)) is SINGLE_PUT  # moto answers "Server: Werkzeug/..."
    sd = _state()
    res = objckpt.save(sd, uri, storage_options=opts)
    s3 = boto3.client("s3", **opts)
    etags = _etags(s3, bucket, "run/ck/")
    blobs = [k for k in etags if k.endswith(".bin")]
    assert res.blobs == len(blobs) == 3 and len(etags) == 4  # 3 blobs and the manifest, nothing else
    assert all("-" not in etags[k] for k in blobs)  # single PUTs: a multipart object's ETag ends in -<parts>
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    out = _blank(sd)
    objckpt.load(out, uri, storage_options=opts)
    assert_same(out, sd)


@pytest.mark.parametrize("how", ["endpoint_kind", "sizes"])
def test_explicit_options_override_the_moto_shape(moto_s3: tuple[str, dict[str, Any]], how: str) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/run/{how}"
    sd = _state()
    if how == "endpoint_kind":
        opts = {**opts, "endpoint_kind": "s3"}
        res = objckpt.save(sd, uri, storage_options=opts)
    else:
        res = objckpt.save(sd, uri, storage_options=opts, blob_size=1 << 30, part_size=16 * MiB)
    etags = _etags(boto3.client("s3", **moto_s3[1]), bucket, f"run/{how}/")
    blobs = [k for k in etags if k.endswith(".bin")]
    assert res.blobs == len(blobs) == 1 and etags[blobs[0]].endswith("-3")  # one blob of 3 parts
    out = _blank(sd)
    objckpt.load(out, uri, storage_options=opts)
    assert_same(out, sd)


def test_dcp_writer_and_convert_follow_the_endpoint_shape(moto_s3: tuple[str, dict[str, Any]], tmp_path: Any) -> None:
    """The DCP plugin and ``convert`` write single-PUT blobs on moto and choose the crc
    block from the tensors' sizes, as ``save`` does."""
    import torch.distributed.checkpoint as dcp

    from objckpt.dcp import StorageWriter
    from objckpt.integrations.convert import convert

    bucket, opts = moto_s3
    s3 = boto3.client("s3", **opts)
    sd = _state()
    tensors = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    dcp.save(tensors, storage_writer=StorageWriter(f"s3://{bucket}/run/dcp", storage_options=opts), no_dist=True)
    torch.save(tensors, tmp_path / "plain.pt")
    convert(str(tmp_path / "plain.pt"), f"s3://{bucket}/run/conv", dst_storage_options=opts)
    for where in ("dcp", "conv"):
        uri = f"s3://{bucket}/run/{where}"
        etags = _etags(s3, bucket, f"run/{where}/")
        blobs = [k for k in etags if k.endswith(".bin")]
        assert len(blobs) >= 2 and all("-" not in etags[k] for k in blobs), (where, etags)  # single PUTs
        m = objckpt.inspect(uri, storage_options=opts)
        want = crc_blocks.for_boxes((t.numel() * t.element_size() for t in tensors.values()), None)
        assert m.crc_block == want < crc_blocks.MAX_BLOCK, where  # chosen, not the fixed 1 MiB
        back = objckpt.read(uri, storage_options=opts)
        for k, t in tensors.items():
            assert torch.equal(back[k], t), (where, k)
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
