"""The load pipeline: manifest -> template match -> resolve -> read plan -> execute.

* :mod:`.session`: the one read session every reader opens (``load``, ``read``, ``inspect``,
  copy, diff, verify, the bridges): store and prefix, the manifest, stored keys, reads.
* :mod:`.pipeline`: ``load``: matching the template; :mod:`.writeback`: the hand-back to Stateful values.
* :mod:`.optimizer_match`: another kind of optimizer's state refused before anything loads;
  :mod:`.reshard_hint`: what a plain template shaped like one rank's part is told.
* :mod:`.fill`: executing a :class:`~objckpt.planning.read_plan.ReadPlan`.
* :mod:`.ranged_get`: concurrent ranged GETs straight into place, crc32c-checked.
* :mod:`.collective`: reading once per replica group and sharing over torch.distributed.
"""
