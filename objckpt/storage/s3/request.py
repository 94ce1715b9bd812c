"""What S3 requests return beyond bytes: listing pages, delete outcomes, error answers.

Both transports (:mod:`.transport`) hand the store the same records, so the
store's calls read the same whatever moved the bytes: objckpt's own HTTP path
parses S3's XML answers here (with the standard library's expat parser, bounded
by the answer size the transport allows), botocore's parses them itself and its
dicts are turned into the same records.

Keys in listings are asked for with ``encoding-type=url`` (as botocore does:
XML 1.0 cannot carry every byte a key may hold) and decoded here the way
botocore decodes them (``unquote_plus``).
"""
from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional
from urllib.parse import unquote_plus
from xml.sax.saxutils import escape

from ...errors import StorageError


@dataclass(frozen=True)
class Listed:
    """One object of a listing page."""

    key: str
    size: int
    etag: Optional[str]
    mtime: Optional[float]  # seconds since the epoch


@dataclass(frozen=True)
class ListPage:
    """One ListObjectsV2 answer; ``next_token`` is None on the last page."""

    objects: list[Listed]
    next_token: Optional[str]


@dataclass(frozen=True)
class Upload:
    """One multipart upload in progress."""

    key: str
    upload_id: str
    initiated: Optional[float]


@dataclass(frozen=True)
class Stored:
    """What a HEAD with ``x-amz-checksum-mode: ENABLED`` says of an object: its size,
    ETag (a multipart object's ends ``-<parts>``) and the crc32c it was stored with, if
    the server keeps one (a multipart object's composite ends ``-<parts>`` too)."""

    size: int
    etag: Optional[str]
    crc32c: Optional[str]


@dataclass(frozen=True)
class UploadsPage:
    """One ListMultipartUploads answer; the markers are None on the last page."""

    uploads: list[Upload]
    next_key_marker: Optional[str] = None
    next_upload_id_marker: Optional[str] = None


@dataclass(frozen=True)
class DeleteError:
    """A key DeleteObjects did not delete, and S3's reason."""

    key: str
    code: str
    message: str = ""


class S3HttpError(Exception):
    """An S3 error answer, shaped like botocore's ClientError (``response``) so the
    store's error mapping and retry classification treat both alike."""

    def __init__(self, status: int, code: str, message: str, what: str, server: Optional[str] = None,
                 region: Optional[str] = None, hint: str = "") -> None:
        super().__init__(f"{what}: HTTP {status} {code or ''} {message or ''}".strip() + hint)
        self.status = status
        self.server = server  # the answer's Server header
        self.region = region  # the answer's x-amz-bucket-region (a HeadBucket's 403 carries it too)
        self.response = {"Error": {"Code": code or str(status), "Message": message},
                         "ResponseMetadata": {"HTTPStatusCode": status}}


class MalformedAnswer(StorageError):
    """An S3 answer (2xx) whose body is not the XML the operation returns."""


def xml_field(text: str, name: str) -> str:
    """The first ``<name>`` element's text of a small XML answer ("" when absent)."""
    m = re.search(rf"<{name}>(.*?)</{name}>", text, re.S)
    return m.group(1).strip() if m else ""


def _parse(text: str, what: str) -> Any:
    from xml.etree import ElementTree  # only a process that lists or deletes pays for it

    try:
        return ElementTree.fromstring(text)
    except ElementTree.ParseError as e:
        raise MalformedAnswer(f"{what}: the answer is not XML ({e}): {text[:80]!r}") from None


def _name(el: Any) -> str:
    return str(el.tag).rsplit("}", 1)[-1]  # S3 sends a namespace, some S3-compatible servers none


def _children(el: Any, name: str) -> Iterator[Any]:
    return (c for c in el if _name(c) == name)


def _text(el: Any, name: str) -> Optional[str]:
    for c in _children(el, name):
        return str(c.text or "")
    return None


def _time(text: Optional[str]) -> Optional[float]:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _key(text: Optional[str], url: bool) -> str:
    return unquote_plus(text or "") if url else (text or "")


def _url_encoded(root: Any) -> bool:
    return (_text(root, "EncodingType") or "").lower() == "url"


def _truncated(root: Any) -> bool:
    return (_text(root, "IsTruncated") or "").strip().lower() == "true"


def list_page(text: str, what: str) -> ListPage:
    """A ListObjectsV2 answer's objects and continuation token."""
    root = _parse(text, what)
    if _name(root) != "ListBucketResult":
        raise MalformedAnswer(f"{what}: answered <{_name(root)}>, not <ListBucketResult>")
    url = _url_encoded(root)
    out = [Listed(_key(_text(c, "Key"), url), int(_text(c, "Size") or 0), _text(c, "ETag"),
                  _time(_text(c, "LastModified"))) for c in _children(root, "Contents")]
    token = _text(root, "NextContinuationToken") if _truncated(root) else None
    if _truncated(root) and not token:
        raise MalformedAnswer(f"{what}: a truncated listing without NextContinuationToken")
    return ListPage(out, token or None)


def uploads_page(text: str, what: str) -> UploadsPage:
    """A ListMultipartUploads answer's uploads and next markers."""
    root = _parse(text, what)
    if _name(root) != "ListMultipartUploadsResult":
        raise MalformedAnswer(f"{what}: answered <{_name(root)}>, not <ListMultipartUploadsResult>")
    url = _url_encoded(root)
    ups = [Upload(_key(_text(u, "Key"), url), _text(u, "UploadId") or "", _time(_text(u, "Initiated")))
           for u in _children(root, "Upload")]
    if not _truncated(root):
        return UploadsPage(ups)
    key_marker = _key(_text(root, "NextKeyMarker"), url)
    if not key_marker:
        raise MalformedAnswer(f"{what}: a truncated listing without NextKeyMarker")
    return UploadsPage(ups, key_marker, _text(root, "NextUploadIdMarker") or "")


def delete_body(keys: list[str]) -> bytes:
    """DeleteObjects' request body: ``keys`` in quiet mode (only failures are answered)."""
    objects = "".join(f"<Object><Key>{escape(k)}</Key></Object>" for k in keys)
    return ('<?xml version="1.0" encoding="UTF-8"?><Delete xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Quiet>true</Quiet>{objects}</Delete>").encode()


def delete_errors(text: str, what: str) -> list[DeleteError]:
    """The keys a DeleteObjects answer says were not deleted."""
    if not text.strip():
        return []  # quiet mode, all deleted: some servers answer with no body
    root = _parse(text, what)
    if _name(root) != "DeleteResult":
        raise MalformedAnswer(f"{what}: answered <{_name(root)}>, not <DeleteResult>")
    return [DeleteError(_text(e, "Key") or "", _text(e, "Code") or "", _text(e, "Message") or "")
            for e in _children(root, "Error")]
