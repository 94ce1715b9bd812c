"""A load of many small tensors: the work per tensor is bounded, and the quick paths that
bound it give what the general paths give.

A state of thousands of small tensors (FSDP shards, optimizer moments, norms) is loaded
in time set by what the load does per tensor, not by its bytes.  These tests count that
work (template walks, views, tiling walks, placements, second hashes, page population)
rather than time it, and prove each quick path against the general one it stands in for.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings, strategies as st

import objckpt
from objckpt.checksum import CellCrcs, crc32c
from objckpt.format.manifest import Chunk, TensorEntry, decode
from objckpt.layout import gathered
from objckpt.load import arrival, match, pipeline, prefault, ranged_get
from objckpt.planning.boxes import intersect
from objckpt.planning.ranges import Request, RequestPiece, Span, plan_requests
from objckpt.planning.read_plan import ChunkIndex
from objckpt.planning.tiling import tiling_defect

MiB = 1 << 20


def _state(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i // 4}.w{i % 4}": torch.randn(257 + i % 5, generator=g) for i in range(n)}


def _counting(monkeypatch: pytest.MonkeyPatch, counts: dict[str, int], module: Any, name: str) -> None:
    real: Callable[..., Any] = getattr(module, name)

    def counted(*a: Any, **k: Any) -> Any:
        counts[name] = counts.get(name, 0) + 1
        return real(*a, **k)

    monkeypatch.setattr(module, name, counted)


def test_a_load_of_many_small_tensors_does_no_per_tensor_extra(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One walk of the template, no placement of a plain tensor, no tiling walk of a chunk that
    covers its tensor alone, no view of a destination for the huge-page advice, and every
    byte hashed once, as it arrived (no second pass)."""
    state = _state(300)
    uri = str(tmp_path / "ck")
    objckpt.save(state, uri)
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    counts: dict[str, int] = {}
    for module, name in ((pipeline, "template_slots"), (match, "template_slots"), (match, "local_part"),
                         (gathered, "tiling_defect"), (prefault, "address"), (ranged_get, "first_mismatch")):
        _counting(monkeypatch, counts, module, name)
    res = objckpt.load(dest, uri)
    assert res.tensors == 300 and all(torch.equal(dest[k], v) for k, v in state.items())
    assert counts == {"template_slots": 1}


def test_a_template_that_grows_is_walked_again(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh optimizer's state is created from the checkpoint after the first walk: the
    match walks the grown template again, and the created entries load."""
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    uri = str(tmp_path / "ck")
    objckpt.save({"model": model, "optim": opt}, uri)
    model2 = torch.nn.Linear(8, 4)
    opt2 = torch.optim.Adam(model2.parameters())
    counts: dict[str, int] = {}
    _counting(monkeypatch, counts, pipeline, "template_slots")
    _counting(monkeypatch, counts, match, "template_slots")
    objckpt.load({"model": model2, "optim": opt2}, uri)
    assert counts == {"template_slots": 2}
    for p, q in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(p["exp_avg"], q["exp_avg"]) and torch.equal(p["exp_avg_sq"], q["exp_avg_sq"])


def test_a_flipped_byte_in_a_small_tensor_is_named(tmp_path: Any) -> None:
    """The whole-chunk check is put in words only when it fails: tensor, blob, offset, chunk."""
    state = _state(40)
    uri = str(tmp_path / "ck")
    objckpt.save(state, uri)
    m = decode(open(os.path.join(uri, "manifest.json"), "rb").read())
    c = m.tensors["layers.3.w1"].chunks[0]
    blob = os.path.join(uri, m.blobs[c.blob].name)
    with open(blob, "r+b") as f:
        f.seek(c.offset + 17)
        b = f.read(1)
        f.seek(c.offset + 17)
        f.write(bytes([b[0] ^ 0x40]))
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    with pytest.raises(objckpt.CorruptCheckpointError,
                       match=rf"tensor 'layers.3.w1': crc32c mismatch in blob .* at offset {c.offset} "
                             rf"\(length {c.length}, chunk at \[0\]\)"):
        objckpt.load(dest, uri)


def test_check_names_are_the_words_of_before() -> None:
    c = Chunk((4, 0), (2, 300), 0, 128, 2400, 7, (1, 2, 3))
    assert [ranged_get.check_name(w) for *_, w in ranged_get.chunk_checks(c, 0, 2400, 1024)] == ["chunk at [4, 0]"]
    assert [ranged_get.check_name(w) for *_, w in ranged_get.chunk_checks(c, 1024, 2400, 1024)] == [
        "block 1 of chunk at [4, 0]", "block 2 of chunk at [4, 0]"]
    assert ranged_get.check_name("as given") == "as given"


# -- quick paths against the general ones ------------------------------------------------------

dims = st.lists(st.integers(0, 5), min_size=0, max_size=3)


@settings(max_examples=300, deadline=None)
@given(dims, st.data())
def test_one_chunk_index_answers_as_a_search(shape: list[int], data: Any) -> None:
    """The index of a tensor stored as one chunk answers a box equal to the chunk at once; any
    box, equal or not, empty or 0-d, gets what intersecting every chunk gives."""
    chunk = Chunk(tuple(0 for _ in shape), tuple(shape), 0, 0, math.prod(shape) * 4, 0)
    offs = tuple(data.draw(st.integers(0, d)) for d in shape)
    box = (offs, tuple(data.draw(st.integers(0, d - o)) for o, d in zip(offs, shape)))
    for b in (box, (chunk.offsets, chunk.shape)):
        got = [(ov.chunk, ov.inter) for ov in ChunkIndex([chunk]).overlapping(b)]
        if not shape:
            want = [(chunk, ((), ()))]
        else:
            inter = intersect((chunk.offsets, chunk.shape), b)
            want = [] if inter is None else [(chunk, inter)]
        assert got == want


@settings(max_examples=300, deadline=None)
@given(dims, st.lists(st.integers(-1, 2), min_size=0, max_size=3), st.lists(st.integers(-1, 1), max_size=3))
def test_one_chunk_coverage_refuses_what_the_tiling_walk_refuses(shape: list[int], shift: list[int],
                                                                 grow: list[int]) -> None:
    """A tensor of one chunk is accepted without the tiling walk only where the walk accepts it."""
    offs = tuple(max(0, s) for s in shift)[: len(shape) + 1]
    cshape = tuple(max(0, d + g) for d, g in zip(shape, grow + [0] * len(shape)))
    c = Chunk(offs, cshape, 0, 0, math.prod(cshape) * 4, 0)
    entry = TensorEntry("t", "float32", tuple(shape), [c])
    walk_ok = tiling_defect([(c.offsets, c.shape)], (tuple(0 for _ in shape), tuple(shape))) is None
    try:
        gathered.check_coverage(entry)
        ok = True
    except objckpt.CorruptCheckpointError:
        ok = False
    assert ok == walk_ok


def _template() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    shared = torch.randn(6, 4, generator=g)
    return {
        "a": torch.randn(3, 4, generator=g),
        "p": torch.nn.Parameter(torch.randn(5, generator=g)),
        "tied1": shared, "tied2": shared,  # one destination: filled once
        "view": shared[:2],  # another box of the same memory
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 3),
        "bf": torch.randn(7, generator=g).to(torch.bfloat16),
        "strided": torch.randn(4, 6, generator=g).t(),
        "nested": {"x": [torch.randn(2, generator=g), 3], "y": "text"},
    }


def _described(m: match.Match) -> Any:
    return ([(t.key, t.box, t.dest.data_ptr(), tuple(t.dest.shape), t.dest.stride()) for t in m.targets],
            [id(s) for s in m.sources], m.n_tensors, [s.key for s in m.value_slots], m.missing, m.unexpected,
            [(c.key, c.pieces) for c in m.casts])


def _match(template: dict[str, Any], uri: str, **kw: Any) -> Any:
    session = objckpt.load.__globals__["ReadSession"](uri)  # (the one path every reader takes)
    m = session.manifest
    from objckpt.format.tree import iter_leaves

    try:
        return _described(match.match_template(template, m, dict(iter_leaves(m.tree)), uri, **kw))
    except objckpt.ObjckptError as e:
        return type(e).__name__, str(e)


@pytest.mark.parametrize("change", ["same", "shape", "dtype", "meta", "cast", "missing"])
def test_plain_tensors_match_as_the_general_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, change: str) -> None:
    """Plain tensors and Parameters are matched in a few steps; the match (targets, boxes,
    destinations, tied ones filled once) and every refusal are those of the general path,
    which goes through the tensor's placements."""
    uri = str(tmp_path / "ck")
    objckpt.save(_template(), uri)
    t = _template()
    cast = False
    if change == "shape":
        t["a"] = torch.empty(4, 3)
    elif change == "dtype":
        t["a"] = torch.empty(3, 4, dtype=torch.float64)
    elif change == "meta":
        t["p"] = torch.nn.Parameter(torch.empty(5, device="meta"))
    elif change == "cast":
        t["a"], cast = torch.empty(3, 4, dtype=torch.bfloat16), True
    elif change == "missing":
        t["extra"] = torch.empty(2)
    quick = _match(t, uri, strict=change != "missing", cast=cast)
    monkeypatch.setattr(match, "_PLAIN", ())  # every leaf through local_part
    general = _match(t, uri, strict=change != "missing", cast=cast)
    assert quick == general
    if change == "same":
        assert quick[2] == 10 and len(quick[0]) == 9  # tied2 is tied1's destination: counted, filled once


def _reference_plan_requests(spans: list[Span], merge_gap: int, max_request: int, split_above: int,
                             split_into: int, gap_share: float = 1 / 32, free_gap: int = 64) -> list[Any]:
    """plan_requests as it was written before its loop kept the current request in locals."""
    by_obj: dict[Any, list[Span]] = {}
    for s in spans:
        if s.length > 0:
            by_obj.setdefault(s.obj, []).append(s)
    out: list[Request] = []
    for obj, group in by_obj.items():
        group.sort(key=lambda s: (s.offset, s.length))
        cur: Any = None
        cur_gaps = 0
        for s in group:
            if s.length > split_above:
                if cur is not None:
                    out.append(cur)
                    cur = None
                pos = 0
                while pos < s.length:
                    n = min(split_into, s.length - pos)
                    out.append(Request(obj, s.offset + pos, n, [RequestPiece(s, 0, pos, n)]))
                    pos += n
                continue
            end = s.offset + s.length
            gap = s.offset - (cur.offset + cur.length) if cur is not None else 0
            merged = max(end - cur.offset, cur.length) if cur is not None else 0
            if (cur is not None and gap <= merge_gap
                    and (gap <= free_gap or cur_gaps + gap <= gap_share * (merged - cur_gaps - gap))
                    and merged <= max_request and s.offset >= cur.offset):
                cur_gaps += max(gap, 0)
                cur.length = max(cur.length, end - cur.offset)
                cur.pieces.append(RequestPiece(s, s.offset - cur.offset, 0, s.length))
            else:
                if cur is not None:
                    out.append(cur)
                cur = Request(obj, s.offset, s.length, [RequestPiece(s, 0, 0, s.length)])
                cur_gaps = 0
        if cur is not None:
            out.append(cur)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5000), st.integers(0, 900)), max_size=40),
       st.integers(0, 300), st.integers(1, 3000), st.integers(1, 3000), st.integers(1, 1000))
def test_requests_are_cut_as_before(raw: list, gap: int, max_req: int, split_above: int, split_into: int) -> None:
    spans = [Span(obj, off, n, i) for i, (obj, off, n) in enumerate(raw)]  # overlapping spans too (tied reads)
    got = plan_requests(list(spans), merge_gap=gap, max_request=max_req, split_above=split_above,
                        split_into=split_into)
    want = _reference_plan_requests(list(spans), gap, max_req, split_above, split_into)
    assert [(r.obj, r.offset, r.length, r.pieces) for r in got] == [(r.obj, r.offset, r.length, r.pieces) for r in want]


def test_scatter_views_fill_each_destination_and_share_one_scratch() -> None:
    """Pieces out of order and gaps between them: each destination gets its own bytes; two
    pieces wanting the same bytes have no scatter list (the request is read into scratch)."""
    dests = [bytearray(10), bytearray(7), bytearray(5)]
    reads = [ranged_get.RangeRead(f"k{i}", "blob", 0, memoryview(d)) for i, d in enumerate(dests)]
    spans = [Span("blob", 0, len(d), i) for i, d in enumerate(dests)]
    req = Request("blob", 0, 40, [RequestPiece(spans[2], 30, 0, 5), RequestPiece(spans[0], 3, 0, 10),
                                  RequestPiece(spans[1], 20, 2, 5)])
    views = ranged_get._scatter_views(req, reads)
    assert views is not None and sum(len(v) for v in views) == 40
    stream = bytes(range(40))
    pos = 0
    for v in views:
        v[:] = stream[pos : pos + len(v)]
        pos += len(v)
    assert bytes(dests[0]) == stream[3:13] and bytes(dests[1][2:]) == stream[20:25] and bytes(dests[2]) == stream[30:35]
    overlapping = Request("blob", 0, 12, [RequestPiece(spans[0], 0, 0, 10), RequestPiece(spans[1], 5, 0, 7)])
    assert ranged_get._scatter_views(overlapping, reads) is None


def test_whole_chunk_reads_are_judged_from_their_one_cell() -> None:
    """A request of whole chunks with gaps between them: each read is judged from the cell its
    piece is, a flipped byte names its check, and a read split over two requests is still
    combined from its cells."""
    data = bytearray(os.urandom(300))
    layout = [(0, 100), (130, 70), (200, 100)]  # (offset in the request, length): a 30-byte gap
    reads = [ranged_get.RangeRead(f"k{i}", "blob", at, memoryview(bytearray(n)),
                                  ((0, n, crc32c(bytes(data[at : at + n])), (-1, (i,))),))
             for i, (at, n) in enumerate(layout)]
    spans = [Span("blob", at, n, i) for i, (at, n) in enumerate(layout)]
    req = Request("blob", 0, 300, [RequestPiece(s, s.offset, 0, s.length) for s in spans])
    data[150] ^= 1  # in read 1
    t = arrival.Tallies(reads)
    tally = t.for_request(req)
    assert isinstance(tally, CellCrcs)
    tally.feed(memoryview(bytes(data)))
    t.record(req, tally)
    assert t.verdict(0) == (True, None) and t.verdict(2) == (True, None)
    judged, bad = t.verdict(1)
    assert judged and bad is not None and bad[0] == reads[1].checks[0] and bad[1] == crc32c(bytes(data[130:200]))


# -- small fresh destinations, populated while the metadata is read ----------------------------

_SCRIPT = r"""
import json, sys, torch, objckpt
from objckpt.load import prefault
uri, n, kib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
calls = []
real = prefault._populate
def counted(addr, length):
    calls.append(length)
    return real(addr, length)
prefault._populate = counted
g = torch.Generator().manual_seed(0)
state = {f"t{i}": torch.randn(kib * 256 + i % 3, generator=g) for i in range(n)}
if sys.argv[4] == "save":
    objckpt.save(state, uri)
    sys.exit(0)
dest = {k: torch.empty_like(v) for k, v in state.items()}  # fresh: no page touched yet
objckpt.load(dest, uri)
first = list(calls)
calls.clear()
objckpt.load(dest, uri)  # loaded into before: its pages are there
print(json.dumps({"first": first, "again": calls, "equal": all(torch.equal(dest[k], v) for k, v in state.items()),
                  "supported": prefault._supported}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise advice of Linux")
def test_small_fresh_destinations_are_populated_in_runs_in_a_new_process(tmp_path: Any) -> None:
    """A restarting job's first load of ~40 MiB of 16 KiB tensors: their pages are populated
    by a background thread while the manifest is read, a few calls for the runs they lie in
    (not one per tensor); the same load again populates nothing; the bytes are the saved ones."""
    uri, n, kib = str(tmp_path / "ck"), 2600, 16
    run = [sys.executable, "-c", _SCRIPT, uri, str(n), str(kib)]
    subprocess.run(run + ["save"], check=True, timeout=300)
    out = subprocess.run(run + ["load"], check=True, timeout=300, capture_output=True, text=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["equal"]
    if got["supported"] is False:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    total = n * kib * 1024
    # a few calls, over the tensors' bytes and what lies between two of them (less than a page each)
    assert 1 <= len(got["first"]) <= n // 20 and total <= sum(got["first"]) <= total + n * prefault._PAGE
    assert max(got["first"]) <= prefault.STEP
    assert got["again"] == []


def test_runs_merge_what_lies_a_page_apart() -> None:
    page = prefault._PAGE
    regions = [(10 * page + 100, 50), (0, page), (page + 16, 3 * page), (10 * page, 100), (30 * page, 8)]
    assert prefault.runs(regions) == [(0, 4 * page + 16), (10 * page, 150), (30 * page, 8)]


def test_small_destinations_below_the_threshold_or_loaded_before_start_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    small = [torch.zeros(1024) for _ in range(8)]  # written: resident
    assert prefault.populate_small([(t.data_ptr(), t.nbytes) for t in small]) is None  # below MIN_BYTES
    monkeypatch.setattr(prefault, "MIN_BYTES", 0)
    assert prefault.populate_small([(t.data_ptr(), t.nbytes) for t in small]) is None  # every page there already
    monkeypatch.setattr(prefault, "SMALL_AHEAD", False)
    assert prefault.begin(small) is None
