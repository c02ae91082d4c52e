"""The ``mapped`` read backend (CPU): bytes already in the page cache are handed out as views of
a private file mapping, so the consumer's own copy (an engine's ``param.copy_``) is the only
copy. Bytes that must come from the disk (``cold``): ``read`` (the registry's default) keeps the
threaded backend's large positional reads; ``readahead`` (the engine path,
integrations/placed.py) hands views too, after a prefetch thread has faulted the item's pages
in through the kernel's sequential readahead (``MADV_SEQUENTIAL``: requests of the device's
``read_ahead_kb``, ahead of the consumer by at most a window), so a cold load is one copy too.

``whole`` items (target -> the full source tensor's byte range): handed as a view of the
full tensor although only the item's own ranges are checked, populated and read ahead (a TP
rank whose engine narrows full tensors itself touches only its part).

Per item, before anything is handed out: the pages of its byte ranges are looked up with
``mincore`` on the mapping (exact, one bitmap per file). An item at least ``WARM_FRACTION``
resident is *warm*: a single-range item becomes a view of the mapping (no copy, no fresh
buffer to fault in and zero); a strided TP slice or a padded item is gathered from the mapping
into a fresh tensor (one copy). The other items are *cold* and go through one threaded
:class:`~pploader.io.read.Reader` over just those items (its window reads ahead).

Views stay valid while referenced (each holds the mapping); like any file mapping (and the
safetensors loaders engines use by default), a file truncated in place while a view is still
being read raises SIGBUS: publish new checkpoints by writing elsewhere and renaming (a renamed-
over file's mapped bytes stay intact). Every file's identity is checked when it is opened and
again after the last item (``check_identity``). The mapping is private (copy-on-write): a
consumer writing into a view never changes the file.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from dataclasses import dataclass, replace
from typing import Iterator, Mapping, Optional

import torch

from ..errors import ReadError
from ..planning.plan import RankPlan, ReadItem
from .backend import ReadOptions, ReadStats, check_identity, item_dtype, materialise
from .read import Reader
from .readahead import Prefetch, advise_sequential, page_span, span_of

__all__ = ["MappedBackend", "open_mapped", "WARM_FRACTION", "COLD_THREADS", "COLD_MODES",
           "READAHEAD_WINDOW", "resident_items"]

logger = logging.getLogger(__name__)

#: An item counts as warm (served from the mapping) when at least this share of its pages is
#: resident; the few missing pages are faulted in by the consumer's copy.
WARM_FRACTION = 0.9
#: Reader threads for cold items unless ``ReadOptions.threads`` says otherwise.
COLD_THREADS = 4
PAGE_BYTES = mmap.PAGESIZE
#: the process's own C library (dlopen(NULL): no library search, no file read at first use)
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore: bit 0 of each byte = resident
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
#: How cold items arrive: ``read`` (positional reads into fresh tensors) or ``readahead``
#: (views, their pages brought in ahead of the consumer: io/readahead.py).
COLD_MODES = ("read", "readahead")
#: ``readahead``: bytes the prefetch thread may run ahead of the consumer
#: (``ReadOptions.window_bytes`` overrides).
READAHEAD_WINDOW = 256 << 20
#: spans closer than this are populated in one call (the gap's pages are mapped too)
_MERGE_GAP = 64 << 10


@dataclass
class _File:
    """One open, identity-checked file: its descriptor, private mapping (as a uint8 tensor)
    and page-residency bitmap (1 byte per page, bit 0 = resident)."""

    fd: int
    base: torch.Tensor
    resident: bytes

    def fraction(self, ranges: tuple[tuple[int, int], ...]) -> float:
        pages = hits = 0
        for off, n in ranges:
            if n <= 0:
                continue
            first, last = off // PAGE_BYTES, (off + n - 1) // PAGE_BYTES
            window = self.resident[first:last + 1]
            pages += len(window)
            hits += len(window) - window.count(0)
        return hits / pages if pages else 1.0


def _map(path: str, fd: int, file: str, plan: RankPlan, bitmap: bool = True) -> _File:
    """Map ``fd`` privately and read its page-residency bitmap (no data is read; none
    unless ``bitmap``)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return _File(fd, torch.empty(0, dtype=torch.uint8), b"")
    try:
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise ReadError(f"cannot map {path}: {exc}", file=file,
                        rank=plan.topology.rank) from exc
    base = torch.frombuffer(mm, dtype=torch.uint8)  # holds ``mm`` while any view lives
    if not bitmap:
        return _File(fd, base, b"")
    pages = (size + PAGE_BYTES - 1) // PAGE_BYTES
    vec = (ctypes.c_ubyte * pages)()
    if _LIBC.mincore(ctypes.c_void_p(base.data_ptr()), size, vec) != 0:
        return _File(fd, base, bytes(pages))  # unknown residency: treat as cold
    return _File(fd, base, bytes(vec).translate(_LOW_BIT))


class MappedBackend:
    """Reads a plan as views of the page cache where warm; cold items by ``cold`` (see the
    module docstring). ``stats.read_bytes``: every planned byte delivered, warm or cold (a
    ``whole`` item's own ranges); ``mapped_bytes``: those of them taken from the mapping (no
    read syscall: /proc's rchar does not count them); ``readahead_bytes``: of those, the cold
    ones faulted in ahead (``readahead``). ``mapped_items``: items served from the mapping."""

    def __init__(self, plan: RankPlan, options: ReadOptions, *, cold: str = "read",
                 whole: Optional[Mapping[str, tuple[int, int]]] = None) -> None:
        if cold not in COLD_MODES:
            raise ValueError(f"cold must be one of {COLD_MODES}, got {cold!r}")
        if whole and cold != "readahead":
            raise ValueError("whole items are handed as views: cold='readahead' only")
        self.plan, self.options, self.stats = plan, options, ReadStats()
        self.cold, self.whole = cold, dict(whole or {})
        self.mapped_bytes = self.readahead_bytes = 0
        self.warm_items = self.mapped_items = 0

    def _err(self, msg: str, item: ReadItem) -> ReadError:
        return ReadError(msg, file=item.file, tensor=item.name, rank=self.plan.topology.rank)

    def _open(self, files: dict[str, _File], item: ReadItem) -> _File:
        f = files.get(item.file)
        if f is None:
            path = self.plan.paths[item.file]
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise self._err(f"cannot open: {exc.strerror}", item) from exc
            try:
                check_identity(self.plan, item.file, fd, item.name)
                f = files[item.file] = _map(path, fd, item.file, self.plan,
                                            bitmap=self.cold == "read")
            except BaseException:
                os.close(fd)
                raise
        return f

    def _check_end(self, f: _File, item: ReadItem, end: int) -> None:
        if end > f.base.numel():
            raise self._err(f"file changed during load: unexpected end of file (the item "
                            f"ends at byte {end}, the file has {f.base.numel()}; truncated "
                            "while loading?)", item)

    def _from_mapping(self, f: _File, item: ReadItem, dst: Optional[torch.Tensor]
                      ) -> torch.Tensor:
        """The item's tensor from the mapping: a view when it is one whole range or a
        ``whole`` item (and no destination is given), else gathered into ``dst`` or a fresh
        tensor."""
        whole = self.whole.get(item.target)
        if whole is not None:
            off, n = whole
            self._check_end(f, item, off + n)
            out = f.base[off:off + n].view(item_dtype(item)).reshape(item.source_shape)
            if dst is not None:
                dst.copy_(out)
                return dst
            return out
        self._check_end(f, item, max((off + n for off, n in item.ranges), default=0))
        dtype = item_dtype(item)
        if dst is None and item.direct and not item.pad_rows and len(item.ranges) == 1:
            off, n = item.ranges[0]
            return f.base[off:off + n].view(dtype).reshape(item.shape)
        out = dst if dst is not None else torch.empty(item.shape, dtype=dtype)
        if item.direct:
            flat, pos = out.reshape(-1).view(torch.uint8), 0
            for off, n in item.ranges:
                flat[pos:pos + n].copy_(f.base[off:off + n])
                pos += n
            materialise(item, flat[:0], out)  # the padding rows only
            return out
        parts = [f.base[off:off + n] for off, n in item.ranges]
        raw = parts[0] if len(parts) == 1 else torch.cat(parts)
        materialise(item, raw, out)
        return out

    def _warm(self, f: _File, item: ReadItem) -> bool:
        return bool(item.ranges) and f.fraction(item.ranges) >= WARM_FRACTION

    def _deliver(self, k: int, item: ReadItem, tensor: torch.Tensor, nbytes: int
                 ) -> tuple[str, torch.Tensor]:
        self.stats.items += 1
        if self.options.on_progress is not None:
            self.options.on_progress(nbytes)
        return item.target, tensor

    def _cancelled(self, item: ReadItem) -> None:
        cancel = self.options.cancel
        if cancel is not None and cancel.is_set():
            raise self._err("cancelled: another rank failed", item)

    def _each(self, destinations: Optional[Mapping[str, torch.Tensor]]
              ) -> Iterator[tuple[str, torch.Tensor]]:
        start, files = time.perf_counter(), dict[str, _File]()
        self.mapped_bytes = self.readahead_bytes = self.warm_items = self.mapped_items = 0
        reader: Optional[Reader] = None
        try:
            if self.cold == "readahead":
                yield from self._each_ahead(files, destinations)
                return
            warm = [self._warm(self._open(files, item), item) for item in self.plan.items]
            cold = [i for i, w in zip(self.plan.items, warm) if not w]
            stream: Iterator[tuple[str, torch.Tensor]] = iter(())
            if cold:
                reader = Reader(replace(self.plan, items=tuple(cold), redistribute=None),
                                window_bytes=self.options.window_bytes,
                                threads=self.options.threads or COLD_THREADS,
                                cancel=self.options.cancel,
                                memory_budget_bytes=self.options.memory_budget_bytes)
                stream = iter(reader)
            self._populate(files, [(i.file, span_of(i.ranges))
                                   for i, w in zip(self.plan.items, warm) if w])
            for k, (item, is_warm) in enumerate(zip(self.plan.items, warm)):
                self._cancelled(item)
                dst = destinations.get(item.target) if destinations is not None else None
                if is_warm:
                    tensor = self._from_mapping(files[item.file], item, dst)
                    self.mapped_bytes += item.read_bytes
                    self.stats.read_bytes += item.read_bytes
                    self.warm_items += 1
                    self.mapped_items += 1
                else:
                    target, tensor = next(stream)
                    if target != item.target:  # pragma: no cover - plan order is kept
                        raise self._err(f"internal: cold stream gave {target}", item)
                    if dst is not None:
                        dst.copy_(tensor)
                        tensor = dst
                yield self._deliver(k, item, tensor, item.read_bytes)
            for _ in stream:  # the cold reader's end: its identity checks and close
                pass
            for file, f in files.items():
                check_identity(self.plan, file, f.fd)
        finally:
            for f in files.values():
                os.close(f.fd)
            if reader is not None:
                self.stats.read_bytes += reader.stats.read_bytes
                self.stats.syscalls += reader.stats.syscalls
                self.stats.peak_inflight_bytes = reader.stats.peak_inflight_bytes
            self.stats.seconds = time.perf_counter() - start
            logger.debug("rank %d: %d item(s) mapped (%d bytes, %d of them read ahead), %d "
                         "read; %d bytes in all", self.plan.topology.rank, self.mapped_items,
                         self.mapped_bytes, self.readahead_bytes,
                         len(self.plan.items) - self.mapped_items, self.stats.read_bytes)

    def _each_ahead(self, files: dict[str, _File],
                    destinations: Optional[Mapping[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``cold="readahead"``: every item from the mapping, its pages (a ``whole`` item's
        own span only) brought in by a :class:`Prefetch` thread in plan order."""
        items = self.plan.items
        spans: list[tuple[int, int]] = []
        slot: list[Optional[int]] = []   # plan position -> its span in ``spans``
        sizes: list[int] = []
        for item in items:
            f = self._open(files, item)
            sizes.append(sum(n for _, n in item.ranges))
            if not item.ranges:
                slot.append(None)
                continue
            lo, hi = span_of(item.ranges)
            self._check_end(f, item, max(hi, sum(self.whole.get(item.target, (0, 0)))))
            slot.append(len(spans))
            spans.append(page_span(f.base.data_ptr(), lo, hi))
        for f in files.values():
            advise_sequential(f.base.data_ptr(), f.base.numel())
        prefetch = Prefetch(spans, window=self.options.window_bytes or READAHEAD_WINDOW,
                            warm_fraction=WARM_FRACTION)
        try:
            for k, item in enumerate(items):
                self._cancelled(item)
                at = slot[k]
                if at is not None:
                    prefetch.wait(at)
                    if prefetch.cold[at]:
                        self.readahead_bytes += sizes[k]
                    else:
                        self.warm_items += 1
                dst = destinations.get(item.target) if destinations is not None else None
                tensor = self._from_mapping(files[item.file], item, dst)
                self.mapped_bytes += sizes[k]
                self.stats.read_bytes += sizes[k]
                self.mapped_items += 1
                yield self._deliver(k, item, tensor, sizes[k])
        finally:
            prefetch.close()
        for file, f in files.items():
            check_identity(self.plan, file, f.fd)

    @staticmethod
    def _populate(files: dict[str, _File], items: list[tuple[str, tuple[int, int]]]) -> None:
        """Map the warm items' resident pages ((file, span of its ranges) each) into this
        process in one call per run of nearby spans (MADV_POPULATE_READ) instead of one page
        fault per 4 KiB during the consumer's copy."""
        spans: dict[str, list[tuple[int, int]]] = {}
        for file, span in items:
            spans.setdefault(file, []).append(span)
        for file, found in spans.items():
            base = files[file].base
            merged: list[list[int]] = []
            for lo, hi in sorted(found):
                if merged and lo <= merged[-1][1] + _MERGE_GAP:
                    merged[-1][1] = max(merged[-1][1], hi)
                else:
                    merged.append([lo, hi])
            for lo, hi in merged:
                # best effort: an older kernel (EINVAL) simply faults pages in on first touch
                _LIBC.madvise(*page_span(base.data_ptr(), lo, min(hi, base.numel())),
                              _MADV_POPULATE_READ)

    def load(self, destinations: Optional[Mapping[str, torch.Tensor]] = None
             ) -> dict[str, torch.Tensor]:
        """Every item (views of the mapping where warm), or copied into ``destinations``."""
        if destinations is not None:
            for item in self.plan.items:
                dst = destinations.get(item.target)
                shape = item.source_shape if item.target in self.whole else item.shape
                if dst is None or tuple(dst.shape) != shape or not dst.is_contiguous() \
                        or dst.dtype != item_dtype(item) or dst.device.type != "cpu":
                    raise self._err(f"destination {item.target} is not a contiguous cpu "
                                    f"tensor of {shape} {item_dtype(item)}", item)
        return dict(self._each(destinations))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._each(None)


def resident_items(plan: RankPlan, ranges: Mapping[str, tuple[str, tuple[tuple[int, int], ...]]]
                   ) -> set[str]:
    """The keys of ``ranges`` (key -> (file, byte ranges)) whose pages are at least
    ``WARM_FRACTION`` resident in the page cache (files as ``plan.paths`` names them; nothing
    is read). Lets a caller choose what to ask the backend for (integrations/placed.py)."""
    out: set[str] = set()
    bitmaps: dict[str, _File] = {}
    try:
        for key, (file, rngs) in ranges.items():
            f = bitmaps.get(file)
            if f is None:
                fd = os.open(plan.paths[file], os.O_RDONLY)
                try:
                    f = bitmaps[file] = _map(plan.paths[file], fd, file, plan)
                except BaseException:
                    os.close(fd)
                    raise
            if rngs and f.fraction(rngs) >= WARM_FRACTION:
                out.add(key)
    finally:
        for f in bitmaps.values():
            os.close(f.fd)
    return out


def open_mapped(plan: RankPlan, device: torch.device, options: ReadOptions) -> MappedBackend:
    """The ``mapped`` backend's factory (io/registry.py)."""
    if device.type != "cpu":
        raise ValueError(f"the mapped backend loads onto cpu, not {device}")
    return MappedBackend(plan, options)
