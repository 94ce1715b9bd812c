"""Bridges to other checkpoint systems and training stacks (DCP, Hugging Face, Lightning)."""
