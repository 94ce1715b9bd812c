"""The in-memory benchmark S3 server speaks enough S3 for boto3 (and so botocore/aiobotocore)."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from testkit.s3server import S3Server

MiB = 1 << 20
_ids = itertools.count()


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with S3Server() as srv:
        yield srv


def _client(endpoint: str, **config: Any) -> Any:
    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
        region_name="us-east-1", config=Config(s3={"addressing_style": "path"}, **config),
    )


@pytest.fixture
def s3(server: S3Server) -> Iterator[tuple[Any, str]]:
    """(boto3 client, fresh bucket) on a reset server."""
    server.reset()
    client = _client(server.endpoint_url)
    bucket = f"bkt-{next(_ids)}"
    client.create_bucket(Bucket=bucket)
    yield client, bucket


def _control(server: S3Server, path: str, method: str = "POST") -> Any:
    req = urllib.request.Request(f"{server.endpoint_url}/_objckpt/{path}", method=method)
    with urllib.request.urlopen(req) as r:
        return json.loads(r.read())


def _code(e: pytest.ExceptionInfo[ClientError]) -> tuple[str, int]:
    return e.value.response["Error"]["Code"], e.value.response["ResponseMetadata"]["HTTPStatusCode"]


def test_put_get_range_head(s3: tuple[Any, str]) -> None:
    c, b = s3
    data = os.urandom(100_000)
    key = "dir/sub dir/a+b%c?d=é.bin"  # needs URL encoding in the path
    c.put_object(Bucket=b, Key=key, Body=data, ContentType="application/x-test", Metadata={"k": "v"})
    assert c.get_object(Bucket=b, Key=key)["Body"].read() == data
    r = c.get_object(Bucket=b, Key=key, Range="bytes=10-19")
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert r["ContentRange"] == "bytes 10-19/100000" and r["Body"].read() == data[10:20]
    assert c.get_object(Bucket=b, Key=key, Range="bytes=99990-")["Body"].read() == data[99990:]
    assert c.get_object(Bucket=b, Key=key, Range="bytes=-5")["Body"].read() == data[-5:]
    assert c.get_object(Bucket=b, Key=key, Range="bytes=99999-200000")["Body"].read() == data[-1:]
    h = c.head_object(Bucket=b, Key=key)
    assert h["ContentLength"] == len(data) and h["ETag"].startswith('"') and h["LastModified"]
    assert h["ContentType"] == "application/x-test" and h["Metadata"] == {"k": "v"}
    with pytest.raises(ClientError) as e:
        c.get_object(Bucket=b, Key=key, Range="bytes=100000-100010")
    assert _code(e) == ("InvalidRange", 416)
    c.put_object(Bucket=b, Key="empty", Body=b"")
    assert c.get_object(Bucket=b, Key="empty")["Body"].read() == b""
    assert c.head_object(Bucket=b, Key="empty")["ContentLength"] == 0


def test_conditional_put(s3: tuple[Any, str]) -> None:
    c, b = s3
    etag = c.put_object(Bucket=b, Key="m", Body=b"one", IfNoneMatch="*")["ETag"]
    with pytest.raises(ClientError) as e:
        c.put_object(Bucket=b, Key="m", Body=b"two", IfNoneMatch="*")
    assert _code(e) == ("PreconditionFailed", 412)
    with pytest.raises(ClientError) as e:
        c.put_object(Bucket=b, Key="m", Body=b"two", IfMatch='"not-the-etag"')
    assert _code(e) == ("PreconditionFailed", 412)
    assert c.get_object(Bucket=b, Key="m")["Body"].read() == b"one"
    etag2 = c.put_object(Bucket=b, Key="m", Body=b"three", IfMatch=etag)["ETag"]
    assert etag2 != etag and c.get_object(Bucket=b, Key="m")["Body"].read() == b"three"


def test_multipart_out_of_order(s3: tuple[Any, str]) -> None:
    c, b = s3
    parts = [os.urandom(5 * MiB + 17), os.urandom(5 * MiB), os.urandom(1234)]
    uid = c.create_multipart_upload(Bucket=b, Key="big")["UploadId"]
    etags = {}
    for n in (3, 1, 2):
        etags[n] = c.upload_part(Bucket=b, Key="big", UploadId=uid, PartNumber=n, Body=parts[n - 1])["ETag"]
    listed = c.list_parts(Bucket=b, Key="big", UploadId=uid)["Parts"]
    assert [(p["PartNumber"], p["Size"]) for p in listed] == [(i + 1, len(p)) for i, p in enumerate(parts)]
    done = c.complete_multipart_upload(
        Bucket=b, Key="big", UploadId=uid,
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n]} for n in (1, 2, 3)]},
    )
    assert done["ETag"].endswith('-3"')
    whole = b"".join(parts)
    assert c.get_object(Bucket=b, Key="big")["Body"].read() == whole
    lo, hi = 5 * MiB - 3, 10 * MiB + 40  # spans all three parts
    assert c.get_object(Bucket=b, Key="big", Range=f"bytes={lo}-{hi}")["Body"].read() == whole[lo: hi + 1]
    assert c.head_object(Bucket=b, Key="big")["ContentLength"] == len(whole)
    assert c.list_multipart_uploads(Bucket=b).get("Uploads", []) == []


def test_multipart_errors_and_conditional_complete(s3: tuple[Any, str]) -> None:
    c, b = s3
    c.put_object(Bucket=b, Key="taken", Body=b"x")
    uid = c.create_multipart_upload(Bucket=b, Key="taken")["UploadId"]
    small = c.upload_part(Bucket=b, Key="taken", UploadId=uid, PartNumber=1, Body=b"tiny")["ETag"]
    last = c.upload_part(Bucket=b, Key="taken", UploadId=uid, PartNumber=2, Body=b"end")["ETag"]
    two = {"Parts": [{"PartNumber": 1, "ETag": small}, {"PartNumber": 2, "ETag": last}]}
    with pytest.raises(ClientError) as e:
        c.complete_multipart_upload(Bucket=b, Key="taken", UploadId=uid, MultipartUpload=two)
    assert _code(e) == ("EntityTooSmall", 400)
    one = {"Parts": [{"PartNumber": 1, "ETag": small}]}
    with pytest.raises(ClientError) as e:
        c.complete_multipart_upload(Bucket=b, Key="taken", UploadId=uid, MultipartUpload=one, IfNoneMatch="*")
    assert _code(e) == ("PreconditionFailed", 412)
    with pytest.raises(ClientError) as e:  # wrong ETag
        c.complete_multipart_upload(Bucket=b, Key="taken", UploadId=uid,
                                    MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": last}]})
    assert _code(e) == ("InvalidPart", 400)
    c.complete_multipart_upload(Bucket=b, Key="taken", UploadId=uid, MultipartUpload=one)  # upload survived the 412
    assert c.get_object(Bucket=b, Key="taken")["Body"].read() == b"tiny"
    with pytest.raises(ClientError) as e:
        c.upload_part(Bucket=b, Key="taken", UploadId=uid, PartNumber=1, Body=b"late")
    assert _code(e) == ("NoSuchUpload", 404)


def test_abort_and_list_uploads(s3: tuple[Any, str]) -> None:
    c, b = s3
    keep = c.create_multipart_upload(Bucket=b, Key="other/k")["UploadId"]
    uid = c.create_multipart_upload(Bucket=b, Key="ckpt/k")["UploadId"]
    c.upload_part(Bucket=b, Key="ckpt/k", UploadId=uid, PartNumber=1, Body=b"abc")
    ups = c.list_multipart_uploads(Bucket=b, Prefix="ckpt/")["Uploads"]
    assert [(u["Key"], u["UploadId"]) for u in ups] == [("ckpt/k", uid)]
    c.abort_multipart_upload(Bucket=b, Key="ckpt/k", UploadId=uid)
    assert c.list_multipart_uploads(Bucket=b, Prefix="ckpt/").get("Uploads", []) == []
    assert [u["UploadId"] for u in c.list_multipart_uploads(Bucket=b)["Uploads"]] == [keep]
    with pytest.raises(ClientError) as e:
        c.abort_multipart_upload(Bucket=b, Key="ckpt/k", UploadId=uid)
    assert _code(e) == ("NoSuchUpload", 404)


def test_list_objects(s3: tuple[Any, str]) -> None:
    c, b = s3
    keys = ["a/1", "a/2", "a/3", "a/sub/4", "a/sub/5", "b/6", "c"]
    for k in keys:
        c.put_object(Bucket=b, Key=k, Body=k.encode())
    r = c.list_objects_v2(Bucket=b, Prefix="a/", MaxKeys=2)
    assert [o["Key"] for o in r["Contents"]] == ["a/1", "a/2"] and r["IsTruncated"] and r["KeyCount"] == 2
    r2 = c.list_objects_v2(Bucket=b, Prefix="a/", MaxKeys=2, ContinuationToken=r["NextContinuationToken"])
    assert [o["Key"] for o in r2["Contents"]] == ["a/3", "a/sub/4"]
    pages = c.get_paginator("list_objects_v2").paginate(Bucket=b, Prefix="a/", PaginationConfig={"PageSize": 2})
    assert [o["Key"] for p in pages for o in p.get("Contents", [])] == [k for k in keys if k.startswith("a/")]
    assert [o["Size"] for o in c.list_objects_v2(Bucket=b, Prefix="c")["Contents"]] == [1]
    # delimiter: common prefixes count toward MaxKeys and are not repeated across pages
    pages = c.get_paginator("list_objects_v2").paginate(Bucket=b, Delimiter="/", PaginationConfig={"PageSize": 1})
    got = [x.get("Key") or x.get("Prefix") for p in pages for x in p.get("Contents", []) + p.get("CommonPrefixes", [])]
    assert got == ["a/", "b/", "c"]
    assert [o["Key"] for o in c.list_objects_v2(Bucket=b, StartAfter="a/sub/4")["Contents"]] == ["a/sub/5", "b/6", "c"]
    pages = c.get_paginator("list_objects").paginate(Bucket=b, PaginationConfig={"PageSize": 3})  # V1, marker
    assert [o["Key"] for p in pages for o in p["Contents"]] == keys


def test_delete_objects_and_missing(s3: tuple[Any, str]) -> None:
    c, b = s3
    for k in ("x/1", "x/2", "x/3"):
        c.put_object(Bucket=b, Key=k, Body=b"-")
    r = c.delete_objects(Bucket=b, Delete={"Objects": [{"Key": "x/1"}, {"Key": "x/2"}, {"Key": "nope"}]})
    assert sorted(d["Key"] for d in r["Deleted"]) == ["nope", "x/1", "x/2"]
    c.delete_objects(Bucket=b, Delete={"Objects": [{"Key": "x/3"}], "Quiet": True})
    assert c.list_objects_v2(Bucket=b).get("Contents", []) == []
    c.delete_object(Bucket=b, Key="never-there")  # S3 answers 204 for a missing key
    with pytest.raises(c.exceptions.NoSuchKey):
        c.get_object(Bucket=b, Key="x/1")
    with pytest.raises(ClientError) as e:
        c.head_object(Bucket=b, Key="x/1")
    assert _code(e) == ("404", 404)
    with pytest.raises(c.exceptions.NoSuchBucket):
        c.list_objects_v2(Bucket="no-such-bucket")
    with pytest.raises(c.exceptions.NoSuchBucket):
        c.put_object(Bucket="no-such-bucket", Key="k", Body=b"")
    c.head_bucket(Bucket=b)
    assert b in [x["Name"] for x in c.list_buckets()["Buckets"]]


def test_stats(s3: tuple[Any, str], server: S3Server) -> None:
    c, b = s3
    _control(server, "reset_stats")
    c.put_object(Bucket=b, Key="k", Body=b"x" * 1000)
    c.get_object(Bucket=b, Key="k", Range="bytes=0-99")["Body"].read()
    c.head_object(Bucket=b, Key="k")
    c.delete_object(Bucket=b, Key="k")
    st = _control(server, "stats", "GET")
    assert st["requests"] == {"GET": 1, "PUT": 1, "POST": 0, "HEAD": 1, "DELETE": 1}
    assert st["bytes_in"] == 1000 and st["bytes_out"] == 100
    assert st["ops"] == {"PutObject": 1, "GetObject": 1, "HeadObject": 1, "DeleteObject": 1}
    assert server.stats() == _control(server, "stats", "GET")  # stats calls are not counted
    _control(server, "reset")
    assert server.stats()["requests"]["PUT"] == 0
    assert c.list_buckets()["Buckets"] == []


def test_fault_injection(s3: tuple[Any, str], server: S3Server) -> None:
    c, b = s3
    no_retry = _client(server.endpoint_url, retries={"total_max_attempts": 1})
    uid = c.create_multipart_upload(Bucket=b, Key="f")["UploadId"]
    _control(server, "fail?op=UploadPart&count=1&status=500")
    with pytest.raises(ClientError) as e:
        no_retry.upload_part(Bucket=b, Key="f", UploadId=uid, PartNumber=1, Body=b"data")
    assert _code(e) == ("InternalError", 500)
    no_retry.upload_part(Bucket=b, Key="f", UploadId=uid, PartNumber=1, Body=b"data")  # fault used up
    server.fail("PutObject", count=2, status=503)
    server.reset_stats()
    c.put_object(Bucket=b, Key="g", Body=b"retried")  # botocore retries SlowDown
    assert server.stats()["ops"]["PutObject"] == 3
    assert c.get_object(Bucket=b, Key="g")["Body"].read() == b"retried"
    server.fail("GetObject", count=1, status=503)
    with pytest.raises(ClientError) as e:
        no_retry.get_object(Bucket=b, Key="g")
    assert _code(e) == ("SlowDown", 503)


def test_cli_prints_endpoint_first() -> None:
    script = Path(__file__).resolve().parents[1] / "testkit" / "s3server.py"
    proc = subprocess.Popen([sys.executable, str(script), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{url}/_objckpt/stats") as r:
            assert json.loads(r.read())["bytes_in"] == 0
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
