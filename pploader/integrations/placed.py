"""What an engine's weight loaders are handed, read from one stage's plan (vLLM's load format,
integrations/vllm.py; no engine import here, so it is testable anywhere).

TP mode ``placed``: only this TP rank's byte ranges are read, then placed at their offsets
inside a full-shaped tensor whose other elements are NaN, so the engine's loaders narrow to the
rank's part as they always do (dtypes without a NaN are read whole). ``full`` / ``sliced``:
the plan's tensors as the reader yields them. Every read goes through the read-backend seam."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator, Optional

import torch

from ..io.backend import ReadBackend
from ..io.read import open_threaded  # noqa: F401 - the default CPU backend imported now, so
#   a load's rchar (/proc/self/io, vLLM's report) counts checkpoint reads, not module imports
from ..io.registry import open_backend
from ..planning.checkpoint import DTYPES
from ..planning.plan import RankPlan, ReadItem
from ..stage import StagePlan

__all__ = ["NAN_DTYPES", "rchar_bytes", "compact_plan", "stage_weights", "read_stage"]

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


def compact_plan(staged: StagePlan) -> RankPlan:
    """The stage's plan with each item read as its placed ranges, back to back, as one flat
    ``uint8`` tensor: any read backend reads it (io/registry.py); :func:`_place` puts the bytes
    at their offsets."""
    def compact(item: ReadItem) -> ReadItem:
        ranges = _placed_ranges(staged, item)
        size = (sum(n for _, n in ranges),)
        return ReadItem(name=item.name, target=item.target, file=item.file, dtype="U8",
                        shape=size, source_shape=size, ranges=ranges, buffer_shape=size)
    return replace(staged.plan, items=tuple(compact(i) for i in staged.plan.items),
                   redistribute=None)


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


def _placed(staged: StagePlan, tp_mode: str) -> bool:
    return tp_mode == "placed" and staged.plan.topology.tp_size > 1


def stage_weights(staged: StagePlan, tp_mode: str
                  ) -> tuple[ReadBackend, Iterator[tuple[str, torch.Tensor]]]:
    """``(reader, (name, tensor) stream)`` of the stage in the form ``tp_mode`` hands over."""
    if _placed(staged, tp_mode):
        reader = open_backend(compact_plan(staged), "cpu")
        # the reader first in zip: its end (identity checks, close) runs after the last item
        return reader, ((item.target, _place(staged, item, compact))
                        for (_, compact), item in zip(reader, staged.plan.items))
    reader = open_backend(staged.plan, "cpu")
    return reader, iter(reader)


def read_stage(staged: StagePlan, tp_mode: str
               ) -> tuple[ReadBackend, Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """Read the whole stage now (this rank's bytes, held compactly); the returned function
    streams it in the form ``tp_mode`` hands over (reload: read and agree before writing)."""
    if _placed(staged, tp_mode):
        reader = open_backend(compact_plan(staged), "cpu")
        held = [(item, compact) for (_, compact), item in zip(reader, staged.plan.items)]
        return reader, lambda: ((item.target, _place(staged, item, compact))
                                for item, compact in held)
    reader = open_backend(staged.plan, "cpu")
    tensors = list(reader)
    return reader, lambda: iter(tensors)
