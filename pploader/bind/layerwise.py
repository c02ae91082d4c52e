"""Layerwise loading from any ``(name, tensor)`` stream (e.g. weights pushed by a trainer).

Each layer's pieces are buffered until the layer is complete; then they are written in place
into the model (the slots of the ``LoadRecord`` that ``load_stage_into`` returned), the layer's modules are
post-processed, and the buffer is freed. A stream ordered by layer therefore buffers at most
one layer. When two or more layers hold buffered pieces at once, :class:`LayerTracker` warns
once with their names and the buffered MB: order the stream by layer to avoid it.

Buffered pieces are kept with :func:`pploader.owned`, so a borrowed stream is safe to feed.
Names are checkpoint names and each tensor is this rank's piece (what
``iter_stage_weights`` yields for the same topology).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..errors import NotReadyError, PlanError
from .place import LoadRecord, Slot, module_tensors
from .postprocess import mark_not_ready, mark_ready, not_ready_reason, run_post_processing
from ..io.read import owned
from .reload import check_destinations

__all__ = ["LayerOrderWarning", "LayerTracker", "LayerwiseReport", "load_layerwise"]


class LayerOrderWarning(UserWarning):
    """Several layers were buffered at once: the weight stream is not ordered by layer."""


class LayerTracker:
    """Layers currently holding buffered pieces, their bytes, and the peaks seen."""

    def __init__(self, warn: Callable[[str], None] = lambda msg: warnings.warn(
            msg, LayerOrderWarning, stacklevel=4)) -> None:
        self.buffered: dict[str, int] = {}
        self.peak_bytes = 0
        self.peak_layers = 0
        self.warned = False
        self._warn = warn

    @property
    def buffered_bytes(self) -> int:
        return sum(self.buffered.values())

    def add(self, layer: str, nbytes: int) -> None:
        """Count ``nbytes`` more buffered for ``layer``; warn once at two buffered layers."""
        self.buffered[layer] = self.buffered.get(layer, 0) + nbytes
        self.peak_bytes = max(self.peak_bytes, self.buffered_bytes)
        self.peak_layers = max(self.peak_layers, len(self.buffered))
        if len(self.buffered) >= 2 and not self.warned:
            self.warned = True
            self._warn(f"pploader: {len(self.buffered)} layers hold buffered weights at once "
                       f"({', '.join(self.buffered)}; {self.buffered_bytes / 1e6:.2f} MB "
                       "buffered): order the weight stream by layer so that at most one layer "
                       "is buffered (this warning is shown once per load)")

    def release(self, layer: str) -> int:
        return self.buffered.pop(layer, 0)

    def clear(self) -> None:
        self.buffered.clear()


@dataclass(frozen=True)
class LayerwiseReport:
    """What a layerwise load did; ``peak_buffered_bytes`` is the most held at once."""

    tensors: int
    groups_applied: int
    peak_buffered_bytes: int
    peak_buffered_layers: int
    warned: bool
    processed: tuple[str, ...]


def _group(slot: Slot, record: LoadRecord) -> str:
    """A layer's checkpoint prefix (``model.layers.3``), or the tensor's own name."""
    if slot.layer is None:
        return slot.source
    return record.family.layer_name(slot.layer, "").rstrip(".")


def _subtree(group: str, slot: Slot, record: LoadRecord) -> Optional[str]:
    """The module subtree to post-process once ``group`` is written (None = none)."""
    if slot.layer is not None:
        return record.names.to_module(group)
    owner = slot.param.rpartition(".")[0]
    return owner or None


def load_layerwise(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                   record: LoadRecord, strict: bool = True, process: bool = True,
                   tracker: Optional[LayerTracker] = None) -> LayerwiseReport:
    """Write a ``(name, tensor)`` stream into ``model`` layer by layer, in place.

    ``record``: what loaded ``model`` (``load_stage_into(...).record``, or the latest
    ``ReloadResult.record``); it gives every name's slot. Strict: a name the stage does not hold, or a stream that ends before every stage
    tensor arrived, raises PlanError. From the first write until the stream is complete the
    model is marked not ready (a failed stream leaves layers of two checkpoints).
    """
    if not isinstance(record, LoadRecord):
        raise PlanError("load_layerwise needs the LoadRecord of the load "
                        f"(record=load_stage_into(...).record), got {type(record).__name__}")
    check_destinations(model, record)
    tracker = tracker if tracker is not None else LayerTracker()
    slots = record.binding.slots
    expected: dict[str, set[str]] = {}
    for slot in slots.values():
        expected.setdefault(_group(slot, record), set()).add(slot.source)
    buffers: dict[str, dict[str, torch.Tensor]] = {}
    seen: set[str] = set()
    processed: list[str] = []
    applied = 0
    tensors = module_tensors(model)

    def apply(group: str, pieces: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, t in pieces.items():
                slot = slots[name]
                slot.view(tensors[slot.param].detach()).copy_(t)
        under = _subtree(group, slots[next(iter(pieces))], record)
        if process and under is not None:
            processed.extend(run_post_processing(model, under=under, exclude=frozenset(processed)))

    before = not_ready_reason(model)
    mark_not_ready(model, "load_layerwise in progress (or interrupted)")
    try:
        for name, tensor in weights:
            found = slots.get(name)
            if found is None:
                if strict:
                    raise PlanError("not a tensor of this rank's stage", tensor=name,
                                    rank=record.topology.rank)
                continue
            slot = found
            _check_piece(name, tensor, slot, record)
            if name in seen:
                raise PlanError("tensor arrived twice in the stream", tensor=name,
                                rank=record.topology.rank)
            seen.add(name)
            group = _group(slot, record)
            if len(expected[group]) == 1:
                apply(group, {name: tensor})  # complete on arrival: nothing to buffer
                applied += 1
                continue
            kept = owned(tensor)
            buffers.setdefault(group, {})[name] = kept
            tracker.add(group, kept.numel() * kept.element_size())
            if len(buffers[group]) == len(expected[group]):
                apply(group, buffers.pop(group))
                tracker.release(group)
                applied += 1
        absent = sorted(n for g in expected for n in expected[g] if n not in seen) \
            if strict else sorted(n for g in buffers for n in expected[g] if n not in seen)
        if absent:
            raise PlanError(f"the stream ended without {len(absent)} tensor(s) of the stage: "
                            + ", ".join(absent[:8]) + (" ..." if len(absent) > 8 else ""),
                            tensor=absent[0], rank=record.topology.rank)
        if process:
            processed.extend(run_post_processing(model, exclude=frozenset(processed)))
    except BaseException as exc:
        if applied or isinstance(exc, NotReadyError):
            mark_not_ready(model, f"load_layerwise failed after {applied} group(s) were written "
                           f"({type(exc).__name__}: {exc}); restore with reload_from_disk")
        else:
            _restore(model, before)  # nothing was written: the model is as it was
        raise
    finally:
        buffers.clear()
        tracker.clear()
    if strict:
        mark_ready(model)  # every tensor of the stage was rewritten
    else:
        _restore(model, before)
    return LayerwiseReport(len(seen), applied, tracker.peak_bytes, tracker.peak_layers,
                           tracker.warned, tuple(processed))


def _restore(model: nn.Module, reason: Optional[str]) -> None:
    if reason is None:
        mark_ready(model)
    else:
        mark_not_ready(model, reason)


def _check_piece(name: str, tensor: torch.Tensor, slot: Slot, record: LoadRecord) -> None:
    if tuple(tensor.shape) != slot.shape:
        raise PlanError(f"shape {list(tensor.shape)} in the stream but this rank's piece is "
                        f"{list(slot.shape)}", tensor=name, rank=record.topology.rank)
    if tensor.dtype != slot.dtype and not (record.allow_cast and tensor.dtype.is_floating_point
                                           and slot.dtype.is_floating_point):
        raise PlanError(f"dtype {tensor.dtype} in the stream but {slot.dtype} planned",
                        tensor=name, rank=record.topology.rank)

