"""What an endpoint's answer says beyond its status code, on either S3 transport.

Two questions are asked of every refusal (and of the answers that start a save
or a read), by the direct path (:mod:`.direct`, raw heads and bodies) and by
botocore's (parsed responses) alike:

* **Is this S3 at all?**  An endpoint URL that points at a web page (a storage
  console's port, a dashboard, a proxy's own page) answers HTTP, so without a
  check a save read its ``200`` to the manifest's HEAD as "a checkpoint is
  already there", and a load its HTML as a corrupt manifest.  S3 and the
  S3-compatible servers sign their answers with ``x-amz-*`` headers (request
  ids; GCS's XML API ``x-goog-*``), refuse with an XML ``<Error><Code>`` body,
  and send an ``ETag`` with every object.  An answer with none of those that is
  an HTML page, or a refusal whose body is not S3's error XML, or an object
  answer without ETag, is not S3's: :class:`~objckpt.errors.NotS3EndpointError`,
  at once and never retried.  Server errors (5xx, 429) are left to the retry
  budgets: a gateway's error page in front of a real S3 is a passing failure.
* **Is the bucket in another region?**  S3 refuses a request signed for the
  wrong region with ``301 PermanentRedirect`` (and ``x-amz-bucket-region``),
  ``400 AuthorizationHeaderMalformed`` naming the ``<Region>``, or, to a HEAD,
  a bare ``400``/``301`` that says nothing; botocore's ``S3RegionRedirectorv2``
  treats exactly these as redirects, and so does :class:`WrongRegion` here.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from ...errors import NotS3EndpointError

#: error codes that always mean "this bucket is served from another region"
REDIRECT_CODES = frozenset({"PermanentRedirect", "TemporaryRedirect", "IllegalLocationConstraintException"})
_SIGNS = ("x-amz", "x-goog")
_HTML = ("text/html", "application/xhtml+xml")


class WrongRegion(Exception):
    """S3 says the request went to (or was signed for) the wrong region.

    ``region``: the bucket's region when the answer named it (header or XML),
    else None (a bare HEAD answer: ask HeadBucket).  ``signed_region``: the
    region the refused request was signed for.  The request is re-signed and
    sent again on the same transport (:mod:`.send`)."""

    def __init__(self, message: str, *, status: int, code: str, region: Optional[str], signed_region: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.region = region
        self.signed_region = signed_region


def _lower(headers: Mapping[str, Any]) -> dict[str, str]:
    return {str(k).lower(): str(v) for k, v in headers.items()}


def has_s3_signs(headers: Mapping[str, Any]) -> bool:
    """Whether the answer carries a header only S3-speaking servers send."""
    return any(str(k).lower().startswith(_SIGNS) for k in headers)


def not_s3_reason(status: int, headers: Mapping[str, Any], body: Optional[str] = None, *,
                  object_answer: bool = False) -> Optional[str]:
    """Why this answer cannot be S3's, or None when it may be.

    ``body``: the error body's text where it was read (None: unknown, as behind
    botocore); ``object_answer``: a 2xx to a HEAD or whole GET of an object,
    which S3 always sends with an ETag."""
    if status >= 500 or status == 429:
        return None
    h = _lower(headers)
    if has_s3_signs(h):
        return None
    ctype = h.get("content-type", "").split(";")[0].strip().lower()
    if ctype in _HTML:
        title = re.search(r"<title[^>]*>(.*?)</title>", body or "", re.S | re.I)
        return "an HTML page" + (f" ({title.group(1).strip()[:80]!r})" if title else "")
    if not 200 <= status < 300 and body is not None and body.strip() and "<Code>" not in body:
        return f"a body that is not S3's error XML ({body.strip()[:60]!r})"
    if object_answer and 200 <= status < 300 and "etag" not in h:
        return "an object without ETag"
    return None


def not_s3_error(endpoint: str, what: str, status: int, headers: Mapping[str, Any], reason: str) -> NotS3EndpointError:
    """The error for an answer :func:`not_s3_reason` refused, naming the endpoint."""
    ctype = _lower(headers).get("content-type") or "no Content-Type"
    return NotS3EndpointError(
        endpoint,
        f"{endpoint} is not an S3 endpoint: {what} was answered HTTP {status} ({ctype}) with {reason} and no S3 "
        "headers (is endpoint_url / AWS_ENDPOINT_URL the S3 API's address, not a console's or another service's, "
        "with no proxy in between answering for it?)")


def says_wrong_region(status: int, code: str, region: Optional[str], *, bare_head: bool) -> bool:
    """Whether an S3 refusal means "the bucket is in another region" (botocore's rules).

    ``bare_head``: the answer is to a HEAD, so it has no body to say why.  A 400 that
    carries another code (``ExpiredToken``, ``InvalidToken``, any refusal of the
    credentials) is never one: see :mod:`.refusals`."""
    if code in REDIRECT_CODES:
        return True
    if code == "AuthorizationHeaderMalformed":
        return region is not None
    if status in (301, 302, 307) and region is not None:
        return True
    return bare_head and not code and status in (301, 400)


def region_of(headers: Mapping[str, Any], body: str = "", error: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """The bucket's region an answer names: ``x-amz-bucket-region``, else the error's ``<Region>``."""
    found = _lower(headers).get("x-amz-bucket-region")
    if not found and body:
        m = re.search(r"<Region>(.*?)</Region>", body, re.S)
        found = m.group(1).strip() if m else None
    if not found and error:
        found = error.get("Region")
    return str(found) if found else None


def botocore_answer(r: Any) -> tuple[int, dict[str, str]]:
    """(status, headers) of a botocore response dict or ClientError (0, {} when it has none)."""
    resp = r if isinstance(r, dict) else getattr(r, "response", None)
    meta = (resp or {}).get("ResponseMetadata", {}) if isinstance(resp, dict) else {}
    headers = meta.get("HTTPHeaders") or {}
    return int(meta.get("HTTPStatusCode") or 0), _lower(headers) if isinstance(headers, dict) else {}


def botocore_not_s3(r: Any, *, head: bool = False, object_answer: bool = False) -> Optional[str]:
    """:func:`not_s3_reason` of a botocore response or ClientError (``head``: to a HEAD,
    which has no body).  botocore keeps no error body; one it could not parse as S3's
    XML leaves an empty code, or the bare status as the code."""
    status, headers = botocore_answer(r)
    if not status:
        return None
    body: Optional[str] = None
    if not head and not 200 <= status < 300:
        err = (getattr(r, "response", None) or {}).get("Error", {})
        parsed = str(err.get("Code", "")) not in ("", str(status))
        if not parsed and int(headers.get("content-length") or 0) > 0:
            body = "(unparsed error body)"
    return not_s3_reason(status, headers, body, object_answer=object_answer)
