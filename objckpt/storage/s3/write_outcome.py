"""What an S3 write's 404 (or other answer readers map) means, and how a completed
multipart upload whose answer was lost is told from anything else at its key.

The pipeline (:mod:`.send`) passes a 404, a 412 and a 416 up unretried for the
caller to map: a read maps them to "not found" or "past the end".  A write has no
such meaning for them, so the store maps them here into a named
:class:`~objckpt.errors.StorageError` (a missing bucket being
:class:`~objckpt.errors.BucketNotFoundError`, decided by the store).

A ``CompleteMultipartUpload`` whose answer is lost (a reset, a timeout) may have
completed: sent again, S3 answers ``404 NoSuchUpload``, the upload being gone *because*
it completed.  Then the object at the key decides (:class:`Expected`): the size, the
part count (S3's ETag of a multipart object ends ``-<parts>``) and, when the server
reports one, the composite crc32c of the parts objckpt sent.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .request import Stored
from .retry import error_code, http_status, is_missing, is_precondition

_PARTS = re.compile(r"-(\d+)$")


def _parts_of(text: Optional[str]) -> Optional[int]:
    """The ``-<parts>`` suffix of a multipart ETag or composite checksum (None: none)."""
    m = _PARTS.search((text or "").strip().strip('"'))
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Expected:
    """The object a multipart upload makes: ``size`` bytes from ``parts`` parts, and
    the composite ``x-amz-checksum-crc32c`` (``<base64>-<parts>``) of the part crcs
    objckpt sent (None when it sent none)."""

    size: int
    parts: int
    crc32c: Optional[str] = None

    def differs(self, found: Optional[Stored]) -> Optional[str]:
        """None when ``found`` (a HEAD of the key) is this upload's object; else what
        is there instead, in words.  Part count: from the ETag, else from the checksum;
        an object that says neither is not taken for ours."""
        if found is None:
            return "no object is at the key"
        if found.size != self.size:
            return f"the object at the key has {found.size} bytes, the upload's parts {self.size}"
        parts = _parts_of(found.etag)
        if parts is None:
            parts = _parts_of(found.crc32c)
        if parts != self.parts:
            said = "neither its ETag nor its checksum says of how many parts" if parts is None else f"{parts} parts"
            return (f"the object at the key (ETag {found.etag}) is not one of {self.parts} parts: {said}")
        if self.crc32c and found.crc32c and found.crc32c.partition("-")[0] != self.crc32c.partition("-")[0]:
            return f"the object at the key has crc32c {found.crc32c}, the parts objckpt sent make {self.crc32c}"
        return None


def s3_answer(e: BaseException) -> str:
    """``HTTP <status> <code> (<message>)`` of an S3 refusal, either transport's."""
    resp = getattr(e, "response", None) or {}
    message = str(resp.get("Error", {}).get("Message", "") or "")
    code = error_code(e)
    text = f"HTTP {http_status(e) or '?'}" + (f" {code}" if code and code != str(http_status(e)) else "")
    return text + (f" ({message})" if message else "")


def upload_gone(upload_id: Optional[str]) -> str:
    """Why a multipart upload is gone before objckpt completed it, and what to do."""
    return (f"the multipart upload {upload_id} no longer exists: it was aborted meanwhile (by `objckpt gc` or a "
            "manager's leftover sweep with a grace period shorter than this save, a bucket lifecycle rule "
            "AbortIncompleteMultipartUpload, or another process); nothing was committed: save again (and give gc "
            "a grace period longer than a save takes)")


def refusal(e: BaseException, upload_id: Optional[str] = None) -> str:
    """Why S3 refused a write with an answer readers map (404, 412, 416), and what
    to check; a missing bucket is decided by the store before this is asked."""
    if error_code(e) == "NoSuchUpload":
        return upload_gone(upload_id)
    if is_missing(e):
        return ("the bucket exists, yet the endpoint answered 404 to a write: is endpoint_url the S3 API's "
                "address, with nothing in between rewriting paths?")
    if is_precondition(e):
        return "a write objckpt sent without a condition was refused as a failed precondition"
    return "a write was refused as if it were a ranged read past an object's end"
