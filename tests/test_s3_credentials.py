"""Refused credentials are named, with the fix, on save, load and read, on both transports (issue 34).

A save's first request is the manifest's HEAD, and S3 answers a HEAD's refusal
without a body: a 20-minute clock skew or keys Ceph RGW does not accept gave a bare
``HTTP 403``, and an expired session token (400) was reported as "sent to the wrong
region ... pass region_name".  Now a bare 400/403 to a HEAD is followed by a one-byte
GET of the key, whose refusal names the code, and a refusal of the credentials is a
:class:`CredentialsRefusedError` (a ``PermissionError``) at once, naming the code and
what to fix, never the region.  Against the in-memory server, which refuses as S3
does (bodiless to a HEAD), with its clock set off or its credentials refused, and
against moto with its IAM authentication on (it checks SigV4 signatures and key ids).
"""
from __future__ import annotations

import json
import urllib.request
from typing import Any, Callable, Iterator

import boto3
import pytest
import torch

import objckpt
from objckpt.errors import CredentialsRefusedError, StorageError
from objckpt.storage.s3.answers import says_wrong_region
from conftest import s3_options
from testkit.s3server import S3Server

#: code -> words of its hint that the message must hold
HINTS = {
    "RequestTimeTooSkewed": "sync the clock (NTP",
    "ExpiredToken": "has expired: refresh them",
    "InvalidToken": "AWS_SESSION_TOKEN",
    "SignatureDoesNotMatch": "check the secret access key",
    "InvalidAccessKeyId": "check the access key id",
}
OPS: dict[str, Callable[[str, dict[str, Any]], Any]] = {
    "save": lambda uri, o: objckpt.save({"x": torch.ones(3)}, uri + "-new", storage_options=o),
    "load": lambda uri, o: objckpt.load({"x": torch.empty(3)}, uri, storage_options=o),
    "read": lambda uri, o: objckpt.read(uri, storage_options=o),
}


def _check(e: CredentialsRefusedError, code: str, op: str) -> None:
    text = str(e)
    assert isinstance(e, PermissionError) and isinstance(e, StorageError) and e.code == code, (type(e), text)
    assert code in text and HINTS[code] in text, text
    assert "region" not in text.lower(), text  # never sent after the region
    assert ("HEAD s3://" if op == "save" else "GET s3://") in text and "manifest.json" in text, text
    if op == "save":  # the bodiless HEAD refusal, explained by a GET of the same key
        assert "one-byte GET of the same key" in text, text


@pytest.fixture
def server() -> Iterator[S3Server]:
    with S3Server() as s:
        boto3.client("s3", **s3_options(s.endpoint_url)).create_bucket(Bucket="cred")
        objckpt.save({"x": torch.ones(3)}, "s3://cred/ck", storage_options=s3_options(s.endpoint_url))
        s.reset_stats()
        yield s


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
@pytest.mark.parametrize("code", ["ExpiredToken", "InvalidToken", "SignatureDoesNotMatch", "InvalidAccessKeyId"])
def test_refused_credentials_are_named_with_the_fix(server: S3Server, code: str, direct: bool, op: str) -> None:
    server.refuse_credentials(code)
    with pytest.raises(CredentialsRefusedError) as ei:
        OPS[op]("s3://cred/ck", {**s3_options(server.endpoint_url), "direct_http": direct})
    _check(ei.value, code, op)
    ops = server.stats()["ops"]
    # not retried: one GET (the load's, or the one that explains the save's HEAD), at most one HEAD
    assert ops.get("GetObject", 0) == 1 and ops.get("HeadObject", 0) <= 1, ops


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
@pytest.mark.parametrize("offset", [1200, -1200])
def test_a_skewed_clock_is_named_with_the_skew(server: S3Server, offset: int, direct: bool, op: str) -> None:
    """The server's clock 20 minutes off: RequestTimeTooSkewed, with the skew its Date shows."""
    server.set_clock(offset)
    with pytest.raises(CredentialsRefusedError) as ei:
        OPS[op]("s3://cred/ck", {**s3_options(server.endpoint_url), "direct_http": direct})
    _check(ei.value, "RequestTimeTooSkewed", op)
    assert ei.value.skew_s is not None and abs(ei.value.skew_s - offset) < 60, ei.value.skew_s
    assert f"about 20 min {'ahead of' if offset > 0 else 'behind'} this machine's" in str(ei.value)
    server.set_clock(0)  # the clock put right, the same store goes on
    OPS[op]("s3://cred/ck", {**s3_options(server.endpoint_url), "direct_http": direct})


def test_a_credential_code_is_never_a_region_refusal() -> None:
    assert not says_wrong_region(400, "ExpiredToken", None, bare_head=True)
    assert not says_wrong_region(400, "InvalidToken", "us-east-1", bare_head=False)
    assert says_wrong_region(400, "", None, bare_head=True)  # a bare 400 to a HEAD may be one


# -- moto, with its IAM authentication on ------------------------------------------------------

def _moto_auth(endpoint: str, free_actions: str) -> None:
    """moto checks signatures and key ids once ``free_actions`` actions have gone unchecked."""
    req = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=free_actions.encode(), method="POST",
                                 headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(req).read()


@pytest.fixture
def moto_user(moto_s3: tuple[str, dict[str, Any]], moto_endpoint: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(bucket, storage options of an IAM user allowed s3:*), moto checking every request."""
    bucket, opts = moto_s3
    iam = boto3.client("iam", **opts)
    iam.create_user(UserName="saver")
    key = iam.create_access_key(UserName="saver")["AccessKey"]
    iam.put_user_policy(UserName="saver", PolicyName="s3", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    user = {**opts, "aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
    _moto_auth(moto_endpoint, "0")
    try:
        yield bucket, user
    finally:
        _moto_auth(moto_endpoint, "inf")


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
def test_moto_refuses_a_wrong_secret_and_an_unknown_key(moto_user: tuple[str, dict[str, Any]], direct: bool) -> None:
    bucket, user = moto_user
    uri = f"s3://{bucket}/ck"
    objckpt.save({"x": torch.ones(3)}, uri, storage_options={**user, "direct_http": direct})  # the user's keys work
    for code, opts in (("SignatureDoesNotMatch", {**user, "aws_secret_access_key": "not-the-secret"}),
                       ("InvalidAccessKeyId", {**user, "aws_access_key_id": "AKIANOSUCHKEY0000000"})):
        for op, run in OPS.items():
            with pytest.raises(CredentialsRefusedError) as ei:
                run(uri, {**opts, "direct_http": direct})
            _check(ei.value, code, op)
