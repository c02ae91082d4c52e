"""Page-cache residency (mincore, cachestat) of byte ranges: lets a loader pick buffered reads
for data that is already in memory and O_DIRECT for data that must come from the device, or
copy resident bytes from a mapping."""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from functools import lru_cache
from typing import Callable, Iterable, Optional

__all__ = ["resident_bytes_of_ranges", "cached_pages", "sample_windows", "sampled_pages",
           "mapped_residency", "advise",
           "PAGE_BYTES", "MADV_SEQUENTIAL", "MADV_WILLNEED", "MADV_POPULATE_READ"]

PAGE_BYTES = mmap.PAGESIZE
#: cachestat(2) (Linux >= 6.5): the number is 451 in the generic and the x86_64 tables
_CACHESTAT = 451 if os.uname().sysname == "Linux" and os.uname().machine in (
    "x86_64", "aarch64") else None
_cachestat_ok = [_CACHESTAT is not None]
#: the process's own C library (dlopen(NULL): no library search, so no file is read on a
#: first use inside a measured load)
_SELF = ctypes.CDLL(None, use_errno=True)
_SELF.syscall.restype = ctypes.c_long
_SELF.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_SELF.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore: bit 0 of each byte = resident
MADV_SEQUENTIAL = getattr(mmap, "MADV_SEQUENTIAL", 2)
MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", 3)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14


def mapped_residency(addr: int, length: int) -> Optional[bytes]:
    """One byte per page of the mapped ``[addr, addr + length)`` (``addr`` page aligned): 1
    in the page cache, 0 not; None when ``mincore`` fails (unknown)."""
    pages = (length + PAGE_BYTES - 1) // PAGE_BYTES
    vec = (ctypes.c_ubyte * pages)()
    if _SELF.mincore(ctypes.c_void_p(addr), length, vec) != 0:
        return None
    return bytes(vec).translate(_LOW_BIT)


def advise(addr: int, length: int, advice: int) -> int:
    """``madvise`` on a mapping, best effort (0, or -1 where the kernel refuses the advice:
    an older kernel's EINVAL just leaves the pages to be faulted in on first touch)."""
    return int(_SELF.madvise(addr, length, advice))


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("nr_cache", "nr_dirty", "nr_writeback",
                                                "nr_evicted", "nr_recently_evicted")]


def cached_pages(fd: int, offset: int, length: int) -> Optional[int]:
    """Pages of ``fd``'s bytes ``[offset, offset + length)`` in the page cache, counted by the
    kernel in one call (``cachestat``: 4-20x faster than ``mincore`` here); None where the
    kernel has no cachestat (callers fall back to mincore)."""
    if _CACHESTAT is None or not _cachestat_ok[0]:
        return None
    if length <= 0:
        return 0
    rng, stat = _Range(offset, length), _Stat()
    if _SELF.syscall(ctypes.c_long(_CACHESTAT), ctypes.c_long(fd), ctypes.byref(rng),
                     ctypes.byref(stat), ctypes.c_long(0)) != 0:
        _cachestat_ok[0] = False  # ENOSYS (older kernel) or a seccomp filter: stop asking
        return None
    return int(stat.nr_cache)


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def sample_windows(off: int, n: int, sample_bytes: int) -> list[tuple[int, int]]:
    """``(off, n)`` itself, or evenly spread windows of ``sample_bytes`` covering a sample."""
    if sample_bytes <= 0 or n <= 4 * sample_bytes:
        return [(off, n)]
    count = max(4, n // (64 * sample_bytes))  # about 1/64 of the range
    step = (n - sample_bytes) // (count - 1)
    return [(off + i * step, sample_bytes) for i in range(count)]


def sampled_pages(off: int, n: int, sample_bytes: int,
                  count: Callable[[int, int], Optional[int]]) -> Optional[tuple[int, int]]:
    """(resident, seen) pages over the sample windows of bytes ``[off, off + n)``;
    ``count(start, length)``: resident pages of a page-aligned byte range, None when unknown
    (then None)."""
    hit = seen = 0
    for w_off, w_n in sample_windows(off, n, sample_bytes):
        first, last = w_off // PAGE_BYTES, (w_off + w_n - 1) // PAGE_BYTES
        got = count(first * PAGE_BYTES, (last - first + 1) * PAGE_BYTES)
        if got is None:
            return None
        hit, seen = hit + got, seen + last - first + 1
    return hit, seen


def _resident_bytes(ranges: list[tuple[int, int]], sample_bytes: int,
                    count: Callable[[int, int], Optional[int]]) -> Optional[int]:
    """Resident bytes of ``ranges``, each scaled from its sampled pages (None: unknown)."""
    resident = 0
    for off, n in ranges:
        got = sampled_pages(off, n, sample_bytes, count)
        if got is None:
            return None
        resident += round(n * got[0] / got[1]) if got[1] else 0
    return resident


def resident_bytes_of_ranges(path: str, ranges: Iterable[tuple[int, int]], *,
                             sample_bytes: int = 64 << 10,
                             strict: bool = False) -> tuple[int, int]:
    """(resident, total) bytes of ``ranges`` ((offset, length) pairs) in the page cache.

    Counted by ``cachestat`` where the kernel has it, else by ``mincore`` on a mapping of the
    file (no data is read either way). Large ranges are sampled (windows of
    ``sample_bytes`` covering about 1/64 of them, scaled up), so checking gigabytes costs
    milliseconds; ``sample_bytes=0`` checks every page. Returns (0, total) when mincore is
    unavailable, so callers treat unknown residency as cold (``strict``: raise OSError instead).
    """
    ranges = [(o, n) for o, n in ranges if n > 0]
    total = sum(n for _, n in ranges)
    size = os.path.getsize(path)
    if not ranges or size == 0:
        return 0, total
    fd = os.open(path, os.O_RDONLY)
    try:
        counted = _resident_bytes(ranges, sample_bytes,  # no mapping where it can
                                  lambda start, length: cached_pages(fd, start, length))
        if counted is not None:
            return counted, total
        libc = _libc()
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            if strict:
                raise OSError(ctypes.get_errno(), f"mmap failed on {path}")
            return 0, total

        def by_mincore(start: int, length: int) -> Optional[int]:
            vec = (ctypes.c_ubyte * (length // PAGE_BYTES))()
            if libc.mincore(ctypes.c_void_p(addr + start), length, vec) != 0:
                return None
            return len(vec) - bytes(vec).count(0)
        try:
            counted = _resident_bytes(ranges, sample_bytes, by_mincore)
            if counted is None:
                if strict:
                    raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
                return 0, total
            return counted, total
        finally:
            libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
