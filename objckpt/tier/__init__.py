"""Tiered checkpoints: commit to node-local storage, replicate to peers, drain to object storage.

- :mod:`.local`: the local tier (a node's folder holds ordinary objckpt checkpoints)
- :mod:`.topology`, :mod:`.peers`: which node each rank is on; copies to and repairs from peers
- :mod:`.drain`: a local step copied to object storage, manifest last, under a bandwidth cap
- :mod:`.restore`: the newest step every rank can get, agreed before any byte moves
- :mod:`.peer_restore`, :mod:`.overlay`: what a rank's load reads, received from peers into
  memory (whole chunks straight into its tensors) and read through a read-only overlay
- :mod:`.advice`: the Young/Daly checkpoint interval from measured costs

The manager (:class:`objckpt.CheckpointManager` with ``tier=TierSettings(...)``, :mod:`.settings`) ties them
together; see docs/tiering.md.
"""
