"""Server-verified uploads: every part carries its crc32c (``x-amz-checksum-crc32c``),
combined from the chunk crcs objckpt computes anyway; the server refuses a part
whose bytes changed in flight, and the checksums it reports are compared with ours.
"""
from __future__ import annotations

import base64
import logging
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


_UNCHECKED = "does not check part checksums"


def _unchecked_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and r.name.startswith("objckpt") and _UNCHECKED in r.getMessage()]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
def test_a_store_that_ignores_part_checksums_is_named_once(server: S3Server, direct: bool,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Ceph RGW accepts a wrong x-amz-checksum-crc32c on UploadPart and reports none back,
    so nothing refuses a part damaged in flight.  A store answering so is named once (two
    saves, one warning), from the answers the upload gets anyway (no request of its own); the
    damage is then caught by objckpt's crc32c when the checkpoint is read.  A store that
    checks them (the same server, checking) is never named."""
    url = server.endpoint_url
    checked = {**_opts(url, direct_http=direct)}
    with caplog.at_level(logging.WARNING, logger="objckpt"):
        objckpt.save(_state(), f"s3://{_bucket(url, 'checks')}/ck", storage_options=checked)
        assert _unchecked_warnings(caplog) == []
        server.check_checksums(False)
        opts = _opts(url, direct_http=direct, throttle_attempts=1)  # another store: the bucket below
        uri = f"s3://{_bucket(url, 'rgw')}/ck"
        objckpt.save(_state(), uri, storage_options=opts)
        server.corrupt(1)  # damaged in flight, and nothing refuses it
        objckpt.save(_state(), uri, storage_options=opts, overwrite=True)
    warned = _unchecked_warnings(caplog)
    assert len(warned) == 1, warned
    assert f"s3://rgw at {url}" in warned[0] and "UploadPart" in warned[0] and "objckpt verify" in warned[0]
    assert server.state.corrupt_bodies == 0  # the damage was stored
    with pytest.raises(objckpt.CorruptCheckpointError):
        objckpt.read(uri, storage_options=opts)


def test_moto_reports_no_part_checksum_and_is_named_once(moto_s3: tuple[str, dict[str, Any]],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """moto (5.x) takes x-amz-checksum-crc32c on PutObject and UploadPart without checking it
    and reports none back, as Ceph RGW does: it is named once, across two saves."""
    bucket, opts = moto_s3
    with caplog.at_level(logging.WARNING, logger="objckpt"):
        for step in range(2):
            objckpt.save(_state(), f"s3://{bucket}/ck-{step}", storage_options=opts)
    warned = _unchecked_warnings(caplog)
    assert len(warned) == 1 and f"s3://{bucket} at" in warned[0], warned
