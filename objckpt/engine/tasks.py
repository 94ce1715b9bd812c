"""Task helpers shared by the engines."""
from __future__ import annotations

import asyncio
from typing import Sequence


async def gather_fail_fast(tasks: Sequence["asyncio.Future[object]"]) -> None:
    """Wait for every task; on the first error cancel the rest, wait for them, raise it."""
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for d in done:
                exc = d.exception()
                if exc is not None:
                    raise exc
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
