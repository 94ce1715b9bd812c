"""Hostile or broken HTTP answers on objckpt's own S3 client (storage/s3/direct.py,
storage/s3/http_answer.py, storage/s3/wire.py).

Each case runs against :class:`hostile_http.HostileServer` with small deadlines set
through the options; a client that hangs fails the test through ``wait_for`` (a
thread join with a generous limit), never by a timed assertion.
"""
from __future__ import annotations

import os
import tracemalloc
from typing import Any, Callable, Iterator

import pytest

from objckpt.runtime import loop as _runtime
from objckpt.errors import StorageError, StorageTimeoutError
from objckpt.storage import open_store
from objckpt.storage.s3.http_answer import BadAnswer, WrongRange
from objckpt.storage.s3.retry import RetryPolicy
from objckpt.storage.s3.direct import DirectClient, Target
from objckpt.storage.s3.credentials import CredentialSource, Credentials
from objckpt.storage.s3.wire import Sink, SlowAnswer

from hostile_http import HostileServer, wait_for

DATA = os.urandom(3 << 20)
LIMIT = 60.0  # seconds a call may take before the test calls it a hang


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[HostileServer, DirectClient]]]:
    """``serve(mode, **server_kw)``: a hostile server and a direct client of it whose
    requests may take max(0.5 s, bytes / 1 MB/s) (read timeout 1 s)."""
    made: list[tuple[HostileServer, DirectClient]] = []

    def make(mode: str, **kw: Any) -> tuple[HostileServer, DirectClient]:
        srv = HostileServer(DATA, mode, **kw)
        target = Target("http", "127.0.0.1", srv.port, f"127.0.0.1:{srv.port}", "/b", "us-east-1")
        client = DirectClient("b", target, CredentialSource(Credentials("a", "b")), connect_timeout=2,
                              read_timeout=1.0, deadline_floor=0.5, min_rate=1e6)
        made.append((srv, client))
        return srv, client

    yield make
    for srv, client in made:
        client.close()
        srv.close()


def _call(fn: Callable[[], Any]) -> Any:
    """``fn()``'s result or exception; fails the test if it does not return at all."""
    returned, out = wait_for(fn, LIMIT)
    assert returned, f"the client did not return within {LIMIT} s"
    return out


def _store(srv: HostileServer, **options: Any) -> Any:
    opts = {"endpoint_url": srv.endpoint, "aws_access_key_id": "a", "aws_secret_access_key": "b",
            "region_name": "us-east-1", "endpoint_kind": "s3", "deadline_floor": 0.5, "min_rate": 1e6,
            "read_timeout": 1.0, "max_backoff": 0.05, **options}
    return open_store("s3://b", opts)[0]


# -- a trickle ends ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["trickle_head", "trickle_body"])
def test_a_trickled_answer_runs_out_of_its_deadline(serve: Any, mode: str) -> None:
    """One byte every 50 ms never trips the 1 s read timeout; the request's deadline
    (here max(0.5 s, 0.4 MB / 1 MB/s)) ends it, naming key, endpoint and rate."""
    srv, client = serve(mode)
    sink = Sink([memoryview(bytearray(400_000))])
    e = _call(lambda: client.read_range("blobs/k", 100, sink, 1.0))
    assert isinstance(e, SlowAnswer) and isinstance(e, TimeoutError), e
    assert "s3://b/blobs/k" in str(e) and f"127.0.0.1:{srv.port}" in str(e)
    assert "B/s" in str(e) and "min_rate" in str(e) and "deadline_floor" in str(e)


def test_a_trickle_is_retried_then_reported_as_a_storage_timeout(serve: Any) -> None:
    """Through the store: retried under the timeout budget, then StorageTimeoutError
    (an ObjckptError and a TimeoutError) naming the endpoint, the key and the rate."""
    srv, _ = serve("trickle_body")
    store = _store(srv, timeout_attempts=2)
    e = _call(lambda: _runtime.run(store.get_range("ck/blobs/0", 0, 1000)))
    assert isinstance(e, StorageTimeoutError) and isinstance(e, TimeoutError), repr(e)
    text = str(e)
    assert srv.endpoint in text and "s3://b/ck/blobs/0" in text and "B/s" in text and "2 attempts" in text
    assert sum(r.startswith("GET ") for r in srv.requests) == 2


def test_an_upload_the_server_reads_slowly_runs_out_of_its_deadline(serve: Any) -> None:
    """The server reads the body 64 KiB per 0.1 s: a 16 MiB PUT allowed max(0.5 s,
    16 MiB / 100 MB/s) stops at its deadline, though every send makes progress."""
    srv, client = serve("slow_reader", interval=0.1)
    client.min_rate = 1e8
    e = _call(lambda: client.put("k", [memoryview(bytearray(16 << 20))], {}, 1.0))
    assert isinstance(e, SlowAnswer), repr(e)
    assert "PUT s3://b/k" in str(e)
    assert client._idle == []  # the connection is not reused


def _policy(options: dict[str, Any]) -> RetryPolicy:
    """The policy a store opened with ``options`` gets (the AWS retry settings left unset)."""
    import botocore.session

    from objckpt.storage.s3.retry_settings import resolve_retry

    return resolve_retry(dict(options), botocore.session.Session(), "the config file").policy


def test_deadline_settings_come_from_options_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("OBJCKPT_S3_DEADLINE_FLOOR", raising=False)
    monkeypatch.delenv("OBJCKPT_S3_MIN_RATE", raising=False)
    p = _policy({})
    assert (p.deadline_floor, p.min_rate) == (60.0, float(1 << 20))
    assert p.deadline(16 << 20) == 60.0 and p.deadline(1 << 30) == 1024.0
    monkeypatch.setenv("OBJCKPT_S3_DEADLINE_FLOOR", "5")
    monkeypatch.setenv("OBJCKPT_S3_MIN_RATE", "2e6")
    p = _policy({})
    assert (p.deadline_floor, p.min_rate) == (5.0, 2e6)
    p = _policy({"deadline_floor": "7", "min_rate": 3e6})  # the options win
    assert (p.deadline_floor, p.min_rate) == (7.0, 3e6)
    monkeypatch.setenv("OBJCKPT_S3_MIN_RATE", "fast")
    with pytest.raises(ValueError, match="OBJCKPT_S3_MIN_RATE"):
        _policy({})
    with pytest.raises(ValueError, match="deadline_floor"):
        _policy({"deadline_floor": 0, "min_rate": 1})


# -- interim answers -------------------------------------------------------------------
def test_interim_answers_are_skipped(serve: Any) -> None:
    """``100 Continue`` and ``103 Early Hints`` before every answer: reads, HEADs, a
    PUT and a POST see the real answer after them, on one kept-alive connection."""
    srv, client = serve("continue")
    sink = Sink([memoryview(bytearray(1 << 20))])
    out = _call(lambda: (client.read_range("k", 5, sink, 1.0), client.get("k", 1.0), client.head("k", 1.0),
                         client.put("k", [memoryview(bytearray(1000))], {}, 1.0),
                         client.create_upload("k", {}, 1.0)))
    assert not isinstance(out, BaseException), repr(out)
    assert bytes(sink.views[0]) == DATA[5:5 + (1 << 20)]
    assert out[1] == DATA and out[2] == (len(DATA), '"e"')
    assert out[3]["ETag"] == '"e"' and out[4] == "u1"
    assert srv.connections == 1


# -- chunked bodies -------------------------------------------------------------------
def test_chunked_answers_stream_into_place_and_a_huge_chunk_is_refused_unread(serve: Any) -> None:
    """A chunked 206 (extensions, a trailer) lands in the sink and the connection is
    reused; a chunk announced at 1 GiB for 2 MB asked for is refused before any of it
    is read: the server floods 64 MiB of it, the client holds none of that."""
    srv, client = serve("chunked")
    sink = Sink([memoryview(bytearray(2_000_000))])
    for lo in (0, 777):
        sink.got = sink._vi = sink._vpos = 0
        assert _call(lambda: client.read_range("k", lo, sink, 1.0)) is None
        assert bytes(sink.views[0]) == DATA[lo:lo + 2_000_000]
    assert srv.connections == 1
    # a whole object answered in chunks (no Content-Length) is read as its chunks say (it sent the store to
    # botocore for good before)
    assert _call(lambda: client.get("k", 1.0)) == DATA

    srv, client = serve("huge_chunk", flood=64 << 20)
    sink = Sink([memoryview(bytearray(2_000_000))])
    tracemalloc.start()
    try:
        e = _call(lambda: client.read_range("k", 0, sink, 1.0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(e, BadAnswer) and "1073741824 bytes announced" in str(e) and "unread" in str(e), repr(e)
    assert sink.got == 0 and peak < 16 << 20, peak


def test_an_announced_terabyte_allocates_what_arrives(serve: Any) -> None:
    """A Content-Length of 1 TiB: a write's answer is refused unread, a whole-object
    GET holds what arrived (a few bytes) until the read times out."""
    srv, client = serve("huge_length")
    tracemalloc.start()
    try:
        put = _call(lambda: client.put("k", [memoryview(bytearray(10))], {}, 1.0))
        get = _call(lambda: client.get("k", 1.0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(put, BadAnswer) and "refused unread" in str(put), repr(put)
    assert isinstance(get, TimeoutError) and not isinstance(get, SlowAnswer), repr(get)  # the 1 s read timeout
    assert peak < 32 << 20, peak


# -- ranges --------------------------------------------------------------------------
def test_a_206_of_the_wrong_range_is_named_not_called_truncated(serve: Any) -> None:
    srv, client = serve("wrong_range")
    sink = Sink([memoryview(bytearray(1000))])
    e = _call(lambda: client.read_range("k", 10, sink, 1.0))
    assert isinstance(e, WrongRange) and "asked for bytes 10-1009" in str(e) and "bytes 11-1010/" in str(e), repr(e)
    assert sink.got == 0

    store = _store(srv, error_attempts=2)
    e = _call(lambda: _runtime.run(store.get_range("ck/b", 10, 1000)))
    assert isinstance(e, StorageError) and "WrongRange" in str(e) and "truncated" not in str(e), repr(e)
    assert srv.endpoint in str(e) and "s3://b/ck/b" in str(e)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 2x0 OK\r\n\r\n",  # a status that is not a number
    b"HTTP/1.1 206 Partial Content\r\nContent-Length: 12abc\r\n\r\n",
    b"HTTP/1.1 206 Partial Content\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # not a chunk size
    b"HTTP/1.1 206 Partial Content\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcdefgh\r\n",  # longer than said
    b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\n" * 20,
])
def test_malformed_answers_are_bad_answers_not_value_errors(answer: bytes) -> None:
    """What a server sends is never trusted to parse: each is BadAnswer (a broken
    connection for the retry budget), never a bare ValueError from int()."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]

    def answer_once() -> None:
        c, _ = srv.accept()
        with c:
            c.recv(65536)
            c.sendall(answer)
            c.recv(1)  # hold the connection until the client closes it

    import threading

    threading.Thread(target=answer_once, daemon=True).start()
    target = Target("http", "127.0.0.1", port, f"127.0.0.1:{port}", "/b", "us-east-1")
    client = DirectClient("b", target, CredentialSource(Credentials("a", "b")), connect_timeout=2, read_timeout=5.0)
    try:
        e = _call(lambda: client.read_range("k", 0, Sink([memoryview(bytearray(100))]), 5.0))
        assert isinstance(e, BadAnswer), repr(e)
        assert "127.0.0.1" in str(e)
    finally:
        client.close()
        srv.close()
