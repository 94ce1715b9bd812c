"""The S3 environment's state (``storage/s3/config.environment_state``, the store cache's
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
from objckpt.storage.s3 import config


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
    real = config._read_digest

    def counting(path: str) -> Any:
        seen.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(config, "_read_digest", counting)
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
    monkeypatch.setattr(config, "_now_ns", lambda: now + 10 * config._SETTLED_NS)  # both files settled
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
    monkeypatch.setattr(config, "_now_ns", lambda: now + 10 * config._SETTLED_NS)
    assert open_store("s3://bkt/y")[0] is s2  # settled, unchanged: the same store
    st = creds.stat()
    _creds(creds, "AKIATHIRD0")
    os.utime(creds, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime back (a coarse clock's tick)
    s3, _ = open_store("s3://bkt/x")
    assert s3 is not s2 and _runtime.run(access_key(s3)) == "AKIATHIRD0"
