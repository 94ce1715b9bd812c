"""The direct S3 read path (storage/s3/direct.py, storage/s3/sigv4.py).

Signatures are checked against botocore's own SigV4 signer for the same
request; reads run against real moto over HTTP and a raw socket server that
misbehaves in the ways real endpoints do (closing kept-alive connections,
cutting bodies).  A restore in a fresh process must not import aiobotocore,
and an endpoint that refuses the direct path must still be read, through
botocore.
"""
from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Iterator

import pytest
import torch

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.storage import open_store
from objckpt.storage.s3.config import S3Config, Transport
from objckpt.storage.s3.direct import DirectClient, Sink, Target
from objckpt.storage.s3.credentials import CredentialSource, Credentials
from objckpt.storage.s3.sigv4 import Signer, quote_path
from testkit.s3server import S3Server

from conftest import make_bucket, s3_options
from wire_spies import spy_splice

NOW = datetime.datetime(2026, 11, 25, 1, 2, 3, tzinfo=datetime.timezone.utc)


@pytest.mark.parametrize("key", ["ck/manifest.json", "a b/ü+%=&/x~y_z.-", "blobs/r0/0"])
@pytest.mark.parametrize("token", [None, "FwoGZXIvYXdzEJr//////////token=="])
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_signature_equals_botocore(key: str, token: Any, method: str) -> None:
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials as BotoCreds

    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token)
    host = "127.0.0.1:9000"
    path = quote_path(f"/bucket/{key}")
    ours = Signer("eu-west-2").headers(method, path, "", host, creds, now=NOW)

    req = AWSRequest(method=method, url=f"http://{host}{path}",
                     headers={"x-amz-content-sha256": "UNSIGNED-PAYLOAD"})
    auth = S3SigV4Auth(BotoCreds(creds.access_key, creds.secret_key, token), "s3", "eu-west-2")
    req.context["timestamp"] = NOW.strftime("%Y%m%dT%H%M%SZ")
    req.headers["X-Amz-Date"] = req.context["timestamp"]
    if token:
        req.headers["X-Amz-Security-Token"] = token
    auth._modify_request_before_signing = lambda r: None  # headers set above, as ours
    canonical = auth.canonical_request(req)
    sig = auth.signature(auth.string_to_sign(req, canonical), req)
    assert ours["authorization"].endswith(f"Signature={sig}")
    assert f"Credential=AKIDEXAMPLE/20261125/eu-west-2/s3/aws4_request" in ours["authorization"]


def test_signature_matches_the_published_aws_example() -> None:
    """AWS's documented GetObject example (ranged GET, empty payload hash) as a fixed
    vector, independent of botocore."""
    import hashlib
    import hmac

    creds = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    t = datetime.datetime(2013, 5, 24, tzinfo=datetime.timezone.utc)
    empty = hashlib.sha256(b"").hexdigest()
    canonical = "\n".join(["GET", "/test.txt", "", "host:examplebucket.s3.amazonaws.com\nrange:bytes=0-9\n"
                           f"x-amz-content-sha256:{empty}\nx-amz-date:20130524T000000Z\n",
                           "host;range;x-amz-content-sha256;x-amz-date", empty])
    scope = "20130524/us-east-1/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", "20130524T000000Z", scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = Signer("us-east-1")._signing_key(creds.secret_key, t.strftime("%Y%m%d"))
    sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    assert sig == "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"


# where requests go and which credentials sign them: tests/test_s3_config_parity.py


def test_ranged_reads_from_moto_land_in_place(moto_endpoint: str) -> None:
    """Keys that need escaping, ranges, a range past the end, a whole object,
    HEAD, a missing key and a missing bucket, all on the direct path."""
    import boto3

    bucket = make_bucket(moto_endpoint)
    data = os.urandom(3 << 20)
    key = "dir with space/ü+%=&~/obj"
    boto3.client("s3", **s3_options(moto_endpoint)).put_object(Bucket=bucket, Key=key, Body=data)
    store, _ = open_store(f"s3://{bucket}", s3_options(moto_endpoint))

    async def go() -> Any:
        assert type(await store.transport()).__name__ == "DirectTransport"  # type: ignore[attr-defined]
        out = bytearray(1 << 20)
        await store.get_range_into(key, 12345, memoryview(out))
        parts = [memoryview(bytearray(7)), memoryview(bytearray(100_000)), memoryview(bytearray(1))]
        await store.get_range_scatter(key, 99, parts)
        tail = await store.get_range(key, len(data) - 10, 100)  # shorter: the object ends
        past = await store.get_range(key, len(data) + 5, 10)  # 416: nothing
        whole = await store.get(key)
        info = await store.head(key)
        missing = await store.head(key + "-nope")
        return out, parts, tail, past, whole, info, missing

    out, parts, tail, past, whole, info, missing = _runtime.run(go())
    assert bytes(out) == data[12345:12345 + (1 << 20)]
    assert b"".join(bytes(p) for p in parts) == data[99:99 + 100_008]
    assert tail == data[-10:] and past == b"" and whole == data
    assert info is not None and info.size == len(data) and missing is None
    with pytest.raises(objckpt.NotFoundError, match="nope"):
        _runtime.run(store.get(key + "-nope"))
    gone, _ = open_store("s3://no-such-bucket-here", s3_options(moto_endpoint))
    with pytest.raises(objckpt.BucketNotFoundError, match="no-such-bucket-here"):
        _runtime.run(gone.get("x"))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
def test_fresh_process_save_and_restore(moto_endpoint: str, direct: bool) -> None:
    """What a job does at start and at its first checkpoint: a new process saves a
    state large enough for multipart uploads, another restores it into fresh
    tensors.  On the direct path neither imports aiobotocore; with
    ``direct_http=False`` everything goes through botocore, which stays tested."""
    bucket = make_bucket(moto_endpoint)
    opts = {**s3_options(moto_endpoint), "direct_http": direct}
    code = textwrap.dedent(f"""
        import sys, torch, objckpt
        g = torch.Generator().manual_seed(5)
        state = {{"w": torch.randn(3000, 5000, generator=g), "b": torch.arange(1000, dtype=torch.int64), "step": 7}}
        if sys.argv[1] == "save":
            objckpt.save(state, "s3://{bucket}/ck", storage_options={opts!r})
        else:
            into = {{"w": torch.empty(3000, 5000), "b": torch.empty(1000, dtype=torch.int64), "step": 0}}
            objckpt.load(into, "s3://{bucket}/ck", storage_options={opts!r})
            assert torch.equal(into["w"], state["w"]) and torch.equal(into["b"], state["b"]) and into["step"] == 7
        print(sorted(m for m in ("aiobotocore", "aiohttp") if m in sys.modules))
    """)
    for op in ("save", "load"):
        r = subprocess.run([sys.executable, "-c", code, op], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1] == ("[]" if direct else "['aiobotocore', 'aiohttp']")
    import boto3

    keys = [o["Key"] for o in boto3.client("s3", **s3_options(moto_endpoint)).list_objects_v2(Bucket=bucket)["Contents"]]
    assert any(k.endswith("manifest.json") for k in keys)
    # 60 MB in one rank's blob: written as a multipart upload, completed, none left open
    assert not boto3.client("s3", **s3_options(moto_endpoint)).list_multipart_uploads(Bucket=bucket).get("Uploads")


# (a PermanentRedirect, or a malformed-header refusal naming a region, is a region redirect:
# followed on the direct path, see tests/test_s3_redirects.py)
@pytest.mark.parametrize("code, status", [("AuthorizationHeaderMalformed", 400), ("SignatureDoesNotMatch", 403),
                                          ("Found", 302)])
def test_endpoint_that_refuses_direct_requests_is_a_clear_error(code: str, status: int) -> None:
    """A refusal the own path does not follow is an error saying what S3 answered and
    what to check, after one attempt; the store stays on its transport (it used to turn
    to botocore for good, the same request taking another route)."""
    with S3Server() as srv:
        url = srv.endpoint_url
        opts = {**s3_options(url), "throttle_attempts": 1}
        import boto3

        boto3.client("s3", **s3_options(url)).create_bucket(Bucket="b")
        state = {"x": torch.randn(1000)}
        objckpt.save(state, "s3://b/ck", storage_options=opts)
        srv.fail("GetObject", count=1, status=status, code=code)
        hint = {"Found": "redirects", "SignatureDoesNotMatch": "secret access key.*direct_http=False"}.get(
            code, "signature or credentials were refused.*direct_http=False")
        said = (rf"{code} .HTTP {status}, not retried" if code == "SignatureDoesNotMatch"  # see test_s3_credentials.py
                else rf"HTTP {status}.*1 attempt.*{code}")
        with pytest.raises(objckpt.StorageError, match=rf"{said}.*{hint}"):
            objckpt.load({"x": torch.empty(1000)}, "s3://b/ck", storage_options=opts)
        into = {"x": torch.empty(1000)}
        objckpt.load(into, "s3://b/ck", storage_options=opts)
        assert torch.equal(into["x"], state["x"])
        transport = _runtime.run(open_store("s3://b", opts)[0].transport())  # type: ignore[attr-defined]
        assert type(transport).__name__ == "DirectTransport"


class _RawServer:
    """An HTTP server on a raw socket that answers GETs from ``data`` and then does
    what ``mode`` says: ``close_idle`` closes each connection after one answer
    without saying so; ``cut`` sends half of the first body and hangs up;
    ``trickle`` sends each body in four pieces 0.3 s apart; ``stall`` sends a
    quarter of the first body, then nothing for 3 s."""

    def __init__(self, data: bytes, mode: str) -> None:
        self.data, self.mode = data, mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.requests: list[str] = []
        self.ranges: list[tuple[int, int]] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket) -> None:
        with c:
            buf = b""
            while b"\r\n\r\n" not in buf:
                d = c.recv(4096)
                if not d:
                    return
                buf += d
            line = buf.split(b"\r\n")[0].decode()
            rng = [h for h in buf.split(b"\r\n") if h.lower().startswith(b"range:")]
            self.requests.append(line)
            lo, hi = (int(x) for x in rng[0].split(b"=")[1].split(b"-"))
            self.ranges.append((lo, hi))
            body = self.data[lo:hi + 1]
            c.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\n\r\n" % len(body))
            if self.mode == "cut" and len(self.requests) == 1:
                c.sendall(body[: len(body) // 2])
                return
            if self.mode in ("trickle", "stall"):
                q = len(body) // 4
                for i in range(4):
                    c.sendall(body[i * q : (i + 1) * q if i < 3 else len(body)])
                    time.sleep(0.3 if self.mode == "trickle" else 3.0)
                    if self.mode == "stall":
                        return
                return
            c.sendall(body)
            # close_idle: the connection ends here, unannounced

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def reader_for() -> Iterator[Any]:
    servers: list[_RawServer] = []

    def make(data: bytes, mode: str, read_timeout: float = 5) -> tuple[DirectClient, _RawServer]:
        srv = _RawServer(data, mode)
        servers.append(srv)
        target = Target("http", "127.0.0.1", srv.port, f"127.0.0.1:{srv.port}", "/b", "us-east-1")
        return DirectClient("b", target, CredentialSource(Credentials("a", "b")), connect_timeout=2,
                            read_timeout=read_timeout), srv

    yield make
    for s in servers:
        s.close()


def test_connection_closed_while_idle_is_reopened_unseen(reader_for: Any) -> None:
    data = os.urandom(1 << 20)
    reader, srv = reader_for(data, "close_idle")
    for lo in (0, 1000, 5000):
        sink = Sink([memoryview(bytearray(4096))])
        reader.read_range("k", lo, sink, 2.0)
        assert bytes(sink.views[0]) == data[lo:lo + 4096]
    assert srv.connections == 3 and len(srv.requests) == 3


def test_body_cut_midway_is_resumed_from_the_first_missing_byte(reader_for: Any) -> None:
    data = os.urandom(1 << 20)
    reader, srv = reader_for(data, "cut")
    sink = Sink([memoryview(bytearray(600_000))])
    with pytest.raises(ConnectionError):
        reader.read_range("k", 10, sink, 2.0)
    assert sink.got == 300_000
    reader.read_range("k", 10, sink, 2.0)  # the retry asks for the rest only
    assert bytes(sink.views[0]) == data[10:600_010]
    assert srv.ranges == [(10, 600_009), (300_010, 600_009)]


@pytest.mark.parametrize("op", ["PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload"])
def test_endpoint_that_refuses_a_direct_write_fails_the_save_clearly(op: str) -> None:
    with S3Server(min_part_size=1 << 20) as srv:
        url = srv.endpoint_url
        opts = {**s3_options(url), "throttle_attempts": 1}
        import boto3

        boto3.client("s3", **s3_options(url)).create_bucket(Bucket="b")
        state = {"x": torch.randn(5 << 20)}  # 20 MiB: multipart
        srv.fail(op, count=1, status=400, code="AuthorizationHeaderMalformed")
        with pytest.raises(objckpt.StorageError, match="AuthorizationHeaderMalformed.*signature or credentials"):
            objckpt.save(state, "s3://b/ck", storage_options=opts)
        objckpt.save(state, "s3://b/ck", storage_options=opts)  # the refusal was once: the next save goes through
        assert torch.equal(objckpt.read("s3://b/ck", storage_options=opts)["x"], state["x"])
        transport = _runtime.run(open_store("s3://b", opts)[0].transport())  # type: ignore[attr-defined]
        assert type(transport).__name__ == "DirectTransport"


def test_a_body_slower_than_the_low_water_mark_is_read_not_timed_out(reader_for: Any) -> None:
    """The receive waits for RECV_LOWAT bytes before waking; a sender that sends less
    per read timeout but never stops is read to the end, as without the mark."""
    data = os.urandom(1 << 20)
    reader, srv = reader_for(data, "trickle", read_timeout=0.5)
    sink = Sink([memoryview(bytearray(40_000))])
    reader.read_range("k", 7, sink, 2.0)
    assert bytes(sink.views[0]) == data[7:40_007]


def test_a_silent_sender_still_times_out_mid_body(reader_for: Any) -> None:
    data = os.urandom(1 << 20)
    reader, srv = reader_for(data, "stall", read_timeout=0.5)
    sink = Sink([memoryview(bytearray(40_000))])
    # the stall trips read_timeout (named in the error), not the request's 2 s deadline
    with pytest.raises(TimeoutError, match=r"sent nothing for 0\.5 s mid-body \(read_timeout\)"):
        reader.read_range("k", 0, sink, 2.0)
    assert sink.got == 10_000
    assert bytes(sink.views[0][:10_000]) == data[:10_000]


@pytest.fixture
def fast_client() -> Iterator[tuple[DirectClient, S3Server]]:
    with S3Server() as srv:
        import boto3

        boto3.client("s3", **s3_options(srv.endpoint_url)).create_bucket(Bucket="b")
        target = S3Config.resolve("b", s3_options(srv.endpoint_url)).target
        client = DirectClient("b", target, CredentialSource(Credentials("testing", "testing")), connect_timeout=2,
                              read_timeout=5)
        yield client, srv
        client.close()



def test_bodies_are_copied_unless_splicing_is_asked_for(fast_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Splicing is opt-in, by the client's ``splice`` (its store's OBJCKPT_SPLICE_BODIES, read
    when the store opened): the variable alone, set after, changes nothing."""
    client, _ = fast_client
    spliced = spy_splice(monkeypatch)
    monkeypatch.setenv("OBJCKPT_SPLICE_BODIES", "1")
    data = os.urandom(1 << 20)
    client.put("k", [memoryview(bytearray(data))], {}, 5.0)
    assert spliced == [] and client.get("k", 5.0) == data
    client.splice = True
    client.put("k2", [memoryview(bytearray(data))], {}, 5.0)
    assert sum(spliced) == len(data) and client.get("k2", 5.0) == data
    client.splice = False
    client.put("k3", [memoryview(bytearray(data))], {}, 5.0)
    assert sum(spliced) == len(data) and client.get("k3", 5.0) == data


def test_spliced_body_may_change_once_the_put_returns(fast_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large bodies leave by splice (the kernel sends from the caller's pages); once
    the 2xx answer is in, the server has read them all: the buffer may be reused."""
    client, _ = fast_client
    client.splice = True
    spliced = spy_splice(monkeypatch)
    data = os.urandom(4 << 20)
    buf = bytearray(data)
    client.put("k", [memoryview(bytes(100)), memoryview(buf)], {}, 5.0)
    buf[:] = bytes(len(buf))  # reused right away, as a staging buffer is
    assert client.get("k", 5.0) == bytes(100) + data
    assert sum(spliced) == len(data)
    assert all(not c.lent for c in client._idle)


def test_a_failed_spliced_put_closes_its_connection(fast_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error answer does not say the body left the socket: the connection is closed
    (abortively), never reused, and the next request goes on a fresh one."""
    from objckpt.storage.s3.request import S3HttpError

    client, srv = fast_client
    client.splice = True
    client.put("warm", [memoryview(bytearray(10))], {}, 5.0)
    assert len(client._idle) == 1
    srv.fail("PutObject", count=1, status=500)
    with pytest.raises(S3HttpError):
        client.put("k", [memoryview(bytearray(os.urandom(1 << 20)))], {}, 5.0)
    assert client._idle == []
    data = os.urandom(1 << 20)
    client.put("k", [memoryview(bytearray(data))], {}, 5.0)
    assert client.get("k", 5.0) == data


def test_without_splice_bodies_are_copied(fast_client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from objckpt.storage.s3 import wire

    client, _ = fast_client
    client.splice = True  # asked for, but not to be had
    monkeypatch.setattr(wire, "_get_vmsplice", lambda: False)
    monkeypatch.setattr(wire, "PIPE_SIZES", ())
    data = os.urandom(3 << 20)
    client.put("k", [memoryview(bytearray(data))], {}, 5.0)
    assert client.get("k", 5.0) == data


@pytest.mark.parametrize("splice", ["1", "0"])
def test_a_body_nobody_reads_times_out(splice: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server takes the connection but never reads: the send times out within the
    timeout given (as sendall's would), and the connection is dropped; spliced or copied."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    target = Target("http", "127.0.0.1", port, f"127.0.0.1:{port}", "/b", "us-east-1")
    # read_timeout far beyond the bound below: the send must stop on the 0.5 s it was given; the
    # bound is 120 times that (a loaded machine never reaches it), a tenth of the wrong timeout
    client = DirectClient("b", target, CredentialSource(Credentials("a", "b")), connect_timeout=2, read_timeout=600,
                          splice=splice == "1")
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            client.put("k", [memoryview(bytearray(256 << 20))], {}, 0.5)
        assert time.monotonic() - t0 < 60 and client._idle == []
    finally:
        srv.close()


def test_on_off_options_take_every_switch_word_and_refuse_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """``direct_http``, ``checksums`` and ``adaptive`` (and ``OBJCKPT_S3_DIRECT_HTTP``) read
    the same on/off words; "off" turns them off (it used to leave them on), and a word
    that is neither is an error naming the option or variable, before any request."""
    from objckpt.storage.s3 import S3Store

    monkeypatch.delenv("OBJCKPT_S3_DIRECT_HTTP", raising=False)
    keys = {"endpoint_url": "http://127.0.0.1:9", "aws_access_key_id": "k", "aws_secret_access_key": "s"}
    store = S3Store("b", **keys, direct_http="off", checksums="OFF", adaptive=" no ")
    assert store.config.transport is Transport.BOTOCORE and store.checksums is False and store.limiter is None
    store = S3Store("b", **keys, direct_http=True, checksums="on", adaptive="1")
    assert store.config.transport is Transport.DIRECT and store.checksums is True and store.limiter is not None
    monkeypatch.setenv("OBJCKPT_S3_DIRECT_HTTP", "off")
    assert S3Store("b", **keys).config.transport is Transport.BOTOCORE
    assert S3Store("b", **keys, direct_http=True).config.transport is Transport.DIRECT  # the option wins
    monkeypatch.setenv("OBJCKPT_S3_DIRECT_HTTP", "sometimes")
    with pytest.raises(ValueError, match="environment variable OBJCKPT_S3_DIRECT_HTTP='sometimes'"):
        S3Store("b", **keys)
    monkeypatch.delenv("OBJCKPT_S3_DIRECT_HTTP")
    with pytest.raises(ValueError, match="storage option 'checksums'='maybe'"):
        S3Store("b", **keys, checksums="maybe")
