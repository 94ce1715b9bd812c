"""Listings, deletes and aborts on S3 (storage/s3/direct.py, storage/s3/request.py).

On the direct transport no operation goes through botocore: ListObjectsV2 (with
continuation), DeleteObjects (batched, quiet, per-key errors named),
ListMultipartUploads and AbortMultipartUpload are signed by sigv4.py and sent
on the own path; with ``direct_http=False`` botocore serves the same calls and
they answer alike.  Pagination is tested with a small page size, not thousands
of objects.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
from typing import Any, Iterator

import pytest

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.storage import open_store
from objckpt.storage.s3.direct import DirectClient, Target
from objckpt.storage.s3.credentials import CredentialSource, Credentials

from conftest import s3_options

KEYS = ["p/a b", "p/ü+%=&~", "p/<x>&'\"", "p/plain"] + [f"p/k{i:03d}" for i in range(19)]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
def test_list_delete_uploads_and_abort(moto_s3: tuple[str, dict[str, Any]], direct: bool) -> None:
    import boto3

    bucket, opts = moto_s3
    s3 = boto3.client("s3", **s3_options(opts["endpoint_url"]))
    for i, k in enumerate(KEYS):
        s3.put_object(Bucket=bucket, Key=k, Body=b"x" * i)
    s3.put_object(Bucket=bucket, Key="q/other", Body=b"y")
    made = {s3.create_multipart_upload(Bucket=bucket, Key=k)["UploadId"]: k for k in KEYS[:5]}
    store, _ = open_store(f"s3://{bucket}", {**opts, "direct_http": direct})
    store.page_size = 4  # type: ignore[attr-defined]
    store.delete_batch = 5  # type: ignore[attr-defined]

    async def go() -> Any:
        listed = await store.list("p/")
        uploads = await store.list_uploads("p/")
        for u in uploads[:3]:
            await store.abort_upload(u)
        await store.abort_upload(uploads[0])  # gone already: not an error
        left = await store.list_uploads("p/")
        await store.delete([o.key for o in listed] + ["p/never-there"])
        return listed, uploads, left, await store.list("p/"), await store.list("q/")

    listed, uploads, left, after, other = _runtime.run(go())
    assert [o.key for o in listed] == sorted(KEYS)
    assert {o.key: o.size for o in listed} == {k: i for i, k in enumerate(KEYS)}
    assert all(o.etag and o.mtime and o.mtime > 1.6e9 for o in listed)
    assert {u.upload_id: u.key for u in uploads} == made
    assert all(u.initiated and u.initiated > 1e9 for u in uploads)  # moto says 2010
    assert len(left) == 2 and not {u.upload_id for u in left} & {u.upload_id for u in uploads[:3]}
    assert after == [] and [o.key for o in other] == ["q/other"]
    # one transport did all of it, the one the config chose
    kind = type(_runtime.run(store.transport())).__name__  # type: ignore[attr-defined]
    assert kind == ("DirectTransport" if direct else "BotocoreTransport")


def test_save_delete_and_gc_in_a_new_process_import_no_botocore_client(moto_s3: tuple[str, dict[str, Any]]) -> None:
    """A job's whole life on the direct transport, deletes and gc included, never
    loads aiobotocore or aiohttp (the delete and gc listings used to)."""
    bucket, opts = moto_s3
    code = textwrap.dedent(f"""
        import sys, torch, objckpt
        from objckpt.runtime import loop as _runtime
        from objckpt.ops.gc import collect_garbage
        from objckpt.storage import open_store
        opts = {opts!r}
        objckpt.save({{"w": torch.arange(10.0)}}, "s3://{bucket}/a", storage_options=opts)
        objckpt.save({{"w": torch.arange(10.0)}}, "s3://{bucket}/b", storage_options=opts)
        objckpt.delete("s3://{bucket}/a", storage_options=opts)
        store, prefix = open_store("s3://{bucket}", opts)
        _runtime.run(collect_garbage(store, "", grace=0))
        print(sorted(o.key.split("/")[0] for o in _runtime.run(store.list(""))),
              sorted(m for m in ("aiobotocore", "aiohttp") if m in sys.modules))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    left, imported = r.stdout.strip().splitlines()[-1].split("] [")
    assert "'a'" not in left and "'b'" in left and imported == "]", r.stdout


class _Recorder:
    """An HTTP server that records each request and answers it with ``answer``."""

    def __init__(self, answer: bytes, *later: bytes) -> None:
        self.answers = [answer, *later]  # one per request, the last one again for any further
        self.requests: list[bytes] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                buf = b""
                while b"\r\n\r\n" not in buf:
                    buf += c.recv(65536)
                head, _, rest = buf.partition(b"\r\n\r\n")
                n = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0)
                while len(rest) < n:
                    rest += c.recv(65536)
                self.requests.append(head + b"\r\n\r\n" + rest)
                answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
                c.sendall(b"HTTP/1.1 200 OK\r\nx-amz-request-id: 1\r\nContent-Type: application/xml\r\n"
                          b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(answer), answer))


@pytest.fixture
def recorder() -> Iterator[Any]:
    made: list[_Recorder] = []

    def make(answer: bytes, *later: bytes) -> tuple[_Recorder, DirectClient]:
        srv = _Recorder(answer, *later)
        made.append(srv)
        target = Target("http", "127.0.0.1", srv.port, f"127.0.0.1:{srv.port}", "/b", "eu-west-2")
        return srv, DirectClient("b", target, CredentialSource(Credentials("AKID", "SECRET", "TOKEN")),
                                 connect_timeout=2, read_timeout=5)

    yield make
    for s in made:
        s.sock.close()


def _botocore_signature(raw: bytes) -> tuple[str, str]:
    """(ours, botocore's) signature of the recorded request ``raw``."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as BotoCreds

    head = raw.split(b"\r\n\r\n")[0].decode()
    line, *rest = head.split("\r\n")
    method, target, _ = line.split(" ")
    headers = dict(h.split(": ", 1) for h in rest)
    req = AWSRequest(method=method, url=f"http://{headers['Host']}{target}",
                     headers={"x-amz-content-sha256": "UNSIGNED-PAYLOAD", "X-Amz-Date": headers["x-amz-date"],
                              "X-Amz-Security-Token": "TOKEN"})
    auth = S3SigV4Auth(BotoCreds("AKID", "SECRET", "TOKEN"), "s3", "eu-west-2")
    req.context["timestamp"] = headers["x-amz-date"]
    auth._modify_request_before_signing = lambda r: None  # type: ignore[method-assign]
    sig = auth.signature(auth.string_to_sign(req, auth.canonical_request(req)), req)
    return headers["authorization"].rsplit("Signature=", 1)[1], sig


def test_listing_requests_are_signed_as_botocore_signs_them(recorder: Any) -> None:
    """The queries the own path sends for listings (a prefix and a continuation token
    that need escaping, ``uploads`` without a value) sign exactly as botocore signs them."""
    page = (b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><EncodingType>url</EncodingType>'
            b"<IsTruncated>true</IsTruncated><NextContinuationToken>t/2+=</NextContinuationToken>"
            b"<Contents><Key>a+b%2Fc</Key><Size>3</Size><ETag>\"e\"</ETag>"
            b"<LastModified>2026-01-02T03:04:05.000Z</LastModified></Contents></ListBucketResult>")
    srv, client = recorder(page)
    got = client.list_page("dir with space/ü+", "tok/en+=", 7, 5.0)
    assert got.next_token == "t/2+=" and [(o.key, o.size, o.etag) for o in got.objects] == [("a b/c", 3, '"e"')]
    ours, theirs = _botocore_signature(srv.requests[-1])
    assert ours == theirs
    assert b"max-keys=7" in srv.requests[-1] and b"continuation-token=tok%2Fen%2B%3D" in srv.requests[-1]

    srv, client = recorder(b"<ListMultipartUploadsResult><EncodingType>url</EncodingType><IsTruncated>true"
                           b"</IsTruncated><NextKeyMarker>k%2B</NextKeyMarker><NextUploadIdMarker>u1"
                           b"</NextUploadIdMarker><Upload><Key>k%2B</Key><UploadId>u1</UploadId></Upload>"
                           b"</ListMultipartUploadsResult>")
    ups = client.list_uploads_page("p/", "k", "u0", 1, 5.0)  # a later page: markers and a page size sent
    assert [(u.key, u.upload_id) for u in ups.uploads] == [("k+", "u1")]
    assert (ups.next_key_marker, ups.next_upload_id_marker) == ("k+", "u1")
    assert b"key-marker=k&" in srv.requests[-1] and b"upload-id-marker=u0" in srv.requests[-1]
    ours, theirs = _botocore_signature(srv.requests[-1])
    assert ours == theirs


def test_delete_sends_content_md5_and_names_the_keys_s3_refused(recorder: Any) -> None:
    import base64
    import hashlib

    answer = (b'<DeleteResult><Error><Key>p/b</Key><Code>AccessDenied</Code><Message>no</Message></Error>'
              b"<Error><Key>p/c</Key><Code>NoSuchKey</Code></Error></DeleteResult>")
    srv, client = recorder(answer)
    errs = client.delete_objects(["p/a", "p/b", "p/c&<"], 5.0)
    assert [(e.key, e.code) for e in errs] == [("p/b", "AccessDenied"), ("p/c", "NoSuchKey")]
    raw = srv.requests[-1]
    head, body = raw.split(b"\r\n\r\n", 1)
    md5 = base64.b64encode(hashlib.md5(body).digest())
    assert b"content-md5: " + md5 in head.lower().replace(md5.lower(), md5)
    assert b"<Quiet>true</Quiet>" in body and b"<Key>p/c&amp;&lt;</Key>" in body
    assert _botocore_signature(raw)[0] == _botocore_signature(raw)[1]

    store, _ = open_store(f"s3://b", {"endpoint_url": f"http://127.0.0.1:{srv.port}", "region_name": "eu-west-2",
                                      "aws_access_key_id": "AKID", "aws_secret_access_key": "SECRET"})
    with pytest.raises(objckpt.StorageError, match=r"did not delete 1 key: 'p/b': AccessDenied no"):
        _runtime.run(store.delete(["p/a", "p/b", "p/c"]))


def test_keys_s3_refused_for_now_are_deleted_again(recorder: Any) -> None:
    """DeleteObjects answers a per-key SlowDown or InternalError inside a 200: the batch
    is sent again under the throttling budget (it used to be a final error), and keys
    still refused when the budget is spent are named."""
    slow = b"<DeleteResult><Error><Key>p/b</Key><Code>SlowDown</Code><Message>Reduce your rate</Message></Error></DeleteResult>"
    srv, _ = recorder(slow, b"<DeleteResult></DeleteResult>")
    opts = {"endpoint_url": f"http://127.0.0.1:{srv.port}", "region_name": "eu-west-2", "aws_access_key_id": "AKID",
            "aws_secret_access_key": "SECRET", "base_backoff": 0.01}
    store, _ = open_store("s3://b", opts)
    _runtime.run(store.delete(["p/a", "p/b"]))
    assert len(srv.requests) == 2 and all(b"<Key>p/a</Key>" in r and b"<Key>p/b</Key>" in r for r in srv.requests)

    srv, _ = recorder(slow)
    store, _ = open_store("s3://b", {**opts, "endpoint_url": f"http://127.0.0.1:{srv.port}", "throttle_attempts": 3})
    with pytest.raises(objckpt.StorageError, match=r"throttle, 3 attempts.*did not delete 1 of them.*'p/b'.*SlowDown"):
        _runtime.run(store.delete(["p/a", "p/b"]))
    assert len(srv.requests) == 3


def test_an_answer_that_is_not_the_operations_xml_is_a_clear_error_sent_once(recorder: Any) -> None:
    """A 200 whose body is not what the operation returns (no UploadId; a listing that is
    not XML) is a MalformedAnswer naming the operation, not retried (it used to send the
    store to botocore for good, or fail inside the XML parser)."""
    from objckpt.storage.s3.request import MalformedAnswer

    srv, _ = recorder(b"<html>a portal page</html>")
    opts = {"endpoint_url": f"http://127.0.0.1:{srv.port}", "region_name": "eu-west-2", "aws_access_key_id": "AKID",
            "aws_secret_access_key": "SECRET"}
    store, _ = open_store("s3://b", opts)
    with pytest.raises(MalformedAnswer, match=r"CreateMultipartUpload s3://b/k at .*no UploadId"):
        _runtime.run(store.create_upload("k"))
    with pytest.raises(MalformedAnswer, match=r"ListObjectsV2 s3://b/p.*<html>, not <ListBucketResult>"):
        _runtime.run(store.list("p"))
    assert len(srv.requests) == 2
