"""AWS Signature Version 4 for S3 requests: it signs, nothing else.

objckpt's own transport (:mod:`.direct`) signs every request with it so that
a restore or save needs neither aiobotocore nor aiohttp (together 0.5-0.7 s of imports
and client set-up in a new process, before the first byte).  The payload is
never hashed (``UNSIGNED-PAYLOAD``, as the botocore client is configured too):
integrity is objckpt's own crc32c per chunk.

Credentials come from :mod:`.credentials`.
"""
from __future__ import annotations

import datetime
import hashlib
import hmac
import threading
from typing import Mapping, Optional
from urllib.parse import quote

from .credentials import Credentials

UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


def quote_path(path: str) -> str:
    """S3's URI encoding of a path: every byte but unreserved characters and ``/``."""
    return quote(path, safe="/~")


def canonical_query(params: Mapping[str, str]) -> str:
    """The query string as SigV4 signs it (and as it is sent): sorted, encoded."""
    return "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}" for k, v in sorted(params.items()))


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


class Signer:
    """Signs S3 requests for one region; the derived key is cached per day and secret."""

    def __init__(self, region: str, service: str = "s3") -> None:
        self.region = region
        self.service = service
        self._lock = threading.Lock()
        self._key: tuple[str, str, bytes] = ("", "", b"")

    def _signing_key(self, secret: str, day: str) -> bytes:
        with self._lock:
            if self._key[0] == day and self._key[1] == secret:
                return self._key[2]
        k = _hmac(("AWS4" + secret).encode(), day)
        for part in (self.region, self.service, "aws4_request"):
            k = _hmac(k, part)
        with self._lock:
            self._key = (day, secret, k)
        return k

    def headers(self, method: str, path: str, query: str, host: str, creds: Credentials,
                now: Optional[datetime.datetime] = None, *, extra: Mapping[str, str] = {}) -> dict[str, str]:
        """The headers that authenticate ``method path?query`` on ``host``.

        ``path`` is already URI-encoded (:func:`quote_path`) and ``query`` is the
        canonical query string (sorted, encoded; empty for plain GET/HEAD).
        ``extra``: other headers the request carries; its ``x-amz-*`` ones are signed
        too (S3 refuses unsigned ones, e.g. requester-pays or SSE-KMS headers).
        """
        t = now or datetime.datetime.now(datetime.timezone.utc)
        amz_date = t.strftime("%Y%m%dT%H%M%SZ")
        day = amz_date[:8]
        hdrs = {k.lower(): str(v) for k, v in extra.items() if k.lower().startswith("x-amz-")}
        hdrs.update({"host": host, "x-amz-content-sha256": UNSIGNED_PAYLOAD, "x-amz-date": amz_date})
        if creds.token:
            hdrs["x-amz-security-token"] = creds.token
        names = sorted(hdrs)
        canonical = "\n".join([
            method, path, query, "".join(f"{n}:{hdrs[n].strip()}\n" for n in names), ";".join(names),
            UNSIGNED_PAYLOAD,
        ])
        scope = f"{day}/{self.region}/{self.service}/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        sig = hmac.new(self._signing_key(creds.secret_key, day), to_sign.encode(), hashlib.sha256).hexdigest()
        given = {k.lower() for k in extra}  # the caller sends those itself
        out = {k: v for k, v in hdrs.items() if k != "host" and k not in given}
        out["authorization"] = (f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
                                f"SignedHeaders={';'.join(names)}, Signature={sig}")
        return out
