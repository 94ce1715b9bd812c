"""Finding keys and key prefixes in encoded trees (objckpt.format.subtree), property-tested."""
from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import objckpt
from objckpt.format.subtree import NOTHING, find, select, tensor_keys
from objckpt.format.tree import encode_tree, iter_leaves

names = st.sampled_from(["a", "b", "0", "1", "a.b", "b.0", "x.y.z", "10"])
leaf = st.one_of(st.integers(-3, 3), st.just("t"), st.none())
trees = st.recursive(leaf, lambda kids: st.one_of(st.dictionaries(names, kids, min_size=1, max_size=4),
                                                  st.lists(kids, min_size=1, max_size=3)), max_leaves=12)


def _flat_ok(tree: Any) -> bool:
    keys = [k for k, _ in iter_leaves(tree)]
    return len(keys) == len(set(keys)) and all(keys)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(names, trees, min_size=1, max_size=4))
def test_every_leaf_is_found_and_every_prefix_selects_it(state: dict) -> None:
    tree = encode_tree(state, lambda k, t: None)
    if not _flat_ok(tree):  # save refuses states whose keys collide ("a.b" and a/b)
        return
    leaves = dict(iter_leaves(tree))
    for key, enc in leaves.items():
        assert find(tree, key) == enc, key
        parts = key.split(".")
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if prefix in leaves:  # a key itself ("a" beside "a.b"): read returns that leaf
                continue
            sub = select(tree, prefix)
            assert sub is not NOTHING, (key, prefix)
            # the leaf is inside what the prefix selects, under the rest of its key
            rest = ".".join(parts[i:])
            inner = dict(iter_leaves(sub)) if isinstance(sub, (dict, list)) else {}
            assert inner.get(rest, find(sub, rest)) == enc, (key, prefix, sub)
    assert select(tree, "nope") is NOTHING and select(tree, "a.") is NOTHING


def test_tensor_keys_of_a_subtree() -> None:
    tree = {"m": {"w": {"$tensor": "m.w"}, "l": [{"$tensor": "m.l.0"}, 3]}, "o": {"$tensor": "o"}}
    assert sorted(tensor_keys(select(tree, "m"))) == ["m.l.0", "m.w"]
    assert tensor_keys(select(tree, "m.l")) == ["m.l.0"]


def test_a_single_string_is_one_key(tmp_path: Any) -> None:
    uri = str(tmp_path / "ck")
    objckpt.save({"w": torch.arange(4), "optim": {"lr": 0.5, "m": torch.ones(2)}}, uri)
    assert list(objckpt.read(uri, "w")) == ["w"]
    got = objckpt.read(uri, "optim")
    assert got["optim"]["lr"] == 0.5 and torch.equal(got["optim"]["m"], torch.ones(2))
