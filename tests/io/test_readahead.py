"""io/readahead.py: the prefetch thread maps spans in order, never more than its window ahead
of the consumer, reports which spans were cold, and stops promptly when closed."""
from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path

import pytest

from pploader.io.readahead import (PAGE_BYTES, Prefetch, merge_span, page_span,
                                  resident_fraction, span_of)


def test_span_of_and_page_span() -> None:
    assert span_of([(4096, 10), (100, 5), (9000, 1)]) == (100, 9001)
    assert page_span(1 << 20, PAGE_BYTES + 7, 3 * PAGE_BYTES) == (
        (1 << 20) + PAGE_BYTES, 2 * PAGE_BYTES)


def test_merge_span_joins_touching_and_overlapping_spans_only() -> None:
    spans: list[tuple[int, int]] = []
    for lo, hi in [(0, 10), (10, 20), (15, 18), (5, 30), (40, 50), (30, 35)]:
        merge_span(spans, lo, hi)
    assert spans == [(0, 30), (40, 10), (30, 5)]   # a span behind the last one is kept apart


@pytest.fixture()
def mapped_file(tmp_path: Path):
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(64 * PAGE_BYTES))
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    yield path, ctypes.addressof(ctypes.c_char.from_buffer(mm))
    mm.close()


def test_window_bounds_how_far_ahead_and_all_spans_arrive(mapped_file) -> None:
    path, addr = mapped_file
    spans = [(addr + k * 8 * PAGE_BYTES, 8 * PAGE_BYTES) for k in range(8)]
    prefetch = Prefetch(spans, window=8 * PAGE_BYTES, warm_fraction=0.9)
    try:
        time.sleep(0.3)   # nothing consumed: at most the window (+ one span) is mapped
        assert sum(e.is_set() for e in prefetch.done) <= 2
        for k in range(len(spans)):
            prefetch.wait(k)
        assert all(e.is_set() for e in prefetch.done)
        assert resident_fraction(addr, 64 * PAGE_BYTES) == 1.0
    finally:
        prefetch.close()


def test_close_before_consuming_stops_the_thread(mapped_file) -> None:
    _, addr = mapped_file
    spans = [(addr + k * PAGE_BYTES, PAGE_BYTES) for k in range(64)]
    prefetch = Prefetch(spans, window=PAGE_BYTES, warm_fraction=0.9)
    prefetch.close()
    assert not prefetch.thread.is_alive()
    assert all(e.is_set() for e in prefetch.done)   # no waiter is left blocked


def test_cold_spans_are_reported(mapped_file) -> None:
    from pploader.bench.methods import evict
    path, addr = mapped_file
    if evict([str(path)]) > 0:
        pytest.skip("this file system keeps the pages resident (no eviction)")
    prefetch = Prefetch([(addr, 16 * PAGE_BYTES)], window=1 << 20, warm_fraction=0.9)
    try:
        prefetch.wait(0)
        assert prefetch.cold == [True]
        assert resident_fraction(addr, 16 * PAGE_BYTES) == 1.0
    finally:
        prefetch.close()
