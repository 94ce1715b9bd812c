"""The load pipeline: manifest -> template match -> resolve -> read plan -> execute.

* :mod:`.pipeline`: ``load`` / ``read`` / ``inspect``: the manifest and matching the template.
* :mod:`.fill`: executing a :class:`~objckpt.planning.read_plan.ReadPlan`.
* :mod:`.ranged_get`: concurrent ranged GETs straight into place, crc32c-checked.
* :mod:`.collective`: reading once per replica group and sharing over torch.distributed.
"""
