"""crc32c over buffers, hardware-accelerated, releasing the GIL."""
from __future__ import annotations

import crc32c as _crc32c


def crc32c(data: memoryview | bytes | bytearray, value: int = 0) -> int:
    """crc32c of ``data`` continuing from ``value`` (0 to start)."""
    return _crc32c.crc32c(data, value)
