"""Test and benchmark helpers for objckpt (not used by the library at run time)."""
