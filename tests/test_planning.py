"""Property tests of the pure planners: packing and range coalescing."""
from __future__ import annotations


from hypothesis import given, settings, strategies as st

from objckpt.planning.pack import TensorSpec, plan_save
from objckpt.planning.ranges import FREE_GAP, GAP_SHARE, Span, plan_requests

shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
specs = st.lists(st.tuples(shapes, st.sampled_from([1, 2, 4, 8, 16])), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(specs, st.integers(64, 4096), st.integers(64, 4096), st.integers(256, 20000))
def test_pack_invariants(raw: list, part: int, chunk: int, blob: int) -> None:
    ss = [TensorSpec(f"t{i}", shape, item) for i, (shape, item) in enumerate(raw)]
    plan = plan_save(ss, blob_bytes=blob, part_bytes=part, chunk_bytes=chunk, align=64)
    by_key: dict[str, list] = {}
    for b in plan.blobs:
        pos = 0
        for i, p in enumerate(b.parts):
            assert p.offset == pos and p.index == i and p.blob == b.index  # parts tile the blob
            if i < len(b.parts) - 1:
                assert p.size >= min(part, 1)  # only the last part may be small
            for c in p.chunks:
                assert p.offset <= c.offset and c.offset + c.length <= p.offset + p.size
                assert c.offset % 64 == 0
                by_key.setdefault(c.key, []).append(c)
            pos += p.size
        assert pos == b.size
        cs = sorted((c for p in b.parts for c in p.chunks), key=lambda c: c.offset)
        for x, y in zip(cs, cs[1:]):
            assert x.offset + x.length <= y.offset  # no overlap
    for s in ss:
        cs = by_key[s.key]
        assert sum(c.length for c in cs) == s.nbytes
        if s.shape:
            rows = sorted((c.row_start, c.row_end) for c in cs)
            assert rows[0][0] == 0 and rows[-1][1] == s.shape[0]
            assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
            row_bytes = s.nbytes // s.shape[0] if s.shape[0] else 0
            for c in cs:
                assert c.length == (c.row_end - c.row_start) * row_bytes
                if c.row_end - c.row_start > 1:
                    assert c.length <= max(chunk, row_bytes)


spans = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 10_000), st.integers(0, 3000)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(spans, st.integers(0, 500), st.integers(1, 4000), st.integers(1, 2000))
def test_requests_cover_each_span_exactly(raw: list, gap: int, max_req: int, split_into: int) -> None:
    # spans of one object do not overlap (as chunks in a blob)
    items, ends = [], {}
    for obj, off, n in raw:
        start = max(off, ends.get(obj, 0))
        items.append(Span(obj, start, n, len(items)))
        ends[obj] = start + n
    reqs = plan_requests(items, merge_gap=gap, max_request=max_req, split_above=max_req, split_into=split_into)
    covered = {s.target: 0 for s in items}
    for r in reqs:
        assert r.length <= max(max_req, split_into)
        for span, at, in_span, n in r.pieces:
            assert r.obj == span.obj
            assert r.offset + at == span.offset + in_span  # bytes land where they belong
            assert at + n <= r.length
            covered[span.target] += n
    for s in items:
        assert covered[s.target] == s.length
    # merged requests waste at most the gaps they bridge
    assert sum(r.length for r in reqs) <= sum(s.length for s in items) + gap * max(len(items), 1)
    # and at most FREE_GAP per span plus GAP_SHARE of the wanted bytes (resharded reads stay near their share)
    wanted = sum(s.length for s in items)
    assert sum(r.length for r in reqs) - wanted <= FREE_GAP * len(items) + GAP_SHARE * wanted
