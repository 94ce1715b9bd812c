"""Logging: one INFO line per save and load with phase timings; retries at WARNING; no credential in any record."""
from __future__ import annotations

import io
import logging
import urllib.request
from typing import Any

import boto3
import pytest
import torch

import objckpt
from objckpt.logs import REDACTED, get_logger, redact

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYSECRETKEY42"
TOKEN = "FwoGZXIvYXdzEXAMPLESESSIONTOKENxyz0123456789abcdef"
KEY_ID = "AKIAIOSFODNN7EXAMPLE"


def _texts(rec: logging.LogRecord) -> list[str]:
    """Everything of a record a handler could print."""
    out = [rec.getMessage(), str(rec.msg), repr(rec.args), str(rec.exc_text or ""), str(rec.stack_info or "")]
    out += [repr(v) for v in vars(rec).values()]
    return out


def test_save_and_load_log_phase_timings(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    uri = str(tmp_path / "ck")
    state = {"w": torch.randn(64, 8), "step": 1}
    with caplog.at_level(logging.INFO, logger="objckpt"):
        res = objckpt.save(state, uri)
        ld = objckpt.load({"w": torch.empty(64, 8), "step": 0}, uri)
    assert list(res.timings.phases) == ["describe", "plan", "stage", "upload", "commit"]
    assert list(ld.timings.phases) == ["manifest", "plan", "fetch", "fill"]
    assert all(v >= 0 for v in [*res.timings.phases.values(), *ld.timings.phases.values()])
    assert sum(res.timings.phases.values()) <= res.seconds + 1e-3
    saves = [r for r in caplog.records if r.name == "objckpt.save" and r.levelno == logging.INFO]
    loads = [r for r in caplog.records if r.name == "objckpt.load" and r.levelno == logging.INFO]
    assert len(saves) == 1 and len(loads) == 1
    s, ln = saves[0].getMessage(), loads[0].getMessage()
    assert uri in s and "rank 0/1" in s and f"{res.bytes} bytes" in s
    for phase in ("describe", "plan", "stage", "upload", "commit"):
        assert f"{phase} " in s and " s" in s
    assert uri in ln and f"{ld.bytes} bytes" in ln
    for phase in ("manifest", "plan", "fetch", "fill"):
        assert f"{phase} " in ln
    # nothing is printed without the application's say-so: the package logger has only its guard
    assert all(isinstance(h, logging.NullHandler) for h in logging.getLogger("objckpt").handlers)


def test_retry_warns_and_no_secret_is_logged(fast_endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    bucket = "logging-secrets"
    boto3.client("s3", endpoint_url=fast_endpoint, aws_access_key_id="x", aws_secret_access_key="y",
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    opts = {"endpoint_url": fast_endpoint, "aws_access_key_id": KEY_ID, "aws_secret_access_key": SECRET,
            "aws_session_token": TOKEN, "region_name": "us-east-1", "base_backoff": 0.01}
    fail = urllib.request.Request(f"{fast_endpoint}/_objckpt/fail?op=PutObject&count=2&status=503", method="POST")
    urllib.request.urlopen(fail).read()
    uri = f"s3://{bucket}/run/ck"
    with caplog.at_level(logging.DEBUG, logger="objckpt"):
        objckpt.save({"w": torch.ones(10)}, uri, storage_options=opts)
        # a message that does carry credentials (as an error text might) is redacted too
        get_logger("objckpt.storage").warning("request failed: key=%s secret_access_key=%s token %s", KEY_ID,
                                              SECRET, TOKEN)
        logging.getLogger("objckpt.other").error("made without get_logger: %s", SECRET)
    assert torch.equal(objckpt.read(uri, storage_options=opts)["w"], torch.ones(10))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "objckpt.storage"]
    retries = [r for r in warnings if "retrying" in r.getMessage()]
    assert len(retries) >= 2 and "HTTP 503" in retries[0].getMessage() and bucket in retries[0].getMessage()
    assert any(REDACTED in r.getMessage() for r in caplog.records if r.name == "objckpt.other")
    for rec in caplog.records:
        for text in _texts(rec):
            assert SECRET not in text and TOKEN not in text and KEY_ID not in text, (rec.name, text)


def test_redaction_patterns_and_direct_handlers() -> None:
    signed = ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAXXXXXXXXXXXXXXXX"
              "%2F20260101%2Fus-east-1&X-Amz-Signature=deadbeefcafe&X-Amz-Security-Token=IQoJb3JpZ2luX2Vj")
    out = redact(signed + " Authorization: AWS4-HMAC-SHA256 Credential=abc, Signature=0123abcd")
    for bad in ("AKIAXXXXXXXXXXXXXXXX", "deadbeefcafe", "IQoJb3JpZ2luX2Vj", "0123abcd"):
        assert bad not in out
    assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in out  # the rest stays readable
    assert redact("saved 3 tensors in 0.2 s") == "saved 3 tensors in 0.2 s"
    # a handler attached straight to a child logger sees redacted records too
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = get_logger("objckpt.load")
    log.addHandler(handler)
    try:
        log.warning("aws_secret_access_key=%s", "zzSuperSecretValue99")
    finally:
        log.removeHandler(handler)
    assert "zzSuperSecretValue99" not in stream.getvalue() and REDACTED in stream.getvalue()
