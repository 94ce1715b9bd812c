"""Format v1: manifests against the JSON Schema, docs/format.md's standalone
reader against real checkpoints, and property round trips of the manifest and
tree codecs."""
from __future__ import annotations

import base64
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import objckpt
from objckpt.errors import CorruptCheckpointError, UnsupportedFormatError
from objckpt.format import manifest as mf
from objckpt.format.dtypes import NAME_TO_DTYPE, _NAMES, itemsize
from objckpt.format.manifest import Blob, Chunk, Manifest, TensorEntry, decode, encode
from objckpt.format.tree import decode_tree, encode_tree, iter_leaves

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = Path(mf.__file__).with_name("manifest.schema.json")
DOC_PATH = ROOT / "docs" / "format.md"
SCHEMA = json.loads(SCHEMA_PATH.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
PROPS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _validate(obj: Any) -> None:
    errors = sorted(VALIDATOR.iter_errors(obj), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5])


def _invalid(obj: Any) -> bool:
    return any(True for _ in VALIDATOR.iter_errors(obj))


# ----------------------------------------------------------------------------- real saves


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    tied = torch.randn(5, 3, generator=g)
    return {
        "model": {
            "embed.weight": tied,
            "head.weight": tied,  # tied: stored once
            "norm": {"weight": torch.randn(7, generator=g).to(torch.bfloat16), "eps": 1e-5},
            "big": torch.randn(300, 17, generator=g),  # several chunks with a small part_size
            "ints": torch.arange(-6, 6, dtype=torch.int64).reshape(3, 2, 2),
            "mask": torch.tensor([True, False, True]),
            "f16": torch.randn(2, 3, generator=g).half(),
        },
        "scalar": torch.tensor(2.5, dtype=torch.float64),  # 0-d
        "empty": torch.empty(0, 4),
        "empty_cols": torch.zeros(3, 0, dtype=torch.int32),
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(5, 3, generator=g)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "nan": float("nan")}],
        },
        "misc": {"$weird": b"\x00\x01", "size": torch.Size([2, 3]), "dtype": torch.bfloat16, "none": None},
        "step": 7,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("fmt") / "ck")
    sd = _state()
    objckpt.save(sd, root, part_size=1024, metadata={"run": "t", "nested": {"a": [1, 2.5, None]}})
    with open(os.path.join(root, "manifest.json"), "rb") as f:
        m = json.loads(f.read())
    return root, sd, m


def test_schema_is_valid_draft_2020_12() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_real_manifest_validates(saved: tuple[str, dict[str, Any], dict[str, Any]]) -> None:
    root, sd, m = saved
    _validate(m)
    t = m["tensors"]
    assert t["model.head.weight"] == {"dtype": "float32", "shape": [5, 3], "alias_of": "model.embed.weight"}
    assert t["scalar"]["shape"] == [] and t["scalar"]["chunks"][0]["offsets"] == []
    assert t["empty"]["chunks"][0]["length"] == 0
    assert t["model.norm.weight"]["dtype"] == "bfloat16"
    assert len(t["model.big"]["chunks"]) > 1
    assert m["metadata"]["nested"] == {"a": [1, 2.5, None]}
    assert decode(json.dumps(m).encode()).tensors.keys() == t.keys()


def test_schema_rejects_malformed(saved: tuple[str, dict[str, Any], dict[str, Any]]) -> None:
    _, _, m = saved

    def mutated(fn: Any) -> dict[str, Any]:
        c = json.loads(json.dumps(m))
        fn(c)
        return c

    chunk = lambda c: c["tensors"]["model.big"]["chunks"][0]  # noqa: E731
    assert _invalid(mutated(lambda c: c.pop("tensors")))
    assert _invalid(mutated(lambda c: c.update(format_version=6)))
    assert _invalid(mutated(lambda c: c.pop("crc32c")))  # v3 carries its checksum
    assert _invalid(mutated(lambda c: c["blobs"][0].update(name="blobs/../../etc/passwd")))
    assert _invalid(mutated(lambda c: c.update(format_version=2)))  # v2 needs meshes and rank_indexes
    # ... which v1 must not have
    assert _invalid(mutated(lambda c: c.update(format_version=1, meshes=[], rank_indexes=[])))
    assert _invalid(mutated(lambda c: c.update(format="other")))
    assert _invalid(mutated(lambda c: chunk(c).pop("crc32c")))
    assert _invalid(mutated(lambda c: chunk(c).update(offset=-64)))
    assert _invalid(mutated(lambda c: chunk(c).update(offset=3)))  # not 64-aligned
    assert _invalid(mutated(lambda c: chunk(c).update(length=1.5)))
    assert _invalid(mutated(lambda c: chunk(c).update(crc32c=2**32)))
    assert _invalid(mutated(lambda c: chunk(c).update(extra=1)))
    assert _invalid(mutated(lambda c: c["tensors"]["model.head.weight"].update(chunks=[])))  # both
    assert _invalid(mutated(lambda c: c["tensors"]["scalar"].pop("chunks")))  # neither
    assert _invalid(mutated(lambda c: c["tensors"]["scalar"].update(dtype="float128")))
    assert _invalid(mutated(lambda c: c["blobs"][0].pop("size")))
    assert _invalid(mutated(lambda c: c.update(metadata=[])))
    # top level is open (forward compatibility within v1), for the schema and the decoder
    fwd = mutated(lambda c: c.update(future_field={"x": 1}))
    _validate(fwd)
    decode(mf.reseal(json.dumps(fwd).encode()))  # a newer writer seals the fields it adds
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        decode(json.dumps(fwd).encode())  # ... and a field added after sealing is a change


def test_doc_example_manifest_validates_and_decodes() -> None:
    text = DOC_PATH.read_text()
    blocks = re.findall(r"```json\n(.*?)```", text, re.S)
    assert blocks, "docs/format.md has no JSON example"
    ex = json.loads(blocks[-1])
    _validate(ex)
    m = decode(json.dumps(ex).encode())
    assert m.tensors["model.head.weight"].alias_of == "model.embed.weight"
    assert m.tensors["model.norm.bias"].chunks[0].offset == 64 and m.blobs[0].size == 70


# ----------------------------------------------------------------------------- the doc's reader


def _doc_reader() -> Any:
    blocks = re.findall(r"```python\n(.*?)```", DOC_PATH.read_text(), re.S)
    code = next(b for b in blocks if "def read_tensor" in b)
    assert "objckpt" not in code.replace('"objckpt"', "")  # no objckpt code needed
    ns: dict[str, Any] = {}
    exec(compile(code, str(DOC_PATH), "exec"), ns)
    return ns["read_tensor"]


def _crc32c(data: bytes) -> int:
    """Bitwise CRC-32C (Castagnoli), as docs/format.md specifies it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.float().numpy()
    return t.numpy()


def test_crc32c_reference_vector() -> None:
    assert _crc32c(b"123456789") == 0xE3069283
    assert _crc32c(b"") == 0


def test_standalone_reader_from_doc(saved: tuple[str, dict[str, Any], dict[str, Any]]) -> None:
    root, sd, m = saved
    read_tensor = _doc_reader()
    expect = {
        "model.embed.weight": sd["model"]["embed.weight"],
        "model.head.weight": sd["model"]["head.weight"],
        "model.norm.weight": sd["model"]["norm"]["weight"],
        "model.big": sd["model"]["big"],
        "model.ints": sd["model"]["ints"],
        "model.mask": sd["model"]["mask"],
        "model.f16": sd["model"]["f16"],
        "scalar": sd["scalar"],
        "empty": sd["empty"],
        "empty_cols": sd["empty_cols"],
        "optim.state.0.step": sd["optim"]["state"][0]["step"],
        "optim.state.0.exp_avg": sd["optim"]["state"][0]["exp_avg"],
    }
    assert set(expect) == set(m["tensors"])
    for key, want in expect.items():
        got = read_tensor(root, key)
        assert got.shape == tuple(want.shape), key
        np.testing.assert_array_equal(got, _as_numpy(want), err_msg=key)
        assert got.dtype == _as_numpy(want).dtype, key


def test_bytes_follow_the_spec(saved: tuple[str, dict[str, Any], dict[str, Any]]) -> None:
    """Alignment, zero padding, blob size, crc32c and row ranges as docs/format.md states them."""
    root, sd, m = saved
    blobs = [Path(root, b["name"]).read_bytes() for b in m["blobs"]]
    for b, data in zip(m["blobs"], blobs):
        assert b["name"].startswith(f"blobs/{m['attempt']}/r00000-") and len(data) == b["size"]
    used: list[list[tuple[int, int]]] = [[] for _ in blobs]
    for key, t in m["tensors"].items():
        if "alias_of" in t:
            continue
        item = torch.empty((), dtype=NAME_TO_DTYPE[t["dtype"]]).element_size()
        for c in t["chunks"]:
            data = blobs[c["blob"]][c["offset"] : c["offset"] + c["length"]]
            assert c["offset"] % 64 == 0
            assert c["length"] == math.prod(c["shape"]) * item
            assert _crc32c(data) == c["crc32c"], key
            if t["shape"]:
                assert c["offsets"][1:] == [0] * (len(t["shape"]) - 1) and c["shape"][1:] == t["shape"][1:]
            used[c["blob"]].append((c["offset"], c["offset"] + c["length"]))
    for data, spans in zip(blobs, used):
        spans.sort()
        assert max(e for _, e in spans) == len(data)  # a blob ends at its last chunk
        pos = 0
        for s, e in spans:
            assert s >= pos  # chunks with bytes never overlap
            assert data[pos:s] == bytes(s - pos)  # padding is zero
            pos = max(pos, e)

    # rows r0..r1 of a multi-chunk tensor, by the formula in the doc
    t = m["tensors"]["model.big"]
    row_bytes = math.prod(t["shape"][1:]) * 4
    r0, r1 = 7, 251
    out = bytearray((r1 - r0) * row_bytes)
    for c in t["chunks"]:
        c0, c1 = c["offsets"][0], c["offsets"][0] + c["shape"][0]
        a, b = max(r0, c0), min(r1, c1)
        if a < b:
            src = blobs[c["blob"]][c["offset"] + (a - c0) * row_bytes : c["offset"] + (b - c0) * row_bytes]
            out[(a - r0) * row_bytes : (b - r0) * row_bytes] = src
    got = np.frombuffer(bytes(out), "<f4").reshape(r1 - r0, -1)
    np.testing.assert_array_equal(got, sd["model"]["big"][r0:r1].numpy())


def test_tree_and_keys_as_documented(saved: tuple[str, dict[str, Any], dict[str, Any]]) -> None:
    _, _, m = saved
    tree = m["tree"]
    assert tree["model"]["embed.weight"] == {"$tensor": "model.embed.weight"}
    assert tree["optim"]["state"] == {"$dict": [[0, {"step": {"$tensor": "optim.state.0.step"},
                                                      "exp_avg": {"$tensor": "optim.state.0.exp_avg"}}]]}
    pg = tree["optim"]["param_groups"][0]
    assert pg["betas"] == {"$tuple": [0.9, 0.999]} and pg["nan"] == {"$float": "nan"}
    assert tree["misc"] == {"$dict": [["$weird", {"$bytes": "AAE="}], ["size", {"$size": [2, 3]}],
                                      ["dtype", {"$dtype": "bfloat16"}], ["none", None]]}
    leaves = dict(iter_leaves(tree))
    assert set(m["tensors"]) <= set(leaves)
    # non-tensor leaves are the largest tensor-free subtrees
    assert {"misc", "optim.param_groups", "step", "model.norm.eps"} <= set(leaves)
    assert "misc.$weird" not in leaves


# ----------------------------------------------------------------------------- versioning, compression


def _small_manifest(**kw: Any) -> Manifest:
    return Manifest(tensors={}, blobs=[], tree={}, **kw)


def test_newer_version_is_rejected_clearly() -> None:
    obj = mf.to_json_obj(_small_manifest())
    obj["format_version"] = 6
    with pytest.raises(UnsupportedFormatError, match="format_version 6.*versions 1 to 5"):
        decode(json.dumps(obj).encode())
    obj["format_version"] = 1
    obj["format"] = "safetensors"
    with pytest.raises(CorruptCheckpointError):
        decode(json.dumps(obj).encode())


def test_compressed_only_above_one_mib_and_detected_by_magic() -> None:
    small = encode(_small_manifest(metadata={"s": "x" * 1000}))
    assert small[:1] == b"{"
    big_m = _small_manifest(metadata={"s": "x" * (mf.COMPRESS_ABOVE + 10)})
    big = encode(big_m)
    assert big[:4] == bytes([0x28, 0xB5, 0x2F, 0xFD])
    assert decode(big).metadata == big_m.metadata
    assert decode(encode(big_m, compress=False)).metadata == big_m.metadata


# ----------------------------------------------------------------------------- manifest round trip

DTYPE_NAMES = sorted(_NAMES)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10)
)
json_values = st.recursive(
    json_scalars,
    lambda ch: st.lists(ch, max_size=4)
    | st.dictionaries(st.text(max_size=8).filter(lambda k: not k.startswith("$")), ch, max_size=4),
    max_leaves=15,
)
json_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=4)


@st.composite
def manifests(draw: Any) -> Manifest:
    blobs = draw(
        st.lists(
            st.builds(Blob, name=st.from_regex(r"blobs/[a-z0-9_.-]{0,12}[a-z0-9]", fullmatch=True),
                      size=st.integers(0, 2**40),
                      rank=st.integers(0, 4096)),
            max_size=4,
        )
    )
    keys = draw(st.lists(st.text(max_size=12), unique=True, max_size=6))
    tensors: dict[str, TensorEntry] = {}
    stored: list[str] = []
    for k in keys:
        ndim = draw(st.integers(0, 3))
        dims = st.lists(st.integers(0, 2**18), min_size=ndim, max_size=ndim).map(tuple)
        shape = draw(dims)
        dtype = draw(st.sampled_from(DTYPE_NAMES))
        if stored and draw(st.booleans()):
            target = tensors[draw(st.sampled_from(stored))]  # an alias has its target's dtype and shape
            tensors[k] = TensorEntry(k, target.dtype, target.shape, alias_of=target.key)
            continue
        entry = TensorEntry(k, dtype, shape)
        if blobs:
            for _ in range(draw(st.integers(0, 3))):
                b = draw(st.integers(0, len(blobs) - 1))
                size = blobs[b].size
                offset = 64 * draw(st.integers(0, size // 64))
                length = draw(st.integers(0, size - offset))
                offs = tuple(draw(st.integers(0, d)) for d in shape)  # the box lies inside the tensor
                box = tuple(draw(st.integers(0, d - o)) for d, o in zip(shape, offs))
                isz = itemsize(NAME_TO_DTYPE[dtype]) if dtype in NAME_TO_DTYPE else 1
                length = math.prod(box) * isz  # decode checks the length against the box
                if offset + length > size or any(c.offsets == offs for c in entry.chunks):
                    continue  # decode refuses chunks past their blob and repeated offsets
                entry.chunks.append(Chunk(offs, box, b, offset, length, draw(st.integers(0, 2**32 - 1))))
        tensors[k] = entry
        stored.append(k)
    return Manifest(
        tensors=tensors,
        blobs=blobs,
        tree=draw(json_values),
        metadata=draw(json_objects),
        attempt=draw(st.text(max_size=30)),
        world_size=draw(st.integers(1, 1 << 20)),
        created=draw(st.floats(min_value=0, max_value=4e9)),
        writer=draw(st.text(max_size=20)),
    )


@PROPS
@given(m=manifests(), compress=st.booleans())
def test_manifest_encode_decode_roundtrip(m: Manifest, compress: bool) -> None:
    data = encode(m, compress=compress)
    assert (data[:4] == mf.ZSTD_MAGIC) == compress
    back = decode(data)
    assert back.format_version == m.format_version == mf.FORMAT_VERSION == 3
    assert back.blobs == m.blobs
    assert list(back.tensors) == list(m.tensors)
    for k, t in m.tensors.items():
        b = back.tensors[k]
        assert (b.key, b.dtype, b.shape, b.alias_of, b.chunks) == (t.key, t.dtype, t.shape, t.alias_of, t.chunks)
    assert back.tree == m.tree and back.metadata == m.metadata
    assert (back.attempt, back.world_size, back.created, back.writer) == (m.attempt, m.world_size, m.created, m.writer)
    assert back == m
    _validate(json.loads(encode(m, compress=False)))  # whatever encode writes, the schema accepts


# ----------------------------------------------------------------------------- tree round trip


def _same(a: Any, b: Any) -> bool:
    """Deep equality that checks types, treats NaN as equal to NaN and tells -0.0 from 0.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            _same(ka, kb) and _same(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items())
        )
    return a == b


tree_keys = st.text(max_size=6) | st.text(max_size=5).map(lambda s: "$" + s) | st.integers()
tree_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # nan and +-inf included
    | st.text(max_size=10)
    | st.text(max_size=5).map(lambda s: "$" + s)
    | st.binary(max_size=10)
    | st.builds(torch.Size, st.lists(st.integers(0, 100), max_size=3))
    | st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool])
    | st.sampled_from([torch.device("cpu"), torch.device("cuda", 1)])
)
trees = st.recursive(
    tree_scalars,
    lambda ch: st.lists(ch, max_size=4)
    | st.lists(ch, max_size=4).map(tuple)
    | st.dictionaries(tree_keys, ch, max_size=4),
    max_leaves=20,
)


def _no_tensor(key: str, t: torch.Tensor) -> None:
    raise AssertionError(f"no tensors expected, got {key!r}")


@PROPS
@given(obj=trees)
def test_tree_encode_decode_roundtrip(obj: Any) -> None:
    enc = encode_tree(obj, _no_tensor)
    wire = json.loads(json.dumps(enc, allow_nan=False))  # the tree is plain JSON
    back = decode_tree(wire, lambda k: pytest.fail(f"unexpected tensor {k!r}"))
    assert _same(obj, back), (obj, back)


def test_tree_tensor_placeholders_and_flat_keys() -> None:
    ts = [torch.full((1,), float(i)) for i in range(6)]
    obj = {"a": {"b.c": ts[0]}, "l": [ts[1], (ts[2], {3: ts[3]})], "$d": {"x": ts[4]}, 7: ts[5]}
    seen: dict[str, torch.Tensor] = {}
    enc = encode_tree(obj, lambda k, t: seen.__setitem__(k, t))
    assert list(seen) == ["a.b.c", "l.0", "l.1.0", "l.1.1.3", "$d.x", "7"]
    assert enc["$dict"][0] == ["a", {"b.c": {"$tensor": "a.b.c"}}]
    back = decode_tree(json.loads(json.dumps(enc)), seen.__getitem__)
    assert back["l"][1][1][3] is ts[3] and back[7] is ts[5] and back["$d"]["x"] is ts[4]


def test_unknown_tag_rejected_and_pickle_needs_opt_in() -> None:
    with pytest.raises(CorruptCheckpointError, match=r"\$frob"):
        decode_tree({"$frob": 1}, lambda k: None)
    blob = {"$pickle": base64.b64encode(b"\x80\x04K\x05.").decode()}  # pickle of 5
    with pytest.raises(objckpt.UnsupportedValueError):
        decode_tree(blob, lambda k: None)
    assert decode_tree(blob, lambda k: None, allow_pickle=True) == 5


# ----------------------------------------------------------------------------- v3 seal, hostile manifests

DATA = Path(__file__).with_name("data")
_reseal = getattr(mf, "reseal", lambda b: b)  # so these tests also run (and fail) on the code before v3


def test_unsealed_v1_checkpoint_from_the_previous_release_still_loads(tmp_path: Path) -> None:
    """tests/data/v1_unsealed was written by objckpt before format v3 (no manifest crc32c)."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(DATA / "v1_unsealed", ck)
    assert "crc32c\":" not in (ck / "manifest.json").read_text().split('"tensors"')[0]
    got = objckpt.read(str(ck))
    assert got["step"] == 11 and got["betas"] == (0.9, 0.999) and got["name"] == "old"
    assert torch.equal(got["model"]["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert objckpt.inspect(str(ck)).format_version == 1


def test_v3_manifest_any_changed_value_or_key_is_detected(saved: tuple[str, dict[str, Any], dict[str, Any]]) -> None:
    root, _, m = saved
    data = Path(root, "manifest.json").read_bytes()
    assert m["format_version"] == 3 and isinstance(m["crc32c"], int)
    decode(json.dumps(m, indent=2).encode())  # reformatting is not a change
    for edit in (lambda c: c["metadata"].update(nested={"a": [1, 2.5, 7]}),
                 lambda c: c["tree"].update(renamed=c["tree"].pop("scalar")),
                 lambda c: c.update(format_version=1),  # a flipped version digit is caught too
                 lambda c: c.update(writer="other")):
        c = json.loads(data)
        edit(c)
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
            decode(json.dumps(c).encode())
        decode(_reseal(json.dumps(c).encode()))  # resealed, the edit is accepted


def _hostile_v1(base: dict[str, Any], edit: Any) -> bytes:
    c = json.loads(json.dumps(base))
    edit(c)
    return _reseal(json.dumps(c).encode())


def _first(c: dict[str, Any]) -> dict[str, Any]:
    return c["tensors"]["model.big"]


HOSTILE_SEALED = {  # each is refused by decode even with a valid checksum
    "tensor_missing_key": lambda c: c["tree"].update(h={"$tensor": "no.such.key"}),
    "duplicate_chunks": lambda c: _first(c).update(chunks=_first(c)["chunks"] + _first(c)["chunks"][:1]),
    "blob_dotdot": lambda c: c["blobs"][0].update(name="blobs/../../../etc/passwd"),
    "blob_nul": lambda c: c["blobs"][0].update(name="blobs/a\u0000b.bin"),
    "blob_outside": lambda c: c["blobs"][0].update(name="other/ck/blobs/x.bin"),
    "shape_2_40": lambda c: [_first(c).update(shape=[1 << 40, 4]), _first(c)["chunks"][0].update(shape=[1 << 40, 4])],
    "length_not_numel": lambda c: _first(c)["chunks"][0].update(length=_first(c)["chunks"][0]["length"] - 4),
    "offset_2_64": lambda c: [c["blobs"][0].update(size=1 << 64), _first(c)["chunks"][0].update(offset=(1 << 64) - 16)],
    "tuple_5": lambda c: c["tree"].update(h={"$tuple": 5}),
    "size_x": lambda c: c["tree"].update(h={"$size": ["x"]}),
    "float_zzz": lambda c: c["tree"].update(h={"$float": "zzz"}),
    "dict_list": lambda c: c["tree"].update(h={"$dict": [[1]]}),
    "dict_unhashable": lambda c: c["tree"].update(h={"$dict": [[[1], 2]]}),
    "device_warp": lambda c: c["tree"].update(h={"$device": "warp"}),
    "bytes_bang": lambda c: c["tree"].update(h={"$bytes": "!!!"}),
    "nesting_300": lambda c: c["tree"].update(h=json.loads("[" * 300 + "]" * 300)),
}


def _one_block_crc(value: Any) -> Any:
    """An edit giving the first chunk of ``model.big`` one crc block holding ``value``."""
    def edit(c: dict[str, Any]) -> None:
        ch = _first(c)["chunks"][0]
        c["crc_block"] = ch["length"]  # one block for this chunk (the others carry none)
        ch["block_crc32c"] = value
    return edit


@pytest.mark.parametrize("bad", [[True], [-1], [1 << 32], [7.0], ["7"], [[7]], {"0": 7}, [1, 2]])
def test_block_crcs_are_refused_item_by_item(saved: tuple[str, dict[str, Any], dict[str, Any]], bad: Any) -> None:
    """Block crcs are checked in bulk (``objckpt.format.manifest.crc_list``): each kind of bad
    item (a bool, out of range, not an integer, not a list, the wrong count) is still refused,
    and the same edit with a good value decodes."""
    _, _, m = saved
    decode(_hostile_v1(m, _one_block_crc([0])))
    decode(_hostile_v1(m, _one_block_crc([(1 << 32) - 1])))
    with pytest.raises(CorruptCheckpointError, match="malformed"):
        decode(_hostile_v1(m, _one_block_crc(bad)))


@pytest.mark.parametrize("case", list(HOSTILE_SEALED))
def test_sealed_hostile_manifest_is_refused_by_decode_and_read(
        saved: tuple[str, dict[str, Any], dict[str, Any]], tmp_path: Path, case: str) -> None:
    import shutil

    root, _, m = saved
    data = _hostile_v1(m, HOSTILE_SEALED[case])
    with pytest.raises(CorruptCheckpointError):
        decode(data)
    ck = tmp_path / "ck"
    shutil.copytree(root, ck)
    (ck / "manifest.json").write_bytes(data)
    with pytest.raises(objckpt.errors.ObjckptError):
        objckpt.read(str(ck))


def test_v2_layout_split_beyond_rows_is_refused() -> None:
    from objckpt.format.manifest import Mesh, RankIndexRef, TensorLayout

    t = TensorEntry("w", "float32", (8, 4), layout=TensorLayout(0, ("S0", "R"), 2, 1))
    refs = [RankIndexRef(f"blobs/a/r{r:05d}.index.json", 10, 0) for r in range(4)]
    m = Manifest({"w": t}, [Blob("blobs/a/r00000-0000.bin", 64, 0)], {"w": {"$tensor": "w"}}, attempt="a",
                 world_size=4, meshes=[Mesh((2, 2), (0, 1, 2, 3))], rank_indexes=refs)
    obj = json.loads(encode(m))
    old = {k: v for k, v in obj.items() if k != "crc32c"}
    old["format_version"] = 2  # what the previous release wrote: unsealed v2, its tables as lists
    old["blobs"] = [{"name": b.name, "size": b.size, "rank": b.rank} for b in m.blobs]
    old["rank_indexes"] = [{"name": r.name, "size": r.size, "crc32c": r.crc32c} for r in refs]
    assert decode(json.dumps(old).encode()).tensors["w"].layout == t.layout
    for field, value in (("split", 10**12), ("rot", 10**12)):
        bad = json.loads(json.dumps(obj))
        bad["tensors"]["w"]["layout"][field] = value
        with pytest.raises(CorruptCheckpointError, match=f"layout {field}"):
            decode(_reseal(json.dumps(bad).encode()))


def test_manifest_size_is_bounded_while_decompressing(monkeypatch: pytest.MonkeyPatch) -> None:
    import zstandard

    obj = json.loads(encode(_small_manifest(metadata={"pad": " " * (3 << 20)}), compress=False))
    bomb = zstandard.ZstdCompressor(level=1).compress(json.dumps(obj).encode())
    assert len(bomb) < 64 << 10
    monkeypatch.setenv("OBJCKPT_MAX_MANIFEST_BYTES", str(1 << 20))
    with pytest.raises(CorruptCheckpointError, match="more than 1048576 bytes.*OBJCKPT_MAX_MANIFEST_BYTES"):
        decode(bomb)
    with pytest.raises(CorruptCheckpointError, match="OBJCKPT_MAX_MANIFEST_BYTES"):
        decode(json.dumps(obj).encode())  # uncompressed too
    monkeypatch.setenv("OBJCKPT_MAX_MANIFEST_BYTES", str(8 << 20))
    assert decode(bomb).metadata["pad"] == " " * (3 << 20)


def test_save_refuses_state_nested_past_the_depth_limit(tmp_path: Path) -> None:
    from objckpt.errors import UnsupportedValueError

    deep: Any = 1
    for _ in range(150):
        deep = {"x": deep}
    with pytest.raises(UnsupportedValueError, match="nested more than 100"):
        objckpt.save({"deep": deep}, str(tmp_path / "ck"))
    ok: Any = torch.ones(2)
    for _ in range(90):
        ok = [ok]
    objckpt.save({"ok": ok}, str(tmp_path / "ck2"))
    got = objckpt.read(str(tmp_path / "ck2"))["ok"]
    for _ in range(90):
        got = got[0]
    assert torch.equal(got, torch.ones(2))


def test_read_refuses_a_tensor_larger_than_its_stored_bytes_before_allocating(
        saved: tuple[str, dict[str, Any], dict[str, Any]], tmp_path: Path) -> None:
    """Chunks that are each valid but cover a sliver of a 4 TiB tensor: no allocation, a clear error."""
    import shutil

    root, _, m = saved
    ck = tmp_path / "ck"
    shutil.copytree(root, ck)
    c = json.loads(json.dumps(m))
    big = _first(c)
    big["shape"] = [1 << 40, big["shape"][1]] if len(big["shape"]) == 2 else [1 << 40]
    (ck / "manifest.json").write_bytes(_reseal(json.dumps(c).encode()))
    with pytest.raises(CorruptCheckpointError, match="model.big.*needs"):
        objckpt.read(str(ck))


def test_metadata_with_non_string_keys_seals_and_reads_back(tmp_path: Path) -> None:
    """The checksum is of what a reader parses (JSON turns int keys into strings, tuples into lists)."""
    uri = str(tmp_path / "ck")
    objckpt.save({"w": torch.ones(2)}, uri, metadata={10: "a", 2: (1, 2), "b": {3: None}})
    assert objckpt.inspect(uri).metadata == {"10": "a", "2": [1, 2], "b": {"3": None}}
