"""What S3 requests carry and how their sockets behave, besides where they go.

Resolved once per store, with the rest of its configuration (:mod:`.config`), from
the same botocore session, the way botocore resolves them
(``Session.get_config_variable``: the environment, then the profile's section of
the AWS config file, then botocore's default), so both transports honour them:

* ``request_checksum_calculation`` (``AWS_REQUEST_CHECKSUM_CALCULATION``):
  ``when_required`` is what users set so S3-compatible stores that refuse flexible
  checksums accept uploads.  Then no part or object carries
  ``x-amz-checksum-crc32c`` and no ``CreateMultipartUpload`` carries
  ``x-amz-checksum-algorithm`` (what the storage option ``checksums=False`` does),
  unless the storage option ``checksums`` is given: an explicit option wins.  The
  server then no longer refuses a part damaged in flight; objckpt's crc32c per
  chunk in the manifest is unchanged and still checks every read, load and verify.
* ``response_checksum_validation`` (``AWS_RESPONSE_CHECKSUM_VALIDATION``):
  ``when_required`` drops ``x-amz-checksum-mode: ENABLED`` from the one HEAD that
  asks for the stored checksum (after a ``CompleteMultipartUpload`` whose answer
  was lost, :mod:`.write_outcome`); that check then compares size and part count.
* ``sdk_ua_app_id`` (``AWS_SDK_UA_APP_ID``; botocore's ``user_agent_appid``):
  ``app/<id>`` in the User-Agent of the own path, sanitized by botocore's own function.
* ``tcp_keepalive`` (``BOTOCORE_TCP_KEEPALIVE``): ``SO_KEEPALIVE`` on the
  sockets of both transports.
* ``OBJCKPT_SPLICE_BODIES`` (objckpt's): request bodies spliced on plain TCP
  (:func:`.wire.send_views`), read here so the store cache (keyed on the
  environment, :mod:`.env_state`) opens a new store when it changes.

Bad values are an :class:`S3ConfigError` naming the setting and its source, where
botocore refuses them too (``InvalidChecksumConfigError``).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

from ...logs import get_logger
from ...options import switch_word
from .setting import S3ConfigError, Setting

log = get_logger("objckpt.storage")

#: the values botocore takes for the two flexible-checksum settings (``botocore.args``)
CHECKSUM_WORDS = ("when_supported", "when_required")
#: the environment variable that turns spliced request bodies on (read when a store opens)
SPLICE_ENV = "OBJCKPT_SPLICE_BODIES"
#: botocore's longest ``user_agent_appid`` (``botocore.args.USERAGENT_APPID_MAXLEN``; longer ones are only warned of)
APP_ID_MAXLEN = 50


@dataclass(frozen=True)
class RequestSettings:
    """The settings of this module, each with its source (see the module docstring)."""

    part_checksums: Setting = Setting(True, "objckpt's default")  #: send x-amz-checksum-crc32c (and -algorithm)
    request_checksums: Setting = Setting("when_supported", "botocore's default")
    response_checksums: Setting = Setting("when_supported", "botocore's default")
    app_id: Setting = Setting(None, "not set")  #: sanitized as botocore sanitizes it; None: not set
    tcp_keepalive: Setting = Setting(False, "botocore's default")
    splice_bodies: Setting = Setting(False, "objckpt's default")

    @property
    def asks_stored_checksum(self) -> bool:
        """Whether a HEAD asks for the object's stored checksum (``x-amz-checksum-mode: ENABLED``)."""
        return self.response_checksums.value != "when_required"

    def user_agent(self) -> str:
        """The own path's User-Agent: ``objckpt``, then ``app/<id>`` as botocore appends it."""
        return "objckpt" + (f" app/{self.app_id.value}" if self.app_id.value else "")

    def describe(self) -> str:
        """What differs from the defaults, with its source, for the store's INFO line ("" when nothing)."""
        said = []
        if not self.part_checksums.value:
            said.append(f"part checksums off ({self.part_checksums.source}): no x-amz-checksum-crc32c is sent, so "
                        "the server does not check parts in flight; objckpt's crc32c per chunk still checks "
                        "every read")
        elif self.request_checksums.value == "when_required":
            said.append(f"part checksums on: {self.part_checksums.source} wins over request_checksum_calculation="
                        f"when_required ({self.request_checksums.source})")
        if not self.asks_stored_checksum:
            said.append(f"stored checksums not asked for on HEAD (response_checksum_validation=when_required, "
                        f"{self.response_checksums.source})")
        if self.app_id.value:
            said.append(f"User-Agent app/{self.app_id.value} ({self.app_id.source})")
        if self.tcp_keepalive.value:
            said.append(f"TCP keepalive ({self.tcp_keepalive.source})")
        if self.splice_bodies.value:
            said.append(f"spliced request bodies ({self.splice_bodies.source})")
        return "; ".join(said)


def resolve_request_settings(session: Any, in_file: str, checksums: Optional[bool]) -> RequestSettings:
    """The settings of botocore ``session`` (whose profile's section of the config file
    is ``in_file``, for messages) and the environment; ``checksums``: the storage option
    ``checksums`` where it was given (it wins), else None."""
    request = _checksum_setting(session, "request_checksum_calculation", in_file)
    response = _checksum_setting(session, "response_checksum_validation", in_file)
    if checksums is not None:
        part = Setting(checksums, "storage option checksums")
    elif request.value == "when_required":
        part = Setting(False, f"request_checksum_calculation=when_required, {request.source}")
    else:
        part = Setting(True, "objckpt's default")
    return RequestSettings(part, request, response, _app_id(session, in_file), _keepalive(session, in_file),
                           _splice())


def _source(session: Any, name: str, in_file: str) -> Optional[str]:
    """Where botocore takes config variable ``name`` from: its environment variable when
    one is set (even empty: botocore takes it), else the profile's key; None: its default."""
    key, env = session.session_var_map[name][:2]
    for n in [env] if isinstance(env, str) else env or []:
        if n in os.environ:
            return f"environment variable {n}"
    if key and session.get_scoped_config().get(key) is not None:
        return f"{key} in {in_file}"
    return None


def _checksum_setting(session: Any, name: str, in_file: str) -> Setting:
    """One flexible-checksum setting, lower-cased and checked as botocore's client does
    (``ClientArgsCreator._handle_checksum_config``); a botocore without it: the default."""
    if name not in session.session_var_map:
        return Setting("when_supported", "botocore's default (this botocore does not have the setting)")
    source = _source(session, name, in_file)
    if source is None:
        return Setting("when_supported", "botocore's default")
    raw = session.get_config_variable(name)
    value = raw.lower() if isinstance(raw, str) else raw
    if value not in CHECKSUM_WORDS:
        raise S3ConfigError(name, source, f"{raw!r} is not one of {', '.join(CHECKSUM_WORDS)} (botocore refuses it "
                                          "too: InvalidChecksumConfigError)")
    return Setting(value, source)


def _app_id(session: Any, in_file: str) -> Setting:
    """botocore's ``user_agent_appid`` (``sdk_ua_app_id``, ``AWS_SDK_UA_APP_ID``), sanitized
    by botocore's function as its User-Agent builder does."""
    if "user_agent_appid" not in session.session_var_map:
        return Setting(None, "not set")
    raw = session.get_config_variable("user_agent_appid")
    if raw is None:
        return Setting(None, "not set")
    from botocore.useragent import sanitize_user_agent_string_component

    source = _source(session, "user_agent_appid", in_file) or "botocore"
    if len(raw) > APP_ID_MAXLEN:  # botocore warns and sends it whole
        log.warning("The configured value for user_agent_appid (%s) exceeds the maximum length of %d characters.",
                    source, APP_ID_MAXLEN)
    return Setting(sanitize_user_agent_string_component(raw, allow_hash=True) or None, source)


def _keepalive(session: Any, in_file: str) -> Setting:
    """botocore's ``tcp_keepalive`` (``BOTOCORE_TCP_KEEPALIVE``, the profile's ``tcp_keepalive``;
    ``ensure_boolean``: only ``true``, any case, is on)."""
    if "tcp_keepalive" not in session.session_var_map:
        return Setting(False, "botocore's default")
    on = bool(session.get_config_variable("tcp_keepalive"))
    return Setting(on, _source(session, "tcp_keepalive", in_file) or "botocore's default")


def _splice() -> Setting:
    """``OBJCKPT_SPLICE_BODIES``: opt-in, off by default.

    Why off: splicing saves the client about a quarter of a save's CPU (0.40 -> 0.29
    CPU-s/GB, 1.03 GiB, local server), but in the same runs it made saves no faster
    warm, 12% slower cold, and 2-rank saves 15-25% slower (ranks and server sharing
    the cores), and wall time is what a training job waits on
    (``benchmarks/results/splice-cold-warm.json``, docs/benchmarks.md)."""
    raw = os.environ.get(SPLICE_ENV, "").strip()
    if not raw:
        return Setting(False, "objckpt's default")
    on = switch_word(raw)
    source = f"environment variable {SPLICE_ENV}"
    if on is None:
        raise S3ConfigError(SPLICE_ENV, source, f"{raw!r}: expected on/off (1/true/yes, 0/false/no)")
    return Setting(on, source)


def keepalive_socket(addr_info: Any) -> socket.socket:
    """A socket for aiohttp's connector (its ``socket_factory``) with ``SO_KEEPALIVE`` on,
    as botocore's ``tcp_keepalive`` asks (aiobotocore ignores botocore's socket options)."""
    family, type_, proto = addr_info[:3]
    sock = socket.socket(family=family, type=type_, proto=proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return sock
