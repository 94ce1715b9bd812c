"""Pure planning functions: no I/O, no collectives, easy to test at scale."""
