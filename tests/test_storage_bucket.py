"""A missing bucket is reported as such, naming it, by every entry point (real moto)."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import objckpt
from objckpt.errors import BucketNotFoundError, NotFoundError

from conftest import s3_options

_STATE = {"w": torch.arange(6.0), "step": 3}


def _save(uri: str, opts: dict[str, Any]) -> None:
    objckpt.save(_STATE, uri, storage_options=opts)


def _async_save(uri: str, opts: dict[str, Any]) -> None:
    objckpt.async_save(_STATE, uri, storage_options=opts).result()


def _read(uri: str, opts: dict[str, Any]) -> None:
    objckpt.read(uri, storage_options=opts)


def _load(uri: str, opts: dict[str, Any]) -> None:
    objckpt.load({"w": torch.zeros(6), "step": 0}, uri, storage_options=opts)


def _inspect(uri: str, opts: dict[str, Any]) -> None:
    objckpt.inspect(uri, storage_options=opts)


@pytest.mark.parametrize("op", [_save, _async_save, _read, _load, _inspect], ids=lambda f: f.__name__.strip("_"))
def test_missing_bucket_is_named(op: Callable[[str, dict[str, Any]], None], moto_endpoint: str) -> None:
    uri = "s3://no-such-bucket-objckpt/run/step-1"
    with pytest.raises(BucketNotFoundError, match="no-such-bucket-objckpt") as ei:
        op(uri, s3_options(moto_endpoint))
    assert ei.value.bucket == "no-such-bucket-objckpt"
    assert isinstance(ei.value, NotFoundError) and isinstance(ei.value, FileNotFoundError)


def test_missing_checkpoint_in_existing_bucket_is_not_a_bucket_error(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    with pytest.raises(NotFoundError, match="no checkpoint") as ei:
        objckpt.read(f"s3://{bucket}/absent", storage_options=opts)
    assert not isinstance(ei.value, BucketNotFoundError)
