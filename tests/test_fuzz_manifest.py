"""Fuzzing the decoders of untrusted metadata: manifest, rank index, tree.

Whatever bytes a store returns, decoding may only succeed or raise an
ObjckptError (never KeyError, TypeError, RecursionError, MemoryError, a hang).
Inputs: valid manifests with random byte flips (caught by the checksum or the
parser), with random JSON values put at random places and *resealed* (so the
structural validation, not the checksum, must catch them), and random JSON.
"""
from __future__ import annotations

import json
from typing import Any

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from objckpt.errors import ObjckptError
from objckpt.format import manifest as mf
from objckpt.format import rank_index
from objckpt.format.manifest import Blob, Chunk, ChunkRecord, Manifest, Mesh, RankIndexRef, TensorEntry, TensorLayout
from objckpt.format.tree import check_tree, decode_tree, iter_leaves

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)

json_scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
                | st.sampled_from(["blobs/a/x.bin", "$tensor", "w", "float32", "S0", "R", "!!!"]))
tags = st.sampled_from(["$tensor", "$tuple", "$dict", "$float", "$size", "$dtype", "$device", "$bytes", "$pickle",
                        "$x"])
json_values = st.recursive(
    json_scalars,
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=6) | tags, ch, max_size=3)
    | st.builds(lambda t, v: {t: v}, tags, ch),
    max_leaves=20,
)


def _v1() -> Manifest:
    t = TensorEntry("w", "float32", (4, 2), [Chunk((0, 0), (2, 2), 0, 0, 16, 7), Chunk((2, 0), (2, 2), 0, 64, 16, 9)])
    a = TensorEntry("a", "float32", (4, 2), alias_of="w")
    tree = {"w": {"$tensor": "w"}, "a": {"$tensor": "a"}, "t": {"$tuple": [1, {"$float": "nan"}]},
            "d": {"$dict": [[1, {"$size": [2, 3]}], [{"$float": "inf"}, {"$bytes": "AAE="}]]},
            "dev": {"$device": "cpu"}, "dt": {"$dtype": "bfloat16"}, "step": 11}
    return Manifest({"w": t, "a": a}, [Blob("blobs/x/r00000-0000.bin", 80, 0)], tree, metadata={"step": 11},
                    attempt="x", crc_block=0)


def _v2() -> Manifest:
    t = TensorEntry("w", "float32", (8, 4), layout=TensorLayout(0, ("S0", "R"), 2, 1))
    refs = [RankIndexRef(f"blobs/a/r{r:05d}.index.json", 10 + r, r) for r in range(4)]
    return Manifest({"w": t}, [Blob(f"blobs/a/r{r:05d}-0000.bin", 64, r) for r in range(4)], {"w": {"$tensor": "w"}},
                    attempt="a", world_size=4, meshes=[Mesh((2, 2), (0, 1, 2, 3))], rank_indexes=refs)


BASES = {"v1": json.loads(mf.encode(_v1())), "v2": json.loads(mf.encode(_v2()))}
INDEX = json.loads(zstandard.ZstdDecompressor().decompress(
    rank_index.encode("a", 1, [ChunkRecord("w", Chunk((0, 0), (4, 4), 0, 0, 64, 5))])))


def _paths(x: Any, here: tuple = ()) -> list[tuple]:
    """Every place in a JSON value (dict keys and list indexes), the root included."""
    out = [here]
    if isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, here + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, here + (i,))
    return out


def _replace(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    obj = json.loads(json.dumps(obj))
    cur = obj
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return obj


def _decode_fully(data: bytes) -> None:
    """Decode a manifest and walk everything a reader would."""
    try:
        m = mf.decode(data)
        decode_tree(m.tree, lambda k: k, where="fuzz")
        list(iter_leaves(m.tree))
        m.nbytes()
    except ObjckptError:
        pass


@FUZZ
@given(base=st.sampled_from(sorted(BASES)), data=st.data())
def test_manifest_value_replacements_resealed_raise_only_objckpt_errors(base: str, data: Any) -> None:
    obj = BASES[base]
    path = data.draw(st.sampled_from([p for p in _paths(obj) if p != ("crc32c",)]))
    mutated = _replace(obj, path, data.draw(json_values))
    try:
        raw = mf.reseal(json.dumps(mutated).encode())
    except ValueError:  # not an object any more: feed it unsealed
        raw = json.dumps(mutated).encode()
    _decode_fully(raw)


@FUZZ
@given(base=st.sampled_from(sorted(BASES)), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)),
                                                         min_size=1, max_size=4))
def test_manifest_byte_flips_raise_only_objckpt_errors(base: str, flips: list[tuple[int, int]]) -> None:
    raw = bytearray(mf.encode(mf.decode(json.dumps(BASES[base]).encode()), compress=False))
    for pos, byte in flips:
        raw[pos % len(raw)] = byte
    _decode_fully(bytes(raw))


@FUZZ
@given(value=json_values)
def test_random_json_manifest_raises_only_objckpt_errors(value: Any) -> None:
    _decode_fully(json.dumps(value).encode())
    if isinstance(value, dict):
        _decode_fully(mf.reseal(json.dumps({**value, "format": "objckpt", "format_version": 3}).encode()))


@FUZZ
@given(data=st.data())
def test_rank_index_mutations_raise_only_objckpt_errors(data: Any) -> None:
    path = data.draw(st.sampled_from([p for p in _paths(INDEX) if p != ("crc32c",)]))
    mutated = _replace(INDEX, path, data.draw(json_values))
    raw = json.dumps(mutated).encode()
    if isinstance(mutated, dict) and data.draw(st.booleans()):
        raw = mf.reseal(raw)
    try:
        rank_index.decode(raw, "fuzz", attempt="a", rank=1, blobs=[0], blob_sizes=[128], crc_block=0,
                          require_crc=True)
    except ObjckptError:
        pass


@FUZZ
@given(tree=json_values)
def test_tree_decoder_raises_only_objckpt_errors(tree: Any) -> None:
    for check in (lambda: check_tree(tree, {"w"}, "fuzz"), lambda: decode_tree(tree, lambda k: k, where="fuzz"),
                  lambda: list(iter_leaves(tree))):
        try:
            check()
        except ObjckptError:
            pass


def test_bases_decode() -> None:
    """The fuzzers start from valid objects."""
    for obj in BASES.values():
        mf.decode(json.dumps(obj).encode())
    rank_index.decode(json.dumps(INDEX).encode(), "x", attempt="a", rank=1, blobs=[0], blob_sizes=[128],
                      crc_block=0, require_crc=True)
    with pytest.raises(ObjckptError):
        rank_index.decode(json.dumps({**INDEX, "rank": 2}).encode(), "x", attempt="a", rank=1, blobs=[0],
                          blob_sizes=[128], crc_block=0)
