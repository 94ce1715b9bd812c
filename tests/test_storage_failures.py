"""S3 failures users hit first are reported in bounded time, as ObjckptErrors that
name the endpoint, the key and the HTTP status; bodies that break mid-stream are
fetched again.  Real servers only: the in-memory S3 server (with fault injection)
behind a loopback fault proxy, and a TCP port that never answers.  Bounded by work,
not measured time: the attempts each request made and the timeout each waited, as the
error reports them (one generous wall bound remains: a server's stop that must not
wait for a stalled client)."""
from __future__ import annotations

import time
from typing import Any, Iterator

import boto3
import pytest
import torch

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.errors import StorageError
from objckpt.storage.s3.retry import RetryPolicy
from testkit.campaign import SilentEndpoint, make_state, same
from testkit.campaign_io import FaultProxy
from testkit.s3server import S3Server

_KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    srv = S3Server()
    srv.start()
    yield srv
    srv.stop()


def _bucket(server: S3Server, name: str) -> str:
    boto3.client("s3", endpoint_url=server.endpoint_url, **_KEYS).create_bucket(Bucket=name)
    return name


@pytest.mark.parametrize("op,fault", [("save", "PutObject"), ("save", "HeadObject"), ("read", "GetObject")])
def test_permanent_500_names_endpoint_status_and_key(server: S3Server, op: str, fault: str) -> None:
    bucket = _bucket(server, f"perm-{op}-{fault.lower()}")
    opts = {"endpoint_url": server.endpoint_url, "error_attempts": 2, "max_backoff": 0.05, **_KEYS}
    uri = f"s3://{bucket}/run"
    if op == "read":
        objckpt.save({"w": torch.ones(4)}, uri, storage_options=opts)
    server.fail(fault, count=1000, status=500)
    try:
        with pytest.raises(StorageError) as info:
            if op == "save":
                objckpt.save({"w": torch.ones(4)}, uri, storage_options=opts)
            else:
                objckpt.read(uri, storage_options=opts)
    finally:
        server.reset()  # faults and buckets: every test makes its own bucket
    msg = str(info.value)
    assert server.endpoint_url in msg and "HTTP 500" in msg and "2 attempts" in msg and bucket in msg, msg


@pytest.mark.parametrize("op", ["save", "read"])
def test_silent_endpoint_with_default_settings_is_reported_in_seconds(op: str) -> None:
    """Defaults only: until the endpoint first answers, a request gets first_answer_timeout."""
    silent = SilentEndpoint()
    url = silent.url
    opts = {"endpoint_url": url, **_KEYS}
    try:
        with pytest.raises(StorageError) as info:
            if op == "save":
                objckpt.save({"w": torch.ones(4)}, "s3://b/run", storage_options=opts)
            else:
                objckpt.read("s3://b/run", storage_options=opts)
    finally:
        silent.close()
    policy, msg = RetryPolicy(), str(info.value)
    assert url in msg and f"(timeout, {policy.timeout_attempts} attempts)" in msg, msg
    assert f"within {policy.first_answer_timeout:g} s (storage option first_answer_timeout)" in msg, msg
    assert len(silent.conns) == policy.timeout_attempts  # the attempts it made: one connection each


def _read_manifest_through(proxy: FaultProxy, bucket: str, **options: Any) -> bytes:
    from objckpt.storage import open_store

    store, prefix = open_store(f"s3://{bucket}/ck", storage_options={"endpoint_url": proxy.url, **_KEYS, **options})
    keys = [o.key for o in _runtime.run(store.list(prefix)) if o.key.endswith("manifest.json")]
    assert keys
    return bytes(_runtime.run(store.get(keys[0])))


# reads take the direct transport by default (storage/s3/direct.py); botocore's serves proxies: both are tested
READ_PATHS = pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])


@READ_PATHS
def test_cut_manifest_body_is_fetched_again(server: S3Server, direct: bool) -> None:
    """About half the connections cut their response after 600-700 bytes: the manifest
    (about 1.8 kB) is fetched again until whole, and the read is bit-exact."""
    bucket = _bucket(server, f"body-cut-retry-{direct}".lower())
    opts = {"endpoint_url": server.endpoint_url, "direct_http": direct, **_KEYS}
    state = make_state(1)
    objckpt.save(state, f"s3://{bucket}/ck", storage_options=opts)
    with FaultProxy(server.endpoint_url, kind="cut", probability=0.5, seed=3, direction="down", min_offset=600,
                    max_offset=700) as proxy:
        back = objckpt.read(f"s3://{bucket}/ck", storage_options={**opts, "endpoint_url": proxy.url,
                                                                   "error_attempts": 12, "max_backoff": 0.05})
        assert proxy.injected > 0
    assert same(state, back)


@READ_PATHS
def test_body_that_always_breaks_is_named(server: S3Server, direct: bool) -> None:
    bucket = _bucket(server, f"body-cut-named-{direct}".lower())
    objckpt.save(make_state(1), f"s3://{bucket}/ck", storage_options={"endpoint_url": server.endpoint_url, **_KEYS})
    with FaultProxy(server.endpoint_url, kind="cut", probability=1.0, direction="down", min_offset=600,
                    max_offset=700) as proxy:
        with pytest.raises(StorageError, match=rf"s3://{bucket}/ck/.*manifest.*2 attempts"):
            objckpt.read(f"s3://{bucket}/ck", storage_options={"endpoint_url": proxy.url, "error_attempts": 2,
                                                                "max_backoff": 0.05, "direct_http": direct, **_KEYS})
        assert proxy.injected >= 2


# --------------------------------------------------------------------------- the test tools themselves


def test_fault_proxy_close_ends_upstream_connections() -> None:
    """Closing the proxy sends FIN upstream even while its pump threads sit in recv: a
    server must not wait forever on a half-sent request of a finished fault trial."""
    import socket

    upstream = socket.socket()
    upstream.bind(("127.0.0.1", 0))
    upstream.listen(4)
    port = upstream.getsockname()[1]
    proxy = FaultProxy(f"http://127.0.0.1:{port}", probability=0.0)
    client = socket.create_connection(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1])), timeout=5)
    client.sendall(b"PUT /b/k HTTP/1.1\r\nContent-Length: 100\r\n\r\nhalf")  # 96 body bytes never come
    upstream.settimeout(5)
    conn, _ = upstream.accept()
    conn.settimeout(5)
    got = b""
    while len(got) < 4 or not got.endswith(b"half"):
        got += conn.recv(4096)
    proxy.close()
    assert conn.recv(4096) == b"", "the upstream connection stayed open after FaultProxy.close()"
    for s in (conn, client, upstream):
        s.close()


def test_server_stop_does_not_wait_on_a_stalled_request() -> None:
    """A client that sent half a body and went silent must not hold S3Server.stop()."""
    import socket

    srv = S3Server()
    srv.start()
    boto3.client("s3", endpoint_url=srv.endpoint_url, aws_access_key_id="t", aws_secret_access_key="t",
                 region_name="us-east-1").create_bucket(Bucket="stall")
    client = socket.create_connection((srv.host, srv.port), timeout=5)
    client.sendall(b"PUT /stall/k HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nhalf")
    time.sleep(0.2)  # the handler is now waiting for the other 96 bytes
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 8
    client.close()
