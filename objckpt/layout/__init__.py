"""Layouts: how a checkpoint records which rank wrote which chunk (see :mod:`.base`).

* :mod:`.gathered`: format v1, every rank's boxes gathered, chunks in the manifest
  (also the manifest of a save whose pieces a source chose: :func:`sourced_manifest`).
* :mod:`.symbolic`: format v2, placements agreed by digest, chunks in per-rank indexes.
"""
from __future__ import annotations

from ..format.manifest import Manifest
from ..storage import ObjectStore
from .base import PLAN_CACHE, ManifestCommon, RankOutcome, Resolver, SaveLayout
from .gathered import GatheredLayout, InlineResolver, RankReport, check_coverage, sourced_manifest
from .symbolic import RankIndexResolver, SymbolicLayout

__all__ = ["PLAN_CACHE", "ManifestCommon", "RankOutcome", "Resolver", "SaveLayout", "GatheredLayout",
           "RankReport", "SymbolicLayout", "check_coverage", "resolver_for", "sourced_manifest"]


def resolver_for(m: Manifest, store: ObjectStore, prefix: str) -> Resolver:
    """The resolver for ``m``'s layout: inline chunks (v1) or rank index objects (v2)."""
    if m.rank_indexes:
        return RankIndexResolver(m, store, prefix)
    return InlineResolver(m)
