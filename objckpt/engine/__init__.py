"""Runs plans: bounded-concurrency uploads and ranged reads."""
