"""206 answers whose range is not the one asked for, on both S3 transports (objckpt's
own HTTP path and botocore's, ``direct_http=False``).

A server may widen a range (a CDN or cache aligning ranges: ``Content-Range`` starts
before the asked offset and covers the asked bytes); the asked bytes are taken out of
it, their crc32c checked as always.  A 206 that does not cover the asked range is an
error of the same class and wording on both transports, naming the key, the range
asked for and the ``Content-Range`` answered.
"""
from __future__ import annotations

import os
from typing import Any, Iterator

import boto3
import pytest
import torch

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.storage import open_store
from objckpt.storage.s3.credentials import CredentialSource, Credentials
from objckpt.storage.s3.direct import DirectClient, Target
from objckpt.storage.s3.wire import Sink
from conftest import assert_same
from hostile_http import WIDEN, HostileServer, wait_for
from testkit.s3server import S3Server

TRANSPORTS = pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
DATA = os.urandom(1 << 20)
LIMIT = 60.0  # seconds a call may take before the test calls it a hang


def _call(fn: Any) -> Any:
    returned, out = wait_for(fn, LIMIT)
    assert returned, f"the client did not return within {LIMIT} s"
    return out


def _hostile_store(srv: HostileServer, direct: bool, **kw: Any) -> Any:
    opts = {"endpoint_url": srv.endpoint, "aws_access_key_id": "a", "aws_secret_access_key": "b",
            "region_name": "us-east-1", "endpoint_kind": "s3", "direct_http": direct, "max_backoff": 0.01, **kw}
    return open_store("s3://b", opts)[0]


# -- a raw-socket server ------------------------------------------------------------------
@TRANSPORTS
def test_a_widened_206_gives_the_asked_bytes(direct: bool) -> None:
    """Ranges answered widened to 64 KiB multiples: each read returns exactly the
    asked bytes (the server sent more, before and after them)."""
    with HostileServer(DATA, "widen_range") as srv:
        store = _hostile_store(srv, direct)
        asked = [(10, 1000), (WIDEN + 7, 3 * WIDEN), (len(DATA) - 5000, 5000), (123_457, 400_000)]
        for off, n in asked:
            assert _call(lambda: _runtime.run(store.get_range("ck/b", off, n))) == DATA[off:off + n], (off, n)
        assert srv.sent > sum(n for _, n in asked)  # the answers were widened
        assert sum(r.startswith("GET ") for r in srv.requests) == len(asked)  # none asked again
        _runtime.run(store.close())


def test_a_widened_206_keeps_the_connection_on_the_direct_path() -> None:
    """The bytes around the asked ones are read and dropped: one connection serves all."""
    with HostileServer(DATA, "widen_range") as srv:
        target = Target("http", "127.0.0.1", srv.port, f"127.0.0.1:{srv.port}", "/b", "us-east-1")
        client = DirectClient("b", target, CredentialSource(Credentials("a", "b")), connect_timeout=2,
                              read_timeout=5.0)
        for lo in (5, WIDEN - 1, 200_001):
            sink = Sink([memoryview(bytearray(70_000))])
            assert _call(lambda: client.read_range("k", lo, sink, 5.0)) is None
            assert bytes(sink.views[0]) == DATA[lo:lo + 70_000]
        assert srv.connections == 1
        client.close()


def test_a_206_that_does_not_cover_the_range_is_named_alike_on_both_transports() -> None:
    """A 206 starting one byte past the asked offset: on either transport the same
    class, StorageError (after the retry budget), naming the key, the asked range and
    the Content-Range answered; never bytes at the wrong offsets (botocore's path
    returned them), never "truncated" or "corrupt"."""
    errors = []
    with HostileServer(DATA, "wrong_range") as srv:
        for direct in (True, False):
            store = _hostile_store(srv, direct, error_attempts=2)
            errors.append(_call(lambda: _runtime.run(store.get_range("ck/b", 10, 1000))))
            _runtime.run(store.close())
    assert [type(e) for e in errors] == [objckpt.StorageError] * 2, errors
    for e in errors:
        text = str(e)
        assert "s3://b/ck/b" in text and "asked for bytes 10-1009" in text and "the 206 answer holds" in text, text
        assert f"'bytes 11-1010/{len(DATA)}'" in text and "2 attempts" in text, text
        assert "truncated" not in text and "corrupt" not in text.lower(), text


# -- a multi-blob checkpoint on the in-memory S3 server ------------------------------------
@pytest.fixture
def server() -> Iterator[S3Server]:
    with S3Server(min_part_size=1 << 20) as s:
        yield s


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(4)
    return {"a": torch.randn(3 << 20, generator=g), "b": torch.randn(1001, 7, generator=g),
            "c": torch.randn(2 << 20, generator=g).to(torch.bfloat16), "d": torch.arange(99_999), "step": 3}


@TRANSPORTS
def test_a_checkpoint_loads_bit_exact_through_widened_ranges(server: S3Server, direct: bool) -> None:
    """A checkpoint of several blobs read whole, read in part and loaded into a
    template while every ranged GET is answered widened (to multiples of 192 KiB + 1):
    bit-exact, and more bytes came than without widening."""
    boto3.client("s3", endpoint_url=server.endpoint_url, aws_access_key_id="k", aws_secret_access_key="s",
                 region_name="us-east-1").create_bucket(Bucket="w")
    opts = {"endpoint_url": server.endpoint_url, "aws_access_key_id": "k", "aws_secret_access_key": "s",
            "region_name": "us-east-1", "direct_http": direct}
    uri = "s3://w/run/ck"
    sd = _state()
    objckpt.save(sd, uri, storage_options=opts, blob_size=8 << 20, part_size=2 << 20)
    assert sum("/blobs/" in k for k in server.state.buckets["w"].objects) >= 2

    def read_all() -> int:
        server.reset_stats()
        assert_same(sd, objckpt.read(uri, storage_options=opts))
        assert_same({"b": sd["b"], "d": sd["d"]}, objckpt.read(uri, ["b", "d"], storage_options=opts))
        into = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in sd.items()}
        objckpt.load(into, uri, storage_options=opts)
        assert_same(sd, into)
        return int(server.stats()["bytes_out"])

    plain = read_all()
    server.widen_ranges((192 << 10) + 1)
    assert read_all() > plain
