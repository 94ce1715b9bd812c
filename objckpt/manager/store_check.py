"""Does this store honour create-only writes?  One probe per manager, before its first index update.

Why: the single-winner commit and the step index's compare-and-swap both rest
on the store refusing a create-only write (S3 ``If-None-Match: *``) when the
object exists.  Some S3-compatible stores accept the header and ignore it.
Reading each write back (:mod:`objckpt.save.commit`, :meth:`StepIndex._append`)
catches a rival write that landed before the read, not one that lands after,
so on such a store two writers can still both be told "committed".  The probe
answers the question for the store itself, deterministically: it creates a
probe object twice with the condition; a store that lets the second create
succeed ignores it.  Three requests (two PUTs, a DELETE) once per manager.

What happens then is a warning naming the store, not a refusal: one writer per
root is still safe there (docs/reliability.md, "What objckpt requires of a store").
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

from ..errors import PreconditionFailed
from ..format import keys
from ..storage import ObjectStore

PROBE_DIR = "_objckpt_index"


@dataclass(frozen=True)
class ConditionalWriteCheck:
    """The probe's verdict; ``detail`` says what the store did."""

    honoured: bool
    detail: str = ""


async def check_conditional_writes(store: ObjectStore, root: str) -> ConditionalWriteCheck:
    """Create ``<root>/_objckpt_index/probe-<random>`` twice with ``if_absent``; then delete it."""
    key = keys.join(root.strip("/"), PROBE_DIR, f"probe-{secrets.token_hex(8)}")
    await store.put(key, b"objckpt conditional-write probe", if_absent=True)
    try:
        await store.put(key, b"objckpt conditional-write probe, second create", if_absent=True)
    except PreconditionFailed:
        return ConditionalWriteCheck(True)
    finally:
        try:
            await store.delete([key])
        except Exception:  # noqa: BLE001 - a stray probe object is harmless (gc ignores it)
            pass
    return ConditionalWriteCheck(False, f"{store.describe()} accepted a second create-only write "
                                        f"(If-None-Match: *) of {key!r}: it ignores the condition")
