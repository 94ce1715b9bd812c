"""A save's per-tensor work for a state of many small tensors: the direct paths (the walk's
key check, the single-rank assignment, whole-tensor packing) give what the general rules
give; a tensor's byte view keeps its tensor alive; an async save's host copies run on
threads in batches; local files are spared the part crc; hashing leaves a thread for the
writes.  Work is bounded by counting calls, never by timing."""
from __future__ import annotations

import math
import threading
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import objckpt
from objckpt import checksum
from objckpt.errors import UnsupportedValueError
from objckpt.format.tree import encode_tree, iter_leaves
from objckpt.planning.assign import TensorMeta, assign_writes
from objckpt.planning.pack import BlobPlan, ChunkPlan, PartPlan, SavePlan, TensorSpec, plan_save, split_rows
from objckpt.runtime import loop as _runtime
from objckpt.runtime.memory import host_bytes
from objckpt.save import mirrors, upload
from objckpt.state import collect, is_stored_leaf


# --------------------------------------------------------------------------- the direct paths


def _reference_plan(specs: list[TensorSpec], blob_bytes: int, part_bytes: int, chunk_bytes: int) -> SavePlan:
    """plan_save's rule as first written: every tensor through split_rows."""
    blobs: list[BlobPlan] = []
    blob: Any = None
    part: Any = None
    for spec in specs:
        for r0, r1 in split_rows(spec, chunk_bytes):
            if len(spec.shape) == 0:
                shape: tuple[int, ...] = ()
                offsets: tuple[int, ...] = ()
                length = spec.itemsize
            else:
                shape = (r1 - r0,) + tuple(spec.shape[1:])
                offsets = (r0,) + (0,) * (len(spec.shape) - 1)
                length = math.prod(shape) * spec.itemsize
            if blob is None or (blob.size >= blob_bytes and length > 0):
                blob = BlobPlan(len(blobs))
                blobs.append(blob)
                part = None
            start = (blob.size + 63) // 64 * 64
            if part is None or part.size >= part_bytes:
                if part is not None:
                    part.size = start - part.offset
                part = PartPlan(blob.index, len(blob.parts), start, 0)
                blob.parts.append(part)
            part.chunks.append(ChunkPlan(spec.key, r0, r1, offsets, shape, blob.index, start, length))
            blob.size = start + length
            part.size = blob.size - part.offset
    return SavePlan(blobs)


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(shapes, st.sampled_from([1, 2, 4, 8])), max_size=12),
       st.integers(1, 400), st.integers(1, 300), st.integers(1, 300))
def test_plan_save_packs_as_the_rule_as_written(specs: list[tuple[tuple[int, ...], int]], blob: int, part: int,
                                                chunk: int) -> None:
    ts = [TensorSpec(f"t{i}", shape, size) for i, (shape, size) in enumerate(specs)]
    got = plan_save(ts, blob_bytes=blob, part_bytes=part, chunk_bytes=chunk)
    assert got == _reference_plan(ts, blob, part, chunk)
    assert all(type(c.shape) is tuple for c in got.chunks)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text("ab.", min_size=1, max_size=3),
                       st.tuples(shapes, st.booleans()), max_size=10))
def test_the_single_rank_assignment_is_the_general_rule(tensors: dict[str, tuple[tuple[int, ...], bool]]) -> None:
    metas = {}
    for key, (shape, cut) in tensors.items():
        boxes: tuple[Any, ...] = (((0,) * len(shape), shape),)
        if cut and shape and shape[0] > 1:  # two boxes (a strided DTensor's local pieces)
            h = shape[0] // 2
            boxes = (((0,) * len(shape), (h,) + shape[1:]), ((h,) + (0,) * (len(shape) - 1),
                                                               (shape[0] - h,) + shape[1:]))
        metas[key] = TensorMeta("float32", shape, 4, boxes)
    # the general rule: every box held by one rank, written whole by it, in (key, box) order
    want = sorted((k, b) for k, m in metas.items() for b in m.boxes)
    got = assign_writes([metas])[0]
    assert [(it.key, it.box) for it in got] == want
    assert all((it.row_start, it.row_end) == (0, it.box[1][0] if it.box[1] else 1) for it in got)


keys = st.one_of(st.sampled_from(["a", "b", "a.b", "b.a", "1", "", "$x", "a.", ".a"]), st.sampled_from([1, 0]))
leaves = st.one_of(st.just("T"), st.integers(0, 3), st.just(None))
trees = st.recursive(leaves, lambda kids: st.one_of(st.dictionaries(keys, kids, max_size=3),
                                                    st.lists(kids, max_size=2)), max_leaves=8)


def _state_of(x: Any) -> Any:
    if x == "T":
        return torch.zeros(1)
    if isinstance(x, dict):
        return {k: _state_of(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_state_of(v) for v in x]
    return x


def _flattened_keys_clash(state: Any) -> bool:
    """The check as first written: list every flattened key and compare."""
    tree = encode_tree(state, lambda k, t: None, is_tensor=is_stored_leaf)
    seen: set[str] = set()
    for key, _ in iter_leaves(tree):
        if key in seen or key == "":
            return True
        seen.add(key)
    return False


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(keys, trees, max_size=4))
@example({"a.b": 1, "a": {"b": "T"}})  # a dotted key beside a container that leads to the same key
@example({"a.0": None, "a": ["T"]})
@example({"a": {"b.c": "T"}, "a.b": {"c": 2}})
@example({"a.b": "T", "a": {"c": "T"}})  # dotted beside a container, no clash: walked in full, saved
def test_the_walk_refuses_exactly_the_states_whose_keys_clash(shape: Any) -> None:
    state = _state_of(shape)
    try:
        clash = _flattened_keys_clash(state)
    except UnsupportedValueError:  # refused for another reason (the same key twice among tensors)
        with pytest.raises(UnsupportedValueError):
            collect(state)
        return
    if clash:
        with pytest.raises(UnsupportedValueError, match="key"):
            collect(state)
    else:
        collect(state)


def test_ties_are_found_between_a_parameter_and_its_data_and_not_across_views(tmp_path: Any) -> None:
    p = torch.nn.Parameter(torch.randn(6, 4))
    col = collect({"w": p, "w_data": p.data, "w_t": p.data.t(), "w_rows": p.data[:3]})
    assert col.alias_of == {"w_data": "w"}  # the same view of the same memory; the others are not
    objckpt.save({"w": p, "w_data": p.data}, str(tmp_path / "c"))
    m = objckpt.inspect(str(tmp_path / "c"))
    assert m.tensors["w_data"].alias_of == "w" and not m.tensors["w_data"].chunks


class _Sub(torch.Tensor):
    """A tensor subclass: a tensor to the walk, but not one of its plain types."""


def _varied(x: Any) -> Any:
    """``_state_of``, with tensors of several kinds: plain, a Parameter, a subclass."""
    if x == "T":
        return torch.zeros(2)
    if x == "P":
        return torch.nn.Parameter(torch.ones(3))
    if x == "S":
        return torch.zeros(1).as_subclass(_Sub)
    if isinstance(x, dict):
        return {k: _varied(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_varied(v) for v in x]
    return x


varied = st.recursive(st.sampled_from(["T", "P", "S", 1, None, "x"]),
                      lambda c: st.lists(c, max_size=3) | st.dictionaries(keys, c, max_size=4), max_leaves=12)


def _encoded(state: Any, plain: tuple[type, ...]) -> Any:
    seen: list[str] = []
    try:
        tree = encode_tree(state, lambda k, t: seen.append(k), is_tensor=is_stored_leaf, plain=plain)
    except UnsupportedValueError as e:
        return ("refused", str(e))
    return tree, seen


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, varied, max_size=5))
@example({"a.b": "T", "a": {"b": "P"}})  # the same key twice: refused alike, naming it
def test_the_inline_tensor_branch_encodes_as_the_call_per_value(shape: Any) -> None:
    """A dict's plain tensors encoded in its loop (``plain``) give the tree, the tensor
    order and the refusals of the call per value."""
    state = _varied(shape)
    assert _encoded(state, (torch.Tensor, torch.nn.Parameter)) == _encoded(state, ())


def test_the_inline_tensor_branch_keeps_the_depth_limit() -> None:
    from objckpt.format.tree import MAX_DEPTH

    deep: Any = {"t": torch.zeros(1)}
    for _ in range(MAX_DEPTH):
        deep = {"d": deep}
    with pytest.raises(UnsupportedValueError, match="nested more than"):
        encode_tree(deep, lambda k, t: None, is_tensor=is_stored_leaf, plain=(torch.Tensor,))
    assert _encoded(deep["d"], (torch.Tensor,)) == _encoded(deep["d"], ())


def test_a_state_dict_is_walked_without_a_call_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk of a flat state dict asks no per-value question of a plain tensor (the
    per-value call was a third of the walk of 3,200 small tensors)."""
    import objckpt.state as state_mod

    asked: list[Any] = []
    real = state_mod.is_stored_leaf

    def counting(x: Any) -> bool:
        asked.append(x)
        return real(x)

    monkeypatch.setattr(state_mod, "is_stored_leaf", counting)
    sd = {f"layers.{i}.w": torch.zeros(3) for i in range(2000)}
    sd["layers.0.p"] = torch.nn.Parameter(torch.ones(2))
    col = collect({"model": sd, "step": 3})
    assert len(col.tensors) == 2001 and col.tree["model"]["layers.7.w"] == {"$tensor": "model.layers.7.w"}
    assert len(asked) <= 3, f"{len(asked)} per-value calls"


def test_a_mirror_follows_its_key_when_the_shape_changes(tmp_path: Any) -> None:
    """A key's host mirror is made again when its tensor changed shape: the old one is not
    kept beside it (the mirrors hold what the last save used)."""
    ms = mirrors.MirrorSet()
    for n in (100, 50):
        assert ms.acquire()
        host = ms.mirror("w", torch.full((n,), 2.0))
        ms.mirror("v", torch.ones(100))
        ms.wait()
        assert torch.equal(host, torch.full((n,), 2.0))
        ms.release()
    assert ms.nbytes == (50 + 100) * 4


# --------------------------------------------------------------------------- the bytes


def test_a_byte_view_keeps_its_memory_alive_and_writes_into_it() -> None:
    import gc

    t = torch.arange(1 << 16, dtype=torch.bfloat16)
    want = t[2:6].clone()
    rows = t[2:6]
    view = host_bytes(rows)
    assert len(view) == 8 and not view.readonly
    view[:2] = b"\x00\x00"
    assert float(t[2]) == 0.0  # the view is the tensor's own memory
    want[0] = 0
    del t, rows
    gc.collect()
    churn = [torch.full((1 << 16,), 7, dtype=torch.bfloat16) for _ in range(8)]  # would reuse freed memory
    assert bytes(view) == want.view(torch.uint8).numpy().tobytes() and churn
    assert len(host_bytes(torch.zeros(0, 3))) == 0 and len(host_bytes(torch.tensor(3.0))) == 4


def test_async_save_copies_on_threads_in_batches(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    batches: list[tuple[int, str]] = []
    real = mirrors._copy

    def counting(pairs: Any) -> None:
        batches.append((len(pairs), threading.current_thread().name))
        real(pairs)

    monkeypatch.setattr(mirrors, "_copy", counting)
    state = {f"layers.{i}.w": torch.full((100,), float(i)) for i in range(600)}
    h = objckpt.async_save(state, str(tmp_path / "a"))
    for v in state.values():
        v.zero_()  # after the call returned: the save holds the values as of the call
    h.result()
    assert sorted(n for n, _ in batches) == [88, 256, 256]  # COPY_BATCH_TENSORS, then the rest
    assert all(name.startswith("objckpt-mirror") for _, name in batches)
    back = objckpt.read(str(tmp_path / "a"))
    assert all(torch.equal(back["layers"][str(i)]["w"] if "layers" in back else back[f"layers.{i}.w"],
                           torch.full((100,), float(i))) for i in range(600))


def test_local_files_are_spared_the_part_crc(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    added: list[int] = []
    real = checksum.RunningCrc.add

    def counting(self: Any, data: Any, crc: Any = None) -> None:
        added.append(len(data))
        real(self, data, crc)

    monkeypatch.setattr(checksum.RunningCrc, "add", counting)
    state = {f"t{i}": torch.randn(50 + i) for i in range(40)}
    objckpt.save(state, str(tmp_path / "c"))
    assert added == []  # a file needs no crc of each part: not built
    assert all(torch.equal(objckpt.read(str(tmp_path / "c"))[k], v) for k, v in state.items())
    views, crcs, whole = upload.direct_views(*_one_part(state), 256)
    assert whole == checksum.crc32c(b"".join(bytes(v) for v in views)) and added  # other stores: built


def _one_part(state: dict[str, torch.Tensor]) -> tuple[PartPlan, dict[str, torch.Tensor]]:
    specs = [TensorSpec(k, tuple(v.shape), 4) for k, v in state.items()]
    plan = plan_save(specs)
    return plan.blobs[0].parts[0], dict(state)


def test_hashing_leaves_a_cpu_thread_for_the_writes(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = threading.Lock()
    now, most = [0], [0]
    real = upload.direct_views

    def counting(*a: Any) -> Any:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            return real(*a)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(upload, "direct_views", counting)
    state = {f"t{i}": torch.randn(4096) for i in range(64)}
    objckpt.save(state, str(tmp_path / "c"), part_size=64 << 10)  # 16 KiB tensors: 4 to a part, 16 parts
    assert 1 <= most[0] <= max(1, _runtime.cpu_threads() - 1)
    assert all(torch.equal(objckpt.read(str(tmp_path / "c"))[k], v) for k, v in state.items())
