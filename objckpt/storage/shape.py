"""How to cut uploads and reads for the kind of S3 endpoint a store talks to.

One shape does not suit every target.  AWS S3 (and the fast S3-compatible
servers measured here) take multipart parts as fast as whole objects, so a save
writes a few large blobs as parallel 16 MiB parts and a load splits large
ranges into concurrent ranged GETs.  moto, the S3 server tests and laptops run,
is a Python process that ingests multipart parts at about a quarter of the
speed of single PUTs (every part is stored, then copied again on complete)
and copies the *whole* object for every ranged GET: there, a 1 GiB save in
16 MiB parts took twice as long as in single PUTs, and a load of a 1 GiB blob
as ~130 ranged GETs of 8 MiB (each copying the whole blob in the server) ran
into read timeouts.  With blobs of about 16 MiB, each written by one PUT and
read back by one GET, a 1 GiB save takes 7 s and a load 3 s (docs/benchmarks.md,
"On moto").

Neither shape changes the format: a manifest already lists several blobs per
rank, and a blob of one part is simply an object written by one PUT.

The kind is decided once per store, without timing anything: no custom
endpoint (or an ``*.amazonaws.com`` one) is ``"s3"``; any other endpoint is
asked one HeadBucket, and a ``Server: Werkzeug/...`` answer (moto's server,
standalone, ``ThreadedMotoServer`` or the moto Docker image) is ``"moto"``.  An
endpoint that does not answer the probe keeps ``"s3"``: the shape that is right
for every S3 implementation, merely slower on moto.  Overrides: the storage
option ``endpoint_kind`` (``"auto"``, ``"s3"``, ``"moto"``) and, for a save,
explicit ``blob_size`` / ``part_size``.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

from ..logs import get_logger
from ..units import MiB

log = get_logger("objckpt.storage")

#: what the ``endpoint_kind`` storage option accepts
KINDS = ("auto", "s3", "moto")
#: how long the one probe of an unknown endpoint may take before it counts as "s3"
PROBE_TIMEOUT_S = 5.0
#: a request size no blob reaches: a request covers a whole blob
WHOLE = 1 << 62


@dataclass(frozen=True)
class UploadShape:
    """Blob and part sizes a save packs to when the caller gives none.  A part
    size of at least the blob size makes every blob one PUT."""

    blob_size: int
    part_size: int


@dataclass(frozen=True)
class ReadShape:
    """How wanted byte spans become ranged GETs (see :func:`objckpt.planning.ranges.plan_requests`)."""

    merge_gap: int
    max_request: int
    split_above: int
    split_into: int


@dataclass(frozen=True)
class Shape:
    """The upload and read shape of one endpoint kind."""

    kind: str
    upload: UploadShape
    read: ReadShape


#: AWS S3 and every store that is not known to prefer another shape (today's defaults)
MULTIPART = Shape("s3", UploadShape(blob_size=1 << 30, part_size=16 * MiB),
                  ReadShape(merge_gap=256 << 10, max_request=16 * MiB, split_above=16 * MiB, split_into=8 * MiB))
#: moto: blobs of ~16 MiB (at most 32 MiB: a blob closes at the first chunk that reaches 16 MiB),
#: one PUT each, several in flight; each blob read by one GET, so the server copies it once.
#: Measured on 2 cores at 1 GiB: 8, 16 and 32 MiB blobs within noise of each other, 16 MiB
#: the most consistent; concurrency 8 and 32 alike, so the store's concurrency is kept.
SINGLE_PUT = Shape("moto", UploadShape(blob_size=16 * MiB, part_size=16 * MiB),
                   ReadShape(merge_gap=256 << 10, max_request=WHOLE, split_above=WHOLE, split_into=WHOLE))
SHAPES = {"s3": MULTIPART, "moto": SINGLE_PUT}

_known: "weakref.WeakKeyDictionary[Any, Shape]" = weakref.WeakKeyDictionary()


def parse_kind(value: Any) -> str:
    """The ``endpoint_kind`` storage option, checked (None: ``"auto"``)."""
    kind = "auto" if value is None else str(value).lower()
    if kind not in KINDS:
        raise ValueError(f"storage option endpoint_kind must be one of {KINDS}, got {value!r}")
    return kind


def kind_from_url(endpoint_url: Optional[str]) -> Optional[str]:
    """``"s3"`` for AWS (no custom endpoint, or an ``amazonaws.com`` host); None
    when the URL alone cannot tell (a custom endpoint: ask it, :func:`kind_from_server`)."""
    if not endpoint_url:
        return "s3"
    host = (urlsplit(endpoint_url if "//" in endpoint_url else "//" + endpoint_url).hostname or "").lower()
    if host.endswith(".amazonaws.com") or host.endswith(".amazonaws.com.cn"):
        return "s3"
    return None


def kind_from_server(server: Optional[str]) -> str:
    """The kind from an endpoint's ``Server`` response header: moto's server is
    Werkzeug's (``Werkzeug/3.1.9 Python/3.11.7``); anything else, or no header, is ``"s3"``."""
    return "moto" if server and server.lower().startswith("werkzeug") else "s3"


async def server_header(store: Any) -> Optional[str]:
    """The ``Server`` header of one HeadBucket on ``store``'s transport, answered or
    refused alike (a 403 or 404 carries it too); None when nothing answers in time."""
    policy = getattr(store, "policy", None)
    timeout = min(PROBE_TIMEOUT_S, getattr(policy, "first_answer_timeout", PROBE_TIMEOUT_S))
    probe = getattr(store, "server_header", None)
    if probe is None:
        return None
    found, server = await probe(timeout)
    return server if found else None


async def shape_for(store: Any) -> Shape:
    """The shape for ``store``, decided once per store.  Stores without an
    ``endpoint_kind`` (local files, memory, test wrappers) get :data:`MULTIPART`,
    the shape they always had."""
    known = _known.get(store)
    if known is not None:
        return known
    kind = getattr(store, "endpoint_kind", None)
    if kind is None:
        return MULTIPART
    if kind == "auto":
        url = getattr(store, "endpoint_url", None)
        kind = kind_from_url(url)
        if kind is None:
            server = await server_header(store)
            kind = kind_from_server(server)
            log.debug("endpoint %s answers as %r: %s shape", url, server, kind)
    shape = SHAPES[kind]
    _known[store] = shape
    return shape


def save_sizes(blob_size: Optional[int], part_size: Optional[int], shape: Shape) -> tuple[int, int]:
    """(blob size, part size) of a save: each one the caller gave wins, the rest come from ``shape``."""
    return (shape.upload.blob_size if blob_size is None else blob_size,
            shape.upload.part_size if part_size is None else part_size)
