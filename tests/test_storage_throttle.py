"""Adaptive concurrency: the AIMD limiter alone, and against a throttling in-memory S3."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import boto3
import pytest
import torch

import objckpt
from objckpt.storage.limiter import AimdLimiter
from testkit.s3server import S3Server

_KEYS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


def test_limiter_halves_on_throttle_and_grows_back(caplog: pytest.LogCaptureFixture) -> None:
    lim = AimdLimiter(8, cooldown=0.0, name="s3://b")
    with caplog.at_level(logging.WARNING, logger="objckpt.storage"):
        lim.throttled()
    assert lim.limit == 4 and "8 -> 4" in caplog.text
    lim.throttled()
    lim.throttled()
    lim.throttled()
    assert lim.limit == 1  # floor
    for _ in range(1 + 2 + 3 + 4 + 5 + 6 + 7):
        lim.succeeded()
    assert lim.limit == 8
    lim.succeeded()
    assert lim.limit == 8  # ceiling


def test_limiter_counts_a_burst_once() -> None:
    import time

    sent = time.monotonic()
    lim = AimdLimiter(16)
    for _ in range(5):  # five refusals of requests sent before the first cut
        lim.throttled(sent_at=sent)
    assert lim.limit == 8
    lim.throttled(sent_at=time.monotonic())  # sent after the cut: counts
    assert lim.limit == 4
    lim2 = AimdLimiter(16, cooldown=60.0)
    for _ in range(5):
        lim2.throttled()
    assert lim2.limit == 8


def test_limiter_caps_requests_in_flight() -> None:
    lim = AimdLimiter(3)
    peak = 0

    async def one() -> None:
        nonlocal peak
        async with lim:
            peak = max(peak, lim.in_flight)
            await asyncio.sleep(0.01)

    async def many() -> None:
        await asyncio.gather(*(one() for _ in range(20)))

    asyncio.run(many())
    assert peak == 3 and lim.in_flight == 0
    with pytest.raises(ValueError):
        AimdLimiter(0)


def _requests(server: S3Server, adaptive: bool, name: str) -> int:
    opts: dict[str, Any] = {"endpoint_url": server.endpoint_url, "concurrency": 32, "adaptive": adaptive,
                            "throttle_attempts": 50, "max_backoff": 0.2, **_KEYS}
    state = {f"t{i}": torch.full((64 * 1024,), float(i)) for i in range(160)}  # 160 x 256 KiB
    server.reset_stats()
    objckpt.save(state, f"s3://thr/{name}", storage_options=opts, blob_size=256 * 1024, part_size=256 * 1024)
    n = sum(server.stats()["requests"].values())
    back = objckpt.read(f"s3://thr/{name}", storage_options=opts)
    assert torch.equal(back["t7"], state["t7"])
    return n


def test_throttled_save_sends_fewer_requests_when_adaptive() -> None:
    with S3Server(latency_s=0.01) as server:
        boto3.client("s3", endpoint_url=server.endpoint_url, **_KEYS).create_bucket(Bucket="thr")
        server.throttle(4)
        fixed = _requests(server, False, "fixed")
        adaptive = _requests(server, True, "adaptive")
    print(f"requests for a throttled save: fixed concurrency {fixed}, adaptive {adaptive}")
    assert adaptive < fixed
