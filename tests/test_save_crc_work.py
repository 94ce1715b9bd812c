"""A save of many small tensors: the part checksums are built while the chunks are hashed
(no Python crc shift per chunk), and the manifest's seal skips its parse-back when every
key is a string — with the same bytes, the same checks and the same checksums as before.
Work is bounded by counting calls, not by timing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Iterator

import boto3
import pytest
import torch

import objckpt
import objckpt.checksum as ck
from objckpt.format import manifest as mf
from objckpt.format import sealed_json
from objckpt.planning.pack import PackLimits, pack_items
from objckpt.save.source import SourcePiece
from objckpt.save.upload import direct_views, part_crc, staged_crcs
from testkit.s3server import S3Server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _small_state(n: int = 60) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    # unaligned sizes: chunks of lengths that are not powers of two, padding between them
    return {f"layers.{i // 4}.w{i % 4}": torch.randn(700 + 37 * i, generator=g) for i in range(n)} | {"step": 7}


def _count_shifts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = ck._shift

    def counting(crc: int, n: int) -> int:
        calls.append(n)
        return real(crc, n)

    monkeypatch.setattr(ck, "_shift", counting)
    ck._shift_tables.cache_clear()  # tables built earlier would hide nothing, but start clean
    return calls


def _plan_of(state: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    pieces = [SourcePiece(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    plan = pack_items(pieces, {p.key: 4 for p in pieces}, PackLimits(1 << 30, 5 << 20, 5 << 20, 5 << 30))
    return plan, {f"{p.key}\x00{i}": tensors[p.key] for i, p in enumerate(pieces)}


def test_part_crc_is_the_crc_of_the_part_bytes_with_no_shift_per_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    plan, by_pk = _plan_of(_small_state())
    parts = [p for b in plan.blobs for p in b.parts]
    assert sum(len(p.chunks) for p in parts) == 60
    calls = _count_shifts(monkeypatch)
    for part in parts:
        views, crcs, whole = direct_views(part, by_pk, 1024)
        data = b"".join(bytes(v) for v in views)
        assert len(data) == part.size and whole == ck.crc32c(data)
        buf = torch.zeros(part.size, dtype=torch.uint8)
        buf.numpy()[:] = memoryview(data)
        staged, staged_whole = staged_crcs(part, buf, 1024)
        assert staged == crcs and staged_whole == whole
    assert calls == []  # the former combine shifted once per chunk and per padding
    assert whole == part_crc(part, crcs)  # and agrees with the combined crc


def test_a_large_chunk_is_combined_not_hashed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"big": torch.randn((ck.REHASH_BELOW + 4096) // 4 + 3), "small": torch.randn(333)}
    plan, by_pk = _plan_of(state)
    hashed: list[int] = []
    real = ck._impl

    def counting(data: Any, value: int = 0) -> int:
        hashed.append(len(data))
        return real(data, value)

    monkeypatch.setattr(ck, "_impl", counting)
    for part in (p for b in plan.blobs for p in b.parts):
        views, _, whole = direct_views(part, by_pk, 64 << 10)
        assert whole == real(b"".join(bytes(v) for v in views))
    big = state["big"].numel() * 4
    assert hashed.count(big) == 0  # the big chunk: its blocks hashed, its whole crc combined
    assert sum(hashed) < 2 * sum(v.numel() * 4 for v in state.values()) + 8192


def test_seal_without_the_parse_gives_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    obj = {"format": "x", "tensors": {"a": {"shape": (3, 4), "chunks": [{"crc32c": 5, "block_crc32c": [1, 2]}]}},
           "metadata": {"note": "é", "f": 1.5, "none": None, "flag": True}, "tree": [{"b": [1, {"c": 2}]}]}
    parsed = sealed_json.seal(obj, str_keys=False)
    loads: list[int] = []
    real = json.loads
    monkeypatch.setattr(sealed_json.json, "loads", lambda *a, **k: loads.append(1) or real(*a, **k))
    assert sealed_json.seal(obj) == parsed and sealed_json.seal(obj, str_keys=True) == parsed
    assert loads == []
    # a key that is not a string: the canonical crc is of what a reader parses back
    odd = {"metadata": {1: "one", "2": {3: [4]}}, "tree": [{10: 1, 9: 2}]}
    sealed = sealed_json.seal(odd)
    assert loads == [1]
    back = json.loads(sealed)
    sealed_json.verify(back, ValueError, required=True)  # the canonical check, not the text crc


@pytest.mark.parametrize("keys", [False, True])
def test_manifest_seal_is_unchanged_and_checked_by_every_reader(tmp_path: Any, keys: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    state = _small_state(12)
    meta = {"run": "a", "step": {"7": 1}} if keys else {"run": "a"}
    objckpt.save(state, str(tmp_path / "ck"), metadata=meta)
    raw = (tmp_path / "ck" / "manifest.json").read_bytes()
    m = mf.decode(raw)
    assert mf.encode(m) == raw  # encoding the decoded manifest again: the same bytes
    monkeypatch.setattr(sealed_json, "only_str_keys", lambda obj: False)  # force the parse-back path
    assert mf.encode(m) == raw
    obj = json.loads(raw)
    sealed_json.verify(obj, ValueError, required=True)  # a reader without crc32c_text: the canonical crc


def test_many_small_tensors_round_trip_with_server_verified_parts() -> None:
    """The part checksums sent to S3 (which refuses a part whose crc32c differs) are the
    ones built while hashing; in a new process, as a user saves and verifies."""
    server = S3Server()
    server.start()
    try:
        opts = {"endpoint_url": server.endpoint_url, "aws_access_key_id": "k", "aws_secret_access_key": "s",
                "region_name": "us-east-1"}
        boto3.client("s3", **opts).create_bucket(Bucket="b")
        code = f"""
import json, torch, objckpt
g = torch.Generator().manual_seed(1)
state = {{f"t{{i}}": torch.randn(700 + 37 * i, generator=g) for i in range(300)}}
state["big"] = torch.randn(7 << 20, generator=g)  # two parts of a multipart blob
opts = {json.dumps(opts)}
objckpt.save(state, "s3://b/ck", storage_options=opts, part_size=5 << 20)
dest = {{k: torch.empty_like(v) for k, v in state.items()}}
objckpt.load(dest, "s3://b/ck", storage_options=opts)
assert all(torch.equal(dest[k], v) for k, v in state.items())
print("ok")
"""
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
        cli = subprocess.run([sys.executable, "-m", "objckpt", "verify", "s3://b/ck"], capture_output=True,
                             text=True, timeout=300, env={**env, "AWS_ENDPOINT_URL": server.endpoint_url,
                                                          "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                                                          "AWS_DEFAULT_REGION": "us-east-1"})
        assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-2000:]
    finally:
        server.stop()
