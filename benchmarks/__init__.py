"""Experiment harnesses for single questions (not in the wheel; run from the repository root).

Each module answers one measurement question with ``python -m benchmarks.<module>``; see
benchmarks/README.md. They may import ``pploader`` (``pploader.bench`` included); the package
never imports them.
"""
