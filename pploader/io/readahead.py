"""Page-cache prefetch for views of a file mapping (io/mapped.py ``cold="readahead"``): a
thread walks the consumer's spans in order, asks the kernel to read the cold ones ahead in
large asynchronous requests (``MADV_WILLNEED`` under ``MADV_SEQUENTIAL``: the device's
``read_ahead_kb`` per request, several in flight) and maps each span's pages into the process
(``MADV_POPULATE_READ``: one call instead of a fault per 4 KiB during the consumer's copy),
at most a window ahead of the consumer. ctypes drops the GIL during each call, so the
consumer copies meanwhile. Residency is looked up per span with ``mincore`` (nothing read),
so the caller learns which spans were warm without a whole-file bitmap."""
from __future__ import annotations

import threading
from typing import Sequence

from .pagecache import (MADV_POPULATE_READ, MADV_SEQUENTIAL, MADV_WILLNEED, PAGE_BYTES, advise,
                        mapped_residency)

__all__ = ["Prefetch", "merge_span", "span_of", "page_span", "resident_fraction", "advise_sequential",
           "LOOKAHEAD_BYTES"]

#: cold bytes asked for ahead of the span being mapped (requests in flight)
LOOKAHEAD_BYTES = 64 << 20


def span_of(ranges: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """(first byte, end) covering ``ranges`` ((offset, length) pairs), in C passes."""
    return min(ranges)[0], max(map(sum, ranges))


def merge_span(spans: list[tuple[int, int]], lo: int, hi: int) -> None:
    """Append bytes ``[lo, hi)`` to ``spans`` ((start, length) pairs), merged into the last
    one when they touch or overlap it (a stage's items: few long spans, not one per tensor)."""
    if spans and spans[-1][0] <= lo <= spans[-1][0] + spans[-1][1]:
        start, length = spans[-1]
        spans[-1] = (start, max(start + length, hi) - start)
    else:
        spans.append((lo, hi - lo))


def page_span(addr: int, lo: int, hi: int) -> tuple[int, int]:
    """(address, length) of the pages holding bytes [lo, hi) of a mapping at ``addr``."""
    first = lo // PAGE_BYTES * PAGE_BYTES
    return addr + first, hi - first


def resident_fraction(addr: int, length: int) -> float:
    """Share of the pages of [addr, addr + length) (page aligned) in the page cache; 0.0
    when mincore fails (unknown: treated as cold)."""
    if length <= 0:
        return 1.0
    bitmap = mapped_residency(addr, length)
    if bitmap is None:
        return 0.0
    return (len(bitmap) - bitmap.count(0)) / len(bitmap)


def advise_sequential(addr: int, length: int) -> None:
    """Fault-time readahead of a mapping in large sequential requests (best effort)."""
    advise(addr, length, MADV_SEQUENTIAL)


class Prefetch:
    """Brings ``spans`` ((address, length), page aligned, in consumption order) in ahead of
    the consumer (module docstring). ``wait(k)`` blocks until span ``k`` is mapped and
    counts it as consumed; ``cold[k]``: span ``k`` was below ``warm_fraction``
    resident when looked up. ``close()`` stops and joins the thread (at most one call in
    flight finishes first). Every call is best effort: an error (an old kernel, a file cut
    short) leaves the pages to the consumer's own faults."""

    def __init__(self, spans: Sequence[tuple[int, int]], *, window: int,
                 warm_fraction: float, lookahead: int = LOOKAHEAD_BYTES) -> None:
        self.spans, self.window = list(spans), max(window, 1)
        self.warm_fraction, self.lookahead = warm_fraction, lookahead
        self.cold = [False] * len(self.spans)
        self.done = [threading.Event() for _ in self.spans]
        self.consumed = 0
        self.stop = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="pploader-prefetch", daemon=True)
        self.thread.start()

    def _ask(self, j: int) -> None:
        addr, length = self.spans[j]
        if resident_fraction(addr, length) < self.warm_fraction:
            self.cold[j] = True
            advise(addr, length, MADV_WILLNEED)  # asynchronous: returns once queued

    def _run(self) -> None:
        try:
            ahead, asked, asked_end = 0, 0, 0  # bytes mapped; spans looked up, their end
            for k, (addr, length) in enumerate(self.spans):
                with self.cond:
                    while not self.stop and ahead - self.consumed > self.window:
                        self.cond.wait()
                    if self.stop:
                        return
                while asked < len(self.spans) and (asked <= k or
                                                   asked_end - ahead < self.lookahead):
                    self._ask(asked)
                    asked_end += self.spans[asked][1]
                    asked += 1
                advise(addr, length, MADV_POPULATE_READ)
                ahead += length
                self.done[k].set()
        finally:
            for event in self.done:  # finished or stopped: release any waiter
                event.set()

    def wait(self, k: int) -> None:
        self.done[k].wait()
        with self.cond:
            self.consumed += self.spans[k][1]
            self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.stop = True
            self.cond.notify()
        self.thread.join()

