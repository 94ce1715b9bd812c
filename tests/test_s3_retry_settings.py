"""The AWS retry settings (``max_attempts``, ``retry_mode``) are read as botocore reads
them and cap objckpt's retry budgets (storage/s3/retry_settings.py).

First the resolution against a real botocore client built from the same inputs
(environment, config file, profile), then the behaviour end to end: a server that
answers 503 SlowDown twice makes boto3 and objckpt both fail with ``max_attempts = 1``
and both succeed with 3, counted in requests the server saw, not in seconds.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Optional

import boto3
import pytest
import torch
from botocore.exceptions import ClientError

import objckpt
from objckpt.errors import StorageError
from objckpt.storage.s3.config import S3Config, S3ConfigError
from objckpt.storage.s3.retry import RetryPolicy
from testkit.s3server import S3Server

_KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
_BUDGETS = ("throttle_attempts", "error_attempts", "timeout_attempts", "connect_attempts")


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """No AWS settings but an empty config file in ``tmp_path``."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    (tmp_path / "config").write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield tmp_path


def _botocore_retries(profile: Optional[str] = None) -> dict[str, Any]:
    """What a real client built from the environment and files says of its retries."""
    c = boto3.session.Session(profile_name=profile).client("s3", region_name="us-east-1", aws_access_key_id="a",
                                                            aws_secret_access_key="b")
    return dict(c.meta.config.retries)


def _resolve(**options: Any) -> S3Config:
    return S3Config.resolve("bkt", {"endpoint_url": "http://127.0.0.1:9", **_KEYS, **options})


CASES = [
    # (name, environment, config file, profile, max_attempts botocore resolves, its source in objckpt's words)
    ("nothing set", {}, "", None, None, "not set"),
    ("AWS_MAX_ATTEMPTS", {"AWS_MAX_ATTEMPTS": "1"}, "", None, 1, "environment variable AWS_MAX_ATTEMPTS"),
    ("config file", {}, "[default]\nmax_attempts = 7\n", None, 7, "profile 'default' of"),
    ("environment wins over the file", {"AWS_MAX_ATTEMPTS": "2"}, "[default]\nmax_attempts = 7\n", None, 2,
     "environment variable AWS_MAX_ATTEMPTS"),
    ("a named profile", {"AWS_PROFILE": "p"}, "[default]\nmax_attempts = 7\n[profile p]\nmax_attempts = 5\n", None, 5,
     "profile 'p' of"),
    ("profile option", {}, "[profile q]\nmax_attempts = 6\nretry_mode = adaptive\n", "q", 6, "profile 'q' of"),
    ("retry_mode alone", {"AWS_RETRY_MODE": "standard"}, "", None, None, "not set"),
    ("defaults_mode", {"AWS_DEFAULTS_MODE": "in-region"}, "", None, None, "not set"),
    ("defaults_mode under retry_mode", {"AWS_DEFAULTS_MODE": "standard"}, "[default]\nretry_mode = adaptive\n", None,
     None, "not set"),
]


@pytest.mark.parametrize("name,env,config,profile,expected,source", CASES, ids=[c[0] for c in CASES])
def test_max_attempts_and_retry_mode_resolve_as_botocore(aws: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                                         env: dict[str, str], config: str, profile: Optional[str],
                                                         expected: Optional[int], source: str) -> None:
    (aws / "config").write_text(config)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    theirs = _botocore_retries(profile)
    cfg = _resolve(**({"profile": profile} if profile else {}))
    assert cfg.retries is not None
    assert theirs.get("total_max_attempts") == expected == cfg.retries.max_attempts.value, (theirs, cfg.retries)
    assert source in cfg.retries.max_attempts.source
    assert cfg.retries.mode.value == theirs["mode"]
    budgets = [getattr(cfg.policy, k) for k in _BUDGETS]
    defaults = [getattr(RetryPolicy(), k) for k in _BUDGETS]
    # botocore's meaning: every retried kind of failure gets that many attempts, the first included;
    # where nothing is set the per-kind defaults stand
    assert budgets == ([expected] * 4 if expected is not None else defaults)
    assert cfg.retries.describe() in cfg.summary()


def test_options_win_over_the_aws_setting(aws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "5")
    cfg = _resolve(max_attempts=2)
    assert cfg.retries is not None and cfg.retries.max_attempts.value == 2
    assert cfg.retries.max_attempts.source == "storage option max_attempts"
    assert [getattr(cfg.policy, k) for k in _BUDGETS] == [2, 2, 2, 2]
    cfg = _resolve(throttle_attempts=9)  # a per-kind option wins over max_attempts for its kind
    assert [getattr(cfg.policy, k) for k in _BUDGETS] == [9, 5, 5, 5]


@pytest.mark.parametrize("env,config,setting,source", [
    ({"AWS_MAX_ATTEMPTS": "0"}, "", "max_attempts", "environment variable AWS_MAX_ATTEMPTS"),
    ({"AWS_MAX_ATTEMPTS": "many"}, "", "max_attempts", "environment variable AWS_MAX_ATTEMPTS"),
    ({}, "[default]\nmax_attempts = -1\n", "max_attempts", "profile 'default' of"),
    ({"AWS_RETRY_MODE": "eager"}, "", "retry_mode", "environment variable AWS_RETRY_MODE"),
    ({}, "[default]\nretry_mode = sometimes\n", "retry_mode", "profile 'default' of"),
], ids=["zero", "not a number", "negative in the file", "bad mode", "bad mode in the file"])
def test_bad_values_are_refused_like_botocore_naming_their_source(aws: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  env: dict[str, str], config: str, setting: str,
                                                                  source: str) -> None:
    (aws / "config").write_text(config)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(Exception):  # botocore refuses them too (ValueError, InvalidMaxRetryAttemptsError...)
        _botocore_retries()
    with pytest.raises(S3ConfigError, match=setting) as info:
        _resolve()
    assert source in str(info.value), str(info.value)


def test_option_zero_is_refused() -> None:
    with pytest.raises(S3ConfigError, match="max_attempts.*storage option max_attempts.*>= 1"):
        _resolve(max_attempts=0)


# -- end to end: 503 SlowDown twice ------------------------------------------------------
@pytest.fixture
def server(aws: Path) -> Iterator[S3Server]:
    with S3Server() as s:
        boto3.client("s3", endpoint_url=s.endpoint_url, **_KEYS).create_bucket(Bucket="slow")
        yield s


def _boto3_get(server: S3Server, key: str) -> Optional[str]:
    """None when boto3's GetObject succeeds, else its error text."""
    c = boto3.client("s3", endpoint_url=server.endpoint_url, **_KEYS)
    try:
        c.get_object(Bucket="slow", Key=key)["Body"].read()
        return None
    except ClientError as e:
        return str(e)


def _two_slowdowns(server: S3Server) -> None:
    """The next two GetObjects answer 503 SlowDown (faults a previous client left unused forgotten)."""
    server.clear_faults()
    server.fail("GetObject", count=2, status=503, code="SlowDown")


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
def test_max_attempts_one_fails_on_two_slowdowns_like_boto3(server: S3Server, monkeypatch: pytest.MonkeyPatch,
                                                            direct: bool) -> None:
    opts = {"endpoint_url": server.endpoint_url, "max_backoff": 0.01, "direct_http": direct, **_KEYS}
    objckpt.save({"w": torch.arange(8.0)}, "s3://slow/run", storage_options=opts)
    key = "plain"
    boto3.client("s3", endpoint_url=server.endpoint_url, **_KEYS).put_object(Bucket="slow", Key=key, Body=b"x")

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    _two_slowdowns(server)
    said = _boto3_get(server, key)
    assert said is not None and "reached max retries: 0" in said, said
    server.reset_stats()
    _two_slowdowns(server)
    with pytest.raises(StorageError, match="1 attempt") as info:
        objckpt.read("s3://slow/run", storage_options=opts)
    assert "SlowDown" in str(info.value) or "503" in str(info.value), str(info.value)
    assert int(server.stats()["ops"].get("GetObject", 0)) == 1  # never sent again

    # the same environment variable changed between two calls: the next call follows it
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    _two_slowdowns(server)
    assert _boto3_get(server, key) is None
    _two_slowdowns(server)
    back = objckpt.read("s3://slow/run", storage_options=opts)
    assert torch.equal(back["w"], torch.arange(8.0))


def test_nothing_set_keeps_the_throttle_budget(server: S3Server) -> None:
    """Where the user set nothing the per-kind defaults stand: 5 SlowDowns are waited out
    (botocore's legacy default of 5 attempts would fail), and the storage option
    ``max_attempts`` means what botocore's does."""
    opts = {"endpoint_url": server.endpoint_url, "max_backoff": 0.01, **_KEYS}
    objckpt.save({"w": torch.ones(3)}, "s3://slow/d", storage_options=opts)
    server.fail("GetObject", count=5, status=503, code="SlowDown")
    assert torch.equal(objckpt.read("s3://slow/d", storage_options=opts)["w"], torch.ones(3))
    _two_slowdowns(server)
    with pytest.raises(StorageError, match="2 attempts"):
        objckpt.read("s3://slow/d", storage_options={**opts, "max_attempts": 2})

