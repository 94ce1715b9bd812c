"""Bridges to other checkpoint systems and training stacks (DCP, Hugging Face, Lightning);
each module imports its framework itself, so ``import objckpt`` never does."""
