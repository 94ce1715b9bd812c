"""torch.distributed, as objckpt uses it: the collectives seam (:mod:`.comm`) and
all knowledge of DTensor / :class:`objckpt.Shard` placements (:mod:`.placements`)."""
