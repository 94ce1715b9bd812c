"""S3 writes whose answer is lost or is a 404, on both transports (objckpt's own HTTP
path and botocore's, ``direct_http=False``), against the in-memory S3 server.

A ``CompleteMultipartUpload`` that completed but whose answer was lost is sent again
and answered ``404 NoSuchUpload``: the object at the key (size, part count from the
ETag, composite crc32c) says whether it is this upload's, completed (the save goes
on and loads bit-exact) or not (a StorageError naming key, upload and cause).  No 404
to a write goes up as a bare S3 or botocore error.
"""
from __future__ import annotations

import os
import re
from typing import Any, Iterator

import boto3
import pytest
import torch

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.storage import open_store
from conftest import assert_same
from testkit.s3server import S3Server

TRANSPORTS = pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
SIZES = {"blob_size": 8 << 20, "part_size": 2 << 20}  # several blobs, each a multipart upload


@pytest.fixture
def server() -> Iterator[S3Server]:
    with S3Server(min_part_size=1 << 20) as s:
        yield s


def _opts(srv: S3Server, direct: bool, **kw: Any) -> dict[str, Any]:
    return {"endpoint_url": srv.endpoint_url, "aws_access_key_id": "k", "aws_secret_access_key": "s",
            "region_name": "us-east-1", "direct_http": direct, "max_backoff": 0.01, **kw}


def _bucket(srv: S3Server, name: str) -> str:
    boto3.client("s3", endpoint_url=srv.endpoint_url, aws_access_key_id="k", aws_secret_access_key="s",
                 region_name="us-east-1").create_bucket(Bucket=name)
    return name


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(3 << 20, generator=g), "b": torch.randn(1001, 7, generator=g),
            "c": torch.randn(2 << 20, generator=g).to(torch.bfloat16), "step": 3}


# -- a lost answer to CompleteMultipartUpload -------------------------------------------
@TRANSPORTS
def test_a_completion_whose_answer_was_lost_is_found_completed(server: S3Server, direct: bool) -> None:
    """The first CompleteMultipartUpload is carried out, then its connection closed
    unanswered; the retry is answered NoSuchUpload; the HEAD finds the upload's object
    (size, parts, composite crc32c): the save succeeds and loads bit-exact."""
    uri = f"s3://{_bucket(server, 'lost')}/run/ck"
    opts = _opts(server, direct)
    sd = _state()
    server.lose_reply("CompleteMultipartUpload", 1)
    objckpt.save(sd, uri, storage_options=opts, **SIZES)  # type: ignore[arg-type]
    st = server.state
    assert st.lost_replies == []  # the answer was lost
    blobs = [o for k, o in st.buckets["lost"].objects.items() if "/blobs/" in k]
    assert len(blobs) >= 2 and all(re.search(r"-\d+\"$", o.etag) for o in blobs)  # several multipart blobs
    assert st.ops["CompleteMultipartUpload"] == len(blobs) + 1  # one sent again, answered NoSuchUpload
    assert st.ops["HeadObject"] >= 1 and not st.buckets["lost"].uploads
    assert_same(sd, objckpt.read(uri, storage_options=opts))


@TRANSPORTS
def test_an_upload_gone_before_completion_is_a_named_storage_error(server: S3Server, direct: bool) -> None:
    """NoSuchUpload with nothing at the key (the upload aborted meanwhile, by gc or a
    lifecycle rule): a StorageError naming the blob's key, the upload id and the cause;
    nothing commits and the save's objects are removed."""
    uri = f"s3://{_bucket(server, 'gone')}/run/ck"
    server.fail("CompleteMultipartUpload", count=1, status=404, code="NoSuchUpload")
    with pytest.raises(objckpt.StorageError) as got:
        objckpt.save(_state(), uri, storage_options=_opts(server, direct), **SIZES)  # type: ignore[arg-type]
    text = str(got.value)
    assert re.search(r"CompleteMultipartUpload s3://gone/run/ck/blobs/\S+ \(upload [0-9a-f]{32}\)", text), text
    assert "NoSuchUpload" in text and "no object is at the key" in text and "aborted meanwhile" in text, text
    assert "save again" in text
    assert not any(k.endswith("manifest.json") for k in server.state.buckets["gone"].objects)


@pytest.mark.parametrize("there", ["other size", "one PUT of the same size"])
@TRANSPORTS
def test_another_object_at_the_key_is_not_taken_for_the_upload(server: S3Server, direct: bool, there: str) -> None:
    """NoSuchUpload while the key holds an object that is not this upload's (another
    size; or the same size written by one PUT: no ``-2`` in its ETag or checksum):
    a StorageError that says what is there, never a success."""
    _bucket(server, "b")
    store = open_store("s3://b", _opts(server, direct))[0]
    parts = [os.urandom(1 << 20), os.urandom(1 << 20)]
    w = store.open_writer("k", 2 << 20, 2)
    for i, p in enumerate(parts):
        _runtime.run(w.write_part(i, i << 20, memoryview(p)))
    _runtime.run(store.put("k", b"x" * 10 if there == "other size" else b"".join(parts)))
    server.fail("CompleteMultipartUpload", count=1, status=404, code="NoSuchUpload")
    with pytest.raises(objckpt.StorageError) as got:
        _runtime.run(w.complete())
    text = str(got.value)
    assert "s3://b/k" in text and re.search(r"upload [0-9a-f]{32}", text), text
    want = "has 10 bytes, the upload's parts 2097152" if there == "other size" else "is not one of 2 parts"
    assert want in text, text
    _runtime.run(store.close())


# -- no 404 to a write goes up unnamed ----------------------------------------------------
@pytest.mark.parametrize("op, code", [("PutObject", "NotFound"), ("CreateMultipartUpload", "NotFound"),
                                      ("UploadPart", "NoSuchUpload"), ("DeleteObjects", "NotFound")])
@TRANSPORTS
def test_a_404_to_a_write_is_a_named_storage_error(server: S3Server, direct: bool, op: str, code: str) -> None:
    """Each write answered 404 (the bucket exists): a StorageError naming the request
    and S3's answer; an UploadPart's NoSuchUpload names the upload and the cause."""
    _bucket(server, "b")
    store = open_store("s3://b", _opts(server, direct))[0]
    server.fail(op, count=1, status=404, code=code)
    with pytest.raises(objckpt.StorageError) as got:
        if op == "PutObject":
            _runtime.run(store.put("k", b"abc"))
        elif op == "DeleteObjects":
            _runtime.run(store.delete(["k"]))
        else:
            w = store.open_writer("k", 2 << 20, 2)
            _runtime.run(w.write_part(0, 0, memoryview(bytes(1 << 20))))
    text = str(got.value)
    assert f"HTTP 404 {code}" in text and "s3://b" in text, text
    if op == "UploadPart":
        assert re.search(r"s3://b/k part 1 \(upload [0-9a-f]{32}\)", text) and "aborted meanwhile" in text, text
    else:
        assert "the bucket exists" in text, text
    _runtime.run(store.close())


@TRANSPORTS
def test_a_bare_404_to_a_write_of_a_missing_bucket_names_the_bucket(server: S3Server, direct: bool) -> None:
    """A 404 whose code does not say what is missing, to a write into a bucket that does
    not exist: one HeadBucket decides, BucketNotFoundError naming the bucket."""
    store = open_store("s3://no-such-bucket", _opts(server, direct))[0]
    server.fail("PutObject", count=1, status=404, code="NotFound")
    with pytest.raises(objckpt.BucketNotFoundError, match="no-such-bucket"):
        _runtime.run(store.put("k", b"abc"))
    _runtime.run(store.close())
