"""Writing a bound stage into its module's storage, in place (used by load, reload, layerwise).

Two paths, chosen per item: a contiguous slot of the checkpoint dtype on a device a read
backend loads onto gets the bytes straight from that backend (io/registry.py picks it: on CPU
positional reads into the slot, on CUDA a pinned ring and asynchronous H2D copies); anything
else (casts, strided slices) streams through a borrowed CPU ring and one ``copy_``.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Mapping, Optional, Protocol

import torch
from torch import nn

from ..io.backend import ReadOptions, ReadStats, item_dtype, merge_stats
from ..io.read import default_window_bytes
from ..io.registry import open_backend, select_backend
from ..planning.plan import RankPlan, ReadItem
from .postprocess import derived_names

__all__ = ["module_tensors", "write_binding"]


class _Slot(Protocol):
    """What writing needs of a ``place.Slot``: its module tensor and its view of it."""

    @property
    def param(self) -> str: ...

    def view(self, base: torch.Tensor) -> torch.Tensor: ...


class _Bound(Protocol):
    """What writing needs of a ``place.Binding`` (structural: no import of place.py)."""

    @property
    def slots(self) -> Mapping[str, _Slot]: ...


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """State-dict tensors (parameters + persistent buffers) minus derived parameters."""
    derived = derived_names(module)
    return {n: t for n, t in module.state_dict(keep_vars=True).items() if n not in derived}


def _fits(view: torch.Tensor, item: ReadItem) -> bool:
    """Whether the item's bytes are exactly ``view``'s (contiguous, same dtype and shape)."""
    return (view.is_contiguous() and view.dtype == item_dtype(item)
            and tuple(view.shape) == item.shape)


def _has_backend(device: torch.device, io_backend: Optional[str]) -> bool:
    """Whether a read backend (``io_backend``, or the device's default) loads onto ``device``."""
    try:
        select_backend(device, io_backend)
    except ValueError:
        return False
    return True


def write_binding(module: nn.Module, binding: _Bound, plan: RankPlan, *,
                  window_bytes: Optional[int] = None, threads: int = 1,
                  cancel: Optional[threading.Event] = None,
                  on_progress: Optional[Callable[[int], None]] = None,
                  io_backend: Optional[str] = None) -> ReadStats:
    """Write every bound item into its slot, in place. Contiguous slots of the checkpoint
    dtype get their bytes straight from the device's read backend (``io_backend``, else the
    default: positional reads on CPU; on CUDA a pinned ring sized to the items and
    asynchronous H2D copies, one backend per device); the rest stream through a borrowed ring
    of at most ``window_bytes`` and are copied (cast / moved to the device) before the next
    item. Every path writes into the existing storage."""
    tensors = module_tensors(module)
    views: dict[str, torch.Tensor] = {}
    direct: dict[torch.device, list[ReadItem]] = {}
    copied: list[ReadItem] = []
    usable: dict[torch.device, bool] = {}
    for item in plan.items:
        slot = binding.slots.get(item.target)
        if slot is None:
            continue  # unexpected (strict=False): not read at all
        view = views[item.target] = slot.view(tensors[slot.param].detach())
        if view.device not in usable:
            usable[view.device] = _has_backend(view.device, io_backend)
        if usable[view.device] and _fits(view, item):
            direct.setdefault(view.device, []).append(item)
        else:
            copied.append(item)
    stats = ReadStats()
    # threads=1 is the CPU reader's default; other backends (a GPU wants many) pick their own
    options = ReadOptions(window_bytes=window_bytes, threads=threads if threads > 1 else None,
                          cancel=cancel, on_progress=on_progress, fit_staging=True)
    with torch.no_grad():
        for device, mine in sorted(direct.items(), key=lambda kv: kv[0].type != "cpu"):
            sub = dataclasses.replace(plan, items=tuple(mine))
            # CPU reads take no window here (straight into the slots)
            backend = open_backend(sub, device, options if device.type != "cpu" else
                                   dataclasses.replace(options, window_bytes=None), io_backend)
            backend.load({i.target: views[i.target] for i in mine})
            merge_stats(stats, backend.stats)
        if copied:
            sub = dataclasses.replace(plan, items=tuple(copied))
            total = sum(max(i.nbytes, i.read_bytes) for i in copied)
            window = window_bytes or min(default_window_bytes(sub),
                                         max(total, sub.largest_item_bytes))
            name = io_backend if _has_backend(torch.device("cpu"), io_backend) else None
            reader = open_backend(sub, "cpu", dataclasses.replace(
                options, window_bytes=window, mode="borrowed"), name)
            for target, tensor in reader:
                views[target].copy_(tensor)  # synchronous: the ring slot is free afterwards
            merge_stats(stats, reader.stats)
    return stats
