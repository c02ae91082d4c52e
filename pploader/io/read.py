"""The streaming executor: positional reads of a RankPlan with bounded host memory.

One module-level rule: nothing here calls torch.distributed. Cancellation (another rank
failed) and progress are plain callables/events handed in by the caller.

Modes:
- ``owned`` (default): every yielded tensor is a fresh allocation the caller keeps.
- ``borrowed`` (opt-in, fast): tensors are views into a reused ring buffer; each one is valid
  only until the consumer asks for the next item (the reader may then refill its bytes in the
  background). Use :func:`owned` to keep one.
- destinations: :meth:`Reader.read_into` reads straight into caller-given tensors.

The ``threaded`` read backend (io/registry.py, made by :func:`open_threaded`).
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from ..planning.checkpoint import DTYPES
from ..errors import ArgumentError, MemoryBudgetError, ReadError
from ..planning.items import ReadItem
from ..planning.rank_plan import RankPlan
from .backend import ReadOptions, ReadStats, check_identity, materialise, zero_padding

logger = logging.getLogger(__name__)

__all__ = ["Reader", "ReadStats", "owned", "is_borrowed", "default_window_bytes",
           "DEFAULT_WINDOW_BYTES", "open_threaded"]

DEFAULT_WINDOW_BYTES = 256 * 1024 * 1024
_MAX_BATCH_BYTES = 64 * 1024 * 1024
_MAX_IOV = 512
_CHUNK = 1 << 30


#: attribute set on a live borrowed ring's storage (views share it, clones do not)
_BORROWED = "_pploader_borrowed"


def is_borrowed(t: torch.Tensor) -> bool:
    """True for a tensor yielded in borrowed mode, or a view of one (backed by a reused buffer
    that its reader may still refill; the reader's ring clears the mark when it ends)."""
    if getattr(t, _BORROWED, False):
        return True
    return t.device.type == "cpu" and bool(getattr(t.untyped_storage(), _BORROWED, False))


def owned(t: torch.Tensor) -> torch.Tensor:
    """A tensor the caller may keep: a clone when ``t`` is borrowed, else ``t`` itself."""
    return t.clone() if is_borrowed(t) else t


def default_window_bytes(plan: RankPlan) -> int:
    """A few hundred MiB or 2x the largest item, whichever is larger."""
    return max(DEFAULT_WINDOW_BYTES, 2 * plan.largest_item_bytes)


def _as_bytes(t: torch.Tensor) -> memoryview:
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")  # type: ignore[arg-type]


class _Ring:
    """A circular arena handing out FIFO-freed byte regions of one reused buffer. While it is
    live its storage is marked borrowed (:func:`is_borrowed` of any view); :meth:`release`
    clears the mark once its reader will not refill it again."""

    def __init__(self, nbytes: int) -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8)
        self.buf.fill_(0)  # prefault once: first touch of fresh memory is slow
        self.size, self.head = nbytes, 0
        self.live: deque[tuple[int, int]] = deque()  # (start, end)
        setattr(self.buf.untyped_storage(), _BORROWED, True)

    def release(self) -> None:
        """The reader is done: views of the buffer are stable from now on."""
        setattr(self.buf.untyped_storage(), _BORROWED, False)

    def _used(self) -> int:
        return sum(e - s for s, e in self.live)

    def alloc_all(self, sizes: list[int]) -> Optional[list[torch.Tensor]]:
        """Regions for every size, or None (and nothing taken) when they do not fit now."""
        if not self.live:
            self.head = 0  # empty ring: start over, so anything up to ``size`` in total fits
        head, taken = self.head, list[torch.Tensor]()
        for n in sizes:
            region = self.alloc(n)
            if region is None:
                for _ in taken:
                    self.live.pop()
                self.head = head
                return None
            taken.append(region)
        return taken

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        if n > self.size:
            raise ReadError(f"item of {n} bytes exceeds the borrowed ring of {self.size} bytes")
        start = self.head if self.head + n <= self.size else 0
        for s, e in self.live:
            if start < e and s < start + n:
                return None
        self.live.append((start, start + n))
        self.head = start + n
        return self.buf[start:start + n]

    def free_oldest(self) -> None:
        self.live.popleft()


class Reader:
    """Executes one RankPlan: ``for target, tensor in Reader(plan): ...``."""

    def __init__(self, plan: RankPlan, *, window_bytes: Optional[int] = None, threads: int = 1,
                 mode: str = "owned", cancel: Optional[threading.Event] = None,
                 on_progress: Optional[Callable[[int], None]] = None,
                 memory_budget_bytes: Optional[int] = None) -> None:
        if mode not in ("owned", "borrowed"):
            raise ArgumentError(f"mode={mode!r}: must be 'owned' or 'borrowed'", argument="mode")
        self.plan, self.threads, self.mode = plan, max(1, threads), mode
        self.window_bytes = window_bytes or default_window_bytes(plan)
        if self.window_bytes < plan.largest_item_bytes:
            big = max(plan.items, key=lambda i: max(i.nbytes, i.read_bytes))
            raise ReadError(f"window of {self.window_bytes} bytes is smaller than the largest "
                            f"item ({plan.largest_item_bytes} bytes)", file=big.file,
                            tensor=big.name, rank=plan.topology.rank)
        # every byte the reader allocates (outputs it hands out, scratch, the borrowed ring) is
        # counted against memory_budget_bytes; exceeding it is a structured out-of-memory error
        self.memory_budget_bytes, self._in_use_bytes = memory_budget_bytes, 0
        self.cancel, self.on_progress = cancel, on_progress
        self.stats = ReadStats()
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        logger.debug("rank %d: reader over %d item(s), window %d bytes, %d thread(s), %s",
                     plan.topology.rank, len(plan.items), self.window_bytes, self.threads, mode)

    # ---- files -------------------------------------------------------------------------
    def _fd(self, file: str, tensor: Optional[str] = None) -> int:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                try:
                    fd = os.open(self.plan.paths[file], os.O_RDONLY)
                except OSError as exc:
                    raise self._err(f"cannot open: {exc.strerror}", file, tensor) from exc
                try:
                    check_identity(self.plan, file, fd, tensor)
                except ReadError:
                    os.close(fd)
                    raise
                self._fds[file] = fd
                logger.debug("rank %d: opened %s", self.plan.topology.rank, file)
            return fd

    def _check_identity(self, file: str, fd: int) -> None:
        check_identity(self.plan, file, fd)

    def _err(self, msg: str, file: Optional[str] = None, tensor: Optional[str] = None) -> ReadError:
        return ReadError(msg, file=file, tensor=tensor, rank=self.plan.topology.rank)

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype, item: Optional[ReadItem],
               what: str = "tensor") -> torch.Tensor:
        """torch.empty counted against the memory budget; OOM becomes MemoryBudgetError."""
        nbytes = math.prod(shape) * dtype.itemsize
        in_use = self._reserve(nbytes, item, what)
        file, name = (item.file, item.name) if item is not None else (None, None)
        budget = self.memory_budget_bytes
        try:
            return torch.empty(shape, dtype=dtype)
        except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            if not isinstance(exc, MemoryError) and "alloc" not in str(exc).lower():
                raise
            raise MemoryBudgetError(f"out of memory: allocating {what} of {nbytes} bytes failed "
                                    f"({in_use} bytes already allocated by this load): {exc}",
                                    nbytes=nbytes, in_use_bytes=in_use, budget_bytes=budget,
                                    file=file, tensor=name, rank=self.plan.topology.rank) from None

    def _reserve(self, nbytes: int, item: Optional[ReadItem], what: str) -> int:
        """Count ``nbytes`` against the budget (MemoryBudgetError past it); bytes in use before."""
        budget = self.memory_budget_bytes
        with self._lock:
            in_use = self._in_use_bytes
            if budget is not None and in_use + nbytes > budget:
                raise MemoryBudgetError(
                    f"out of memory: {what} of {nbytes} bytes would exceed the memory budget "
                    f"({in_use} of {budget} bytes in use)", nbytes=nbytes, in_use_bytes=in_use,
                    budget_bytes=budget, file=item.file if item else None,
                    tensor=item.name if item else None, rank=self.plan.topology.rank)
            self._in_use_bytes += nbytes
            return in_use

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._in_use_bytes -= nbytes

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    # ---- reading -----------------------------------------------------------------------
    def _pread_into(self, fd: int, views: list[memoryview], offset: int, item: ReadItem) -> None:
        """Fill ``views`` (consecutive in the file from ``offset``) completely."""
        pending = [v for v in views if len(v)]
        while pending:
            if self.cancel is not None and self.cancel.is_set():
                raise self._err("cancelled: another rank failed", item.file, item.name)
            batch, total = list[Any](), 0
            for v in pending[:_MAX_IOV]:
                if total + len(v) > _CHUNK and batch:
                    break
                batch.append(v if len(v) <= _CHUNK else v[:_CHUNK])
                total += len(batch[-1])
            try:
                got = os.preadv(fd, batch, offset)
            except OSError as exc:
                raise self._err(f"read failed at offset {offset}: {exc.strerror}", item.file,
                                item.name) from exc
            self.stats.syscalls += 1
            if got == 0:
                raise self._err(f"file changed during load: unexpected end of file at offset "
                                f"{offset} (truncated while loading?)", item.file, item.name)
            offset += got
            with self._lock:
                self.stats.read_bytes += got
            while got:
                head = pending[0]
                if len(head) <= got:
                    got -= len(head)
                    pending.pop(0)
                else:
                    pending[0] = head[got:]
                    got = 0

    def _read_item(self, item: ReadItem, dst: torch.Tensor) -> None:
        fd = self._fd(item.file, item.name) if item.ranges else -1
        if item.direct:
            out = _as_bytes(dst)
            pos = 0
            for off, n in item.ranges:
                self._pread_into(fd, [out[pos:pos + n]], off, item)
                pos += n
            zero_padding(item, dst)
            return
        scratch = sum(n for _, n in item.ranges)
        buf = self._empty((scratch,), torch.uint8, item, "read buffer")
        try:
            self._gather_into(fd, item, buf, dst)
        finally:
            del buf
            self._release(scratch)

    def _gather_into(self, fd: int, item: ReadItem, buf: torch.Tensor, dst: torch.Tensor) -> None:
        view, pos = _as_bytes(buf), 0
        for off, n in item.ranges:
            self._pread_into(fd, [view[pos:pos + n]], off, item)
            pos += n
        materialise(item, buf, dst)

    def _read_batch(self, batch: list[tuple[ReadItem, torch.Tensor]]) -> None:
        first = batch[0][0]
        if len(batch) > 1:  # contiguous direct items: one preadv for all of them
            views = [_as_bytes(dst) for _, dst in batch]
            self._pread_into(self._fd(first.file, first.name), views, first.ranges[0][0], first)
        else:
            self._read_item(first, batch[0][1])
        with self._lock:
            self.stats.items += len(batch)
        if self.on_progress is not None:
            self.on_progress(sum(i.read_bytes for i, _ in batch))

    def _batches(self, max_bytes: int = _MAX_BATCH_BYTES) -> Iterator[list[ReadItem]]:
        """Group consecutive single-range items that are adjacent in one file."""
        batch: list[ReadItem] = []
        size = 0
        for item in self.plan.items:
            simple = item.direct and len(item.ranges) == 1 and not item.pad_rows
            if (batch and simple and item.file == batch[-1].file
                    and batch[-1].ranges[-1][0] + batch[-1].ranges[-1][1] == item.ranges[0][0]
                    and size + item.read_bytes <= max_bytes):
                batch.append(item)
                size += item.read_bytes
                continue
            if batch:
                yield batch
            batch, size = [item], item.read_bytes
            if not simple:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch

    def _alloc(self, items: list[ReadItem], ring: Optional[_Ring]
               ) -> Optional[list[torch.Tensor]]:
        """Outputs for a whole batch, or None when the ring cannot hold all of them yet."""
        if ring is None:
            return [self._empty(i.shape, DTYPES[i.dtype][0], i) for i in items]
        raws = ring.alloc_all([max(i.nbytes, 1) for i in items])
        if raws is None:
            return None
        outs = []
        for item, raw in zip(items, raws):
            t = raw[:item.nbytes].view(DTYPES[item.dtype][0]).reshape(item.shape)
            t._pploader_borrowed = True  # type: ignore[attr-defined]
            outs.append(t)
        return outs

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(target, tensor)`` in plan order with at most ``window_bytes`` in flight."""
        # the ring never needs more than the whole plan (small stages: small ring)
        ring_bytes = min(self.window_bytes, sum(max(i.nbytes, 1) for i in self.plan.items) or 1)
        if self.mode == "borrowed":
            self._reserve(ring_bytes, None, "borrowed ring")
        ring = _Ring(ring_bytes) if self.mode == "borrowed" else None
        start = time.perf_counter()
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pploader-read")
        queue: deque[tuple[list[tuple[ReadItem, torch.Tensor]], Future, int]] = deque()
        inflight = 0
        batches = self._batches(min(_MAX_BATCH_BYTES, ring_bytes) if ring is not None
                                else min(_MAX_BATCH_BYTES, self.window_bytes))  # window bounds
        pending_batch: Optional[list[ReadItem]] = None
        try:
            while True:
                while True:  # submit ahead while the window allows
                    if pending_batch is None:
                        pending_batch = next(batches, None)
                    if pending_batch is None:
                        break
                    cost = sum(i.nbytes + (i.read_bytes if not i.direct else 0)
                               for i in pending_batch)
                    if queue and inflight + cost > self.window_bytes:
                        break
                    outs = self._alloc(pending_batch, ring)
                    if outs is None:
                        if not queue:  # an empty ring always fits one batch (<= window)
                            raise self._err(f"internal: a batch of {cost} bytes does not fit "
                                            f"the empty {ring_bytes}-byte ring",
                                            pending_batch[0].file, pending_batch[0].name)
                        break  # ring full: wait for the consumer to release
                    pairs = list(zip(pending_batch, outs))
                    queue.append((pairs, pool.submit(self._read_batch, pairs), cost))
                    inflight += cost
                    self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, inflight)
                    pending_batch = None
                if not queue:
                    break
                pairs, fut, cost = queue.popleft()
                fut.result()
                for item, tensor in pairs:
                    yield item.target, tensor
                    if ring is not None:
                        ring.free_oldest()
                inflight -= cost
            for file, fd in list(self._fds.items()):
                self._check_identity(file, fd)
        finally:
            for _, fut, _ in queue:
                fut.cancel()
            pool.shutdown(wait=True)
            if ring is not None:
                ring.release()
            self.close()
            self.stats.seconds = time.perf_counter() - start

    def read_into(self, destinations: Mapping[str, torch.Tensor]) -> ReadStats:
        """Read every item straight into ``destinations[target]`` (contiguous CPU tensors)."""
        for item in self.plan.items:
            dst = destinations.get(item.target)
            if dst is None:
                raise self._err("no destination given", item.file, item.target)
            if (tuple(dst.shape) != item.shape or dst.dtype != DTYPES[item.dtype][0]
                    or not dst.is_contiguous() or dst.device.type != "cpu"):
                raise self._err(f"destination is {tuple(dst.shape)} {dst.dtype} on {dst.device} "
                                f"(contiguous={dst.is_contiguous()}), expected {item.shape} "
                                f"{DTYPES[item.dtype][0]} contiguous on cpu", item.file, item.target)
        start = time.perf_counter()
        # one thread: read inline (nothing to overlap with; no hand-offs, ~4% faster warm)
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pploader-read") \
            if self.threads > 1 else None
        try:
            batches = ([(i, destinations[i.target]) for i in b] for b in self._batches())
            if pool is None:
                for batch in batches:
                    self._read_batch(batch)
            else:
                for fut in [pool.submit(self._read_batch, batch) for batch in batches]:
                    fut.result()
            for file, fd in list(self._fds.items()):
                self._check_identity(file, fd)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            self.close()
            self.stats.seconds = time.perf_counter() - start
        return self.stats

    def load(self, destinations: Optional[Mapping[str, torch.Tensor]] = None
             ) -> dict[str, torch.Tensor]:
        """The read-backend call (io/backend.py): every item as a fresh tensor (``owned``
        mode) or a borrowed view, or, with ``destinations``, read into them
        (:meth:`read_into`) and returned by target."""
        if destinations is None:
            return dict(self)
        self.read_into(destinations)
        return {i.target: destinations[i.target] for i in self.plan.items}


def open_threaded(plan: RankPlan, device: torch.device, options: ReadOptions) -> Reader:
    """The ``threaded`` backend's factory (io/registry.py): a :class:`Reader` (CPU)."""
    if device.type != "cpu":
        raise ValueError(f"the threaded reader loads onto cpu, not {device}")
    return Reader(plan, window_bytes=options.window_bytes, threads=options.threads or 1,
                  mode=options.mode, cancel=options.cancel, on_progress=options.on_progress,
                  memory_budget_bytes=options.memory_budget_bytes)
