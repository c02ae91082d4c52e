"""The pinned backend's read requests (pure: no I/O, no CUDA): a plan's byte ranges as pieces,
coalesced per file and cut into slot-sized, aligned requests (io/device.py reads them;
benchmarks/disk_patterns.py measures the patterns they make on the disk).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from ..planning.items import ReadItem

__all__ = ["Piece", "Chunk", "pieces", "chunks", "interleave_files"]


class Piece(NamedTuple):
    """One piece of one item: ``length`` bytes of ``file`` at ``offset``, landing at byte
    ``pos`` of item ``target``'s buffer. (Named tuples: a stage has thousands, planned inside
    the load's clock.)"""

    file: str
    offset: int
    length: int
    target: int              # index of the item whose byte buffer receives it
    pos: int                 # byte offset in that buffer


class Chunk(NamedTuple):
    """One read request: ``length`` bytes of ``file`` from ``offset`` into one slot, then the
    H2D copies of its ``pieces`` (each at ``piece.offset - offset`` in the slot)."""

    file: str
    offset: int
    length: int
    pieces: tuple[Piece, ...]


def chunks(pieces: Sequence[Piece], slot_bytes: int, align: int = 1,
            gap_bytes: int = 0) -> list[Chunk]:
    """Coalesce the pieces of each file into runs (adjacent, overlapping, or at most
    ``gap_bytes`` apart: the gap is read and dropped), then cut every run into requests of
    ``slot_bytes`` at ``align``-ed file offsets (O_DIRECT: 4096; the last request of a run
    ends where its data ends; the reader rounds it up). A piece crossing a cut is split.
    Every request but a run's last is a full slot, so a stage is read in the fewest, largest
    requests whatever its tensors' sizes."""
    if slot_bytes % align:
        raise ValueError(f"slot of {slot_bytes} bytes is not a multiple of {align}")
    runs: list[tuple[str, int, int, list[Piece]]] = []
    for p in sorted(pieces, key=lambda p: (p.file, p.offset)):
        if runs and runs[-1][0] == p.file and p.offset <= runs[-1][2] + gap_bytes:
            f, s, e, members = runs[-1]
            members.append(p)
            runs[-1] = (f, s, max(e, p.offset + p.length), members)
        else:
            runs.append((p.file, p.offset, p.offset + p.length, [p]))
    chunks: list[Chunk] = []
    for file, start, _end, members in runs:
        base = start - start % align
        windows: dict[int, list[Piece]] = {}
        ends: dict[int, int] = {}
        for p in members:  # in file order: a window's first piece starts it
            off, stop = p.offset, p.offset + p.length
            k = (off - base) // slot_bytes
            while True:
                w_end = base + (k + 1) * slot_bytes
                z = stop if stop < w_end else w_end
                if k in windows:
                    windows[k].append(Piece(file, off, z - off, p.target, p.pos + off - p.offset))
                    if z > ends[k]:
                        ends[k] = z
                else:
                    windows[k] = [Piece(file, off, z - off, p.target, p.pos + off - p.offset)]
                    ends[k] = z
                if z >= stop:
                    break
                off, k = z, k + 1
        for k in sorted(windows):
            ps = windows[k]
            first = ps[0].offset
            w0 = max(base + k * slot_bytes, first - first % align)  # a window starting in a
            chunks.append(Chunk(file, w0, ends[k] - w0, tuple(ps)))  # gap starts at its data
    return chunks


def interleave_files(chunks: list[Chunk]) -> list[Chunk]:
    """The requests in round-robin over the files (each file still front to back): the
    readers then stream from every file at once instead of from one file at a time."""
    by_file: dict[str, list[Chunk]] = {}
    for c in chunks:
        by_file.setdefault(c.file, []).append(c)
    lists = list(by_file.values())
    out: list[Chunk] = []
    for i in range(max((len(x) for x in lists), default=0)):
        out += [x[i] for x in lists if i < len(x)]
    return out


def pieces(item: ReadItem, target: int) -> list[Piece]:
    out, pos = [], 0
    for off, n in item.ranges:
        if n:
            out.append(Piece(item.file, off, n, target, pos))
        pos += n
    return out
