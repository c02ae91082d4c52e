"""An item's byte ranges as strided runs (one strided copy per run), and a partly resident
item split by page residency (the ``mapped`` backend with
``fault_budget``): its resident stretches are copied from the file mapping, its missing ones
read by positional reads of exactly the item's bytes there, both straight into the
destination.

A page cache that is being reclaimed (a VM's balloon, another job's reads) leaves a shard
with a few missing megabytes: rather than read the whole shard row by row, or fault the
missing pages in (a fault reads a whole page, the neighbouring TP ranks' bytes included),
only those rows (or, of a one-range shard, those pages' bytes) are read.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from ..planning.items import ReadItem
from .pagecache import PAGE_BYTES

__all__ = ["Run", "Stretch", "strided_runs", "touched", "run_bytes", "split_resident",
           "copy_stretch", "split_into"]

#: ``(offset, length, count, stride)``: ``count`` byte ranges of ``length``, ``stride`` apart
Run = tuple[int, int, int, int]


def strided_runs(ranges: Sequence[tuple[int, int]]) -> list[Run]:
    """``ranges`` as runs of ``(offset, length, count, stride)``: ``count`` ranges of equal
    ``length`` whose offsets step by ``stride`` (>= length), in order. A dim-1 shard's rows
    are one run (one strided copy instead of one copy per row); any ranges are covered."""
    n = len(ranges)
    if n > 2:  # the common case in C passes: every range alike, evenly spaced
        offs, lens = zip(*ranges)
        stride = offs[1] - offs[0]
        if stride >= lens[0] > 0 and lens.count(lens[0]) == n and \
                offs == tuple(range(offs[0], offs[0] + stride * n, stride)):
            return [(offs[0], lens[0], n, stride)]
    out: list[Run] = []
    i = 0
    while i < n:
        off, length = ranges[i]
        j, stride = i + 1, 0
        while j < n and ranges[j][1] == length:
            step = ranges[j][0] - ranges[j - 1][0]
            if not stride:
                if step < length:
                    break
                stride = step
            elif step != stride:
                break
            j += 1
        out.append((off, length, j - i, stride or length))
        i = j
    return out


def touched(off: int, n: int, count: int, stride: int) -> int:
    """Pages touched by a run (its span when the gaps are shorter than a page)."""
    if count == 1 or stride - n < PAGE_BYTES:
        return (off + (count - 1) * stride + n - 1) // PAGE_BYTES - off // PAGE_BYTES + 1
    return sum((row + n - 1) // PAGE_BYTES - row // PAGE_BYTES + 1
               for row in range(off, off + count * stride, stride))


def run_bytes(runs: Sequence[Run]) -> int:
    return sum(n * count for _, n, count, _ in runs)


class Stretch(NamedTuple):
    """Resident bytes of an item: ``rows`` ranges of ``length`` at ``offset`` + k x
    ``stride`` in the file, landing at byte ``pos`` of the destination, one after another."""

    pos: int
    offset: int
    length: int
    rows: int
    stride: int


def _pieces(runs: Sequence[Run], page: int, bitmap: bytes, first: int
            ) -> list[tuple[int, int, int, bool]]:
    """``(file offset, length, destination pos, resident)`` of each row of ``runs``; a
    one-range run (a whole tensor, a dim-0 shard) is cut where page residency changes."""
    out, pos = [], 0
    for off, n, count, stride in runs:
        if count == 1:
            a, end = off, off + n
            while a < end:
                i = a // page - first
                ok = bitmap[i] != 0
                j = bitmap.find(b"\x00" if ok else b"\x01", i + 1)  # next change of state
                b = end if j < 0 else min(end, (j + first) * page)
                out.append((a, b - a, pos + a - off, ok))
                a = b
        else:
            for r in range(count):
                a = off + r * stride
                out.append((a, n, pos + r * n,
                            0 not in bitmap[a // page - first:(a + n - 1) // page - first + 1]))
        pos += n * count
    return out


def split_resident(item: ReadItem, runs: Sequence[Run],
                   resident: Callable[[int, int], bytes], page: int
                   ) -> tuple[list[Stretch], list[ReadItem]]:
    """The item's resident stretches and, for the rest, ``U8`` read items of exactly its
    bytes (targets ``<target>@<pos>``: destination bytes ``[pos, pos + nbytes)``).
    ``resident(first, last)``: one byte per page, 0 = not resident."""
    spans = [(off, off + (count - 1) * stride + n) for off, n, count, stride in runs if n]
    if not spans:
        return [], []
    first = min(x for x, _ in spans) // page
    last = (max(y for _, y in spans) - 1) // page
    groups: list[tuple[bool, list[tuple[int, int, int]]]] = []
    for x, n, pos, ok in _pieces(runs, page, resident(first, last), first):
        if groups and groups[-1][0] == ok:
            groups[-1][1].append((x, n, pos))
        else:
            groups.append((ok, [(x, n, pos)]))
    stretches: list[Stretch] = []
    reads: list[ReadItem] = []
    for ok, group in groups:
        if ok:
            stretches.extend(_stretches(group))
            continue
        ranges: list[tuple[int, int]] = []
        for a, n, _ in group:  # adjacent pieces (a one-range item's pages): one range
            if ranges and ranges[-1][0] + ranges[-1][1] == a:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + n)
            else:
                ranges.append((a, n))
        pos, nbytes = group[0][2], sum(n for _, n, _ in group)
        reads.append(ReadItem(item.name, f"{item.target}@{pos}", item.file, "U8", (nbytes,),
                              item.source_shape, tuple(ranges), (nbytes,)))
    return stretches, reads


def _stretches(group: list[tuple[int, int, int]]) -> list[Stretch]:
    """Consecutive pieces (consecutive in the destination) as strided stretches."""
    out: list[Stretch] = []
    for a, n, pos in group:
        if out:
            s = out[-1]
            step = a - (s.offset + (s.rows - 1) * s.stride)
            if n == s.length and (s.rows == 1 and step >= n or step == s.stride):
                out[-1] = s._replace(rows=s.rows + 1, stride=step if s.rows == 1 else s.stride)
                continue
        out.append(Stretch(pos, a, n, 1, n))
    return out


def copy_stretch(base: torch.Tensor, flat: torch.Tensor, s: Stretch) -> None:
    """Copy one stretch from the mapping ``base`` into the destination bytes ``flat``."""
    flat[s.pos:s.pos + s.length * s.rows].view(s.rows, s.length).copy_(
        base.as_strided((s.rows, s.length), (s.stride, 1), s.offset))


def split_into(item: ReadItem, runs: Sequence[Run], base: torch.Tensor,
               resident: Callable[[int, int], bytes], dst: torch.Tensor
               ) -> Optional[tuple[list[Callable[[], object]], dict[ReadItem, torch.Tensor]]]:
    """A partly resident ``item`` bound to its destination: the copies of its resident
    stretches from the mapping ``base`` and the read items of its missing bytes with their
    views of ``dst``; None to read it whole (nothing resident, or the file is shorter than
    the item: the positional reads name the truncation)."""
    end = max(off + (count - 1) * stride + n for off, n, count, stride in runs)
    if end > base.numel():
        return None
    stretches, reads = split_resident(item, runs, resident, PAGE_BYTES)
    if not stretches:
        return None
    flat = dst.reshape(-1).view(torch.uint8)
    copies: list[Callable[[], object]] = [partial(copy_stretch, base, flat, s)
                                        for s in stretches]
    views = {r: flat[int(r.target.rsplit("@", 1)[1]):][:r.nbytes] for r in reads}
    return copies, views
