"""What an engine's weight loaders are handed, read from one stage's plan (vLLM's load format,
integrations/vllm.py; no engine import here, so it is testable anywhere).

TP mode ``placed``: only this TP rank's byte ranges are read, then placed at their offsets
inside a full-shaped tensor whose other elements are NaN, so the engine's loaders narrow to the
rank's part as they always do (dtypes without a NaN are read whole). ``full`` / ``sliced``:
the plan's tensors as the reader yields them."""
from __future__ import annotations

import time
from typing import Callable, Iterator, Optional

import torch

from ..io.read import Reader
from ..planning.checkpoint import DTYPES
from ..planning.plan import ReadItem
from ..stage import StagePlan

__all__ = ["NAN_DTYPES", "rchar_bytes", "stage_weights", "read_stage"]

#: Floating dtypes whose unread elements are poisoned with NaN in ``placed`` mode.
NAN_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def rchar_bytes() -> Optional[int]:
    """Bytes this process read through read syscalls so far (/proc/self/io), if available."""
    try:
        with open("/proc/self/io", "rb") as fh:
            for line in fh:
                if line.startswith(b"rchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _placed_ranges(staged: StagePlan, item: ReadItem) -> tuple[tuple[int, int], ...]:
    """The byte ranges to read for ``item``: its plan ranges, or the whole tensor for dtypes
    without a NaN to poison the unread part with (integers, fp8)."""
    entry = staged.index.entry(item.name)
    if DTYPES[item.dtype][0] not in NAN_DTYPES:
        return ((entry.start, entry.nbytes),)
    return item.ranges


def _read_compact(reader: Reader, staged: StagePlan, item: ReadItem) -> torch.Tensor:
    """The bytes of ``item``'s ranges, back to back (this rank's part only)."""
    ranges = _placed_ranges(staged, item)
    out = torch.empty(sum(n for _, n in ranges), dtype=torch.uint8)
    raw = memoryview(out.numpy()).cast("B")  # type: ignore[arg-type]
    pos, fd = 0, reader._fd(item.file)
    for offset, nbytes in ranges:
        reader._pread_into(fd, [raw[pos:pos + nbytes]], offset, item)
        pos += nbytes
    return out


def _place(staged: StagePlan, item: ReadItem, compact: torch.Tensor) -> torch.Tensor:
    """A full-shaped tensor with ``compact``'s bytes at their offsets and NaN elsewhere:
    vLLM's loaders narrow it to this rank's part."""
    entry = staged.index.entry(item.name)
    ranges = _placed_ranges(staged, item)
    out = torch.empty(item.source_shape, dtype=DTYPES[item.dtype][0])
    if ranges != ((entry.start, entry.nbytes),):
        out.fill_(float("nan"))
    raw, pos = out.reshape(-1).view(torch.uint8), 0
    for offset, nbytes in ranges:
        raw[offset - entry.start: offset - entry.start + nbytes] = compact[pos:pos + nbytes]
        pos += nbytes
    return out


def _placed_reads(staged: StagePlan, reader: Reader) -> Iterator[tuple[ReadItem, torch.Tensor]]:
    start = time.perf_counter()
    try:
        for item in staged.plan.items:
            yield item, _read_compact(reader, staged, item)
        for file, fd in list(reader._fds.items()):
            reader._check_identity(file, fd)
    finally:
        reader.close()
        reader.stats.seconds = time.perf_counter() - start


def _placed(staged: StagePlan, tp_mode: str) -> bool:
    return tp_mode == "placed" and staged.plan.topology.tp_size > 1


def stage_weights(staged: StagePlan, tp_mode: str
                  ) -> tuple[Reader, Iterator[tuple[str, torch.Tensor]]]:
    """``(reader, (name, tensor) stream)`` of the stage in the form ``tp_mode`` hands over."""
    reader = Reader(staged.plan)
    if _placed(staged, tp_mode):
        return reader, ((item.target, _place(staged, item, compact))
                        for item, compact in _placed_reads(staged, reader))
    return reader, iter(reader)


def read_stage(staged: StagePlan, tp_mode: str
               ) -> tuple[Reader, Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """Read the whole stage now (this rank's bytes, held compactly); the returned function
    streams it in the form ``tp_mode`` hands over (reload: read and agree before writing)."""
    reader = Reader(staged.plan)
    if _placed(staged, tp_mode):
        held = list(_placed_reads(staged, reader))
        return reader, lambda: ((item.target, _place(staged, item, compact))
                                for item, compact in held)
    tensors = list(reader)
    return reader, lambda: iter(tensors)
