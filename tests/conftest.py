"""Shared fixtures: one real moto S3 server over HTTP per test session.

The server binds port 0 (a fixed port deadlocks under pytest-xdist) and is
reset between tests; each test gets a fresh bucket.
"""
from __future__ import annotations

import itertools
import logging
import os
import urllib.request
from typing import Any, Iterator

import pytest
import torch

from rgw_fixture import rgw, rgw_s3  # noqa: F401  (a real Ceph RGW, skipped with the reason where it cannot run)

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
logging.getLogger("werkzeug").setLevel(logging.ERROR)

_bucket_ids = itertools.count()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server._server.server_port  # type: ignore[attr-defined]
    yield f"http://127.0.0.1:{port}"
    server.stop()


def s3_options(endpoint: str) -> dict[str, Any]:
    return {
        "endpoint_url": endpoint,
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "region_name": "us-east-1",
    }


def make_bucket(endpoint: str) -> str:
    import boto3

    name = f"bkt-{os.getpid()}-{next(_bucket_ids)}"
    boto3.client("s3", **s3_options(endpoint)).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="module")
def memory_s3() -> Iterator[Any]:
    """A dedicated in-memory S3 server (testkit/s3server.py) for the test module: fault
    injection, checksum and credential behaviours moto does not have."""
    from testkit.s3server import S3Server

    server = S3Server()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def moto_s3(moto_endpoint: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(bucket, storage_options) on a freshly reset moto server."""
    req = urllib.request.Request(f"{moto_endpoint}/moto-api/reset", method="POST")
    urllib.request.urlopen(req).read()
    yield make_bucket(moto_endpoint), s3_options(moto_endpoint)


@pytest.fixture(scope="session")
def fast_endpoint() -> Iterator[str]:
    from testkit.s3server import S3Server

    server = S3Server()
    server.start()
    yield server.endpoint_url
    server.stop()


@pytest.fixture(params=["local", "s3"])
def local_or_s3(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
    """A checkpoint URI (and storage options) on local files, then on moto S3."""
    if request.param == "local":
        return str(tmp_path / "ck"), {}
    bucket, opts = request.getfixturevalue("moto_s3")
    return f"s3://{bucket}/run/ck", opts


@pytest.fixture(params=["memory", "local", "s3", "fsspec"])
def ckpt_uri(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any]]:
    """A checkpoint URI (and storage options) on each backend."""
    kind = request.param
    n = next(_bucket_ids)
    if kind == "memory":
        return f"memory://t{os.getpid()}-{n}/run/step-1", {}
    if kind == "local":
        return str(tmp_path / "run" / "step-1"), {}
    if kind == "fsspec":
        return f"fsspec+memory://t{os.getpid()}-{n}/run/step-1", {}
    endpoint = request.getfixturevalue("moto_endpoint")
    return f"s3://{make_bucket(endpoint)}/run/step-1", s3_options(endpoint)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Deep equality of nested states, bitwise for tensors (NaN-safe)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        if a.numel():
            av = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            bv = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(av, bv), path
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b) if isinstance(b, dict) else b)
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
        return
    if isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, path
        return
    assert a == b and type(a) is type(b), (path, a, b)


@pytest.fixture(autouse=True)
def _restore_deterministic_mode() -> Iterator[None]:
    """Lightning's ``deterministic=True`` turns on torch's deterministic algorithms for the
    whole process; each test gets the mode it started with back, so tests do not depend on order."""
    was = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(was)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Float sums split over threads round differently: runs compared bit for bit use one thread each."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def s3_run(moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str,
           monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, dict[str, Any]]:
    """(bucket, run URI, storage options), with fsspec (Lightning's own I/O) pointed at moto."""
    bucket, opts = moto_s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    return bucket, f"s3://{bucket}/run", opts
