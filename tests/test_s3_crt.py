"""The zero-copy request body (storage/s3/http_body.py) as the file botocore and awscrt take it for.

With ``boto3[crt]`` installed botocore signs through awscrt, which wraps a body
that has ``seek`` as a stream and anything else as ``BytesIO(body)``: that
failed every save on botocore's path ("a bytes-like object is required, not
'ViewsPayload'").  botocore also rewinds a body (``seek(0)``) before it sends a
request again after a region redirect.  The end-to-end proof (saves through
botocore with and without awscrt, behind a redirecting proxy) is in
tests/test_s3_redirects.py; these check the body itself.
"""
from __future__ import annotations

import asyncio
import hashlib
import io
from typing import Any

import pytest
import torch

from objckpt.storage.s3.http_body import SLICE, ViewsPayload


def _views() -> tuple[list[memoryview], bytes]:
    a = torch.arange(1000, dtype=torch.float32)  # a float view: cast to bytes, not copied
    b = bytes(range(256)) * 2000  # larger than one write slice
    c = bytearray(b"tail")
    views = [memoryview(a.numpy()), memoryview(b""), memoryview(b), memoryview(c)]  # type: ignore[arg-type]
    return views, a.numpy().tobytes() + b + bytes(c)


class _Writer:
    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    async def write(self, data: memoryview) -> None:
        assert len(data) <= SLICE
        self.pieces.append(bytes(data))


def test_body_reads_seeks_and_tells_like_a_file() -> None:
    views, whole = _views()
    body = ViewsPayload(views)
    assert len(body) == len(whole) and body.seekable() and body.readable()
    assert body.read(10) == whole[:10] and body.tell() == 10
    buf = bytearray(5000)  # a read that spans the end of one view and the start of the next
    body.seek(3990)
    assert body.readinto(buf) == 5000 and bytes(buf) == whole[3990:8990]
    assert body.seek(-4, io.SEEK_END) == len(whole) - 4 and body.read() == b"tail"
    assert body.read(100) == b"" and body.readinto(bytearray(8)) == 0  # at the end
    body.seek(0)
    assert b"".join(iter(lambda: body.read(65536), b"")) == whole  # botocore's chunked hashing loop
    with pytest.raises(ValueError):
        body.seek(-1)


def test_body_sends_whole_again_whatever_was_read() -> None:
    """A signer or checksum may read the body to its end; every send is still all of it."""
    views, whole = _views()
    body = ViewsPayload(views)
    body.read()
    for _ in range(2):  # sent, then sent again after a redirect
        w: Any = _Writer()
        asyncio.run(body.write(w))
        assert b"".join(w.pieces) == whole


def test_awscrt_signer_takes_the_body_as_a_stream() -> None:
    """botocore's CRT signer with a payload hash (signed over plain HTTP) reads the
    body through awscrt's input stream: the hash is the body's, no bytes() needed."""
    pytest.importorskip("awscrt")
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials
    from botocore.crt.auth import CrtS3SigV4Auth

    views, whole = _views()
    body = ViewsPayload(views)
    req = AWSRequest(method="PUT", url="http://127.0.0.1:9000/bkt/key", data=body, headers={})
    req.context["client_config"] = None  # no config: the payload is signed over plain HTTP
    CrtS3SigV4Auth(Credentials("AKID", "SECRET"), "s3", "eu-west-1").add_auth(req)
    assert req.headers["x-amz-content-sha256"] == hashlib.sha256(whole).hexdigest()
    assert "eu-west-1/s3/aws4_request" in req.headers["Authorization"]
