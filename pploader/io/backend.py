"""The read-backend seam: what every backend takes (a plan, options), gives (tensors, or the
caller's destinations filled) and reports (``ReadStats``), plus the one shared step that turns
an item's raw bytes into its tensor.

A backend only moves bytes (positional reads, staging, copies); *which* bytes is the plan's
business (planning/), *which* backend is ``io/registry.py``'s. Like
``torch.distributed.checkpoint``'s ``StorageReader``: the planner never knows the storage.
Nothing here calls torch.distributed.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from typing import (Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol, Sequence,
                    runtime_checkable)

import torch

from ..errors import ReadError
from ..planning.checkpoint import DTYPES, FileIdentity
from ..planning.items import ReadItem
from ..planning.rank_plan import RankPlan

__all__ = ["ReadBackend", "ReadOptions", "ReadStats", "BackendFactory", "item_dtype",
           "materialise", "zero_padding", "merge_stats", "sum_stats", "collect", "check_identity"]


@dataclass
class ReadStats:
    """What a backend did (its own byte accounting, cross-checked against /proc in tests)."""

    read_bytes: int = 0
    items: int = 0
    syscalls: int = 0         # read requests issued (preadv / readinto calls)
    seconds: float = 0.0
    peak_inflight_bytes: int = 0


def merge_stats(into: ReadStats, other: ReadStats) -> None:
    """Add ``other`` (a later backend of the same load) into ``into``."""
    into.read_bytes += other.read_bytes
    into.items += other.items
    into.syscalls += other.syscalls
    into.seconds += other.seconds
    into.peak_inflight_bytes = max(into.peak_inflight_bytes, other.peak_inflight_bytes)


def sum_stats(parts: "Sequence[ReadStats]", seconds: float) -> ReadStats:
    """The stats of one load made of several backends' (``parts``), over ``seconds`` of wall
    time (reads and collectives)."""
    out = ReadStats()
    for part in parts:
        merge_stats(out, part)
    out.seconds = seconds
    return out


def collect(stream: Iterable[tuple[str, torch.Tensor]],
            destinations: Optional[Mapping[str, torch.Tensor]] = None
            ) -> dict[str, torch.Tensor]:
    """``load()`` of a streaming executor: every ``(target, tensor)`` of ``stream`` by target,
    or (``destinations``) copied into the caller's tensors, which are returned."""
    out: dict[str, torch.Tensor] = {}
    for target, tensor in stream:
        if destinations is None:
            out[target] = tensor
            continue
        dst = destinations.get(target)
        if dst is None:
            raise ValueError(f"no destination given for {target!r}")
        dst.copy_(tensor)
        out[target] = dst
    return out


@dataclass(frozen=True)
class ReadOptions:
    """How to read, for any backend; a backend ignores what does not apply to it.

    ``threads`` / ``window_bytes`` None: the backend's default. ``mode``: ``owned`` (fresh
    tensors) or ``borrowed`` (views into a reused buffer, valid until the next item; a backend
    without one yields owned tensors, which is always allowed). ``ring``: a CUDA backend's
    pinned staging to reuse across loads; ``fit_staging``: size new staging to the plan (and
    ``window_bytes``) instead of the default (many small in-place writes, bind/write.py).
    ``device_window_bytes``: the device budget of a stream onto a GPU (io/transfer/direct.py).
    ``before_write``: called once by ``load(destinations)`` of a backend that supports it (the
    ``mapped`` one) after its opening work and before its first write into a destination, so
    a caller's agreement among ranks (the DCP reader's) overlaps that work; a caller using
    another backend calls it itself before ``load``.
    """

    window_bytes: Optional[int] = None
    threads: Optional[int] = None
    mode: str = "owned"
    cancel: Optional[threading.Event] = None
    on_progress: Optional[Callable[[int], None]] = None
    memory_budget_bytes: Optional[int] = None
    ring: Any = None
    direct_io: Optional[bool] = None
    fit_staging: bool = False
    device_window_bytes: Optional[int] = None
    before_write: Optional[Callable[[], None]] = None

    def __post_init__(self) -> None:
        """Every public read path passes here: the option table's ranges (arguments.py), an
        ArgumentError naming the argument (``threads=0``, ``window_bytes=nan`` ...)."""
        from ..arguments import check, check_callable, check_choice, check_event
        check(window_bytes=self.window_bytes, threads=self.threads,
              memory_budget_bytes=self.memory_budget_bytes,
              device_window_bytes=self.device_window_bytes)
        check_choice("mode", self.mode, ("owned", "borrowed"))
        check_event("cancel", self.cancel)
        check_callable("on_progress", self.on_progress)
        check_callable("before_write", self.before_write)


@runtime_checkable
class ReadBackend(Protocol):
    """One rank's plan read onto one device. Made by a factory registered in io/registry.py:
    ``factory(plan, device, options) -> ReadBackend``.

    - ``load()``: every item as a fresh tensor on the device, ``{target: tensor}``;
      ``load(destinations)``: the bytes straight into the caller's contiguous tensors of the
      items' shapes and dtypes (on the device), returned by target;
    - ``iter(backend)``: ``(target, tensor)`` in plan order (what ``load_weights`` consumes);
    - ``stats``: bytes read, requests, seconds of the last load.

    Errors are ``ReadError`` naming file, tensor and rank; a set ``options.cancel`` stops the
    read with one. Every raw byte becomes its tensor through :func:`materialise`.
    """

    plan: RankPlan
    stats: ReadStats

    def load(self, destinations: Optional[Mapping[str, torch.Tensor]] = None
             ) -> dict[str, torch.Tensor]: ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


#: ``factory(plan, device, options)``: how io/registry.py makes a backend
BackendFactory = Callable[[RankPlan, torch.device, ReadOptions], ReadBackend]


def item_dtype(item: ReadItem) -> torch.dtype:
    """The torch dtype of an item's stored bytes."""
    return DTYPES[item.dtype][0]


def zero_padding(item: ReadItem, dst: torch.Tensor) -> None:
    """Zero ``dst``'s bytes past the item's read bytes (its ``pad_rows`` vocab padding rows)."""
    if item.pad_rows:
        dst.reshape(-1).view(torch.uint8)[item.read_bytes:].zero_()


def materialise(item: ReadItem, raw: torch.Tensor, dst: torch.Tensor) -> None:
    """Write the item's tensor into ``dst`` from ``raw``: the bytes of ``item.ranges``
    concatenated (uint8, ``read_bytes`` long, on ``dst``'s device). The one place that knows
    how read bytes become a tensor: dtype view, ``buffer_shape``, the ``gather`` of a coalesced
    strided read, and the zero ``pad_rows``. For a direct item ``raw`` may be ``dst``'s own
    bytes (read in place): then only the padding is written."""
    if item.direct:
        out = dst.reshape(-1).view(torch.uint8)
        if raw.numel() and raw.data_ptr() != out.data_ptr():
            out[:item.read_bytes].copy_(raw)
        zero_padding(item, dst)
        return
    t = raw.view(item_dtype(item)).reshape(item.buffer_shape)
    for dim, intervals in item.gather:
        parts = [t.narrow(dim, a, n) for a, n in intervals]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    if item.pad_rows:
        rows = item.shape[0] - item.pad_rows
        dst[rows:].zero_()
        dst[:rows].copy_(t)
    else:
        dst.copy_(t)


def check_identity(plan: RankPlan, file: str, fd: int, tensor: Optional[str] = None) -> None:
    """ReadError unless the open ``fd`` is still the file planned (size, inode, mtime, ctime):
    a checkpoint changed (truncated, rewritten) since planning is never read."""
    st = os.fstat(fd)
    now, then = FileIdentity.of(st), plan.identities[file]
    if st.st_nlink == 0 and then.ctime_ns:  # renamed over while open (the documented way
        now = replace(now, ctime_ns=then.ctime_ns)  # to publish): unlinking moves ctime,
    if now != then:                                 # the open inode's bytes are intact
        raise ReadError(f"file changed during load (planned size {then.size}, inode "
                        f"{then.inode}, mtime_ns {then.mtime_ns}, ctime_ns {then.ctime_ns}; "
                        f"now size {now.size}, inode {now.inode}, mtime_ns {now.mtime_ns}, "
                        f"ctime_ns {now.ctime_ns}): publish new checkpoints by "
                        "writing elsewhere and renaming", file=file, tensor=tensor,
                        rank=plan.topology.rank)
