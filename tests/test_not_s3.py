"""An endpoint that answers HTTP but is not S3 (issue 22): its own error, at once.

Pointing ``endpoint_url`` at a web page (a storage console's port) made a save
say "a checkpoint already exists" (the page's 200 to the manifest's HEAD) and a
load "CorruptCheckpointError: not valid JSON" (the page as a manifest).  Both
must raise :class:`NotS3EndpointError` naming the endpoint, on either transport,
without retrying and without writing anything; and answers of real S3 servers
that look odd (moto's ``text/html`` on a bodiless 404) must not be taken for one.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import objckpt
from objckpt.errors import NotS3EndpointError
from objckpt.storage.s3.answers import not_s3_reason
from web_page_server import WebPageServer


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
@pytest.mark.parametrize("status", [200, 404])
def test_a_web_page_endpoint_is_not_s3_for_save_and_load(status: int, direct: bool) -> None:
    with WebPageServer(status) as srv:
        opts: dict[str, Any] = {"endpoint_url": srv.endpoint_url, "aws_access_key_id": "k",
                                "aws_secret_access_key": "s", "region_name": "us-east-1", "direct_http": direct}
        with pytest.raises(NotS3EndpointError, match="is not an S3 endpoint") as saved:
            objckpt.save({"x": torch.ones(4)}, "s3://bkt/run/ck", storage_options=opts)
        assert saved.value.endpoint.startswith(srv.endpoint_url) and srv.endpoint_url in str(saved.value)
        assert "HTML page" in str(saved.value)
        for load in (lambda: objckpt.read("s3://bkt/run/ck", storage_options=opts),
                     lambda: objckpt.load({"x": torch.empty(4)}, "s3://bkt/run/ck", storage_options=opts)):
            with pytest.raises(NotS3EndpointError, match="is not an S3 endpoint") as loaded:
                load()
            assert srv.endpoint_url in str(loaded.value)
        assert isinstance(saved.value, ConnectionError) and isinstance(saved.value, objckpt.ObjckptError)
        assert srv.writes() == []  # nothing was written (or deleted)
        assert len(srv.requests) <= 8, srv.requests  # one refusal per call, not a retry loop


@pytest.mark.parametrize("status, headers, body, object_answer, is_s3", [
    # moto: a bodiless 404 (and a PUT's 200) labelled text/html, but with its request id
    (404, {"Content-Type": "text/html; charset=utf-8", "x-amzn-requestid": "X"}, "", False, True),
    (200, {"Content-Type": "text/html; charset=utf-8", "x-amzn-requestid": "X", "ETag": '"e"'}, None, False, True),
    # S3's error XML, and S3's object answers
    (403, {"Content-Type": "application/xml"}, "<Error><Code>AccessDenied</Code></Error>", False, True),
    (200, {"ETag": '"e"', "Content-Length": "3"}, None, True, True),
    # a gateway's 502/503 page in front of S3: a passing server error, left to the retries
    (503, {"Content-Type": "text/html"}, "<html>Service Unavailable</html>", False, True),
    # a bodiless refusal without any sign either way: given the benefit of the doubt
    (404, {}, "", False, True),
    # not S3: a page, a plain-text refusal, an object without ETag
    (200, {"Content-Type": "text/html"}, "<html><title>Console</title></html>", False, False),
    (404, {"Content-Type": "text/plain"}, "404 page not found", False, False),
    (200, {"Content-Type": "application/octet-stream"}, None, True, False),
])
def test_what_counts_as_an_s3_answer(status: int, headers: dict[str, str], body: Any, object_answer: bool,
                                     is_s3: bool) -> None:
    assert (not_s3_reason(status, headers, body, object_answer=object_answer) is None) is is_s3
