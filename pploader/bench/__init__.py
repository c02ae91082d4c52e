"""Benchmarks: imported only by the ``pploader bench`` command, never by the core."""
