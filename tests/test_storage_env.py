"""The S3 environment is read per call: a changed endpoint or key gets a new client."""
from __future__ import annotations

import os
from typing import Any

import boto3
import pytest
import torch

import objckpt
from objckpt import _runtime
from objckpt.storage import open_store

_KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


def _bucket(endpoint: str, name: str) -> Any:
    c = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing")
    try:
        c.create_bucket(Bucket=name)
    except c.exceptions.BucketAlreadyOwnedByYou:
        pass
    return c


def _keys(client: Any, bucket: str) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]


def test_endpoint_change_reaches_the_new_server(
    monkeypatch: pytest.MonkeyPatch, moto_endpoint: str, fast_endpoint: str
) -> None:
    name = f"envswitch-{os.getpid()}"
    a, b = _bucket(moto_endpoint, name), _bucket(fast_endpoint, name)
    for k, v in _KEYS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    state = {"w": torch.arange(10.0)}

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    objckpt.save(state, f"s3://{name}/one")
    monkeypatch.setenv("AWS_ENDPOINT_URL", fast_endpoint)
    objckpt.save(state, f"s3://{name}/two")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    objckpt.save(state, f"s3://{name}/three")

    on_a, on_b = _keys(a, name), _keys(b, name)
    assert any(k.startswith("one/") for k in on_a) and any(k.startswith("three/") for k in on_a)
    assert not any(k.startswith("two/") for k in on_a)
    assert any(k.startswith("two/") for k in on_b)
    assert not any(k.startswith(("one/", "three/")) for k in on_b)
    torch.testing.assert_close(objckpt.read(f"s3://{name}/three")["w"], state["w"])


def test_credential_change_builds_a_client_with_the_new_keys(
    monkeypatch: pytest.MonkeyPatch, moto_endpoint: str
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)

    async def access_key(store: Any) -> str:
        client = await store.client()
        creds = client._get_credentials()
        frozen = await creds.get_frozen_credentials()
        return str(frozen.access_key)

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "first")
    s1, _ = open_store("s3://bkt/x")
    assert open_store("s3://bkt/y")[0] is s1  # unchanged environment: reused
    assert _runtime.run(access_key(s1)) == "first"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "second")
    s2, _ = open_store("s3://bkt/x")
    assert s2 is not s1
    assert _runtime.run(access_key(s2)) == "second"
