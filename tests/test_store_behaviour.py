"""What S3 implementations do with the requests objckpt relies on, and what objckpt does there.

The first half measures stores with :func:`testkit.store_probe.probe` (boto3, the reference
client) and asserts each fact the docs' table of S3 implementations states; each test is one
column of that table, parametrized by store, so a cell cites ``test_<column>[<store>]``:

* ``moto``: moto's S3 server (the ``moto_endpoint`` of conftest);
* ``server``: the project's test server (``testkit/s3server.py``) as it starts: checksums
  checked, S3's 5 MiB minimum part size;
* ``server-unchecked``: the same after ``check_checksums(False)`` (behaves as Ceph RGW does
  with checksums: accepted unchecked, none reported back);
* ``server-no-minimum``: ``S3Server(min_part_size=0)``.

Two more stores check that the probe tells a "no" when it sees one: moto behind a proxy that
drops ``If-None-Match`` (``moto-ignoring-if-none-match``) and the test server answering
DeleteObjects ``501 NotImplemented`` (``server-without-delete-objects``).

The second half (``test_objckpt_*``) is what objckpt does on such stores, where no other test
already shows it.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, Iterator, List, Tuple

import boto3
import pytest
import torch

import objckpt
from conftest import assert_same, make_bucket
from testkit.http_count import CountingProxy, DropsIfNoneMatch
from testkit.s3server import S3Server
from testkit.store_probe import PART_CHECKSUM_REFUSALS, StoreFacts, make_client, probe

MiB = 1 << 20
_PROBE_PREFIX = "objckpt-store-probe/"


# ---- measuring the stores -------------------------------------------------------------------
class _Measured:
    """One store's facts and what the probe left under its prefix (objects, open uploads)."""

    def __init__(self, facts: StoreFacts, left: List[str]) -> None:
        self.facts, self.left = facts, left


def _probe_and_look(endpoint: str, bucket: str) -> _Measured:
    facts = probe(endpoint, bucket, "testing", "testing")
    s3 = make_client(endpoint, "testing", "testing")
    left = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=_PROBE_PREFIX).get("Contents", [])]
    left += [u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket, Prefix=_PROBE_PREFIX).get("Uploads", [])]
    return _Measured(facts, left)


def _on_server(setup: Callable[[S3Server], None], **kw: Any) -> _Measured:
    with S3Server(**kw) as srv:
        setup(srv)
        make_client(srv.endpoint_url, "testing", "testing").create_bucket(Bucket="probe")
        return _probe_and_look(srv.endpoint_url, "probe")


def _moto(endpoint: str) -> _Measured:
    return _probe_and_look(endpoint, make_bucket(endpoint))


def _moto_ignoring_if_none_match(endpoint: str) -> _Measured:
    bucket = make_bucket(endpoint)
    with DropsIfNoneMatch(endpoint) as proxy:
        return _probe_and_look(proxy.url, bucket)


_STORES: Dict[str, Callable[[str], _Measured]] = {
    "moto": _moto,
    "moto-ignoring-if-none-match": _moto_ignoring_if_none_match,
    "server": lambda _: _on_server(lambda s: None),
    "server-unchecked": lambda _: _on_server(lambda s: s.check_checksums(False)),
    "server-no-minimum": lambda _: _on_server(lambda s: None, min_part_size=0),
    "server-without-delete-objects": lambda _: _on_server(
        lambda s: s.fail("DeleteObjects", 100, 501, "NotImplemented")),
}


@pytest.fixture(scope="module")
def measured(moto_endpoint: str) -> Iterator[Callable[[str], _Measured]]:
    """Each store probed once for the module (a probe is a few requests and 6 MiB)."""
    done: Dict[str, _Measured] = {}

    def get(store: str) -> _Measured:
        if store not in done:
            done[store] = _STORES[store](moto_endpoint)
        return done[store]

    yield get


def _noted(facts: StoreFacts, start: str) -> str:
    """The probe's note that starts with ``start`` ("" when none)."""
    return next((n for n in facts.notes if n.startswith(start)), "")


# ---- the table: one test per column -----------------------------------------------------------
@pytest.mark.parametrize("store, put, complete", [
    pytest.param("moto", True, True, id="moto"),
    pytest.param("server", True, True, id="server"),
    pytest.param("moto-ignoring-if-none-match", False, False, id="moto-ignoring-if-none-match"),
])
def test_conditional_create(measured: Callable[[str], _Measured], store: str, put: bool, complete: bool) -> None:
    """PutObject / CompleteMultipartUpload with ``If-None-Match: *`` on an existing key:
    refused with 412 (True), or the object replaced (False)."""
    facts = measured(store).facts
    assert (facts.put_if_none_match, facts.complete_if_none_match) == (put, complete), facts
    if not put:
        assert "object now b'second'" in _noted(facts, "PutObject If-None-Match"), facts.notes


@pytest.mark.parametrize("store, checked, echoed", [
    pytest.param("moto", False, False, id="moto"),
    pytest.param("server", True, True, id="server"),
    pytest.param("server-unchecked", False, False, id="server-unchecked"),
])
def test_part_checksums_checked(measured: Callable[[str], _Measured], store: str, checked: bool,
                                echoed: bool) -> None:
    """UploadPart (and PutObject) with a wrong ``x-amz-checksum-crc32c`` refused with a 400
    (BadDigest here), or stored as sent; and whether UploadPart's answer echoes the checksum
    (what objckpt's "does not check part checksums" warning keys on)."""
    facts = measured(store).facts
    assert (facts.part_checksum_checked, facts.put_checksum_checked, facts.part_checksum_echoed) == (
        checked, checked, echoed), facts
    said = _noted(facts, "UploadPart with a wrong crc32c")
    if checked:
        assert said.split()[-2:] in (["400", c] for c in PART_CHECKSUM_REFUSALS), said
    else:
        assert said.endswith("accepted"), said
        # the SDK's x-amz-sdk-checksum-algorithm beside it changes nothing
        assert _noted(facts, "UploadPart with x-amz-sdk-checksum-algorithm").endswith("accepted"), facts.notes


@pytest.mark.parametrize("store, put, multipart, complete", [
    pytest.param("moto", False, True, False, id="moto"),
    pytest.param("server", True, True, True, id="server"),
    pytest.param("server-unchecked", False, False, False, id="server-unchecked"),
])
def test_checksums_returned(measured: Callable[[str], _Measured], store: str, put: bool, multipart: bool,
                            complete: bool) -> None:
    """HEAD with ``x-amz-checksum-mode: ENABLED`` returns ``x-amz-checksum-crc32c`` of a
    PutObject that carried one / of an object uploaded in parts with crc32c; the
    CompleteMultipartUpload answer carries ``ChecksumCRC32C``."""
    facts = measured(store).facts
    assert (facts.head_checksum_put, facts.head_checksum_multipart, facts.complete_returns_checksum) == (
        put, multipart, complete), facts
    said = _noted(facts, "multipart crc32c")
    if store == "server":  # S3's composite form: crc32c of the part crcs, "-<parts>"
        assert re.search(r"Complete answered \S+==-2, HEAD \S+==-2$", said), said
    if store == "moto":
        # moto keeps a PutObject's checksum only when x-amz-sdk-checksum-algorithm names it, and
        # gives a multipart object's composite without its "-<parts>"
        assert not _noted(facts, "HEAD checksum of a PutObject sent with").endswith("none"), facts.notes
        assert re.search(r"HEAD [^\s-]+==$", said), said


@pytest.mark.parametrize("store, supported", [
    pytest.param("moto", True, id="moto"),
    pytest.param("server", True, id="server"),
    pytest.param("server-without-delete-objects", False, id="server-without-delete-objects"),
])
def test_delete_objects(measured: Callable[[str], _Measured], store: str, supported: bool) -> None:
    """DeleteObjects removes the keys it names (False: refused, here 501 NotImplemented)."""
    facts = measured(store).facts
    assert facts.delete_objects is supported, facts
    if not supported:
        assert _noted(facts, "DeleteObjects") == "DeleteObjects: 501 NotImplemented", facts.notes


@pytest.mark.parametrize("store, enforced", [
    pytest.param("moto", True, id="moto"),
    pytest.param("server", True, id="server"),
    pytest.param("server-no-minimum", False, id="server-no-minimum"),
])
def test_minimum_part_size(measured: Callable[[str], _Measured], store: str, enforced: bool) -> None:
    """A non-last part of 64 KiB: CompleteMultipartUpload refuses with 400 EntityTooSmall
    (True) or accepts it (False)."""
    facts = measured(store).facts
    assert facts.min_part_size_enforced is enforced, facts
    said = _noted(facts, "Complete with a")
    assert said.endswith("400 EntityTooSmall" if enforced else "accepted"), said


@pytest.mark.parametrize("store", sorted(_STORES))
def test_the_probe_leaves_nothing_behind(measured: Callable[[str], _Measured], store: str) -> None:
    """Every object and upload the probe made is gone, on every store, whatever it answered
    (its cleanup deletes one key at a time: it works without DeleteObjects); every fact is a
    yes or a no (no unexpected answer)."""
    m = measured(store)
    assert m.left == [], m.left
    assert None not in [getattr(m.facts, f) for f in StoreFacts.__dataclass_fields__ if f != "notes"], m.facts
    assert not [n for n in m.facts.notes if "unexpected" in n or "cleanup" in n], m.facts.notes


# ---- what objckpt does there --------------------------------------------------------------------
def _opts(url: str, **kw: Any) -> Dict[str, Any]:
    return {"endpoint_url": url, "aws_access_key_id": "k", "aws_secret_access_key": "s", "region_name": "us-east-1",
            "max_backoff": 0.01, **kw}


def _bucket(url: str, name: str) -> str:
    boto3.client("s3", endpoint_url=url, aws_access_key_id="k", aws_secret_access_key="s",
                 region_name="us-east-1").create_bucket(Bucket=name)
    return name


def _state(mib: int = 12) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(mib * MiB // 4, generator=g), "b": torch.randn(1001, 7, generator=g), "step": 7}


class _SeesConditions(CountingProxy):
    """The proxy, also noting (method, path, query) of each request sent with ``If-None-Match``."""

    def __init__(self, upstream: str) -> None:
        super().__init__(upstream)
        self.conditional: List[Tuple[str, str]] = []

    def _handler_class(self) -> type:
        base, proxy = super()._handler_class(), self

        class Handler(base):  # type: ignore[valid-type, misc]
            def _forward(self) -> None:
                if self.headers.get("If-None-Match") is not None:
                    proxy.conditional.append((self.command, self.path))
                super()._forward()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        return Handler


def test_objckpt_sends_if_none_match_only_on_put_object_never_on_complete() -> None:
    """A multipart save: its only conditional requests are PutObjects (the manifest, and the
    conditional-write probe's two), never a CompleteMultipartUpload, so how a store treats
    ``If-None-Match`` on Complete does not matter to objckpt."""
    with S3Server() as srv:
        proxy = _SeesConditions(srv.endpoint_url)
        with proxy:
            uri = f"s3://{_bucket(srv.endpoint_url, 'cond')}/run/ck"
            sd = _state()
            objckpt.save(sd, uri, storage_options=_opts(proxy.url), part_size=5 * MiB)
        completes = [r for r in proxy.requests if r.method == "POST" and "uploadId=" in r.query]
        assert completes, proxy.requests  # the blob was uploaded in parts
        assert [m for m, _ in proxy.conditional] == ["PUT"] * 3, proxy.conditional
        assert sorted(p.rsplit("/", 2)[-2] for _, p in proxy.conditional) == ["_objckpt_probe"] * 2 + ["ck"], \
            proxy.conditional
        assert not [p for _, p in proxy.conditional if "uploadId" in p or "partNumber" in p]
        assert_same(sd, objckpt.read(uri, storage_options=_opts(srv.endpoint_url)))


def test_objckpt_parts_are_at_least_5_mib_whatever_part_size_asks() -> None:
    """On a store that refuses non-last parts under 5 MiB (S3, moto, the test server), a save
    asked for 1 MiB parts still completes: every part but the last is 5 MiB or more (the
    store's ``min_part_size``), so a 12 MiB blob is 3 parts, not 12."""
    with S3Server() as srv:  # S3's 5 MiB minimum, EntityTooSmall below it
        uri = f"s3://{_bucket(srv.endpoint_url, 'parts')}/run/ck"
        sd = _state(12)
        objckpt.save(sd, uri, storage_options=_opts(srv.endpoint_url), part_size=1 * MiB)
        ops = srv.stats()["ops"]
        assert ops["CompleteMultipartUpload"] == 1 and ops["UploadPart"] == 3, ops
        assert_same(sd, objckpt.read(uri, storage_options=_opts(srv.endpoint_url)))


def test_objckpt_on_a_store_with_a_larger_minimum_part_fails_naming_entity_too_small() -> None:
    """objckpt assumes S3's 5 MiB minimum: on a store that asks for more (here 8 MiB) the
    save's CompleteMultipartUpload is refused, and the save fails with a StorageError naming
    the request and EntityTooSmall; nothing is committed and no upload is left open."""
    with S3Server(min_part_size=8 * MiB) as srv:
        uri = f"s3://{_bucket(srv.endpoint_url, 'bigmin')}/run/ck"
        with pytest.raises(objckpt.StorageError, match=r"CompleteMultipartUpload.*EntityTooSmall"):
            objckpt.save(_state(12), uri, storage_options=_opts(srv.endpoint_url), part_size=5 * MiB)
        b = srv.state.buckets["bigmin"]
        assert not [k for k in b.objects if k.endswith("manifest.json")] and not b.uploads, (list(b.objects), b.uploads)


def test_objckpt_on_a_store_without_delete_objects() -> None:
    """objckpt deletes only with DeleteObjects (no one-key DeleteObject fallback).  On a store
    that answers it 501 NotImplemented: a save and an overwrite still succeed, leaving what
    they would have deleted (the conditional-write probe's object, the replaced blobs); an
    explicit delete fails at once (a 501 is not retried) with a StorageError naming
    DeleteObjects and the 501."""
    with S3Server() as srv:
        srv.fail("DeleteObjects", 1000, 501, "NotImplemented")
        url, uri = srv.endpoint_url, f"s3://{_bucket(srv.endpoint_url, 'nodel')}/run/ck"
        objckpt.save(_state(1), uri, storage_options=_opts(url))
        objckpt.save(_state(1), uri, storage_options=_opts(url), overwrite=True)
        keys = sorted(srv.state.buckets["nodel"].objects)
        assert len([k for k in keys if "/_objckpt_probe/" in k]) == 1, keys
        assert len([k for k in keys if "/blobs/" in k]) == 2, keys  # the replaced attempt's blob stays
        srv.reset_stats()
        with pytest.raises(objckpt.StorageError, match=r"DeleteObjects.*501.*NotImplemented"):
            objckpt.delete(uri, storage_options=_opts(url))
        assert srv.stats()["ops"].get("DeleteObjects") == 1  # a missing operation is not asked again
        assert "DeleteObject" not in srv.stats()["ops"]
        assert objckpt.read(uri, storage_options=_opts(url))["step"] == 7  # still there


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "botocore"])
def test_objckpt_finds_a_lost_completion_on_a_store_that_returns_no_checksums(direct: bool) -> None:
    """On a store that reports no checksum (Complete's answer and HEAD say none), a
    CompleteMultipartUpload whose answer was lost is still recognised as completed, from the
    object's size and the part count its ETag ends with: the save succeeds, loads bit-exact."""
    with S3Server() as srv:
        srv.check_checksums(False)
        uri = f"s3://{_bucket(srv.endpoint_url, 'lostcrc')}/run/ck"
        opts = _opts(srv.endpoint_url, direct_http=direct)
        sd = _state(12)
        srv.lose_reply("CompleteMultipartUpload", 1)
        objckpt.save(sd, uri, storage_options=opts, part_size=5 * MiB)
        st = srv.state
        assert st.lost_replies == [] and st.ops["CompleteMultipartUpload"] == 2, st.ops  # lost, sent again
        assert not any(o.crc32c for o in st.buckets["lostcrc"].objects.values())  # no checksum to go by
        assert_same(sd, objckpt.read(uri, storage_options=opts))


def test_objckpt_a_409_conflict_on_the_manifest_create_is_not_taken_for_another_commit() -> None:
    """S3 answers a create-only PutObject that races another write of the key with 409
    ConditionalRequestConflict and asks for a retry (unlike 412, nothing says the key is
    taken).  A save whose manifest PUT gets one, with no manifest at the key, must not be
    told that another writer committed there first."""
    with S3Server() as srv:
        url = srv.endpoint_url
        _bucket(url, "conflict")
        objckpt.save(_state(12), "s3://conflict/run/a", storage_options=_opts(url), part_size=5 * MiB)
        # the next save writes its blob in parts: its one PutObject is the manifest's
        srv.fail("PutObject", 1, 409, "ConditionalRequestConflict")
        sd = _state(12)
        objckpt.save(sd, "s3://conflict/run/b", storage_options=_opts(url), part_size=5 * MiB)
        assert_same(sd, objckpt.read("s3://conflict/run/b", storage_options=_opts(url)))
