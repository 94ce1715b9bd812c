"""Server-verified uploads: every part carries its crc32c (``x-amz-checksum-crc32c``),
combined from the chunk crcs objckpt computes anyway; the server refuses a part
whose bytes changed in flight, and the checksums it reports are compared with ours.
"""
from __future__ import annotations

import base64
import os
from typing import Any, Iterator

import boto3
import pytest
import torch

import objckpt
from objckpt.checksum import composite_header, crc32c, crc32c_combine, crc_header
from testkit.s3server import S3Server


@pytest.fixture
def server() -> Iterator[S3Server]:
    s = S3Server()
    s.start()
    yield s
    s.stop()


def _opts(url: str, **kw: Any) -> dict[str, Any]:
    return {"endpoint_url": url, "aws_access_key_id": "k", "aws_secret_access_key": "s", "region_name": "us-east-1",
            **kw}


def _bucket(url: str, name: str) -> str:
    boto3.client("s3", **_opts(url)).create_bucket(Bucket=name)
    return name


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    # 28 MiB in several tensors: a multipart blob (16 MiB parts) with padding between chunks
    return {"a": torch.randn(6 << 20, generator=g), "b": torch.randn(1001, 7, generator=g),
            "c": torch.randn(2 << 20, generator=g).to(torch.bfloat16), "step": 3}


def _same(x: dict[str, Any], y: dict[str, Any]) -> bool:
    return all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)


def test_crc_combine_and_s3_encodings() -> None:
    a, b = os.urandom(5000), os.urandom(70001)
    assert crc32c_combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)
    assert base64.b64decode(crc_header(0x01020304)) == b"\x01\x02\x03\x04"
    parts = [crc32c(a), crc32c(b)]
    raw = b"".join(c.to_bytes(4, "big") for c in parts)
    assert composite_header(parts) == f"{crc_header(crc32c(raw))}-2"


def test_save_sends_part_checksums_the_server_verifies(server: S3Server) -> None:
    url = server.endpoint_url
    uri = f"s3://{_bucket(url, 'ck')}/run/ck"
    sd = _state()
    objckpt.save(sd, uri, storage_options=_opts(url))
    objs = server.state.buckets["ck"].objects
    blobs = [o for k, o in objs.items() if "/blobs/" in k]
    assert blobs and all(o.crc32c for o in objs.values())  # every object, manifest included
    assert any(o.crc32c.endswith("-2") for o in blobs)  # a multipart blob: the composite of 2 part crcs
    assert _same(sd, objckpt.read(uri, storage_options=_opts(url)))


def test_a_part_damaged_in_flight_is_refused_and_nothing_commits(server: S3Server) -> None:
    url = server.endpoint_url
    uri = f"s3://{_bucket(url, 'dmg')}/run/ck"
    objckpt.save({"a": torch.zeros(10), "step": 1}, uri, storage_options=_opts(url))
    server.corrupt(1000)  # every body from now on is damaged: retries cannot get through
    with pytest.raises(objckpt.ObjckptError, match="BadDigest|CRC32C"):
        objckpt.save(_state(), uri, storage_options=_opts(url, error_attempts=2), overwrite=True)
    server.corrupt(0)
    back = objckpt.read(uri, storage_options=_opts(url))
    assert back["step"] == 1 and torch.equal(back["a"], torch.zeros(10))  # the previous checkpoint, intact


def test_one_damaged_part_is_sent_again(server: S3Server) -> None:
    url = server.endpoint_url
    uri = f"s3://{_bucket(url, 'retry')}/run/ck"
    sd = _state()
    server.corrupt(1)
    objckpt.save(sd, uri, storage_options=_opts(url))
    assert server.state.corrupt_bodies == 0  # the damage happened
    assert _same(sd, objckpt.read(uri, storage_options=_opts(url)))


def test_checksums_can_be_turned_off(server: S3Server) -> None:
    url = server.endpoint_url
    uri = f"s3://{_bucket(url, 'off')}/run/ck"
    objckpt.save(_state(), uri, storage_options=_opts(url, checksums=False))
    assert not any(o.crc32c for o in server.state.buckets["off"].objects.values())


def test_moto_accepts_the_checksummed_upload(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/run/ck"
    sd = _state()
    objckpt.save(sd, uri, storage_options=opts)
    assert _same(sd, objckpt.read(uri, storage_options=opts))
