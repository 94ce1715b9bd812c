"""Dead, silent and failing endpoints are reported within their budgets.

The budgets are asserted as work, not as measured time: the attempts a request made
(the retry budget for its kind of failure) and the timeout each attempt waited (the
option the error names), both as the error reports them."""
from __future__ import annotations

import socket
import threading
from typing import Any, Iterator

import pytest
import torch

import objckpt
from objckpt.errors import StorageError
from objckpt.storage.s3.retry import Failure, RetryPolicy

_KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


def _refused_endpoint() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A TCP server that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


@pytest.mark.parametrize("op", ["save", "read"])
def test_refused_connection_fails_fast_naming_the_endpoint(op: str) -> None:
    ep = _refused_endpoint()
    opts = {"endpoint_url": ep, **_KEYS}
    with pytest.raises(StorageError, match=ep.replace(".", r"\.")) as info:
        if op == "save":
            objckpt.save({"w": torch.ones(4)}, "s3://b/run", storage_options=opts)
        else:
            objckpt.read("s3://b/run", storage_options=opts)
    assert f"(connect, {RetryPolicy().connect_attempts} attempts)" in str(info.value), str(info.value)


def test_silent_endpoint_fails_after_the_first_byte_timeout(silent_endpoint: str) -> None:
    opts = {"endpoint_url": silent_endpoint, "read_timeout": 1, "timeout_attempts": 2, **_KEYS}
    with pytest.raises(StorageError, match="timeout") as info:
        objckpt.read("s3://b/run", storage_options=opts)
    # two attempts, each waiting 1 s (the first answer never gets longer than read_timeout)
    assert "(timeout, 2 attempts)" in str(info.value) and " within 1 s (storage option " in str(info.value)


def test_permanent_500_fails_after_the_error_budget() -> None:
    import boto3

    from testkit.s3server import S3Server

    with S3Server() as server:
        boto3.client("s3", endpoint_url=server.endpoint_url, **_KEYS).create_bucket(Bucket="perm500")
        opts = {"endpoint_url": server.endpoint_url, "error_attempts": 3, "max_backoff": 0.05, **_KEYS}
        objckpt.save({"w": torch.ones(4)}, "s3://perm500/run", storage_options=opts)
        server.fail("GetObject", count=1000, status=500)
        with pytest.raises(StorageError, match="3 attempts"):
            objckpt.read("s3://perm500/run", storage_options=opts)


def test_policy_from_options(monkeypatch: pytest.MonkeyPatch) -> None:
    import botocore.session

    from objckpt.storage.s3.retry_settings import resolve_retry

    for k in ("AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    session = botocore.session.Session()
    opts: dict[str, Any] = {"read_timeout": "2.5", "max_attempts": 3, "throttle_attempts": 9, "other": 1}
    p = resolve_retry(opts, session, "the config file").policy
    # max_attempts caps every kind (botocore's meaning); a per-kind option wins over it
    assert (p.read_timeout, p.throttle_attempts, p.error_attempts, p.timeout_attempts, p.connect_attempts) == (
        2.5, 9, 3, 3, 3)
    assert opts == {"other": 1}
    assert p.attempts(Failure.FATAL) == 1
    with pytest.raises(ValueError, match="error_attempts"):
        resolve_retry({"error_attempts": 0}, session, "the config file")
