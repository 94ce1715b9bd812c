"""Resharded loads move at most 1.1x the bytes each rank needs (manifest and rank indexes
apart), for a tiny Llama's few-KB-to-256-KB tensors and for tens-of-MB ones, and every
byte they deliver is still verified: a corrupted byte in a block read only in part fails.

The save runs at world 2 in real gloo processes (FSDP2's layout: ``Shard(0)`` DTensors);
each world-3 rank's share is then loaded here through a counting store
(:mod:`testkit.reshard`), on moto S3 for the small state.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import objckpt
from objckpt.planning import crc_blocks
from objckpt.storage import open_store
from testkit import reshard
from objckpt.testing.stores import CountingStore

from mp import run_multiprocess

SMALL = reshard.tiny_llama()  # 6.3 MB: 0.5 KB norms, 64-256 KB matrices, with AdamW moments
LARGE = {"embed": (6144, 1024), "w1": (2816, 1024), "w2": (1024, 2816), "norm": (1024,)}  # 24, 11, 11 MiB


def _save(rank: int, world: int, uri: str, which: str, opts: dict[str, Any]) -> int:
    return reshard.save_rank(rank, world, uri, SMALL if which == "small" else LARGE, opts)


def _check(ranks: list[reshard.RankBytes]) -> None:
    for r in ranks:
        assert r.needed > 0 and r.fetched <= 1.1 * r.needed, (r, r.ratio)


def test_small_state_2_to_3_reads_at_most_1_1x_each_share(moto_s3: tuple[str, dict[str, Any]]) -> None:
    bucket, opts = moto_s3
    uri = f"s3://{bucket}/small"
    run_multiprocess(2, _save, uri, "small", opts)
    m = objckpt.inspect(uri, storage_options=opts)
    assert 0 < m.crc_block < 64 << 10  # chosen small: the shards are 32-128 KB
    ranks = reshard.measure(uri, SMALL, 3, opts)
    _check(ranks)
    index = sum(ri.size for ri in m.rank_indexes)
    assert all(r.metadata <= len(objckpt.format.manifest.encode(m)) + index for r in ranks)


def test_small_state_saved_by_one_process_reads_at_most_1_1x_at_world_3(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({k: reshard.full_tensor(k, s) for k, s in SMALL.items()}, uri)
    _check(reshard.measure(uri, SMALL, 3))


def test_large_tensors_2_to_3_read_at_most_1_1x_each_share(tmp_path: Any) -> None:
    uri = str(tmp_path / "large")
    run_multiprocess(2, _save, uri, "large", {})
    assert objckpt.inspect(uri).crc_block <= crc_blocks.MAX_BLOCK
    _check(reshard.measure(uri, LARGE, 3))


def _blob_path(root: str, m: objckpt.format.manifest.Manifest, key: str) -> tuple[str, int, int]:
    (c,) = m.tensors[key].chunks
    return os.path.join(root, m.blobs[c.blob].name), c.offset, m.crc_block


@pytest.mark.parametrize("where", ["before", "inside", "after"])
def test_corrupt_byte_in_a_partly_read_block_is_detected(tmp_path: Any, where: str) -> None:
    """The reader wants rows starting and ending inside crc blocks: a flipped byte of those
    blocks fails the load, whether the reader wanted that byte or only its block."""
    uri = str(tmp_path / "ck")
    full = torch.randn(512, 64)  # 128 KiB in 256-byte rows
    objckpt.save({"w": full}, uri)
    m = objckpt.inspect(uri)
    path, off, block = _blob_path(uri, m, "w")
    assert 256 < block < full.numel() * 4
    row = 256
    r0 = block // row + 1 if block >= row else 1  # the wanted rows start one row into block 1
    r1 = r0 + 3 * block // row  # and end inside a later block
    first_block_start, last_block_end = (r0 * row) // block * block, -(-(r1 * row) // block) * block
    byte = {"before": first_block_start + 5, "inside": r0 * row + 7, "after": last_block_end - 3}[where]
    assert first_block_start <= byte < last_block_end and (where == "inside") == (r0 * row <= byte < r1 * row)

    counting = CountingStore(open_store(uri)[0])

    def load() -> torch.Tensor:
        dst = objckpt.Shard(torch.zeros(r1 - r0, 64), (512, 64), (r0, 0))
        objckpt.load({"w": dst}, uri, store=counting)
        return dst.local

    assert torch.equal(load(), full[r0:r1])  # intact: loads, reading only the blocks it touches
    assert sum(n for _, _, n in counting.ranges) == last_block_end - first_block_start
    with open(path, "r+b") as f:
        f.seek(off + byte)
        b = f.read(1)
        f.seek(off + byte)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(objckpt.CorruptCheckpointError, match="crc32c mismatch"):
        load()


def test_crc_block_choice() -> None:
    """Small chunks get small blocks, large ones at most 1 MiB; an explicit crc_block is kept."""
    assert crc_blocks.choose([64 << 10] * 10) == 2 << 10
    assert crc_blocks.choose([16 << 20] * 10) == 512 << 10
    assert crc_blocks.choose([1 << 30]) == crc_blocks.MAX_BLOCK
    assert crc_blocks.choose([100, 500]) == crc_blocks.MAX_BLOCK  # read whole anyway
    assert crc_blocks.choose([1500] * 8) == crc_blocks.MIN_BLOCK
    assert sum(crc_blocks.chunk_lengths(40 << 20, 16 << 20)) == 40 << 20
    assert max(crc_blocks.chunk_lengths(40 << 20, 16 << 20)) <= 16 << 20


def test_crc_block_choice_is_the_rule_as_written() -> None:
    """choose() evaluates its waste estimate from sorted lengths and prefix sums (a state of
    thousands of chunks is chosen once per save); it must pick what the rule says: the
    largest power of two in range whose sum(min(block, n)) over the chunks longer than
    min_block is at most WASTE of their bytes."""
    import random

    def by_definition(lengths: list[int], max_block: int, min_block: int) -> int:
        big = [n for n in lengths if n > min_block]
        block = 1 << max(max_block, 1).bit_length() - 1
        while block > min_block and sum(min(block, n) for n in big) > crc_blocks.WASTE * sum(big):
            block >>= 1
        return max(block, min(min_block, max_block))

    rng = random.Random(7)
    for _ in range(500):
        lengths = [rng.choice([rng.randint(0, 5000), rng.randint(0, 1 << 22), 1 << rng.randint(0, 24)])
                   for _ in range(rng.randint(0, 40))]
        max_block = rng.choice([crc_blocks.MAX_BLOCK, 1, 3, 4096, 1 << 22])
        min_block = rng.choice([crc_blocks.MIN_BLOCK, 0, 1, 512, 8192])
        want = by_definition(lengths, max_block, min_block)
        assert crc_blocks.choose(lengths, max_block=max_block, min_block=min_block) == want, (lengths, max_block,
                                                                                             min_block)


def test_explicit_crc_block_is_kept(tmp_path: Any) -> None:
    objckpt.save({"w": torch.zeros(64, 64)}, str(tmp_path / "a"), crc_block=4096)
    assert objckpt.inspect(str(tmp_path / "a")).crc_block == 4096
    objckpt.save({"w": torch.zeros(64, 64)}, str(tmp_path / "b"))
    assert objckpt.inspect(str(tmp_path / "b")).crc_block == 1 << 10
