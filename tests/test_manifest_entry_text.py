"""The manifest's entries written as text directly (format/entry_json.py) are what ``json``
writes for them, and a seal with its entries encoded ahead is the seal of the same object
encoded whole: the same bytes, the same canonical crc a reader checks.  Work is bounded by
counting encoder calls, never by timing."""
from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from objckpt.format import entry_json, sealed_json
from objckpt.format import manifest as mf
from objckpt.format.entries import Chunk, ShardSpec, TensorEntry

names = st.text(min_size=1, max_size=12)  # any characters: quotes, backslashes, controls, non-ASCII
ints = st.integers(min_value=0, max_value=(1 << 62) - 1)
dims = st.lists(st.integers(min_value=0, max_value=1 << 20), max_size=4)
crcs = st.integers(min_value=0, max_value=(1 << 32) - 1)
chunks = st.builds(Chunk, offsets=dims.map(tuple), shape=dims.map(tuple), blob=ints, offset=ints, length=ints,
                   crc32c=crcs, block_crc32c=st.lists(crcs, max_size=5).map(tuple))


@st.composite
def entries(draw: Any) -> TensorEntry:
    key, dtype, shape = draw(names), draw(st.sampled_from(["float32", "bfloat16", "int64", "bool", 'a"b\\c'])), draw(dims)
    kind = draw(st.sampled_from(["chunks", "alias", "layout"]))
    if kind == "alias":
        return TensorEntry(key, dtype, tuple(shape), alias_of=draw(names))
    if kind == "layout":
        spec = ShardSpec(draw(st.integers(0, 3)), tuple(draw(st.lists(st.sampled_from(["R", "S0", "S1"]), max_size=3))),
                         draw(st.integers(1, 4)), draw(st.integers(0, 3)))
        return TensorEntry(key, dtype, tuple(shape), layout=spec)
    return TensorEntry(key, dtype, tuple(shape), chunks=draw(st.lists(chunks, max_size=3)))


@settings(max_examples=400, deadline=None)
@given(entries())
@example(TensorEntry("w", "float32", (True, 2)))  # a bool where an int goes: left to json ("true")
@example(TensorEntry("w", "float32", (2,), chunks=[Chunk((0,), (2,), 0, 0, 8, 7, ())]))
def test_an_entry_written_directly_is_what_json_writes(t: TensorEntry) -> None:
    assert entry_json.entry_text(t) == sealed_json.encode_canonical(entry_json.entry_dict(t))


@settings(max_examples=200, deadline=None)
@given(names)
@example("plain.key_0")
@example('q"uote\\back\x7f\x00é☃')
def test_a_key_is_quoted_as_json_quotes_it(key: str) -> None:
    assert entry_json.json_str(key) == json.dumps(key)


def _manifest(tensors: list[TensorEntry], tree: Any) -> mf.Manifest:
    return mf.Manifest(attempt="a1", tensors={t.key: t for t in tensors}, blobs=[], tree=tree, world_size=1,
                       metadata={"note": "x"})


@settings(max_examples=150, deadline=None)
@given(st.lists(entries(), max_size=6, unique_by=lambda t: t.key))
def test_a_seal_with_entries_encoded_ahead_is_the_seal_of_the_whole(tensors: list[TensorEntry]) -> None:
    m = _manifest(tensors, {t.key: {"$tensor": t.key} for t in tensors})
    whole = mf.to_json_obj(m)
    # the same object encoded whole: its entries' dicts in sorted key order, as written ahead
    whole["tensors"] = {k: json.loads(sealed_json.encode_canonical(v)) for k, v in whole["tensors"].items()}
    ahead = sealed_json.seal(mf.to_json_obj(m, entries_ahead=True), str_keys=True)
    assert ahead == sealed_json.seal(whole, str_keys=True)
    obj = json.loads(ahead)  # and the canonical crc is the one a reader recomputes
    stored = obj.pop("crc32c")
    assert stored == json.loads(sealed_json.seal(obj))["crc32c"]


def test_encode_writes_each_entry_once_and_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seal encodes no entry through ``json`` (the body around them only), and what it
    writes decodes to the same entries, also after re-indentation (the canonical crc)."""
    tensors = [TensorEntry(f"layers.{i}.w", "float32", (4,), chunks=[Chunk((0,), (4,), 0, 64 * i, 16, i, ())])
               for i in range(300)]
    m = _manifest(tensors, {t.key: {"$tensor": t.key} for t in tensors})
    m.blobs = [mf.Blob("blobs/a1/0", 64 * 300, 0)]
    calls: list[Any] = []
    real = sealed_json.encode_canonical

    def counting(v: Any) -> str:
        calls.append(v)
        return real(v)

    monkeypatch.setattr(sealed_json, "encode_canonical", counting)
    monkeypatch.setattr(entry_json, "encode_canonical", counting)
    data = mf.encode(m, compress=False)
    assert len(calls) <= 1, f"{len(calls)} encoder calls"  # the body's canonical text, entries excluded
    back = mf.decode(data)
    assert [back.tensors[t.key].chunks for t in tensors] == [t.chunks for t in tensors]
    again = mf.decode(json.dumps(json.loads(data), indent=2).encode())
    assert list(again.tensors) == [t.key for t in tensors]
