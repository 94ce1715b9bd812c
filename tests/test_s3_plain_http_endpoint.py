"""An ``https://`` endpoint that serves plain HTTP, and what the start-up log says of TLS.

The TLS handshake with a plain HTTP server gets its ``HTTP/1.1 400`` back, which OpenSSL
reads as a record of a wrong version: the user saw a bare ``SSLError: wrong version
number``, retried as a broken connection.  Now both transports raise
:class:`PlainHttpEndpointError` (a StorageError) at once, naming the endpoint and the
``http://`` URL of the same port.  The store's INFO line names a CA bundle only for an
https:// endpoint.  The test kit's S3 server (plain HTTP) plays the endpoint.
"""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from typing import Any, Iterator

import pytest
import torch

import objckpt
from conftest import s3_options
from objckpt.errors import PlainHttpEndpointError, StorageError
from objckpt.storage.s3.config import S3Config
from testkit.s3server import S3Server


@pytest.fixture
def server() -> Iterator[S3Server]:
    import boto3

    with S3Server() as srv:
        boto3.client("s3", **s3_options(srv.endpoint_url)).create_bucket(Bucket="b")
        yield srv


def _https(srv: S3Server, direct: bool) -> dict[str, Any]:
    """Options for ``srv`` with an https:// URL, generous budgets (a retry would show)."""
    return {**s3_options(srv.endpoint_url.replace("http://", "https://")), "direct_http": direct,
            "connect_attempts": 4, "error_attempts": 4}


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
def test_https_url_for_a_plain_http_endpoint_is_named_at_once(server: S3Server, direct: bool,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    state = {"x": torch.arange(6.0)}
    objckpt.save(state, "s3://b/ck", storage_options=s3_options(server.endpoint_url))
    opts = _https(server, direct)
    port = server.port
    server.reset_stats()
    caplog.set_level(logging.WARNING, logger="objckpt")
    for call in (lambda: objckpt.save(state, "s3://b/ck2", storage_options=opts),
                 lambda: objckpt.read("s3://b/ck", storage_options=opts)):
        with pytest.raises(PlainHttpEndpointError) as e:
            call()
        assert isinstance(e.value, StorageError) and isinstance(e.value, ConnectionError)
        text = str(e.value)
        assert f"at https://127.0.0.1:{port}" in text
        assert f"Set endpoint_url to 'http://127.0.0.1:{port}'" in text and "from storage option endpoint_url" in text
        assert "not TLS" in text and "not retried" in text
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]  # no second attempt
    assert not server.stats()["ops"]  # no request reached the server: the handshake was the end of it


def test_without_a_port_the_http_url_keeps_443() -> None:
    from objckpt.storage.s3.tls import plain_http_error

    e = plain_http_error("HEAD s3://b/k", "https://s3.example.com", "https://s3.example.com", "storage option "
                         "endpoint_url", "WRONG_VERSION_NUMBER")
    assert "Set endpoint_url to 'http://s3.example.com:443'" in str(e)  # the port that answered, without TLS
    e = plain_http_error("HEAD s3://b/k", "https://s3.us-east-1.amazonaws.com", None, "AWS", "WRONG_VERSION_NUMBER")
    assert "endpoint_url" not in str(e) and "a proxy" in str(e)  # AWS speaks TLS: something in between does not


def _summary(caplog: pytest.LogCaptureFixture, bucket: str, options: dict[str, Any]) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="objckpt.storage"):
        S3Config.resolve(bucket, options)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"s3://{bucket}: ")]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_start_up_line_names_tls_only_for_https(caplog: pytest.LogCaptureFixture, tmp_path: Any) -> None:
    import certifi

    keys = {"aws_access_key_id": "k", "aws_secret_access_key": "s", "region_name": "us-east-1"}
    plain = _summary(caplog, "b1", {**keys, "endpoint_url": "http://127.0.0.1:9"})
    assert "endpoint http://127.0.0.1:9" in plain and "TLS" not in plain and "CA " not in plain
    plain = _summary(caplog, "b2", {**keys, "endpoint_url": "http://127.0.0.1:9", "verify": False})
    assert "TLS" not in plain
    ca = str(tmp_path / "ca.pem")
    with open(certifi.where()) as src, open(ca, "w") as dst:
        dst.write(src.read())
    tls = _summary(caplog, "b3", {**keys, "endpoint_url": "https://127.0.0.1:9", "ca_bundle": ca})
    assert f", TLS CA {ca} (storage option ca_bundle)" in tls
    tls = _summary(caplog, "b4", {**keys, "endpoint_url": "https://127.0.0.1:9", "verify": False})
    assert ", TLS unverified" in tls


def test_in_a_new_process(server: S3Server) -> None:
    """As a training script meets it: the error's class and text on both transports, and the
    INFO lines (TLS named for the https:// endpoint only)."""
    code = textwrap.dedent(f"""
        import json, logging, sys, torch, objckpt
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
        plain = {s3_options(server.endpoint_url)!r}
        objckpt.save({{"x": torch.ones(3)}}, "s3://b/ok", storage_options=plain)
        out = []
        for direct in (True, False):
            opts = {{**plain, "endpoint_url": plain["endpoint_url"].replace("http://", "https://"),
                     "direct_http": direct}}
            try:
                objckpt.read("s3://b/ok", storage_options=opts)
                out.append({{"read": True}})
            except Exception as e:
                out.append({{"error": type(e).__name__, "text": str(e)}})
        print(json.dumps(out))
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for got in json.loads(r.stdout.strip().splitlines()[-1]):
        assert got.get("error") == "PlainHttpEndpointError", got
        assert f"Set endpoint_url to 'http://127.0.0.1:{server.port}'" in got["text"]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("s3://b: ")]
    assert len(lines) == 3, r.stderr
    assert "TLS" not in lines[0] and all(", TLS CA " in ln for ln in lines[1:]), lines
    assert "SSLError" not in r.stderr and "retrying" not in r.stderr
