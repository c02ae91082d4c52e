"""One file of the ``mapped`` backend (io/mapped.py): its descriptor and private mapping, and
the residency of the pages an item touches, asked of the kernel per run (``cachestat`` on a
run's span, ``mincore`` on the mapping where some page is missing), never for a whole file."""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import ReadError
from ..planning.rank_plan import RankPlan
from .mapped_split import Run, strided_runs, touched
from .pagecache import PAGE_BYTES, cached_pages, mapped_residency, sampled_pages

__all__ = ["MappedFile", "map_file", "WARM_SAMPLE_BYTES"]

#: window of the sampled whole-stage residency check (:meth:`MappedFile.nearly_resident`)
WARM_SAMPLE_BYTES = 256 << 10


@dataclass
class MappedFile:
    """One open, identity-checked file: its descriptor and private mapping (as a uint8
    tensor). Page residency is asked of the kernel only for the pages an item touches
    (a whole-file ``mincore`` bitmap costs ~0.2 µs a page on a VM): ``cachestat`` counts a
    run's span in one call, ``mincore`` lists its pages when some are missing."""

    fd: int
    base: torch.Tensor

    def resident(self, first: int, last: int) -> bytes:
        """One byte per page ``first..last`` (inclusive): 1 resident, 0 not (or unknown)."""
        pages = last - first + 1
        size = self.base.numel()
        if pages <= 0 or first * PAGE_BYTES >= size:
            return bytes(max(pages, 0))
        length = min(pages * PAGE_BYTES, size - first * PAGE_BYTES)
        bitmap = mapped_residency(self.base.data_ptr() + first * PAGE_BYTES, length)
        if bitmap is None:
            return bytes(pages)  # unknown residency: treat as cold
        return bitmap + bytes(pages - len(bitmap))  # pages past the file's end: not resident

    def missing(self, runs: Sequence[Run]) -> tuple[int, int]:
        """(pages not resident, pages touched) of ``runs`` (:func:`strided_runs`): a run
        whose gaps are shorter than a page touches every page it spans (one count); rows
        further apart are counted row by row."""
        missing = pages = 0
        for off, n, count, stride in runs:
            if n <= 0 or count <= 0:
                continue
            first = off // PAGE_BYTES
            last = (off + (count - 1) * stride + n - 1) // PAGE_BYTES
            cached = cached_pages(self.fd, first * PAGE_BYTES, (last - first + 1) * PAGE_BYTES)
            if cached is not None and cached >= last - first + 1:  # all resident: one call
                pages += touched(off, n, count, stride)
                continue
            bitmap = self.resident(first, last)
            if count == 1 or stride - n < PAGE_BYTES:
                missing, pages = missing + bitmap.count(0), pages + len(bitmap)
                continue
            for row in range(off, off + count * stride, stride):
                window = bitmap[row // PAGE_BYTES - first:(row + n - 1) // PAGE_BYTES - first + 1]
                missing, pages = missing + window.count(0), pages + len(window)
        return missing, pages

    def nearly_resident(self, lo: int = 0, hi: "int | None" = None, *,
                        missing_share: float = 0.01,
                        sample_bytes: int = WARM_SAMPLE_BYTES) -> bool:
        """At most ``missing_share`` of the pages of bytes ``[lo, hi)`` (default: the file)
        are out of the page cache, counted by ``cachestat`` over evenly spread windows of
        ``sample_bytes`` covering about 1/64 of them (``0``: every page; the kernel's count
        costs ~50 ns a page, 8 ms for a 300 MB shard). False where the kernel cannot tell,
        so callers look item by item. A few pages of a file just read can be missing, and a
        missed cold patch only costs its faults: the copy brings them in."""
        hi = self.base.numel() if hi is None else min(hi, self.base.numel())
        if hi <= lo:
            return True
        got = sampled_pages(lo, hi - lo, sample_bytes,
                            lambda start, length: cached_pages(self.fd, start, length))
        return got is not None and got[1] - got[0] <= missing_share * got[1]

    def fraction(self, ranges: tuple[tuple[int, int], ...]) -> float:
        """Share of the pages ``ranges`` touch that are resident (1.0 for no bytes)."""
        missing, pages = self.missing(strided_runs(ranges))
        return 1.0 - missing / pages if pages else 1.0


def map_file(path: str, fd: int, file: str, plan: RankPlan, *, random: bool = False) -> MappedFile:
    """Map ``fd`` privately (no data is read); ``random``: a fault reads only its page."""
    size = os.fstat(fd).st_size
    if size == 0:
        return MappedFile(fd, torch.empty(0, dtype=torch.uint8))
    try:
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise ReadError(f"cannot map {path}: {exc}", file=file,
                        rank=plan.topology.rank) from exc
    if random:
        mm.madvise(mmap.MADV_RANDOM)
    return MappedFile(fd, torch.frombuffer(mm, dtype=torch.uint8))  # holds ``mm`` while views live
