"""The S3 environment's state (``storage/s3/env_state.environment_state``, the store cache's
key, taken on every call): the AWS config and credentials files cost a stat once settled,
and a rewritten file still takes effect at the next call, however quickly it was rewritten."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from objckpt.runtime import loop as _runtime
from objckpt.storage import open_store
from objckpt.storage.s3 import config, env_state


def _creds(path: Path, key: str) -> None:
    path.write_text(f"[default]\naws_access_key_id = {key}\naws_secret_access_key = secret\n")


@pytest.fixture
def aws_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Path, Path]:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE",
              "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    cfg, creds = tmp_path / "config", tmp_path / "credentials"
    cfg.write_text("[default]\nregion = us-east-1\n")
    _creds(creds, "AKIAFIRST0")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(cfg))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    return cfg, creds


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = env_state._read_digest

    def counting(path: str) -> Any:
        seen.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(env_state, "_read_digest", counting)
    return seen


def test_settled_files_cost_a_stat_and_a_rewrite_is_read(monkeypatch: pytest.MonkeyPatch,
                                                         aws_files: tuple[Path, Path]) -> None:
    """Files older than the settling window are read once, then known by their stat; a
    file written within it is read on every call (its stat cannot vouch for its bytes
    when a same-size rewrite may keep the timestamp); a rewrite of a settled file is read."""
    cfg, creds = aws_files
    reads = _reads(monkeypatch)
    first = config.environment_state()
    assert sorted(reads) == ["config", "credentials"]
    config.environment_state()
    assert sorted(reads) == ["config", "config", "credentials", "credentials"]  # both just written: read again

    now = time.time_ns()
    monkeypatch.setattr(env_state, "_now_ns", lambda: now + 10 * env_state._SETTLED_NS)  # both files settled
    reads.clear()
    config.environment_state()
    assert sorted(reads) == ["config", "credentials"]  # read once more, now with a settled stat
    reads.clear()
    assert config.environment_state() == first
    assert reads == []  # unchanged and settled: a stat each, no read

    _creds(creds, "AKIASECND0")  # same size, new bytes
    assert config.environment_state() != first
    assert reads == ["credentials"]
    reads.clear()
    assert config.environment_state() != first and reads == []  # settled (by the patched clock) again


def test_rewritten_credentials_file_takes_effect_at_the_next_call(monkeypatch: pytest.MonkeyPatch,
                                                                  aws_files: tuple[Path, Path],
                                                                  moto_endpoint: str) -> None:
    """The keys of a credentials file rewritten between two calls of one process (same size,
    at once; then again after it settled, its mtime put back) sign the next call's requests."""
    _, creds = aws_files
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)

    async def access_key(store: Any) -> str:
        transport = await store.transport()  # the own path: its client signs with these keys
        return str(transport.client.creds.get().access_key)

    s1, _ = open_store("s3://bkt/x")
    assert _runtime.run(access_key(s1)) == "AKIAFIRST0"
    _creds(creds, "AKIASECND0")  # at once, same size
    s2, _ = open_store("s3://bkt/x")
    assert s2 is not s1 and _runtime.run(access_key(s2)) == "AKIASECND0"

    now = time.time_ns()
    monkeypatch.setattr(env_state, "_now_ns", lambda: now + 10 * env_state._SETTLED_NS)
    assert open_store("s3://bkt/y")[0] is s2  # settled, unchanged: the same store
    st = creds.stat()
    _creds(creds, "AKIATHIRD0")
    os.utime(creds, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime back (a coarse clock's tick)
    s3, _ = open_store("s3://bkt/x")
    assert s3 is not s2 and _runtime.run(access_key(s3)) == "AKIATHIRD0"


# -- botocore's credential chain, walked while the store opens -----------------------------------

class _ContainerCreds:
    """A container credentials endpoint (``AWS_CONTAINER_CREDENTIALS_FULL_URI``, what ECS and
    EKS Pod Identity serve) on loopback, in a thread; ``asked`` is set by its first request."""

    def __init__(self, key: str) -> None:
        import http.server
        import json
        import threading

        self.asked = threading.Event()
        outer = self
        body = json.dumps({"AccessKeyId": key, "SecretAccessKey": "csecret", "Token": "ctoken",
                           "Expiration": "2099-01-01T00:00:00Z"}).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                outer.asked.set()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/creds"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_chain_is_walked_while_the_store_opens_and_signs_its_requests(
        monkeypatch: pytest.MonkeyPatch, aws_files: tuple[Path, Path], moto_endpoint: str) -> None:
    """Credentials from botocore's chain (here a container endpoint) are asked for as the
    store opens, before its first request, so that round trip overlaps the rest of the
    call; the store's requests then carry them."""
    _, creds = aws_files
    creds.write_text("")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    server = _ContainerCreds("ASIACONTAINER")
    try:
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", server.url)
        store, _ = open_store("s3://bkt-early/x")
        assert server.asked.wait(10), "the chain was not walked when the store opened"

        async def access_key() -> str:
            transport = await store.transport()  # type: ignore[attr-defined]
            return str(transport.client.creds.get().access_key)

        assert _runtime.run(access_key()) == "ASIACONTAINER"
    finally:
        server.close()


def test_no_credentials_is_said_at_each_call_not_at_the_opening(monkeypatch: pytest.MonkeyPatch,
                                                                aws_files: tuple[Path, Path],
                                                                moto_endpoint: str) -> None:
    """With no credentials anywhere, opening the store succeeds and every call that needs
    them fails with NoCredentialsError (a walk started early is raised once, then walked again)."""
    import objckpt
    from objckpt.storage.s3.config import NoCredentialsError

    _, creds = aws_files
    creds.write_text("")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for k in ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
              "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    open_store("s3://bkt-nocreds/x")
    for _ in range(2):
        with pytest.raises(NoCredentialsError, match="unsigned=True"):
            objckpt.inspect("s3://bkt-nocreds/x")
