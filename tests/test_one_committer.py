"""One committer: ``objckpt/save/commit.py`` is the only place that writes a manifest
conditionally.  A save, a drain to object storage, ``objckpt.copy`` and a node folder's
metadata all commit through it, so the rules (look before deleting after a failed PUT, the
read-back that catches a store ignoring If-None-Match, a manifest of the same attempt
already there is this commit) cannot drift apart between copies of them."""
from __future__ import annotations

import re
from pathlib import Path

import objckpt

PACKAGE = Path(objckpt.__file__).parent
#: the other create-only writes, none of them a manifest: the index document, the commit
#: window's decision record, the store's conditional-write probe, and the stores themselves
#: (storage/: they implement put; testing/stores.py passes it through)
OTHER_CREATES = {"manager/index.py", "save/decision.py", "save/store_check.py", "testing/stores.py"}


def test_only_save_commit_writes_conditionally_besides_the_non_manifest_records() -> None:
    writers = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if re.search(r"\bput\([^)]*if_absent\s*=\s*(?!if_absent\b)", text):
            rel = path.relative_to(PACKAGE).as_posix()
            if not rel.startswith("storage/"):
                writers.add(rel)
    assert writers - OTHER_CREATES == {"save/commit.py"}, writers


def test_the_drain_copy_and_node_folders_commit_through_it() -> None:
    for rel in ("tier/drain.py", "ops/copy.py", "tier/local.py"):
        text = (PACKAGE / rel).read_text()
        assert re.search(r"from \.\.save\.commit import [^\n]*\bcommit(_async)?\b", text), rel
