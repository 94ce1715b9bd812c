"""The S3 environment is read per call: a changed endpoint or key gets a new client; and the
settings it holds (with the AWS config files and storage options) send every request of both
transports to the same place: round trips in new processes and per-option checks on moto."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import boto3
import pytest
import torch
from s3_tls import MotoServer, Seen, make_ca

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.errors import StorageError
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


def test_config_file_edit_and_objckpt_settings_between_calls_make_a_new_store(
    monkeypatch: pytest.MonkeyPatch, moto_endpoint: str, fast_endpoint: str, tmp_path: Path
) -> None:
    """What the S3 settings are read from besides the options is one list
    (``config.environment_state``): an ``endpoint_url`` edited in the AWS config file and
    an ``OBJCKPT_S3_DEADLINE_FLOOR`` set between two calls of one process both take effect."""
    name = f"cfgedit-{os.getpid()}"
    a, b = _bucket(moto_endpoint, name), _bucket(fast_endpoint, name)
    for k, v in _KEYS.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "OBJCKPT_S3_DEADLINE_FLOOR"):
        monkeypatch.delenv(k, raising=False)
    cfg = tmp_path / "config"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(cfg))
    state = {"w": torch.arange(6.0)}

    cfg.write_text(f"[default]\nendpoint_url = {moto_endpoint}\n")
    objckpt.save(state, f"s3://{name}/one")
    first, _ = open_store(f"s3://{name}/one")
    cfg.write_text(f"[default]\nendpoint_url = {fast_endpoint}\n")
    objckpt.save(state, f"s3://{name}/two")
    assert any(k.startswith("one/") for k in _keys(a, name)) and not any(k.startswith("one/") for k in _keys(b, name))
    assert any(k.startswith("two/") for k in _keys(b, name)) and not any(k.startswith("two/") for k in _keys(a, name))

    monkeypatch.setenv("OBJCKPT_S3_DEADLINE_FLOOR", "7")
    again, _ = open_store(f"s3://{name}/two")
    assert again is not first and again.policy.deadline_floor == 7.0
    torch.testing.assert_close(objckpt.read(f"s3://{name}/two")["w"], state["w"])


def test_credential_change_builds_a_client_with_the_new_keys(
    monkeypatch: pytest.MonkeyPatch, moto_endpoint: str
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)

    async def access_key(store: Any) -> str:
        transport = await store.transport()  # the own path here: its client signs with these keys
        return str(transport.client.creds.get().access_key)

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "first")
    s1, _ = open_store("s3://bkt/x")
    assert open_store("s3://bkt/y")[0] is s1  # unchanged environment: reused
    assert _runtime.run(access_key(s1)) == "first"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "second")
    s2, _ = open_store("s3://bkt/x")
    assert s2 is not s1
    assert _runtime.run(access_key(s2)) == "second"


# -- where requests go: round trips through both transports (storage/s3/config.py) --------------

_CHILD = r"""
import json, logging, sys, torch, objckpt
from objckpt.runtime import loop as _runtime
from objckpt.ops.gc import collect_garbage
from objckpt.storage import open_store
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
uri, opts = sys.argv[1], json.loads(sys.argv[2])
state = {"w": torch.arange(3000.0)}
objckpt.save(state, uri + "/a", storage_options=opts, part_size=5 << 20)
same = torch.equal(objckpt.read(uri + "/a", storage_options=opts)["w"], state["w"])
objckpt.save(state, uri + "/b", storage_options=opts)
objckpt.delete(uri + "/b", storage_options=opts)  # listing + DeleteObjects
store, prefix = open_store(uri, opts)
_runtime.run(collect_garbage(store, prefix, grace=0))
print(json.dumps({"same": same, "transport": store.config.transport.value}))
"""


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k.upper() not in (
        "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "OBJCKPT_S3_DIRECT_HTTP")}
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    env.update(extra)
    return env


def _run_child(uri: str, env: dict[str, str], opts: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    p = subprocess.run([sys.executable, "-c", _CHILD, uri, json.dumps(opts or {})], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def _both_transports(seen: list[Seen]) -> tuple[list[Seen], list[Seen]]:
    """The requests of the own path and of botocore; both did a whole round trip, deletes included."""
    own, boto = [s for s in seen if not s.botocore], [s for s in seen if s.botocore]
    assert own and boto, [(s.method, s.path, s.headers.get("user-agent")) for s in seen]
    for one in (own, boto):
        assert any(s.method == "POST" and "delete" in s.query for s in one)  # the delete reached it
    return own, boto


@pytest.fixture(scope="module")
def private_ca(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_ca(tmp_path_factory.mktemp("ca"))


def test_new_process_takes_region_endpoint_and_ca_from_the_config_file(private_ca: Any, tmp_path: Path) -> None:
    """`aws configure` style: region, endpoint_url and ca_bundle only in the profile of
    ~/.aws/config, keys only in the credentials file.  Saves, reads, deletes and gc in a
    new process reach the private-CA HTTPS endpoint, every request signed for the
    profile's region, on both transports (the own path signed us-east-1, sent to AWS
    and trusted only the system's CAs before)."""
    with MotoServer(private_ca) as srv:
        import boto3

        boto3.client("s3", endpoint_url=srv.url, region_name="eu-west-1", verify=str(private_ca.ca),
                     aws_access_key_id="k", aws_secret_access_key="s").create_bucket(
            Bucket="cfg-file", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
        srv.seen.clear()
        (tmp_path / "config").write_text(f"[profile lab]\nregion = eu-west-1\nendpoint_url = {srv.url}\n"
                                         f"ca_bundle = {private_ca.ca}\n")
        (tmp_path / "credentials").write_text("[lab]\naws_access_key_id = k\naws_secret_access_key = s\n")
        out, err = _run_child("s3://cfg-file/run", _child_env(
            AWS_CONFIG_FILE=str(tmp_path / "config"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"),
            AWS_PROFILE="lab"))
        assert out == {"same": True, "transport": "direct"}
        # the same through botocore (on the direct transport no request goes through it)
        out2, _ = _run_child("s3://cfg-file/boto", _child_env(
            AWS_CONFIG_FILE=str(tmp_path / "config"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "credentials"),
            AWS_PROFILE="lab"), {"direct_http": False})
    assert out2 == {"same": True, "transport": "botocore"}
    own, boto = _both_transports(srv.seen)
    assert {s.scheme for s in srv.seen} == {"https"}
    assert {s.signed_region for s in srv.seen} == {"eu-west-1"}
    assert f"endpoint {srv.url} (profile 'lab' of {tmp_path / 'config'})" in err


def test_new_process_with_ssl_cert_file_and_no_proxy(private_ca: Any, tmp_path: Path) -> None:
    """Only SSL_CERT_FILE names the private CA, and HTTPS_PROXY is set with NO_PROXY covering
    the endpoint: every operation works on both transports (deletes and gc failed: botocore
    trusted certifi; the proxy variable silently turned the own path off), and the log says
    which transport serves the store and why."""
    with MotoServer(private_ca) as srv:
        import boto3

        boto3.client("s3", endpoint_url=srv.url, region_name="us-east-1", verify=str(private_ca.ca),
                     aws_access_key_id="k", aws_secret_access_key="s").create_bucket(Bucket="certfile")
        srv.seen.clear()
        env = _child_env(
            SSL_CERT_FILE=str(private_ca.ca), AWS_ENDPOINT_URL=srv.url, HTTPS_PROXY="http://127.0.0.1:9",
            NO_PROXY="localhost,127.0.0.1", AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s",
            AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"))
        out, err = _run_child("s3://certfile/run", env)
        out2, _ = _run_child("s3://certfile/boto", env, {"direct_http": False})
    assert out == {"same": True, "transport": "direct"} and out2 == {"same": True, "transport": "botocore"}
    _both_transports(srv.seen)
    assert {s.scheme for s in srv.seen} == {"https"}
    assert "s3://certfile: direct transport (objckpt's own HTTP path (HTTPS_PROXY bypassed by NO_PROXY" in err
    assert "SSL_CERT_FILE (botocore alone would use certifi)" in err


_made = iter(range(1 << 30))


@pytest.fixture(scope="module")
def recorder() -> Iterator[MotoServer]:
    with MotoServer() as srv:
        yield srv


@pytest.fixture
def recording(recorder: MotoServer) -> tuple[MotoServer, str]:
    """The recording moto server, its record emptied, and a fresh bucket on it."""
    bucket = f"opts-{os.getpid()}-{next(_made)}"
    boto3.client("s3", endpoint_url=recorder.url, region_name="us-east-1", aws_access_key_id="k",
                 aws_secret_access_key="s").create_bucket(Bucket=bucket)
    recorder.seen.clear()
    return recorder, bucket


def _opts(url: str, **extra: Any) -> dict[str, Any]:
    return {"endpoint_url": url, "aws_access_key_id": "k", "aws_secret_access_key": "s", "region_name": "us-east-1",
            **extra}


@pytest.mark.parametrize("direct", [True, False], ids=["own-path", "botocore"])
def test_request_payer_and_sse_kms_reach_s3_on_either_transport(recording: tuple[MotoServer, str],
                                                                 direct: bool) -> None:
    srv, b = recording
    opts = _opts(srv.url, direct_http=direct, request_payer="requester", sse_kms_key_id="alias/ckpt")
    state = {"w": torch.arange(300_000.0), "v": torch.ones(3)}
    objckpt.save(state, f"s3://{b}/ck", storage_options=opts, part_size=5 << 20, blob_size=1 << 20)
    torch.testing.assert_close(objckpt.read(f"s3://{b}/ck", storage_options=opts)["w"], state["w"])
    objckpt.delete(f"s3://{b}/ck", storage_options=opts)
    seen = srv.seen
    assert seen and all(s.headers.get("x-amz-request-payer") == "requester" for s in seen), seen
    creates = [s for s in seen if (s.method == "PUT" and "partNumber" not in s.query)
               or (s.method == "POST" and s.query.startswith("uploads"))]
    others = [s for s in seen if s not in creates]
    assert creates and all(s.headers.get("x-amz-server-side-encryption") == "aws:kms" and
                           s.headers.get("x-amz-server-side-encryption-aws-kms-key-id") == "alias/ckpt" for s in creates)
    assert not any("x-amz-server-side-encryption" in s.headers for s in others)
    assert all("x-amz-request-payer" in s.headers["authorization"] for s in seen)  # signed, as S3 requires
    assert {s.botocore for s in seen} == {not direct}  # one transport serves the store, listings and deletes too
    objckpt.save(state, f"s3://{b}/kept", storage_options=opts)
    c = boto3.client("s3", **{k: v for k, v in _opts(srv.url).items()})
    key = next(o["Key"] for o in c.list_objects_v2(Bucket=b, Prefix="kept/")["Contents"])
    assert c.head_object(Bucket=b, Key=key)["SSEKMSKeyId"] == "alias/ckpt"


@pytest.mark.parametrize("direct", [True, False], ids=["own-path", "botocore"])
def test_unsigned_reads_send_no_credentials(recording: tuple[MotoServer, str], direct: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    srv, b = recording
    state = {"w": torch.arange(10.0)}
    objckpt.save(state, f"s3://{b}/pub", storage_options=_opts(srv.url))
    public = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": "*", "Action": [
        "s3:GetObject", "s3:ListBucket"], "Resource": [f"arn:aws:s3:::{b}", f"arn:aws:s3:::{b}/*"]}]}
    boto3.client("s3", **_opts(srv.url)).put_bucket_policy(Bucket=b, Policy=json.dumps(public))
    srv.seen.clear()
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    opts = {"endpoint_url": srv.url, "unsigned": True, "direct_http": direct}
    torch.testing.assert_close(objckpt.read(f"s3://{b}/pub", storage_options=opts)["w"], state["w"])
    assert srv.seen and not any("authorization" in s.headers for s in srv.seen)
    assert any(not s.botocore for s in srv.seen) is direct


def test_ca_bundle_and_verify_options(private_ca: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private CA as storage option ca_bundle, or verify=False, on both transports; without
    either, a clear error naming the CA bundle botocore would use."""
    import boto3

    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    state = {"w": torch.arange(10.0)}
    with MotoServer(private_ca) as srv:
        boto3.client("s3", **_opts(srv.url), verify=str(private_ca.ca)).create_bucket(Bucket="tls")
        for i, extra in enumerate([{"ca_bundle": str(private_ca.ca)}, {"verify": False},
                                   {"ca_bundle": str(private_ca.ca), "direct_http": False}]):
            opts = _opts(srv.url, **extra)
            objckpt.save(state, f"s3://tls/ck{i}", storage_options=opts)
            torch.testing.assert_close(objckpt.read(f"s3://tls/ck{i}", storage_options=opts)["w"], state["w"])
            objckpt.delete(f"s3://tls/ck{i}", storage_options=opts)
        with pytest.raises(StorageError, match=r"CA bundle .*botocore's default \(certifi\)|certifi"):
            objckpt.read("s3://tls/ck0", storage_options=_opts(srv.url, connect_attempts=1, error_attempts=1))


def test_unreachable_proxy_is_named_with_its_variable(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HTTP_PROXY", dead)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    caplog.set_level(logging.INFO, logger="objckpt.storage")
    with pytest.raises(StorageError) as info:
        objckpt.read("s3://anything/ck", storage_options=_opts(moto_endpoint))
    assert f"via proxy {dead} (environment variable HTTP_PROXY)" in str(info.value)
    assert any("botocore transport (requests go through proxy" in r.getMessage() for r in caplog.records)
