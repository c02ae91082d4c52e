"""What an engine's weight loaders are handed, read from one stage's plan (vLLM's load format,
integrations/vllm.py; no engine import here, so it is testable anywhere).

TP mode ``placed``: the engine's loaders narrow full tensors to the rank's part as they always
do. CPU workers (the ``mapped`` backend, default): each split tensor is handed as a view of its
whole bytes in the page cache while only this rank's ranges are checked, faulted in and, when
cold, read ahead (io/mapped.py ``whole``): one copy, the engine's, touching only its part.
Other backends and GPU workers: only the rank's byte ranges are read, then placed at their
offsets inside a full-shaped tensor whose other elements are NaN (dtypes without a NaN are
read whole). ``full`` / ``sliced``: the plan's tensors as the reader yields them. Every read
goes through the read-backend seam, chosen in one place (:func:`open_reader`). Tensors are
handed under the engine's names (integrations/engine_plan.py)."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterable, Iterator, Mapping, Optional

import torch

from ..io.backend import ReadBackend, ReadOptions
from ..io.transfer import open_transfer
from ..io.mapped import MappedBackend, open_mapped  # noqa: F401 - the default backend
#   imported now, so a load's rchar (/proc/self/io, vLLM's report) counts checkpoint reads,
#   not module imports
from ..io.read import open_threaded  # noqa: F401
from ..io.registry import open_backend
from ..planning.checkpoint import DTYPES
from ..planning.plan import RankPlan, ReadItem
from ..stage import StagePlan
from .engine_plan import engine_names

__all__ = ["NAN_DTYPES", "DEFAULT_BACKEND", "rchar_bytes", "compact_plan", "open_reader",
           "whole_ranges", "stage_weights", "read_stage"]

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
    ``uint8`` tensor: any read backend reads it (io/registry.py); :func:`_place` puts the
    bytes at their offsets."""
    def compact(item: ReadItem) -> ReadItem:
        ranges = _placed_ranges(staged, item)
        size = (sum(n for _, n in ranges),)
        return ReadItem(name=item.name, target=item.target, file=item.file, dtype="U8",
                        shape=size, source_shape=size, ranges=ranges, buffer_shape=size)
    return replace(staged.plan, items=tuple(compact(i) for i in staged.plan.items),
                   redistribute=None)


def _uniform_runs(ranges: tuple[tuple[int, int], ...]) -> Optional[tuple[int, int]]:
    """(stride, run bytes) when ``ranges`` are equal runs at a constant stride (a dim-1 TP
    slice, row by row), else None."""
    if len(ranges) < 2:
        return None
    n, stride = ranges[0][1], ranges[1][0] - ranges[0][0]
    if stride < n or any(r[1] != n or r[0] - ranges[0][0] != i * stride
                         for i, r in enumerate(ranges)):
        return None
    return stride, n


def _place(staged: StagePlan, item: ReadItem, compact: torch.Tensor) -> torch.Tensor:
    """A full-shaped tensor with ``compact``'s bytes at their offsets and NaN elsewhere, on
    ``compact``'s device (transient, per tensor): vLLM's loaders narrow it to this rank's
    part. Row runs at a constant stride (dim-1 slices) are placed in one strided copy."""
    entry = staged.index.entry(item.name)
    ranges = _placed_ranges(staged, item)
    dtype = DTYPES[item.dtype][0]
    if ranges == ((entry.start, entry.nbytes),):  # read whole: already the tensor's bytes
        return compact.view(dtype).reshape(item.source_shape)
    out = torch.empty(item.source_shape, dtype=dtype, device=compact.device)
    out.fill_(float("nan"))
    raw = out.reshape(-1).view(torch.uint8)
    runs = _uniform_runs(ranges)
    if runs is not None:
        stride, n = runs
        first = ranges[0][0] - entry.start
        rows = len(ranges)
        # the rows' bytes as a [rows, stride] view of the tensor from its first run on
        block = raw[first:first + (rows - 1) * stride + n]
        torch.as_strided(block, (rows, n), (stride, 1)).copy_(compact.view(rows, n))
        return out
    pos = 0
    for offset, nbytes in ranges:
        raw[offset - entry.start: offset - entry.start + nbytes] = compact[pos:pos + nbytes]
        pos += nbytes
    return out


def _placed(staged: StagePlan, tp_mode: str) -> bool:
    return tp_mode == "placed" and staged.plan.topology.tp_size > 1


#: The backend the engine path reads with unless told otherwise (io/registry.py): views of
#: the page cache, cold pages read ahead by the kernel (the engine's copy is the only one).
DEFAULT_BACKEND = "mapped"


def _mapped_here(backend: Optional[str], device: "str | torch.device") -> bool:
    return (backend or DEFAULT_BACKEND) == "mapped" and torch.device(device).type == "cpu"


def open_reader(staged: StagePlan, plan: RankPlan, backend: Optional[str] = None,
                options: Optional[ReadOptions] = None,
                device: "str | torch.device" = "cpu",
                whole: Optional[Mapping[str, tuple[int, int]]] = None) -> ReadBackend:
    """The one place the engine path picks its read backend and device. CPU workers: host
    memory through ``backend`` (default ``mapped``, cold items read ahead into the page cache
    and handed as views too; ``whole``: targets handed as their full tensors, io/mapped.py).
    A GPU worker (``device`` cuda): the device stream (io/transfer/direct.py: pinned ring ->
    device tensors under a budget, each handed over as it lands), so the engine's ``copy_``
    is device to device; ``backend`` applies only when it loads onto that device."""
    if _mapped_here(backend, device):
        return MappedBackend(plan, options or ReadOptions(), cold="readahead", whole=whole)
    if torch.device(device).type == "cpu":
        return open_backend(plan, "cpu", options, name=backend or DEFAULT_BACKEND)
    from ..io.registry import select_backend
    try:
        name: Optional[str] = select_backend(device, backend).name if backend else None
    except ValueError:
        name = None  # a host backend (the CPU default): the device's own
    return open_transfer(replace(staged, plan=plan, transfer=None), device, options,
                         io_backend=name)


def whole_ranges(staged: StagePlan) -> dict[str, tuple[int, int]]:
    """``placed`` items whose rank ranges are not their whole tensor: target -> the tensor's
    whole byte range in its file (what the ``mapped`` backend hands as a view)."""
    out = {}
    for item in staged.plan.items:
        entry = staged.index.entry(item.name)
        if item.ranges != ((entry.start, entry.nbytes),):
            out[item.target] = (entry.start, entry.nbytes)
    return out


def _stream(staged: StagePlan, tp_mode: str, backend: Optional[str],
            options: Optional[ReadOptions], device: "str | torch.device" = "cpu"
            ) -> tuple[ReadBackend, Iterator[tuple[ReadItem, torch.Tensor]], Callable[
                [ReadItem, torch.Tensor], torch.Tensor]]:
    """(reader, (item, read tensor) pairs in plan order, how a read tensor becomes the one
    handed over) for ``tp_mode``, read onto ``device``."""
    if _placed(staged, tp_mode) and not _mapped_here(backend, device):
        reader = open_reader(staged, compact_plan(staged), backend, options, device)

        def finish(item: ReadItem, raw: torch.Tensor) -> torch.Tensor:
            return _place(staged, item, raw)
        # the reader first in zip: its end (identity checks, close) runs after the last item
        return reader, ((item, raw) for (_, raw), item in zip(reader, staged.plan.items)), \
            finish
    # placed on the mapped backend: views of whole tensors, only the rank's pages touched
    whole = whole_ranges(staged) if _placed(staged, tp_mode) else None
    reader = open_reader(staged, staged.plan, backend, options, device, whole=whole)
    return reader, ((item, t) for (_, t), item in zip(reader, staged.plan.items)), \
        lambda item, t: t


def _named(staged: StagePlan, pairs: Iterable[tuple[ReadItem, torch.Tensor]]
           ) -> Iterator[tuple[str, torch.Tensor]]:
    for item, tensor in pairs:
        for name in engine_names(staged, item):
            yield name, tensor


def stage_weights(staged: StagePlan, tp_mode: str, backend: Optional[str] = None,
                  options: Optional[ReadOptions] = None, device: "str | torch.device" = "cpu"
                  ) -> tuple[ReadBackend, Iterator[tuple[str, torch.Tensor]]]:
    """``(reader, (name, tensor) stream)`` of the stage in the form ``tp_mode`` hands over,
    under the engine's names (:func:`engine_names`); on a GPU ``device`` the tensors arrive
    on it (``placed``: the NaN fill and placement run there, per tensor)."""
    reader, pairs, finish = _stream(staged, tp_mode, backend, options, device)
    return reader, _named(staged, ((item, finish(item, raw)) for item, raw in pairs))


def read_stage(staged: StagePlan, tp_mode: str, backend: Optional[str] = None,
               options: Optional[ReadOptions] = None
               ) -> tuple[ReadBackend, Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """Read the whole stage now (this rank's bytes: views of resident pages, the rest held
    compactly); the returned function streams it in the form ``tp_mode`` hands over (reload:
    read and agree before writing)."""
    reader, pairs, finish = _stream(staged, tp_mode, backend, options)
    held = list(pairs)
    return reader, lambda: _named(staged, ((item, finish(item, raw)) for item, raw in held))
