"""The checks of every object name a manifest holds, at the cost of C, not of Python per character.

A manifest of a 65,536-rank symbolic save names 131,072 objects (a blob and an index object
per rank); decoding it checked each name's characters in a Python generator, 6.8 million
steps and most of a second of every loading rank's time (docs/s3-scale.md §6).  The checks
must still refuse exactly what they refused: pinned against the per-character versions.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from objckpt.format.keys import BLOB_DIR, is_safe_object_name
from objckpt.format.spread import plain_segment


def _safe_by_characters(name: object) -> bool:
    """The per-character check the fast one replaced (its exact rules)."""
    if not isinstance(name, str) or not name.startswith(BLOB_DIR + "/") or len(name) > 1024:
        return False
    if any(ch in name for ch in ("\x00", "\\")) or any(ord(ch) < 0x20 for ch in name):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def _segment_by_characters(name: str) -> bool:
    return (name not in ("", ".", "..") and not any(ch in name for ch in "/\\")
            and not any(ord(ch) < 0x20 for ch in name))


_CHARS = st.sampled_from(["a", "0", ".", "/", "\\", "\x00", "\x01", "\x1f", " ", "\x7f", "é", "-"])


@settings(max_examples=3000, deadline=None)
@given(st.lists(_CHARS, max_size=12).map("".join), st.booleans())
def test_the_name_checks_refuse_exactly_what_they_refused(tail: str, prefixed: bool) -> None:
    name = (BLOB_DIR + "/" + tail) if prefixed else tail
    assert is_safe_object_name(name) == _safe_by_characters(name), repr(name)
    assert plain_segment(tail) == _segment_by_characters(tail), repr(tail)


def test_the_name_checks_on_known_names() -> None:
    good = ["blobs/20261122T000000-0123abcd/r65535-0000.bin", "blobs/a/r00001.index.json", "blobs/x"]
    bad = ["blobs/", "blobs//x", "blobs/./x", "blobs/../x", "blobs/a/..", "blobs/a\\b", "blobs/a\x00",
           "blobs/a\nb", "manifest.json", "../blobs/x", "blobs/" + "a" * 1020, 7, None]
    assert [is_safe_object_name(n) for n in good] == [True] * len(good)
    assert [is_safe_object_name(n) for n in bad] == [False] * len(bad)
    assert [plain_segment(s) for s in ("20261122T000000-0123abcd", "", ".", "..", "a/b", "a\\b", "a\tb")] == [
        True, False, False, False, False, False, False]


def _python_calls(fn: Callable[[], Any]) -> int:
    """How many Python frames (function calls and generator resumptions) ``fn`` runs."""
    calls = [0]

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[0] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[0]


def test_a_long_name_is_checked_in_a_bounded_number_of_python_steps() -> None:
    name = BLOB_DIR + "/" + "20261122T000000-0123abcd/" + "r" * 900
    assert is_safe_object_name(name)
    assert _python_calls(lambda: is_safe_object_name(name)) < 10  # was one step per character: > 900
    assert _python_calls(lambda: plain_segment("a" * 900)) < 10


_VALUES = st.one_of(st.integers(-2, 2), st.sampled_from([1 << 32, (1 << 32) - 1, (1 << 62) - 1, 1 << 62, True,
                                                         False, None, "7", 1.0]))
_NAMES = st.one_of(st.sampled_from(["blobs/a/r00000-0000.bin", "blobs/a/../x", "blobs//x", "blobs/a\\b", "", 7,
                                    "spread/a/x", "manifest.json"]), st.none())


def _v2_manifest(blob: dict, index: dict) -> bytes:
    from objckpt.format.manifest import Blob, Manifest, Mesh, RankIndexRef, ShardSpec, TensorEntry, encode, \
        to_json_obj
    from objckpt.format.sealed_json import seal

    m = Manifest(tensors={"w": TensorEntry("w", "float32", (4,), layout=ShardSpec(0, ("S0",)))},
                 blobs=[Blob("blobs/a/r00000-0000.bin", 16, 0)], tree={"w": {"__tensor__": "w"}}, metadata={},
                 attempt="a", world_size=1, meshes=[Mesh((1,), (0,))],
                 rank_indexes=[RankIndexRef("blobs/a/r00000.index.json", 9, 5)])
    obj = to_json_obj(m)
    obj["blobs"], obj["rank_indexes"] = [blob], [index]
    assert encode(m)  # the manifest as written encodes
    return seal(obj)


def _acceptable(e: dict, extra: str, hi: int, default: Any) -> bool:
    """The rules for a blob ("rank") or rank-index ("crc32c") entry, written out independently."""
    def plain_int(v: Any, top: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < top
    return (is_safe_object_name(e.get("name")) and plain_int(e.get("size"), 1 << 62)
            and plain_int(e.get(extra, default), hi))


@settings(max_examples=400, deadline=None)
@given(_NAMES, _VALUES, _VALUES, st.booleans(), _NAMES, _VALUES, _VALUES)
def test_blob_and_index_entries_are_accepted_exactly_by_the_rules(bname: Any, bsize: Any, brank: Any,
                                                                     has_rank: bool, iname: Any, isize: Any,
                                                                     icrc: Any) -> None:
    """Every blob and rank-index entry is checked by a fast path, then by the full checks when
    the fast one says no: together they accept exactly what the rules allow, no more."""
    import pytest

    from objckpt.errors import CorruptCheckpointError
    from objckpt.format.manifest import Blob, RankIndexRef, decode

    blob = {"name": bname, "size": bsize, **({"rank": brank} if has_rank else {})}
    index = {"name": iname, "size": isize, "crc32c": icrc}
    data = _v2_manifest(blob, index)
    if _acceptable(blob, "rank", 1 << 62, 0) and _acceptable(index, "crc32c", 1 << 32, None):
        m = decode(data)
        assert m.blobs == [Blob(bname, bsize, brank if has_rank else 0)]
        assert m.rank_indexes == [RankIndexRef(iname, isize, icrc)]
    else:
        with pytest.raises(CorruptCheckpointError):
            decode(data)
