"""What a resolved S3 configuration depends on besides the storage options, as one key.

:mod:`.config` keeps botocore sessions and endpoint answers per state of the AWS
environment and files, and ``storage.open_store`` keys its S3 stores on
:func:`environment_state` on every call, so a change between two calls (a new
endpoint, keys refreshed, a deadline set, ``aws configure`` run meanwhile) gets a
store resolved anew.  The AWS config and credentials files enter the key by the
digest of their bytes, read again only when their stat changed or is too recent to
vouch for them (:func:`_file_digest`), so a call costs a stat per file, not a read.
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Optional

_KEPT_FILES = 32


def files_state() -> tuple[Optional[str], ...]:
    """The AWS config and credentials files' digests (:func:`_file_digest`)."""
    return tuple(_file_digest(os.path.expanduser(os.environ.get(name, default)))
                  for name, default in (("AWS_CONFIG_FILE", "~/.aws/config"),
                                        ("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")))


#: a file whose mtime is at least this much older than the stat that saw it is "settled":
#: any later write stamps a later mtime (coarse clocks tick in ms; FAT and old file systems
#: in 1-2 s), so an unchanged stat means unchanged bytes.  A younger one is read again.
_SETTLED_NS = 3_000_000_000
#: path -> (stat identity, digest of the bytes, whether the stat was settled when taken)
_digests: dict[str, tuple[tuple[int, ...], Optional[str], bool]] = {}
_now_ns = time.time_ns


def _file_digest(path: str) -> Optional[str]:
    """The sha1 of a file's bytes (None: absent or unreadable), read again only when its
    stat (device, inode, size, mtime, ctime) changed or was too recent to vouch for the
    bytes (the "racily clean" rule of git's index): a stat-based key that cannot miss a
    same-size rewrite within one timestamp tick.  The key stays the bytes' digest, so a
    file settling or a rewrite of identical bytes never makes a new session or store."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    seen = _digests.get(path)
    if seen is not None and seen[2] and seen[0] == ident:
        return seen[1]
    settled = _now_ns() - max(st.st_mtime_ns, st.st_ctime_ns) >= _SETTLED_NS
    digest = _read_digest(path)
    if len(_digests) >= _KEPT_FILES:  # AWS_CONFIG_FILE pointed at ever new files (tests)
        _digests.clear()
    _digests[path] = (ident, digest, settled)
    return digest


def _read_digest(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return hashlib.sha1(f.read()).hexdigest()
    except OSError:
        return None


#: variables outside AWS_* and OBJCKPT_S3* that a resolved configuration depends on:
#: proxies (botocore's ``get_environ_proxies``), CA files, the CRT switch, botocore's
#: ``tcp_keepalive`` and objckpt's splice switch (:mod:`.request_settings`), and HOME
#: (where ``~/.aws`` is)
_OTHER_ENV = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
              "no_proxy", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "BOTO_DISABLE_CRT",
              "BOTOCORE_TCP_KEEPALIVE", "OBJCKPT_SPLICE_BODIES", "HOME")


def environment_state() -> tuple[Any, ...]:
    """Everything besides the storage options that :meth:`S3Config.resolve` reads: every
    ``AWS_*`` and ``OBJCKPT_S3*`` variable, the few others in :data:`_OTHER_ENV`, and
    the AWS config and credentials files' bytes (read again only when their stat changed
    or is too recent to vouch for them: :func:`_file_digest`).  The store cache keys S3
    stores on it (``storage.open_store``, on every call), so a change between two calls (a
    new endpoint, keys refreshed, a deadline set, ``aws configure`` run meanwhile) gets a
    store resolved anew.  It lives here, beside the code that reads these, so the list
    cannot drift from what is read."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("AWS_", "OBJCKPT_S3"))))  # one pass
    return env, files_state(), tuple(os.environ.get(k) for k in _OTHER_ENV)
