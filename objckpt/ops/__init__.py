"""Whole-checkpoint operations: copy, diff, delete, garbage collection and block-crc verification.

Each works on committed checkpoints as units (a manifest and the objects it
names), so it sits above :mod:`objckpt.save` and :mod:`objckpt.load` (whose
manifest readers and commit rules it reuses) and below :mod:`objckpt.api`,
the manager, the integrations and the command line, which call it.

* :mod:`.copy` -- ``objckpt.copy``: a checkpoint to another store, every chunk crc checked;
* :mod:`.diff` -- ``objckpt.diff``: what differs between two checkpoints, by crc where it can;
* :mod:`.delete` -- one checkpoint, manifest first;
* :mod:`.gc` -- what failed, killed or replaced saves left under a prefix;
* :mod:`.verify` -- every chunk's block crcs (``objckpt verify``).

The package imports nothing itself, so importing one operation does not load the others.
"""
