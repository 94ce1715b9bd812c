"""Refusals of a request's credentials, named with what to fix, on either S3 transport.

Some refusals are about the credentials, not the request, the bucket or the region:
``RequestTimeTooSkewed`` (this machine's clock), ``ExpiredToken`` and
``InvalidToken`` (the session token of temporary credentials),
``SignatureDoesNotMatch`` (the secret key) and ``InvalidAccessKeyId`` (the key id).
Sending again cannot change them, so :func:`credentials_refused` turns one into a
:class:`~objckpt.errors.CredentialsRefusedError` (a ``PermissionError``) at once,
naming the code and the fix, never the region: an expired token used to be
reported as "sent to the wrong region", a skewed clock as a bare ``HTTP 403``.

**A HEAD's refusal has no body** (S3 sends none with an answer to HEAD), so it
carries only its status; a save's first request is the manifest's HEAD.  Where a
HEAD of an object is refused with a bare 400 or 403 (:func:`is_bare`), both
transports ask a one-byte GET of the same key, whose refusal carries S3's error
XML; :func:`says_why` tells whether it named a reason (which then goes up in
place of the bare one, a region refusal included).  Only refused HEADs pay for it.
"""
from __future__ import annotations

import email.utils
import time
from typing import Any, Mapping, Optional

from ...errors import CredentialsRefusedError, NotS3EndpointError
from .answers import WrongRegion, botocore_answer
from .retry import error_code, http_status, is_missing, is_past_end

_CLOCK = ("this machine's clock and the server's differ by more than S3 allows (15 minutes), so every signature "
          "is refused: sync the clock (NTP: chronyd or systemd-timesyncd, e.g. `timedatectl set-ntp true`; in a "
          "container or VM, the host's clock)")
_EXPIRED = ("the session token of these temporary credentials has expired: refresh them (`aws sso login`, assume "
            "the role again, or a new AWS_SESSION_TOKEN with its keys) and start again; for long runs let botocore "
            "refresh them (a profile with role_arn or SSO, container or instance credentials) instead of fixed keys "
            "and a token in the environment or the storage options")
_TOKEN = ("the session token is malformed or does not belong to these keys: check aws_session_token / "
          "AWS_SESSION_TOKEN (a token left over from other credentials?)")
_SECRET = ("the server computed another signature with the secret key it holds for this access key id: check the "
           "secret access key (storage option aws_secret_access_key, AWS_SECRET_ACCESS_KEY or the profile's "
           "aws_secret_access_key; stray whitespace, another key's secret); an endpoint that wants another signing "
           "than SigV4 is served through botocore with storage option direct_http=False")
_KEY_ID = ("the server knows no such access key id: check the access key id (storage option aws_access_key_id, "
           "AWS_ACCESS_KEY_ID, or the profile chosen by storage option profile, else AWS_DEFAULT_PROFILE, else "
           "AWS_PROFILE, as botocore reads them) and that the keys "
           "belong to this endpoint (AWS keys do not work on another S3 service, nor the reverse)")

#: S3's codes for refused credentials -> what to fix
HINTS: Mapping[str, str] = {"RequestTimeTooSkewed": _CLOCK, "ExpiredToken": _EXPIRED, "InvalidToken": _TOKEN,
                            "SignatureDoesNotMatch": _SECRET, "InvalidAccessKeyId": _KEY_ID}
CREDENTIAL_CODES = frozenset(HINTS)


def _status_code(e: BaseException) -> tuple[int, str]:
    if isinstance(e, WrongRegion):
        return e.status, e.code
    return http_status(e), error_code(e)


def is_bare(e: BaseException) -> bool:
    """A 400 or 403 that names no reason: what S3 answers a HEAD it refuses."""
    status, code = _status_code(e)
    return status in (400, 403) and code in ("", str(status))


def says_why(e: BaseException) -> bool:
    """Whether ``e``, the refusal of the GET that follows a bare HEAD refusal, says more
    than the HEAD did: S3's code (a region refusal included) or an endpoint that is not
    S3.  A missing key, a range past the end, a bare status or a broken connection
    does not: the HEAD's own refusal stands."""
    if isinstance(e, NotS3EndpointError):
        return True
    if isinstance(e, WrongRegion):
        return bool(e.code) or e.region is not None
    status, code = _status_code(e)
    return bool(status) and code not in ("", str(status)) and not is_missing(e) and not is_past_end(e)


def _span(seconds: float) -> str:
    if seconds >= 5400:
        return f"about {seconds / 3600:.1f} h"
    return f"about {round(seconds / 60)} min" if seconds >= 90 else f"{seconds:.0f} s"


def clock_skew(headers: Mapping[str, str], now: Optional[float] = None) -> Optional[float]:
    """The server's clock minus this machine's, in seconds, from the answer's ``Date``
    header (None when it has none, or one that does not parse)."""
    date = headers.get("date")
    if not date:
        return None
    try:
        server = email.utils.parsedate_to_datetime(date).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return server - (time.time() if now is None else now)


def credentials_refused(e: BaseException, what: str) -> Optional[CredentialsRefusedError]:
    """The error for a refusal of the credentials (``what``: the request and where it
    went, for the message), or None when ``e`` is not one."""
    status, code = _status_code(e)
    if code not in CREDENTIAL_CODES:
        return None
    err = (getattr(e, "response", None) or {}).get("Error", {})
    said = str(err.get("Message") or "").strip()
    detail = [f"S3 said {said!r}"] if said else []
    if getattr(e, "explains_head", False):
        detail.append("a HEAD's refusal has no body: a one-byte GET of the same key named it")
    skew = None
    if code == "RequestTimeTooSkewed":
        _, headers = botocore_answer(e)
        skew = clock_skew(headers)
        if skew is not None and abs(skew) >= 60:
            side = "ahead of" if skew > 0 else "behind"
            detail.append(f"the server's clock (Date: {headers.get('date')}) is {_span(abs(skew))} {side} "
                          "this machine's")
        elif skew is not None:  # the clock that signed was off then, or the server's own clock is
            detail.append(f"the server's Date ({headers.get('date')}) is within a minute of this machine's clock")
    more = f" ({'; '.join(detail)})" if detail else ""
    out = CredentialsRefusedError(f"{what} was refused: {code} (HTTP {status}, not retried){more}: {HINTS[code]}")
    out.code, out.skew_s = code, skew
    return out


def mark_explains_head(e: Any) -> Any:
    """``e`` (the follow-up GET's refusal), marked as the reason of a bare HEAD refusal."""
    try:
        e.explains_head = True
    except AttributeError:  # pragma: no cover - every exception takes attributes
        pass
    return e
