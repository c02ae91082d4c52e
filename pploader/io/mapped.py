"""The ``mapped`` read backend (CPU): bytes already in the page cache are handed out as views of
a private file mapping, so the consumer's own copy (an engine's ``param.copy_``) is the only
copy. Bytes that must come from the disk (``cold``): ``read`` (the registry's default) keeps the
threaded backend's large positional reads; ``readahead`` (the engine path,
integrations/placed.py) hands views too, after a prefetch thread has faulted the item's pages
in through the kernel's readahead (io/readahead.py, ahead of the consumer by at most a
window), so a cold load is one copy too; a stage that is warm throughout gets no prefetch
thread (the consumer's copy faults its pages in, 16 at a time; the whole-stage check samples
each file's span, ``MappedFile.nearly_resident``). ``whole`` items (target -> the full source
tensor's byte range): handed as a view of the full tensor although only the item's own ranges
are checked and read ahead (a TP rank whose engine narrows full tensors itself touches only its
part).

Per item, before anything is handed out: the pages of its byte ranges are looked up (exact:
``cachestat`` on the span of each run of ranges, ``mincore`` on the mapping where some page is
missing). An item at least ``WARM_FRACTION`` resident (or, with ``fault_budget``, whose
missing pages hold at most that share of its bytes) is *warm*: a single-range item becomes a
view of the mapping (no copy, no fresh buffer to fault in and zero); a strided TP slice or a
padded item is gathered from the mapping into a fresh tensor (one copy: a run of equal rows at
a constant stride, as a dim-1 shard's rows are, is one strided ``copy_``, not one per row).
The other items are *cold* and go through one threaded :class:`~pploader.io.read.Reader` over
just those items (its window reads ahead). With destinations (``load(destinations)``) warm
items are copied from the mapping straight into them and cold ones read straight into them
(``Reader.read_into``).

Views stay valid while referenced (each holds the mapping); like any file mapping (and the
safetensors loaders engines use by default), a file truncated in place while a view is still
being read raises SIGBUS: publish new checkpoints by writing elsewhere and renaming (a renamed-
over file's mapped bytes stay intact). Every file's identity is checked when it is opened and
again after the last item (``check_identity``). The mapping is private (copy-on-write): a
consumer writing into a view never changes the file.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Callable, Iterator, Mapping, Optional

import torch

from ..errors import ReadError
from ..planning.items import ReadItem
from ..planning.rank_plan import RankPlan
from .backend import ReadOptions, ReadStats, check_identity, item_dtype, materialise
from .mapped_file import MappedFile, map_file
from .mapped_split import Run, run_bytes, split_into, strided_runs
from .pagecache import MADV_POPULATE_READ, PAGE_BYTES, advise
from .read import Reader
from .readahead import Prefetch, advise_sequential, merge_span, page_span

__all__ = ["MappedBackend", "open_mapped", "WARM_FRACTION", "COLD_THREADS", "COLD_MODES",
           "READAHEAD_WINDOW", "strided_runs"]

logger = logging.getLogger(__name__)

#: An item counts as warm (served from the mapping) when at least this share of its pages is
#: resident; the few missing pages are faulted in by the consumer's copy.
WARM_FRACTION = 0.9
#: Reader threads for cold items (and copying threads for warm ones into destinations) unless
#: ``ReadOptions.threads`` says otherwise.
COLD_THREADS = 4
#: How cold items arrive: ``read`` (positional reads into fresh tensors), ``readahead``
#: (views, their pages brought in ahead of the consumer: io/readahead.py) or ``fault`` (into
#: destinations: copied from the mapping like warm ones, on the copy threads, after
#: ``MADV_NORMAL`` on their pages so each fault reads around it in large requests, as an
#: ``mmap`` reader such as torch's ``HuggingFaceStorageReader`` does; without destinations
#: as ``read``; without ``fault_budget`` no residency is asked: the mapping is ``MADV_NORMAL``
#: and every item is copied from it). On the 2-core VM ``fault`` read a cold PP2 x TP2 DCP stage at torch's
#: speed where ``read`` (one ``preadv`` per dim-1 row) took 1.1-1.5x its time.
COLD_MODES = ("read", "readahead", "fault")
MADV_NORMAL = 0
#: ``readahead``: bytes the prefetch thread may run ahead of the consumer
#: (``ReadOptions.window_bytes`` overrides).
READAHEAD_WINDOW = 256 << 20
#: spans closer than this are populated in one call (the gap's pages are mapped too)
_MERGE_GAP = 64 << 10


class MappedBackend:
    """Reads a plan as views of the page cache where warm; cold items by ``cold`` (see the
    module docstring). ``stats.read_bytes``: every planned byte delivered, warm or cold (a
    ``whole`` item's own ranges); ``mapped_bytes``: those of them taken from the mapping (no
    read syscall: /proc's rchar does not count them); ``readahead_bytes``: of those, the cold
    ones faulted in ahead (``readahead``); ``mapped_items``: items served from the mapping;
    ``faulting``: (``cold="fault"``, no fault budget) the sample found pages to read.

    Which items are warm: by default those with at least ``warm_fraction`` of their pages
    resident (the few missing are faulted in with the kernel's read-around). ``fault_budget``
    (a share, e.g. 0.01) instead bounds what faults may read from storage: an item is warm
    when its missing pages hold at most that share of its bytes, and the mapping is
    ``MADV_RANDOM`` so a fault reads only its own page (a caller that promises to read about
    its bytes only, as the DCP reader does)."""

    def __init__(self, plan: RankPlan, options: ReadOptions, *,
                 warm_fraction: float = WARM_FRACTION,
                 fault_budget: Optional[float] = None,
                 cold_threads: Optional[int] = None, cold: str = "read",
                 whole: Optional[Mapping[str, tuple[int, int]]] = None) -> None:
        if cold not in COLD_MODES:
            raise ValueError(f"cold must be one of {COLD_MODES}, got {cold!r}")
        if whole and cold != "readahead":
            raise ValueError("whole items are handed as views: cold='readahead' only")
        if not 0.0 < warm_fraction <= 1.0:
            raise ValueError(f"warm_fraction must be in (0, 1], got {warm_fraction}")
        if fault_budget is not None and fault_budget < 0:
            raise ValueError(f"fault_budget must be >= 0, got {fault_budget}")
        self.plan, self.options, self.stats = plan, options, ReadStats()
        self.warm_fraction, self.fault_budget = warm_fraction, fault_budget
        self.cold_threads = cold_threads  # reader threads of cold items (None: ``threads``)
        self.cold, self.whole = cold, dict(whole or {})
        self.mapped_bytes = self.readahead_bytes = 0
        self.warm_items = self.mapped_items = 0
        self._runs: dict[str, list[Run]] = {}
        self._missing: dict[str, tuple[int, int]] = {}  # (pages missing, touched) by target
        self.faulting = False  # cold="fault": copies that will wait on storage (sampled)

    def _err(self, msg: str, item: ReadItem) -> ReadError:
        return ReadError(msg, file=item.file, tensor=item.name, rank=self.plan.topology.rank)

    def _open(self, files: dict[str, MappedFile], item: ReadItem) -> MappedFile:
        f = files.get(item.file)
        if f is None:
            path = self.plan.paths[item.file]
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise self._err(f"cannot open: {exc.strerror}", item) from exc
            try:
                check_identity(self.plan, item.file, fd, item.name)
                f = files[item.file] = map_file(path, fd, item.file, self.plan,
                                            random=self.fault_budget is not None)
            except BaseException:
                os.close(fd)
                raise
        return f

    def _item_runs(self, item: ReadItem) -> list[Run]:
        runs = self._runs.get(item.target)
        if runs is None:
            runs = self._runs[item.target] = strided_runs(item.ranges)
        return runs

    def _span(self, item: ReadItem) -> tuple[int, int]:
        """(first byte, end) of the item's ranges, from its strided runs (a dim-1 shard's
        thousands of rows are one run: no pass over its ranges)."""
        runs = self._item_runs(item)
        return (min(off for off, _, _, _ in runs),
                max(off + (count - 1) * stride + n for off, n, count, stride in runs))

    def _warm(self, files: dict[str, MappedFile]) -> list[bool]:
        """Per item (plan order): served from the mapping (its files opened and mapped)."""
        out = []
        for item in self.plan.items:
            if not item.ranges:
                out.append(False)
                continue
            runs = self._item_runs(item)
            missing, pages = self._open(files, item).missing(runs)
            self._missing[item.target] = (missing, pages)
            if self.fault_budget is not None:
                out.append(missing * PAGE_BYTES <= self.fault_budget * run_bytes(runs))
            else:
                out.append(not pages or 1.0 - missing / pages >= self.warm_fraction)
        return out

    def _all_mapped(self, files: dict[str, MappedFile]) -> list[bool]:
        """``cold="fault"``, no fault budget: every item copied from the ``MADV_NORMAL``
        mapping, no item's residency asked; a sample of each file's span says whether the
        copies will wait on storage (then ``cold_threads`` copy: waits leave cores idle)."""
        spans: dict[str, list[tuple[int, int]]] = {}  # per file: the items' spans, merged
        for item in self.plan.items:
            self._open(files, item)
            if item.ranges:
                merge_span(spans.setdefault(item.file, []), *self._span(item))
        self.faulting = any(not files[f].nearly_resident(lo, lo + n)
                             for f, pieces in spans.items() for lo, n in pieces)
        return [bool(item.ranges) for item in self.plan.items]

    def _from_mapping(self, f: MappedFile, item: ReadItem, dst: Optional[torch.Tensor]
                      ) -> torch.Tensor:
        """The item's tensor from the mapping: a view when it is one whole range (and no
        destination is given), else copied into ``dst`` or a fresh tensor (one strided copy
        per run of :func:`strided_runs`; a ``whole`` item: a view of its full tensor)."""
        whole = self.whole.get(item.target)
        if whole is not None:
            off, n = whole
            self._check_end(f, item, off + n)
            out = f.base[off:off + n].view(item_dtype(item)).reshape(item.source_shape)
            if dst is not None:
                dst.copy_(out)
                return dst
            return out
        runs = self._item_runs(item)
        self._check_end(f, item, max(off + (count - 1) * stride + n
                                     for off, n, count, stride in runs))
        dtype = item_dtype(item)
        if dst is None and item.direct and not item.pad_rows and len(item.ranges) == 1:
            off, n = item.ranges[0]
            return f.base[off:off + n].view(dtype).reshape(item.shape)
        out = dst if dst is not None else torch.empty(item.shape, dtype=dtype)
        if item.direct:
            flat, pos = out.reshape(-1).view(torch.uint8), 0
            for off, n, count, stride in runs:
                flat[pos:pos + n * count].view(count, n).copy_(
                    f.base.as_strided((count, n), (stride, 1), off))
                pos += n * count
            materialise(item, flat[:0], out)  # the padding rows only
            return out
        parts = [f.base[off:off + n] for off, n in item.ranges]
        raw = parts[0] if len(parts) == 1 else torch.cat(parts)
        materialise(item, raw, out)
        return out

    def _check_end(self, f: MappedFile, item: ReadItem, end: int) -> None:
        if end > f.base.numel():
            raise self._err(f"file changed during load: unexpected end of file (the item "
                            f"ends at byte {end}, the file has {f.base.numel()}; truncated "
                            "while loading?)", item)

    def _cold_reader(self, cold: list[ReadItem]) -> Reader:
        return Reader(replace(self.plan, items=tuple(cold), redistribute=None),
                      window_bytes=self.options.window_bytes,
                      threads=self.cold_threads or self.options.threads or COLD_THREADS,
                      cancel=self.options.cancel,
                      on_progress=self.options.on_progress,
                      memory_budget_bytes=self.options.memory_budget_bytes)

    def _each(self) -> Iterator[tuple[str, torch.Tensor]]:
        start, files = time.perf_counter(), dict[str, MappedFile]()
        self.mapped_bytes = self.readahead_bytes = self.warm_items = self.mapped_items = 0
        reader: Optional[Reader] = None
        try:
            if self.cold == "readahead":
                yield from self._each_ahead(files, None)
                return
            warm = self._warm(files)
            cold = [i for i, w in zip(self.plan.items, warm) if not w]
            stream: Iterator[tuple[str, torch.Tensor]] = iter(())
            if cold:
                reader = self._cold_reader(cold)
                reader.on_progress = None  # counted below, once per item
                stream = iter(reader)
            self._populate(files, [(i.file, self._span(i))
                                   for i, w in zip(self.plan.items, warm) if w])
            for item, is_warm in zip(self.plan.items, warm):
                self._check_cancel(item)
                if is_warm:
                    tensor = self._from_mapping(files[item.file], item, None)
                    self._count_warm(item)
                else:
                    target, tensor = next(stream)
                    if target != item.target:  # pragma: no cover - plan order is kept
                        raise self._err(f"internal: cold stream gave {target}", item)
                    if self.options.on_progress is not None:
                        self.options.on_progress(item.read_bytes)
                self.stats.items += 1
                yield item.target, tensor
            for _ in stream:  # the cold reader's end: its identity checks and close
                pass
            for file, f in files.items():
                check_identity(self.plan, file, f.fd)
        finally:
            self._finish(files, reader, start)

    def _into(self, destinations: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Warm items copied from the mapping into their destinations (on ``threads``
        threads), then cold ones read straight into theirs (no intermediate tensor; with
        ``cold="fault"`` copied from the mapping too, faulted in with read-around); with
        ``fault_budget``, a partly resident item is split (io/mapped_split.py): its resident
        rows / pages copied, the rest read. Our own copy faults the pages in (the kernel maps
        the resident neighbours of each fault), so nothing is populated ahead."""
        start, files = time.perf_counter(), dict[str, MappedFile]()
        self.mapped_bytes = self.readahead_bytes = self.warm_items = self.mapped_items = 0
        reader: Optional[Reader] = None
        try:
            if self.cold == "readahead":
                if self.options.before_write is not None:
                    self.options.before_write()
                return dict(self._each_ahead(files, destinations))
            warm = self._warm(files) if self.fault_budget is not None or \
                self.cold != "fault" else self._all_mapped(files)
            hot = [i for i, w in zip(self.plan.items, warm) if w]
            if self.cold == "fault" and not self.faulting:
                # a resident stage: its pages mapped in one call per run of nearby items
                # (MADV_POPULATE_READ), cheaper than the copies' faults into destinations
                # already touched (docs/benchmarks.md, the DCP reader on CPU)
                self._populate(files, [(i.file, self._span(i)) for i in hot
                                       if i.ranges and i.target not in self.whole])
            jobs: list[Callable[[], object]] = [
                partial(self._from_mapping, files[i.file], i, destinations[i.target])
                for i in hot]
            cold: list[ReadItem] = []
            parts: dict[ReadItem, torch.Tensor] = {}
            mapped = 0  # bytes of the partly resident items copied from the mapping
            for item, is_warm in zip(self.plan.items, warm):
                if is_warm:
                    continue
                if self.cold == "fault" and item.ranges:
                    # the kernel's fault read-around (MADV_NORMAL on the item's pages: large
                    # requests), the copy on the copy threads as for a warm item
                    f = files[item.file]
                    lo, hi = self._span(item)
                    self._check_end(f, item, hi)
                    advise(*page_span(f.base.data_ptr(), lo, hi), MADV_NORMAL)
                    jobs.append(partial(self._from_mapping, f, item, destinations[item.target]))
                    hot.append(item)
                    continue
                got = self._split(files, item, destinations[item.target])
                if got is None:
                    cold.append(item)
                    continue
                copies, reads = got
                jobs.extend(copies)
                mapped += run_bytes(self._item_runs(item)) - sum(i.nbytes for i in reads)
                parts.update(reads)
            if self.options.before_write is not None:
                self.options.before_write()
            self._run_copies(jobs, self.plan.items[0] if self.plan.items else None)
            for item in hot:
                self._count_warm(item)
            self.stats.items += len(hot)
            if cold or parts:
                reader = self._cold_reader([*cold, *parts])
                reader.read_into({**{i.target: destinations[i.target] for i in cold},
                                  **{i.target: view for i, view in parts.items()}})
            self.stats.items += len(self.plan.items) - len(hot)
            self.mapped_bytes += mapped
            self.stats.read_bytes += mapped
            if mapped and self.options.on_progress is not None:
                self.options.on_progress(mapped)
            for file, f in files.items():
                check_identity(self.plan, file, f.fd)
        finally:
            self._finish(files, reader, start)
        return {i.target: destinations[i.target] for i in self.plan.items}

    def _split(self, files: dict[str, MappedFile], item: ReadItem, dst: torch.Tensor
               ) -> Optional[tuple[list[Callable[[], object]], dict[ReadItem, torch.Tensor]]]:
        """A partly resident item (``fault_budget`` set): copies of its resident stretches
        and read items of its missing bytes with their destination views; None to read it
        whole (more than half its pages missing, a padded or gathered item, or no fault
        budget)."""
        if self.fault_budget is None or not item.direct or item.pad_rows or not item.ranges:
            return None
        missing, pages = self._missing.get(item.target, (1, 1))
        if 2 * missing > pages:  # mostly cold: one exact read of it beats a split
            return None
        f = files[item.file]
        return split_into(item, self._item_runs(item), f.base, f.resident, dst)

    def _run_copies(self, jobs: list[Callable[[], object]], item: Optional[ReadItem]) -> None:
        """Run the copies from the mapping on ``threads`` threads (copy_ releases the GIL)."""
        if item is not None:
            self._check_cancel(item)
        threads = self.options.threads or COLD_THREADS
        if self.faulting and self.cold_threads:
            threads = max(threads, self.cold_threads)
        threads = min(threads, len(jobs))
        if threads > 1:
            with ThreadPoolExecutor(threads, thread_name_prefix="pploader-copy") as pool:
                for fut in [pool.submit(job) for job in jobs]:
                    fut.result()
        else:
            for job in jobs:
                job()

    def _check_cancel(self, item: ReadItem) -> None:
        cancel = self.options.cancel
        if cancel is not None and cancel.is_set():
            raise self._err("cancelled: another rank failed", item)

    def _count_warm(self, item: ReadItem) -> None:
        nbytes = run_bytes(self._item_runs(item))
        self.mapped_bytes += nbytes
        self.stats.read_bytes += nbytes
        self.warm_items += 1
        self.mapped_items += 1
        if self.options.on_progress is not None:
            self.options.on_progress(nbytes)

    def _finish(self, files: dict[str, MappedFile], reader: Optional[Reader], start: float) -> None:
        for f in files.values():
            os.close(f.fd)
        if reader is not None:
            self.stats.read_bytes += reader.stats.read_bytes
            self.stats.syscalls += reader.stats.syscalls
            self.stats.peak_inflight_bytes = reader.stats.peak_inflight_bytes
        self.stats.seconds = time.perf_counter() - start
        logger.debug("rank %d: %d item(s) mapped (%d bytes), %d read (%d bytes)",
                     self.plan.topology.rank, self.warm_items, self.mapped_bytes,
                     len(self.plan.items) - self.warm_items, self.stats.read_bytes)

    def _each_ahead(self, files: dict[str, MappedFile],
                    destinations: Optional[Mapping[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``cold="readahead"``: every item from the mapping, its pages (a ``whole`` item's
        own span only) brought in by a :class:`~pploader.io.readahead.Prefetch` thread in
        plan order, unless every item is warm already."""
        items = self.plan.items
        extent: dict[str, tuple[int, int]] = {}  # file -> the bytes its items span
        for item in items:
            f = self._open(files, item)
            if not item.ranges:
                continue
            whole = self.whole.get(item.target)   # its full tensor: bounds without a scan
            lo, hi = self._span(item) if whole is None else (whole[0], sum(whole))
            self._check_end(f, item, hi)
            was = extent.get(item.file, (lo, hi))
            extent[item.file] = (min(was[0], lo), max(was[1], hi))
        # a warm stage needs no prefetch thread nor readahead advice: the consumer's copy
        # faults its pages in, 16 at a time (cheaper than MADV_POPULATE_READ, and no thread
        # beside every worker)
        whole_files = {name for name, (lo, hi) in extent.items()
                       if files[name].nearly_resident(lo, hi)}
        warm = all(i.file in whole_files or
                   files[i.file].fraction(i.ranges) >= self.warm_fraction
                   for i in items if i.ranges)
        slot: list[Optional[int]] = [None] * len(items)   # plan position -> its span's
        prefetch = None
        if not warm:
            for f in files.values():
                advise_sequential(f.base.data_ptr(), f.base.numel())
            spans: list[tuple[int, int]] = []   # each item's own pages (not its whole tensor)
            for k, item in enumerate(items):
                if item.ranges:
                    slot[k] = len(spans)
                    spans.append(page_span(files[item.file].base.data_ptr(),
                                           *self._span(item)))
            prefetch = Prefetch(spans, window=self.options.window_bytes or READAHEAD_WINDOW,
                                warm_fraction=self.warm_fraction)
        try:
            for k, item in enumerate(items):
                self._check_cancel(item)
                at, size = slot[k], item.read_bytes
                if at is not None and prefetch is not None:
                    prefetch.wait(at)
                    if prefetch.cold[at]:
                        self.readahead_bytes += size
                    else:
                        self.warm_items += 1
                elif item.ranges:
                    self.warm_items += 1
                dst = destinations.get(item.target) if destinations is not None else None
                tensor = self._from_mapping(files[item.file], item, dst)
                self.mapped_bytes += size
                self.stats.read_bytes += size
                self.mapped_items += 1
                self.stats.items += 1
                if self.options.on_progress is not None:
                    self.options.on_progress(size)
                yield item.target, tensor
        finally:
            if prefetch is not None:
                prefetch.close()
        for file, f in files.items():
            check_identity(self.plan, file, f.fd)

    @staticmethod
    def _populate(files: dict[str, MappedFile], items: list[tuple[str, tuple[int, int]]]) -> None:
        """Map the warm items' resident pages ((file, span of its ranges) each) into this
        process in one call per run of nearby spans (MADV_POPULATE_READ) instead of faults
        during the consumer's copy."""
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
                advise(*page_span(base.data_ptr(), lo, min(hi, base.numel())),
                       MADV_POPULATE_READ)

    def load(self, destinations: Optional[Mapping[str, torch.Tensor]] = None
             ) -> dict[str, torch.Tensor]:
        """Every item (views of the mapping where warm), or copied into ``destinations``."""
        if destinations is None:
            return dict(self._each())
        for item in self.plan.items:
            dst = destinations.get(item.target)
            shape = item.source_shape if item.target in self.whole else item.shape
            if dst is None or tuple(dst.shape) != shape or not dst.is_contiguous() \
                    or dst.dtype != item_dtype(item) or dst.device.type != "cpu":
                raise self._err(f"destination {item.target} is not a contiguous cpu "
                                f"tensor of {shape} {item_dtype(item)}", item)
        return self._into(destinations)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._each()


def open_mapped(plan: RankPlan, device: torch.device, options: ReadOptions, *,
                warm_fraction: float = WARM_FRACTION, fault_budget: Optional[float] = None,
                cold_threads: Optional[int] = None, cold: str = "read") -> MappedBackend:
    """The ``mapped`` backend's factory (io/registry.py; the keywords: see MappedBackend)."""
    if device.type != "cpu":
        raise ValueError(f"the mapped backend loads onto cpu, not {device}")
    return MappedBackend(plan, options, warm_fraction=warm_fraction, fault_budget=fault_budget,
                         cold_threads=cold_threads, cold=cold)
