"""A CA bundle is loaded once per file version in a process (storage/s3/tls.py): the check
when a store opens and the own path's connections share the context, later stores too;
a rewritten bundle is loaded again, a broken one is still an error naming its source."""
from __future__ import annotations

import os
import shutil
import ssl
from pathlib import Path
from typing import Any

import certifi
import pytest

from objckpt.storage.s3 import direct, tls
from objckpt.storage.s3.config import S3Config, S3ConfigError


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []
    real = ssl.create_default_context

    def counting(*a: Any, **kw: Any) -> ssl.SSLContext:
        seen.append(kw.get("cafile") or kw.get("capath"))
        return real(*a, **kw)

    monkeypatch.setattr(tls.ssl, "create_default_context", counting)
    return seen


def _client(cfg: S3Config) -> direct.DirectClient:
    return direct.DirectClient(cfg.bucket, cfg.target, cfg.credentials(), connect_timeout=1, read_timeout=1)  # type: ignore[arg-type]


def test_a_bundle_is_loaded_once_per_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             builds: list[Any]) -> None:
    for k in list(os.environ):
        if k.startswith("AWS_") or k in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    ca = tmp_path / "ca.pem"
    shutil.copy(certifi.where(), ca)
    opts = {"endpoint_url": "https://s3.example.invalid:9443", "region_name": "us-east-1", "ca_bundle": str(ca),
            "aws_access_key_id": "a", "aws_secret_access_key": "b"}
    first = S3Config.resolve("one", opts)
    c1 = _client(first)
    c2 = _client(S3Config.resolve("two", opts))  # another store, same bundle
    assert builds == [str(ca)]  # checked at the opening, that context serves both stores' connections
    assert c1._ssl is c2._ssl and c1._ssl.verify_mode == ssl.CERT_REQUIRED

    with open(ca, "a") as f:  # a new version of the bundle
        f.write("\n")
    _client(S3Config.resolve("three", opts))
    assert builds == [str(ca), str(ca)]

    ca.write_text("not a certificate\n")
    with pytest.raises(S3ConfigError, match="cannot be used as a CA bundle") as info:
        S3Config.resolve("four", opts)
    assert info.value.source == "storage option ca_bundle"

    off = _client(S3Config.resolve("five", {**opts, "verify": False}))
    assert off._ssl is not None and off._ssl.verify_mode == ssl.CERT_NONE and not off._ssl.check_hostname
