"""A real Ceph RGW for the test session (testkit/rgw.py), started once, on first use.

Where the Ceph packages are missing, or the cluster cannot start on this machine, the tests
that use it are skipped with the reason (``pytest -rs`` prints it); ``OBJCKPT_REQUIRE_RGW=1``
turns a failed start into an error instead, for a CI that installed the packages on purpose.
"""
from __future__ import annotations

import itertools
import os
from typing import Any, Iterator

import pytest

from testkit import rgw as rgw_kit

_buckets = itertools.count()


@pytest.fixture(scope="session")
def rgw() -> Iterator[rgw_kit.Rgw]:
    why = rgw_kit.available()
    if why is not None:
        pytest.skip(f"Ceph RGW cannot run here: {why}")
    try:
        gw = rgw_kit.start()
    except rgw_kit.RgwStartError as e:
        if os.environ.get("OBJCKPT_REQUIRE_RGW") == "1":
            raise
        pytest.skip(f"Ceph RGW did not start: {str(e)[:2000]}")
    with gw:
        yield gw


def new_bucket(gw: rgw_kit.Rgw) -> str:
    """A fresh bucket on ``gw`` (RGW wants 3 to 63 characters)."""
    import boto3

    name = f"rgw-{os.getpid()}-{next(_buckets)}"
    boto3.client("s3", **gw.client_options()).create_bucket(Bucket=name)
    return name


@pytest.fixture
def rgw_s3(rgw: rgw_kit.Rgw) -> tuple[str, dict[str, Any]]:
    """(a fresh bucket, storage_options) on the session's RGW."""
    return new_bucket(rgw), rgw.storage_options()
