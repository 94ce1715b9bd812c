"""botocore's flexible-checksum settings, honoured on both transports
(storage/s3/request_settings.py).

``request_checksum_calculation = when_required`` (``AWS_REQUEST_CHECKSUM_CALCULATION``)
sends no ``x-amz-checksum-crc32c`` / ``x-amz-checksum-algorithm`` unless the storage
option ``checksums`` is given; ``response_checksum_validation = when_required``
(``AWS_RESPONSE_CHECKSUM_VALIDATION``) drops ``x-amz-checksum-mode`` from the HEAD
that asks for a stored checksum.  What the in-memory S3 server received is what is
checked (it keeps every request's headers, and can refuse checksum headers as some
S3-compatible stores do); values are read as a botocore client reads them (parity),
and a bad one is refused as botocore refuses it.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterator

import boto3
import pytest
import torch

import objckpt
from conftest import assert_same
from objckpt.runtime import loop as _runtime
from objckpt.storage.s3 import S3Store
from objckpt.storage.s3.config import S3Config, S3ConfigError
from testkit.s3server import S3Server

TRANSPORTS = pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
_REQ, _RESP = "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION"


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No AWS settings in the environment; an empty AWS config file to write into."""
    for k in list(os.environ):
        if k.startswith(("AWS_", "OBJCKPT_S3")):
            monkeypatch.delenv(k)
    (tmp_path / "config").write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return tmp_path / "config"


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with S3Server(min_part_size=1 << 20) as s:
        boto3.client("s3", endpoint_url=s.endpoint_url, aws_access_key_id="k", aws_secret_access_key="s",
                     region_name="us-east-1").create_bucket(Bucket="bkt")
        yield s


def _opts(srv: S3Server, direct: bool, **kw: Any) -> dict[str, Any]:
    return {"endpoint_url": srv.endpoint_url, "aws_access_key_id": "k", "aws_secret_access_key": "s",
            "region_name": "us-east-1", "direct_http": direct, "max_backoff": 0.01, **kw}


def _writes(srv: S3Server, store: S3Store) -> dict[str, set[str]]:
    """A PutObject, and a two-part upload whose CompleteMultipartUpload answer is lost (so
    the store asks the object's HEAD, with its stored checksum, whether it completed);
    the ``x-amz-checksum-*`` headers the server received, by operation."""
    srv.keep_headers(True)
    srv.lose_reply("CompleteMultipartUpload", 1)
    part = bytes(range(256)) * 4096  # 1 MiB

    async def go() -> None:
        await store.put("one", b"x" * 1000)
        w = store.open_writer("two", 2 * len(part), 2)
        await w.write_part(0, 0, memoryview(part))
        await w.write_part(1, len(part), memoryview(part))
        await w.complete()
        await store.close()

    try:
        _runtime.run(go())
        seen = srv.headers_seen()
    finally:
        srv.keep_headers(False)
    assert srv.state.lost_replies == []  # the answer was lost: the HEAD decided
    out: dict[str, set[str]] = {}
    for op, headers in seen:
        out.setdefault(op, set()).update(k for k in headers if k.startswith("x-amz-checksum-"))
    assert {"PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "HeadObject"} <= set(out)
    return out


CASES = [  # (id, environment, config file, storage options, part checksums sent, stored checksum asked for)
    ("defaults", {}, "", {}, True, True),
    ("both when_required in the environment", {_REQ: "WHEN_REQUIRED", _RESP: "when_required"}, "", {}, False, False),
    ("request when_required in the config file", {}, "[default]\nrequest_checksum_calculation = when_required\n", {},
     False, True),
    ("response when_required in the config file", {}, "[default]\nresponse_checksum_validation = when_required\n",
     {}, True, False),
    ("the environment wins over the file", {_REQ: "when_supported"},
     "[default]\nrequest_checksum_calculation = when_required\n", {}, True, True),
    ("an explicit checksums option wins", {_REQ: "when_required"}, "", {"checksums": True}, True, True),
    ("checksums=False alone", {}, "", {"checksums": False}, False, True),
]


@TRANSPORTS
@pytest.mark.parametrize("env,config,options,parts,mode", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_what_the_server_receives(aws: Path, server: S3Server, monkeypatch: pytest.MonkeyPatch, direct: bool,
                                  env: dict[str, str], config: str, options: dict[str, Any], parts: bool,
                                  mode: bool) -> None:
    """Each source turns the headers off (or keeps them) on both transports; the upload
    whose answer was lost is recognised either way."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    aws.write_text(config)
    store = S3Store("bkt", **_opts(server, direct, **options))
    got = _writes(server, store)
    for op in ("PutObject", "UploadPart"):
        assert ("x-amz-checksum-crc32c" in got[op]) is parts, (op, got)
    assert ("x-amz-checksum-algorithm" in got["CreateMultipartUpload"]) is parts, got
    assert ("x-amz-checksum-mode" in got["HeadObject"]) is mode, got
    assert store.config.checksums is parts


@TRANSPORTS
def test_a_store_that_refuses_checksum_headers_takes_a_save_with_when_required(
        aws: Path, server: S3Server, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    """An S3-compatible store that refuses flexible-checksum headers: a save fails as
    it is; with AWS_REQUEST_CHECKSUM_CALCULATION=when_required it goes through and
    loads bit-exact (objckpt's crc32c per chunk checks the read)."""
    g = torch.Generator().manual_seed(5)
    sd = {"w": torch.randn(3 << 18, generator=g), "b": torch.randn(1000, generator=g), "step": 1}
    sizes = {"blob_size": 2 << 20, "part_size": 1 << 20}
    server.refuse_checksum_headers(True)
    try:
        with pytest.raises(objckpt.StorageError, match="x-amz-checksum-crc32c"):
            objckpt.save(sd, f"s3://bkt/refused-{direct}/ck", storage_options=_opts(server, direct),
                         **sizes)  # type: ignore[arg-type]
        monkeypatch.setenv(_REQ, "when_required")
        uri = f"s3://bkt/accepted-{direct}/ck"
        objckpt.save(sd, uri, storage_options=_opts(server, direct), **sizes)  # type: ignore[arg-type]
        assert_same(sd, objckpt.read(uri, storage_options=_opts(server, direct)))
    finally:
        server.refuse_checksum_headers(False)


def test_the_store_says_once_what_turned_the_part_check_off(aws: Path, server: S3Server,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """One INFO line per store names the setting and its source; an explicit option that
    wins over it is said too."""
    caplog.set_level(logging.INFO, logger="objckpt.storage")
    monkeypatch.setenv(_REQ, "when_required")
    aws.write_text("[default]\nresponse_checksum_validation = when_required\n")
    S3Config.resolve("bkt", _opts(server, True))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "s3://bkt" in r.getMessage()]
    assert len(lines) == 1
    assert ("part checksums off (request_checksum_calculation=when_required, environment variable "
            f"{_REQ})") in lines[0]
    assert f"response_checksum_validation=when_required, response_checksum_validation in profile 'default' of {aws}" \
        in lines[0]
    caplog.clear()
    S3Config.resolve("bkt", _opts(server, True, checksums="on"))
    line = next(r.getMessage() for r in caplog.records if "s3://bkt" in r.getMessage())
    assert (f"part checksums on: storage option checksums wins over request_checksum_calculation=when_required "
            f"(environment variable {_REQ})") in line


@pytest.mark.parametrize("env,config,setting,source", [
    ({_REQ: "sometimes"}, "", "request_checksum_calculation", f"environment variable {_REQ}"),
    ({}, "[default]\nresponse_checksum_validation = never\n", "response_checksum_validation",
     "response_checksum_validation in profile 'default' of "),
    ({_RESP: ""}, "", "response_checksum_validation", f"environment variable {_RESP}"),
])
def test_a_bad_value_is_refused_as_botocore_refuses_it(aws: Path, monkeypatch: pytest.MonkeyPatch,
                                                       env: dict[str, str], config: str, setting: str,
                                                       source: str) -> None:
    from botocore.exceptions import InvalidChecksumConfigError

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    aws.write_text(config)
    with pytest.raises(S3ConfigError) as got:
        S3Config.resolve("bkt", {"endpoint_url": "http://127.0.0.1:9", "aws_access_key_id": "k",
                                 "aws_secret_access_key": "s", "region_name": "us-east-1"})
    assert got.value.setting == setting and got.value.source.startswith(source), got.value
    assert "when_supported" in str(got.value)
    with pytest.raises(InvalidChecksumConfigError):
        boto3.session.Session().client("s3", region_name="us-east-1", aws_access_key_id="k",
                                       aws_secret_access_key="s")


PARITY = [
    ({}, ""),
    ({_REQ: "when_required"}, ""),
    ({_REQ: "When_Required", _RESP: "WHEN_REQUIRED"}, ""),
    ({_RESP: "when_supported"}, "[default]\nresponse_checksum_validation = when_required\n"),
    ({}, "[default]\nrequest_checksum_calculation = WHEN_REQUIRED\nresponse_checksum_validation = when_supported\n"),
    ({"AWS_PROFILE": "p"}, "[default]\nrequest_checksum_calculation = when_required\n[profile p]\n"
                           "response_checksum_validation = when_required\n"),
]


@pytest.mark.parametrize("env,config", PARITY)
def test_the_values_are_botocores(aws: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                  config: str) -> None:
    """objckpt's resolved values are what a botocore client built from the same inputs
    holds in ``meta.config`` (nothing is sent)."""
    import botocore.session

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    aws.write_text(config)
    cfg = S3Config.resolve("bkt", {"endpoint_url": "http://127.0.0.1:9", "aws_access_key_id": "k",
                                   "aws_secret_access_key": "s", "region_name": "us-east-1"})
    client = botocore.session.Session().create_client("s3", region_name="us-east-1", aws_access_key_id="k",
                                                      aws_secret_access_key="s")
    rs = cfg.request_settings
    assert rs.request_checksums.value == client.meta.config.request_checksum_calculation
    assert rs.response_checksums.value == client.meta.config.response_checksum_validation
    assert cfg.checksums is (client.meta.config.request_checksum_calculation == "when_supported")
