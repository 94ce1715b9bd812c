"""Benchmark harness for objckpt and the tools it is compared with.

Run modules from the repository root, e.g. ``python -m benchmarks.bench_save_load``.
"""
