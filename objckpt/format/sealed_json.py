"""Sealed JSON: the bounded reading and the self-checksum of manifests and rank indexes.

Why: a manifest is the commit record *and* the only metadata a reader trusts, so
(1) any changed byte must be detected — the object carries a ``"crc32c"`` field,
the crc32c of the *canonical* JSON of everything else (``docs/format.md`` §9.1),
which survives re-indentation by tools yet catches every changed value or key;
and (2) reading one must cost bounded memory and time, whatever it holds — the
decompressed size is capped (:func:`max_manifest_bytes`, env
``OBJCKPT_MAX_MANIFEST_BYTES``) while streaming, and nesting deeper than the
parser's recursion is refused instead of escaping as ``RecursionError``.
"""
from __future__ import annotations

import io
import json
import os
import re
import secrets
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Callable, Optional

import zstandard

from ..checksum import crc32c

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
CRC_FIELD = "crc32c"
#: the crc32c of the sealed text's bytes before this field (see :func:`seal`)
TEXT_CRC_FIELD = "crc32c_text"
MAX_BYTES_ENV = "OBJCKPT_MAX_MANIFEST_BYTES"
DEFAULT_MAX_BYTES = 256 << 20

Bad = Callable[[str], Exception]


def max_manifest_bytes() -> int:
    """The largest (decompressed) manifest or rank index a reader accepts: 256 MiB, or
    the env var ``OBJCKPT_MAX_MANIFEST_BYTES`` (read at each call, so tests and tools may set it)."""
    raw = os.environ.get(MAX_BYTES_ENV, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value > 0:
            return value
    return DEFAULT_MAX_BYTES


def canonical(obj: Any) -> bytes:
    """The canonical JSON of ``obj``: keys sorted, no spaces, ASCII only (``\\uXXXX``), no NaN."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


#: one value's canonical JSON (:func:`canonical`, as text): its dicts' keys sorted
encode_canonical = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                                    allow_nan=False).encode


@dataclass(frozen=True)
class EncodedDict:
    """A dict member of a sealed object whose values were encoded ahead, one by one, each
    as its canonical JSON (:data:`encode_canonical`): the dict's compact text (its own key
    order) and its canonical text (keys sorted) are then both joins of the same pieces,
    where encoding the whole object twice (compact, then canonical) was most of the cost
    of sealing a manifest of thousands of tensors (a 3,200-tensor manifest: 25 ms each).
    ``items``: (key, its JSON string, its value's canonical JSON) in the dict's order; the
    keys are ``str``."""

    items: list[tuple[str, str, str]]

    @classmethod
    def of(cls, d: dict[str, Any]) -> "EncodedDict":
        return cls([(k, json.dumps(k), encode_canonical(v)) for k, v in d.items()])

    def text(self, sort: bool) -> str:
        items = sorted(self.items, key=itemgetter(0)) if sort else self.items
        return "{" + ",".join([f"{q}:{v}" for _, q, v in items]) + "}"


def seal(obj: dict[str, Any], *, str_keys: Optional[bool] = None) -> bytes:
    """Compact JSON of ``obj`` in its own key order (tensor order is meaningful) with two
    fields appended last: ``crc32c_text``, the crc32c of the bytes before it (what a reader
    checks first: no re-encoding), then ``crc32c``, the crc32c of the *canonical* JSON of
    everything else, ``crc32c_text`` included (what survives re-indentation, and what
    readers that do not know ``crc32c_text`` check).  ``str_keys``: the caller knows whether
    every dict in ``obj`` has only ``str`` keys (None: :func:`only_str_keys` finds out).
    A member given as an :class:`EncodedDict` is written as the dict it stands for (every
    other dict of ``obj`` must then have only ``str`` keys: ``str_keys`` is taken as True):
    the same bytes as sealing that dict itself with its values' dicts in sorted key order."""
    body = {k: v for k, v in obj.items() if k not in (CRC_FIELD, TEXT_CRC_FIELD)}
    if not body:
        return f'{{"{CRC_FIELD}":{crc32c(canonical({}))}}}'.encode()
    # a member encoded ahead is a placeholder in both encodings (a NUL and 128 random bits:
    # no other string of the object holds it), replaced by its text (see EncodedDict)
    ahead = {k: v for k, v in body.items() if isinstance(v, EncodedDict)}
    marks: dict[str, str] = {}
    for k in ahead:
        token = "\x00" + secrets.token_hex(16)
        body[k], marks[k] = token, json.dumps(token)
    raw_s = json.dumps(body, separators=(",", ":"), allow_nan=False)
    for k, v in ahead.items():
        raw_s = _put(raw_s, marks[k], v.text(False))
    raw = raw_s.encode()
    text = raw[:-1]
    text_crc = crc32c(text)
    # the canonical crc is of what a reader parses back (int dict keys become strings, tuples
    # lists): with only string keys that is ``body`` itself as the canonical encoder writes
    # it (tuples are written as lists), so the parse is needed only for other keys
    if ahead:
        str_keys = True  # (the caller's promise: see above)
    elif str_keys is None:
        str_keys = only_str_keys(body)
    parsed = dict(body) if str_keys else json.loads(raw)
    parsed[TEXT_CRC_FIELD] = text_crc
    can_s = encode_canonical(parsed)
    for k, v in ahead.items():
        can_s = _put(can_s, marks[k], v.text(True))
    crc = crc32c(can_s.encode())
    return text + f',"{TEXT_CRC_FIELD}":{text_crc},"{CRC_FIELD}":{crc}}}'.encode()


def _put(text: str, quoted: str, value: str) -> str:
    """``text`` with its one occurrence of ``quoted`` (a placeholder's JSON) replaced by ``value``."""
    at = text.find(quoted)
    if at < 0 or text.find(quoted, at + 1) >= 0:
        raise ValueError("sealed JSON: a placeholder of a member encoded ahead was not found exactly once")
    return text[:at] + value + text[at + len(quoted):]


_SCALARS = frozenset({int, float, str, bool, type(None)})


def only_str_keys(obj: Any) -> bool:
    """Whether every dict in ``obj`` has only ``str`` keys (exactly: a subclass may encode
    otherwise), checking each list's item types in C before walking into it: a manifest's
    lists of block crcs cost one set each, not a Python step per item."""
    stack = [obj]
    while stack:
        o = stack.pop()
        t = type(o)
        if t is dict:
            if o and set(map(type, o)) != {str}:
                return False
            stack.extend(v for v in o.values() if type(v) not in _SCALARS)
        elif t is list or t is tuple:
            if not _SCALARS.issuperset(map(type, o)):
                stack.extend(v for v in o if type(v) not in _SCALARS)
        elif t not in _SCALARS:
            return False  # anything else: as the encoder and the parse make it
    return True


#: the sealed text's last bytes: its text crc, then its canonical crc, then the closing brace
_TAIL = re.compile(rb',"crc32c_text":(\d{1,10}),"crc32c":\d{1,10}\}\Z')


def _text_intact(text: bytes, obj: Any) -> bool:
    """Whether ``text`` ends exactly as :func:`seal` writes it and its ``crc32c_text`` is the
    crc32c of the bytes before that field: then every byte is as the writer wrote it, and
    the canonical re-encoding (a fifth of a large manifest's decode) is not needed."""
    m = _TAIL.search(text, max(0, len(text) - 48))
    if m is None or not isinstance(obj, dict):
        return False
    stored = int(m.group(1))
    return obj.get(TEXT_CRC_FIELD) == stored and crc32c(memoryview(text)[: m.start()]) == stored


def reseal(data: bytes) -> bytes:
    """Recompute the checksum of hand-edited manifest or rank-index JSON (for tests and tools).

    ``data`` may be zstd-compressed; the result is uncompressed canonical JSON, sealed."""
    obj = load_json(data, ValueError)
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return seal(obj)


def verify(obj: dict[str, Any], bad: Bad, *, required: bool, text_intact: bool = False) -> None:
    """Check ``obj``'s ``crc32c`` field (popping it, and ``crc32c_text``); ``required``: its
    absence is an error.  ``text_intact`` (from :func:`load_sealed`): the text's own crc
    proved every byte unchanged, so the canonical re-encoding is skipped."""
    if CRC_FIELD not in obj:
        if required:
            raise bad(f"its '{CRC_FIELD}' checksum field is missing")
        return
    stored = obj.pop(CRC_FIELD)
    if text_intact:
        obj.pop(TEXT_CRC_FIELD, None)
        return
    try:
        actual = crc32c(canonical(obj))
    except (ValueError, RecursionError) as e:
        raise bad(f"cannot be re-encoded to check its checksum ({e})") from None
    if type(stored) is not int or stored != actual:
        raise bad(f"checksum mismatch: '{CRC_FIELD}' is {stored!r}, the content has {actual} — "
                  "the object was changed or damaged after it was written")
    obj.pop(TEXT_CRC_FIELD, None)  # covered by the canonical crc just checked


def _decompress(data: bytes, limit: int, bad: Bad) -> bytes:
    out = bytearray()
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)) as r:
            while True:
                piece = r.read(min(1 << 20, limit + 1 - len(out)))
                if not piece:
                    break
                out += piece
                if len(out) > limit:
                    # the exception's traceback keeps this frame (and ``out``) alive as
                    # long as the caller keeps the error: free the bytes now
                    out.clear()
                    raise bad(_too_big(limit, "decompresses to"))
    except zstandard.ZstdError as e:
        out.clear()
        raise bad(f"bad zstd stream ({e})") from None
    return bytes(out)


def _too_big(limit: int, how: str) -> str:
    return (f"{how} more than {limit} bytes, the limit for a manifest or rank index; "
            f"if it is genuine, raise the limit with the environment variable {MAX_BYTES_ENV}")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(data: bytes, bad: Bad) -> Any:
    """zstd-decompress (when it starts with the magic) and parse, within the size bound;
    ``bad(what)`` builds the error that names the object."""
    return _parse(_text(data, bad), bad)


def load_sealed(data: bytes, bad: Bad) -> tuple[Any, bool]:
    """:func:`load_json`, and whether the text's own seal proves it unchanged (pass it to
    :func:`verify` as ``text_intact``)."""
    text = _text(data, bad)
    obj = _parse(text, bad)
    return obj, _text_intact(text, obj)


def _text(data: bytes, bad: Bad) -> bytes:
    limit = max_manifest_bytes()
    if data[:4] == ZSTD_MAGIC:
        return _decompress(data, limit, bad)
    if len(data) > limit:
        raise bad(_too_big(limit, "is"))
    return data


def _parse(data: bytes, bad: Bad) -> Any:
    try:
        return json.loads(data, parse_constant=_no_constant)
    except RecursionError:
        raise bad("nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"not valid JSON: {e}") from None
