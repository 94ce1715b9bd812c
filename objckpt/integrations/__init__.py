"""Adapters between objckpt and training frameworks; each module imports its framework itself,
so ``import objckpt`` never does."""
