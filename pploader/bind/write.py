"""Writing a bound stage into its module's storage, in place (used by load, reload, layerwise).

Three paths, chosen per item: contiguous CPU slots of the checkpoint dtype are read into
directly; contiguous CUDA slots of that dtype get their bytes through ``DeviceLoader``'s pinned
ring and asynchronous H2D copies; anything else (casts, strided slices) streams through a
borrowed ring and one ``copy_``.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import nn

from ..planning.checkpoint import DTYPES
from ..io.device import DEFAULT_DEVICE_THREADS, DEFAULT_SLOT_BYTES, DeviceLoader, PinnedRing
from ..planning.plan import RankPlan, ReadItem
from .postprocess import derived_names
from ..io.read import Reader, ReadStats, default_window_bytes

if TYPE_CHECKING:  # pragma: no cover
    from .place import Binding

__all__ = ["module_tensors", "write_binding"]


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """State-dict tensors (parameters + persistent buffers) minus derived parameters."""
    derived = derived_names(module)
    return {n: t for n, t in module.state_dict(keep_vars=True).items() if n not in derived}



def _fits(view: torch.Tensor, item: ReadItem) -> bool:
    """Whether the item's bytes are exactly ``view``'s (contiguous, same dtype and shape)."""
    return (view.is_contiguous() and view.dtype == DTYPES[item.dtype][0]
            and tuple(view.shape) == item.shape)


def _direct(view: torch.Tensor, item: ReadItem) -> bool:
    return view.device.type == "cpu" and _fits(view, item)


def _to_device(view: torch.Tensor, item: ReadItem) -> bool:
    return view.device.type == "cuda" and _fits(view, item)


def _pinned_ring(items: Sequence[ReadItem], window_bytes: Optional[int],
                 threads: int) -> PinnedRing:
    """Host staging for device writes: ``threads`` x 2 pinned slots, no larger than the items
    need nor (given) ``window_bytes`` in all; larger items are split over several slots."""
    threads = max(1, threads)
    page = 1 << 12
    slot = min(DEFAULT_SLOT_BYTES, -(-sum(i.read_bytes for i in items) // threads))
    if window_bytes:
        slot = min(slot, window_bytes // (2 * threads))
    return PinnedRing(threads, max(page, -(-slot // page) * page), lazy=True)


def _merge_stats(into: ReadStats, other: ReadStats) -> None:
    into.read_bytes += other.read_bytes
    into.items += other.items
    into.syscalls += other.syscalls
    into.seconds += other.seconds
    into.peak_inflight_bytes = max(into.peak_inflight_bytes, other.peak_inflight_bytes)


def write_binding(module: nn.Module, binding: "Binding", plan: RankPlan, *,
                  window_bytes: Optional[int] = None, threads: int = 1,
                  cancel: Optional[threading.Event] = None,
                  on_progress: Optional[Callable[[int], None]] = None) -> ReadStats:
    """Write every bound item into its slot, in place. Contiguous CPU slots of the checkpoint
    dtype are read into directly; contiguous CUDA slots of that dtype get their bytes through
    a pinned ring by asynchronous H2D copies (``DeviceLoader``, one per device); the rest
    stream through a borrowed ring of at most ``window_bytes`` and are copied (cast / moved
    to the device) before the next item. Every path writes into the existing storage."""
    tensors = module_tensors(module)
    views: dict[str, torch.Tensor] = {}
    direct: list[ReadItem] = []
    to_device: list[ReadItem] = []
    copied: list[ReadItem] = []
    for item in plan.items:
        slot = binding.slots.get(item.target)
        if slot is None:
            continue  # unexpected (strict=False): not read at all
        view = views[item.target] = slot.view(tensors[slot.param].detach())
        (direct if _direct(view, item) else to_device if _to_device(view, item)
         else copied).append(item)
    stats = ReadStats()
    kw = dict(threads=threads, cancel=cancel, on_progress=on_progress)
    device_threads = threads if threads > 1 else DEFAULT_DEVICE_THREADS  # GPU wants many
    with torch.no_grad():
        if direct:
            sub = dataclasses.replace(plan, items=tuple(direct))
            reader = Reader(sub, **kw)  # type: ignore[arg-type]
            _merge_stats(stats, reader.read_into({i.target: views[i.target] for i in direct}))
        for device in dict.fromkeys(views[i.target].device for i in to_device):
            mine = tuple(i for i in to_device if views[i.target].device == device)
            torch.cuda.synchronize(device)  # pending work on the destinations (zero fills,
            # a forward still reading them) finishes before the loader's own streams write
            loader = DeviceLoader(dataclasses.replace(plan, items=mine), device,
                                  ring=_pinned_ring(mine, window_bytes, device_threads),
                                  cancel=cancel, on_progress=on_progress)
            loader.load({i.target: views[i.target] for i in mine})  # synchronises the device
            _merge_stats(stats, loader.stats)
        if copied:
            sub = dataclasses.replace(plan, items=tuple(copied))
            total = sum(max(i.nbytes, i.read_bytes) for i in copied)
            window = window_bytes or min(default_window_bytes(sub),
                                         max(total, sub.largest_item_bytes))
            reader = Reader(sub, window_bytes=window, mode="borrowed", **kw)  # type: ignore
            for target, tensor in reader:
                views[target].copy_(tensor)  # synchronous: the ring slot is free afterwards
            _merge_stats(stats, reader.stats)
    return stats
