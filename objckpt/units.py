"""Byte units, defined once."""
KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
