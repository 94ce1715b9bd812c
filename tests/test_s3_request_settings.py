"""AWS settings besides where requests go, and what a store's errors name
(storage/s3/request_settings.py, config.py, direct.py).

* the profile: botocore reads ``AWS_DEFAULT_PROFILE`` before ``AWS_PROFILE``; errors
  name the variable that chose it;
* ``sdk_ua_app_id`` / ``AWS_SDK_UA_APP_ID``: ``app/<id>`` in the own path's User-Agent,
  as a botocore client appends it (captured from a client, nothing sent);
* ``tcp_keepalive`` / ``BOTOCORE_TCP_KEEPALIVE``: ``SO_KEEPALIVE`` on both transports'
  sockets, as botocore's socket options say;
* ``defaults_mode``: its endpoint effect follows botocore's;
* ``OBJCKPT_SPLICE_BODIES``: read when the store opens; the store cache follows it;
* a host that does not resolve, with virtual-host addressing, is named as the
  bucket's host, not the endpoint's.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Iterator

import boto3
import pytest

import objckpt
from objckpt.runtime import loop as _runtime
from objckpt.storage import open_store
from objckpt.storage.s3 import S3Store
from objckpt.storage.s3.config import NoCredentialsError, S3Config, S3ConfigError
from testkit.s3server import S3Server
from wire_spies import spy_splice

TRANSPORTS = pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No AWS settings in the environment; empty AWS config and credentials files."""
    for k in list(os.environ):
        if k.startswith(("AWS_", "OBJCKPT_S3", "BOTOCORE_")) or k == "OBJCKPT_SPLICE_BODIES":
            monkeypatch.delenv(k)
    for name in ("config", "credentials"):
        (tmp_path / name).write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return tmp_path


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with S3Server() as s:
        boto3.client("s3", endpoint_url=s.endpoint_url, aws_access_key_id="k", aws_secret_access_key="s",
                     region_name="us-east-1").create_bucket(Bucket="bkt")
        yield s


def _opts(srv: S3Server, direct: bool = True, **kw: Any) -> dict[str, Any]:
    return {"endpoint_url": srv.endpoint_url, "aws_access_key_id": "k", "aws_secret_access_key": "s",
            "region_name": "us-east-1", "direct_http": direct, "max_backoff": 0.01, **kw}


def _botocore_client(**kw: Any) -> Any:
    import botocore.session

    return botocore.session.Session().create_client("s3", region_name="us-east-1", aws_access_key_id="k",
                                                    aws_secret_access_key="s", **kw)


# -- the profile ---------------------------------------------------------------------------
def test_aws_default_profile_wins_over_aws_profile_and_errors_name_it(aws: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Both set to different profiles: botocore takes AWS_DEFAULT_PROFILE's, so does objckpt,
    and a missing profile or missing credentials name that variable and that profile."""
    import botocore.session
    from botocore.exceptions import ProfileNotFound

    (aws / "config").write_text("[profile first]\nregion = eu-west-1\n[profile second]\nregion = ap-south-1\n")
    (aws / "credentials").write_text("[second]\naws_access_key_id = AK\naws_secret_access_key = SK\n")
    monkeypatch.setenv("AWS_DEFAULT_PROFILE", "first")
    monkeypatch.setenv("AWS_PROFILE", "second")
    assert botocore.session.Session().profile == "first"
    assert botocore.session.Session().get_credentials() is None  # "first" has no keys; "second" would
    cfg = S3Config.resolve("bkt", {})
    assert cfg.region.value == "eu-west-1"
    with pytest.raises(NoCredentialsError) as no_keys:
        cfg.credentials()
    assert "the profile 'first' (environment variable AWS_DEFAULT_PROFILE)" in str(no_keys.value)

    monkeypatch.setenv("AWS_DEFAULT_PROFILE", "nosuch")
    with pytest.raises(ProfileNotFound):
        botocore.session.Session().get_scoped_config()
    with pytest.raises(S3ConfigError) as missing:
        S3Config.resolve("bkt", {})
    assert missing.value.setting == "profile" and missing.value.source == "environment variable AWS_DEFAULT_PROFILE"
    assert "nosuch" in str(missing.value)


# -- the User-Agent's app id ---------------------------------------------------------------------
class _Captured(Exception):
    pass


def _botocore_app_component() -> str:
    """The ``app/...`` component of the User-Agent a botocore client sends (captured
    before sending: nothing leaves)."""
    client = _botocore_client()
    agents: list[str] = []

    def capture(request: Any, **_: Any) -> None:
        ua = request.headers["User-Agent"]
        agents.append(ua.decode() if isinstance(ua, bytes) else ua)
        raise _Captured()

    client.meta.events.register("before-send.s3", capture)
    with pytest.raises(_Captured):
        client.head_bucket(Bucket="bkt")
    apps = [c for c in agents[0].split() if c.startswith("app/")]
    assert len(apps) == 1, agents
    return apps[0]


@pytest.mark.parametrize("source", ["environment", "config file"])
def test_the_app_id_goes_into_the_user_agent_as_botocore_sends_it(aws: Path, server: S3Server,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   source: str) -> None:
    """Characters botocore replaces are replaced alike ('#' kept); botocore's transport
    sends the same component."""
    raw = "my app/v1#2 (x)"
    if source == "environment":
        monkeypatch.setenv("AWS_SDK_UA_APP_ID", raw)
    else:
        (aws / "config").write_text(f"[default]\nsdk_ua_app_id = {raw}\n")
    want = _botocore_app_component()
    assert want == "app/my-app-v1#2--x-"
    seen = {}
    for direct in (True, False):
        server.keep_headers(True)
        try:
            store = S3Store("bkt", **_opts(server, direct))

            async def go() -> None:
                await store.put("ua", b"1")
                await store.close()

            _runtime.run(go())
            agents = [h.get("user-agent", "") for op, h in server.headers_seen() if op == "PutObject"]
        finally:
            server.keep_headers(False)
        assert len(agents) == 1
        seen[direct] = agents[0]
    assert seen[True] == f"objckpt {want}"
    assert want in seen[False].split()


def test_no_app_id_no_component(aws: Path) -> None:
    cfg = S3Config.resolve("bkt", {"endpoint_url": "http://127.0.0.1:9", "aws_access_key_id": "k",
                                   "aws_secret_access_key": "s", "region_name": "us-east-1"})
    assert cfg.request_settings.user_agent() == "objckpt"


# -- TCP keepalive ---------------------------------------------------------------------------------
def _botocore_keepalive() -> bool:
    opts = _botocore_client()._endpoint.http_session._socket_options
    return (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1) in opts


@pytest.mark.parametrize("env,config,on", [
    ({}, "", False),
    ({"BOTOCORE_TCP_KEEPALIVE": "true"}, "", True),
    ({"BOTOCORE_TCP_KEEPALIVE": "yes"}, "", False),  # botocore's ensure_boolean: only "true"
    ({}, "[default]\ntcp_keepalive = True\n", True),
    ({"BOTOCORE_TCP_KEEPALIVE": "false"}, "[default]\ntcp_keepalive = true\n", False),
])
def test_tcp_keepalive_is_set_on_the_own_paths_sockets(aws: Path, server: S3Server, monkeypatch: pytest.MonkeyPatch,
                                                      env: dict[str, str], config: str, on: bool) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    (aws / "config").write_text(config)
    assert _botocore_keepalive() is on
    store = S3Store("bkt", **_opts(server))
    assert store.config.request_settings.tcp_keepalive.value is on

    async def go() -> list[int]:
        await store.put("ka", b"1")
        t = await store.transport()
        got = [c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) for c in t.client._idle]  # type: ignore[attr-defined]
        await store.close()
        return got

    flags = _runtime.run(go())
    assert flags and all(bool(f) is on for f in flags)


def test_tcp_keepalive_on_the_botocore_transport(aws: Path, server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """aiobotocore drops botocore's socket options; objckpt's socket factory sets it."""
    from objckpt.storage.s3 import request_settings

    made: list[int] = []
    real = request_settings.keepalive_socket

    def spy(addr_info: Any) -> socket.socket:
        sock = real(addr_info)
        made.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE))
        return sock

    monkeypatch.setattr(request_settings, "keepalive_socket", spy)
    for value, want in (("false", []), ("true", [1])):
        monkeypatch.setenv("BOTOCORE_TCP_KEEPALIVE", value)
        made.clear()
        store = S3Store("bkt", **_opts(server, direct=False))

        async def go() -> None:
            await store.put("ka", b"1")
            await store.close()

        _runtime.run(go())
        assert [bool(f) for f in made] == [bool(w) for w in want], value


# -- defaults_mode ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["legacy", "standard", "in-region"])
def test_defaults_mode_moves_the_endpoint_as_in_botocore(aws: Path, monkeypatch: pytest.MonkeyPatch,
                                                         mode: str) -> None:
    """`standard` sends us-east-1 to its regional endpoint, `legacy` to the global one:
    the endpoint objckpt resolves is the one a botocore client has."""
    monkeypatch.setenv("AWS_DEFAULTS_MODE", mode)
    cfg = S3Config.resolve("bkt", {"region_name": "us-east-1", "aws_access_key_id": "k", "aws_secret_access_key": "s"})
    client = _botocore_client()
    assert cfg.client_endpoint == client.meta.endpoint_url
    assert ("us-east-1" in cfg.client_endpoint) is (mode != "legacy")


# -- the splice switch ---------------------------------------------------------------------------
def test_splicing_is_read_when_the_store_opens_and_the_cache_follows_it(aws: Path, server: S3Server,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A store keeps what OBJCKPT_SPLICE_BODIES said when it opened; the next open_store
    after a change gets a new store saying the new value."""
    spliced = spy_splice(monkeypatch)
    opts = _opts(server)
    body = bytes(1 << 20)

    def put(store: Any, key: str) -> int:
        before = sum(spliced)
        _runtime.run(store.put(key, bytearray(body)))
        return sum(spliced) - before

    monkeypatch.setenv("OBJCKPT_SPLICE_BODIES", "1")
    on, _ = open_store("s3://bkt/splice", opts)
    assert on.config.request_settings.splice_bodies.value is True
    monkeypatch.setenv("OBJCKPT_SPLICE_BODIES", "0")
    assert put(on, "a") == len(body)  # opened with it on: still on
    off, _ = open_store("s3://bkt/splice", opts)
    assert off is not on and off.config.request_settings.splice_bodies.value is False
    assert put(off, "b") == 0
    monkeypatch.setenv("OBJCKPT_SPLICE_BODIES", "maybe")
    with pytest.raises(S3ConfigError) as bad:
        open_store("s3://bkt/splice", opts)
    assert bad.value.setting == "OBJCKPT_SPLICE_BODIES"


def test_the_store_cache_follows_botocore_tcp_keepalive(aws: Path, server: S3Server,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    opts = _opts(server)
    first, _ = open_store("s3://bkt/ka", opts)
    monkeypatch.setenv("BOTOCORE_TCP_KEEPALIVE", "true")
    second, _ = open_store("s3://bkt/ka", opts)
    assert second is not first and second.config.request_settings.tcp_keepalive.value is True


# -- a host that does not resolve -----------------------------------------------------------------
@TRANSPORTS
def test_an_unresolvable_virtual_host_is_named(aws: Path, direct: bool) -> None:
    """Virtual-host addressing connects to ``bucket.endpoint-host``: that is the host the
    error names (the endpoint's own host may resolve).  One attempt: no waiting."""
    opts = {"endpoint_url": "http://objckpt-test.invalid:9000", "addressing_style": "virtual", "direct_http": direct,
            "aws_access_key_id": "k", "aws_secret_access_key": "s", "region_name": "us-east-1",
            "connect_attempts": 1, "error_attempts": 1, "timeout_attempts": 1, "connect_timeout": 2,
            "first_answer_timeout": 2}
    with pytest.raises(objckpt.StorageError) as got:
        objckpt.read("s3://bkt-host/run/ck", storage_options=opts)
    assert "bkt-host.objckpt-test.invalid" in str(got.value), got.value
