"""Direct-to-GPU loading: positional reads into a reused ring of pinned staging buffers,
asynchronous host-to-device copies straight into the destination tensors.

Each reader thread owns ``slots_per_thread`` pinned slots and one CUDA stream: it fills a
slot with a chunk (one file range, possibly several adjacent tensors), enqueues the H2D
copies of that slot on its stream, records an event, and only reuses the slot once that
event has completed. No pageable-to-device copy is on the hot path; host memory is the
ring (threads x slots x slot_bytes), allocated once and reusable across loads.

The ``pinned`` read backend (io/registry.py, made by :func:`open_pinned`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Callable, Iterator, Mapping, Optional, Protocol, Sequence

import torch

from ..planning.checkpoint import DTYPES
from ..errors import ReadError
from .pagecache import resident_bytes_of_ranges
from ..planning.items import ReadItem
from ..planning.rank_plan import RankPlan
from .backend import ReadOptions, ReadStats, materialise, zero_padding
from .pinned_ring import DEFAULT_DEVICE_THREADS, DEFAULT_SLOT_BYTES, PinnedRing
from .registry import indexed_device
from .staging import lend_staging, process_staging, return_staging, start_staging
from .requests import Chunk as _Chunk
from .requests import chunks as _chunks
from .requests import interleave_files as _interleave_files
from .requests import pieces as _pieces

__all__ = ["PinnedRing", "DeviceLoader", "Feed", "DEFAULT_SLOT_BYTES", "DEFAULT_DEVICE_THREADS",
           "fitted_ring", "open_pinned", "prepared_staging"]

DIRECT_ALIGN = 4096          # O_DIRECT offset/length/address alignment
_PAGE = 4096
logger = logging.getLogger(__name__)


class Feed(Protocol):
    """What the readers of a :class:`DeviceLoader` run on: the chunks to read, in order, and
    the device buffers their pieces land in (``load``: :class:`_WholeFeed`; ``stream``:
    io/device_stream.py)."""

    chunk_count: int

    def take(self) -> Optional[_Chunk]:
        """The next chunk to read (None: no more); its buffers exist or are being made."""

    def before_copy(self, chunk: _Chunk, stream: torch.cuda.Stream) -> bool:
        """Wait until ``chunk``'s buffers exist and order ``stream`` after their making;
        False: stopped, read no further."""

    def buffer(self, target: int) -> torch.Tensor:
        """The byte buffer of item ``target`` (the pieces' ``pos`` index into it)."""

    def after_copy(self, chunk: _Chunk, event: torch.cuda.Event) -> None:
        """``chunk``'s copies are queued; ``event`` completes when they are done."""

    def prepare(self, allocate: Callable[[], None]) -> None:
        """Run ``allocate`` (the destinations) on the caller's thread, then release readers."""

    def stop(self) -> None:
        """Wake every waiter: a reader failed or the consumer left."""


class _WholeFeed:
    """``load()``'s feed: every destination allocated at once by :meth:`prepare`.

    The caching allocator may hand out a block that another thread freed while its kernels
    on the same stream still use it (safe for work on that stream, which runs after them).
    The readers copy from their own streams, so each waits for the allocating stream's mark
    first: without it, a reader overwrote a pipelined TP=4 exchange's piece that a queued copy
    into its send buffer had still to read (found on 4 GPUs, tests/gpu/test_tp_gpu.py)."""

    def __init__(self, chunks: list[_Chunk], buffers: list[Optional[torch.Tensor]],
                 device: torch.device) -> None:
        self.chunk_count, self._buffers, self._device = len(chunks), buffers, device
        self._chunks, self._lock = iter(chunks), threading.Lock()
        self._ready, self._stopped = threading.Event(), False
        self._allocated: Optional[torch.cuda.Event] = None

    def take(self) -> Optional[_Chunk]:
        with self._lock:
            return next(self._chunks, None)

    def prepare(self, allocate: Callable[[], None]) -> None:
        try:
            allocate()
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(self._device))
            self._allocated = allocated
        finally:
            self._ready.set()

    def before_copy(self, chunk: _Chunk, stream: torch.cuda.Stream) -> bool:
        self._ready.wait()
        if self._stopped or self._allocated is None:
            return False
        stream.wait_event(self._allocated)  # after the allocating stream's work
        return True

    def buffer(self, target: int) -> torch.Tensor:
        buf = self._buffers[target]
        assert buf is not None
        return buf

    def after_copy(self, chunk: _Chunk, event: torch.cuda.Event) -> None:
        pass

    def stop(self) -> None:
        self._stopped = True
        self._ready.set()


class DeviceLoader:
    """Load a RankPlan onto a CUDA device (called by the rank that owns the device)."""

    def __init__(self, plan: RankPlan, device: torch.device | str, *,
                 ring: Optional[PinnedRing] = None, cancel: Optional[threading.Event] = None,
                 on_progress: Optional[Callable[[int], None]] = None,
                 direct_io: Optional[bool] = None, prepare_ring: bool = False) -> None:
        """``direct_io``: True reads with O_DIRECT (bypassing the page cache: what cold loads
        from fast devices want), False buffered, None (default) decides per load from the
        page-cache residency of the planned ranges (mostly cached -> buffered).
        ``prepare_ring``: start the ring's background page-locking now (:meth:`PinnedRing.
        prepare`). Off by default: measured on 2x H100 (docs/benchmarks-gpu.md, fourth
        round) page-locking *during* the load made it 0.1-0.35 s slower (the destinations'
        cudaMalloc and the copies wait for the preparer's cudaHostRegister in the driver);
        each reader then page-locks its slots after its first read into them. Prepare the
        ring *before* the load instead (``PinnedRing(prepare=True)`` at start-up)."""
        self.plan, self.device = plan, indexed_device(device)
        self.direct_io, self.direct = direct_io, False
        if self.device.type != "cuda":
            raise ValueError(f"DeviceLoader needs a cuda device, got {self.device}")
        self._lent = ring is None  # the process's staging (io/staging.py), given back after
        self.ring = ring if ring is not None else lend_ring(self.device)
        self.ring.bind_device(self.device)
        self.ready_slots = 0  # slots page-locked when the last load started
        self.cancel, self.on_progress = cancel, on_progress
        self.stats = ReadStats()
        self.staging_device_bytes = 0
        self.timings: dict[str, float] = {}  # seconds per phase of the last load (profiling)
        self._marks: dict[str, float] = {}  # first take / read / H2D of the last load
        self.residency_s = 0.0  # the O_DIRECT decision's page-cache sampling, last load
        self._lock = threading.Lock()
        # True: allocate the destinations while the readers' first reads run. Off by default:
        # cudaMalloc and the readers' cudaHostRegister serialise in the driver, and measured
        # on an H100 host it was slower than allocating first (docs/benchmarks-gpu.md)
        self.overlap_alloc = False
        # O_DIRECT requests span gaps up to this size between needed ranges of a file (read
        # and dropped), and readers take requests file by file or round-robin over the files
        self.direct_gap_bytes = 0
        self.interleave_files = False
        if prepare_ring:
            self.ring.prepare()  # no-op when already under way or done

    def _err(self, msg: str, file: Optional[str] = None) -> ReadError:
        return ReadError(msg, file=file, rank=self.plan.topology.rank)

    def load(self, destinations: Optional[Mapping[str, torch.Tensor]] = None
             ) -> dict[str, torch.Tensor]:
        """Fill ``destinations`` (allocated on the device when None) and return them.

        With ``overlap_alloc`` the reader threads start before the destinations exist (their
        first reads and slot page-locking overlap the allocation; each waits for it only
        before its first device copy)."""
        if destinations is not None:  # pending work on them (zero fills, a forward still
            torch.cuda.synchronize(self.device)  # reading them) ends before our streams write
        start = time.perf_counter()
        chunks = self._plan_chunks()
        t_resid = time.perf_counter()
        out: dict[str, torch.Tensor] = {}
        post: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        buffers: list[Optional[torch.Tensor]] = [None] * len(self.plan.items)
        times: dict[str, float] = {}

        def allocate() -> None:  # on this thread, while the readers' first reads run
            t0 = time.perf_counter()
            for idx, item in enumerate(self.plan.items):
                dtype = DTYPES[item.dtype][0]
                dst = None if destinations is None else destinations.get(item.target)
                if dst is None:
                    if destinations is not None:
                        raise self._err(f"no destination for {item.target}", item.file)
                    dst = torch.empty(item.shape, dtype=dtype, device=self.device)
                elif (tuple(dst.shape) != item.shape or dst.dtype != dtype
                      or not dst.is_contiguous()):
                    raise self._err(f"destination {item.target} is {tuple(dst.shape)} "
                                    f"{dst.dtype}, expected {item.shape} {dtype} contiguous",
                                    item.file)
                out[item.target] = dst
                if item.direct:
                    buffers[idx] = dst.reshape(-1).view(torch.uint8)
                    zero_padding(item, dst)
                else:  # coalesced strided read: stage the box on the device, gather after
                    tmp = torch.empty(item.read_bytes, dtype=torch.uint8, device=self.device)
                    self.staging_device_bytes = max(self.staging_device_bytes, tmp.numel())
                    buffers[idx] = tmp
                    post.append((item, tmp, dst))
            times["destinations_s"] = time.perf_counter() - t0

        pin_before = self.ring.alloc_seconds
        feed = _WholeFeed(chunks, buffers, self.device)
        try:
            if not self.overlap_alloc:
                feed.prepare(allocate)  # before the readers start (see overlap_alloc)
            threads, fds, errors = self._start(feed, allocate if self.overlap_alloc else None)
            self._join(threads, fds, errors, feed)
            t_io = time.perf_counter()
            for item, tmp, dst in post:
                materialise(item, tmp, dst)
            torch.cuda.synchronize(self.device)
        finally:
            self._give_back_ring()
        self.stats.items = len(out)
        self.stats.seconds = time.perf_counter() - start
        self.timings = {"residency_s": t_resid - start, **times, "io_s": t_io - t_resid,
                        "gather_sync_s": start + self.stats.seconds - t_io,
                        "pin_s_summed_over_threads": self.ring.alloc_seconds - pin_before,
                        "first_h2d_s": self._marks.get("first_h2d", t_resid) - t_resid}
        return out

    def stream(self, budget_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """``(target, tensor)`` on the device in plan order, each handed over as soon as its
        bytes have landed, with at most about ``budget_bytes`` of stream-owned device memory
        alive (io/device_stream.py); the tensor is released when the consumer moves on."""
        from .device_stream import DeviceStream
        start = time.perf_counter()
        feed = DeviceStream(self.plan, self.device, budget_bytes)
        fds: dict[str, int] = {}
        errors: list[BaseException] = []
        # the readers start now (thread, CUDA stream) and wait for the chunks planned here
        threads = self._spawn(feed, fds, errors, self.ring.threads)
        t_chunks = t_started = start
        try:
            chunks = self._plan_chunks()
            t_chunks = time.perf_counter()
            self._open_files(fds)
            feed.begin(chunks)
            t_started = time.perf_counter()
            yield from feed.items(errors, lambda: not any(t.is_alive() for t in threads))
        except BaseException:
            feed.stop()
            raise
        finally:
            try:
                self._join(threads, fds, errors, feed)
            finally:
                self._give_back_ring()
            self.stats.items = feed.handed
            self.stats.seconds = time.perf_counter() - start
            self.stats.peak_inflight_bytes = feed.peak_bytes
            self.staging_device_bytes = feed.peak_bytes
            self.timings = {"residency_s": self.residency_s, "chunks_s": t_chunks - start,
                            "started_s": t_started - start,
                            **{f"{k}_s": v - start for k, v in self._marks.items()},
                            **feed.timings}

    def _give_back_ring(self) -> None:
        """The load is done with the ring: the process's staging goes back to its cache, a
        ring that was being page-locked resumes (io/staging.py)."""
        if self._lent:
            self._lent = False
            return_staging(self.ring)
        else:
            self.ring.resume()

    def _plan_chunks(self) -> list[_Chunk]:
        """The plan's read requests for this load (O_DIRECT decided now, unless fixed)."""
        t0 = time.perf_counter()
        self.direct = self._use_direct() if self.direct_io is None else self.direct_io
        self.residency_s = time.perf_counter() - t0
        pieces = [p for idx, item in enumerate(self.plan.items) for p in _pieces(item, idx)]
        chunks = _chunks(pieces, self.ring.slot_bytes, DIRECT_ALIGN if self.direct else 1,
                         self.direct_gap_bytes if self.direct else 0)
        return _interleave_files(chunks) if self.interleave_files else chunks

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(target, tensor)`` in plan order: the whole plan is loaded at the first step."""
        yield from self.load().items()

    def _use_direct(self) -> bool:
        """O_DIRECT when less than half of the planned bytes are in the page cache, judged
        from up to 16 spread ranges per file, 1 MiB of each (a few hundred pages)."""
        if not hasattr(os, "O_DIRECT"):
            return False
        resident = total = 0
        for file, path in self.plan.paths.items():
            ranges = [r for i in self.plan.items if i.file == file for r in i.ranges if r[1]]
            step = max(1, len(ranges) // 16)
            sample = [(off, min(n, 1 << 20)) for off, n in ranges[::step]]
            r, t = resident_bytes_of_ranges(path, sample, sample_bytes=1 << 20)
            resident, total = resident + r, total + t
        return total > 0 and resident < total / 2

    def _open(self, path: str) -> int:
        if self.direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # e.g. tmpfs: no O_DIRECT; buffered reads of the same bytes
                pass
        return os.open(path, os.O_RDONLY)

    def _start(self, feed: "Feed", allocate: Optional[Callable[[], None]]
               ) -> tuple[list[threading.Thread], dict[str, int], list[BaseException]]:
        """Open the files (checked against the plan) and start the readers on ``feed``;
        ``allocate``: run by the feed meanwhile, on this thread (``overlap_alloc``)."""
        fds: dict[str, int] = {}
        self._open_files(fds)
        errors: list[BaseException] = []
        threads = self._spawn(feed, fds, errors, min(self.ring.threads,
                                                     max(1, feed.chunk_count)))
        if allocate is not None:
            try:
                feed.prepare(allocate)
            except BaseException as exc:  # noqa: BLE001 - raised by the caller's join
                errors.insert(0, exc)
                feed.stop()
        return threads, fds, errors

    def _open_files(self, fds: dict[str, int]) -> None:
        """Every plan file into ``fds``, checked against its planned identity (all closed
        again on failure)."""
        try:
            for f, p in self.plan.paths.items():
                fds[f] = self._open(p)
                st = os.fstat(fds[f])
                if (st.st_size, st.st_ino) != (self.plan.identities[f].size,
                                               self.plan.identities[f].inode):
                    raise self._err("file changed since planning", f)
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            fds.clear()
            raise

    def _spawn(self, feed: "Feed", fds: Mapping[str, int], errors: list[BaseException],
               count: int) -> list[threading.Thread]:
        """``count`` reader threads on ``feed``, started (``fds`` may still be filling: a
        reader opens nothing and takes its first chunk from the feed when it is ready)."""
        self._marks = {}
        self.ring.stop_preparing()  # the driver to the load alone (io/staging.py)
        self.ready_slots = self.ring.ready_slots
        threads = [threading.Thread(target=self._worker, args=(i, feed, fds, errors),
                                    name=f"pploader-h2d-{i}") for i in range(count)]
        for t in threads:
            t.start()
        return threads

    def _join(self, threads: list[threading.Thread], fds: Mapping[str, int],
              errors: list[BaseException], feed: "Feed") -> None:
        """Wait for the readers, close the files, raise the first error."""
        try:
            if errors:
                feed.stop()
            for t in threads:
                t.join()
        finally:
            for fd in fds.values():
                os.close(fd)
        if errors:
            raise errors[0]

    def _worker(self, index: int, feed: "Feed", fds: Mapping[str, int],
                errors: list[BaseException]) -> None:
        """One reader: take a chunk, read it into a free slot, queue its H2D copies on this
        thread's stream into the feed's buffers, tell the feed; until the chunks run out."""
        stream: Optional[torch.cuda.Stream] = None
        j = 0
        try:
            torch.cuda.set_device(self.device)  # every CUDA call of this thread on our GPU
            slots = self.ring.slots(index)
            stream = torch.cuda.Stream(device=self.device)
            events: list[Optional[torch.cuda.Event]] = [None] * len(slots)
            self._marks.setdefault("reader_ready", time.perf_counter())
            while not errors:
                chunk = feed.take()
                if chunk is None:
                    break
                self._marks.setdefault("first_take", time.perf_counter())
                if self.cancel is not None and self.cancel.is_set():
                    raise self._err("cancelled: another rank failed", chunk.file)
                b = j % len(slots)
                event = events[b]
                if event is not None:
                    event.synchronize()
                pinned, view = slots[b]
                nread = self._read_chunk(fds[chunk.file], view, chunk)
                self._marks.setdefault("first_read", time.perf_counter())
                self.ring.reached(index, b)  # page-locked or pageable: never waits for it
                if not feed.before_copy(chunk, stream) or errors:
                    break
                with torch.cuda.stream(stream):
                    for p in chunk.pieces:
                        pos = p.offset - chunk.offset
                        feed.buffer(p.target)[p.pos:p.pos + p.length].copy_(
                            pinned[pos:pos + p.length], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    events[b] = ev
                feed.after_copy(chunk, ev)
                self._marks.setdefault("first_h2d", time.perf_counter())
                with self._lock:
                    self.stats.read_bytes += nread
                    self.stats.syscalls += 1
                if self.on_progress is not None:
                    self.on_progress(sum(p.length for p in chunk.pieces))
                j += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised by the loader's join
            errors.append(exc)
            feed.stop()
        finally:  # no copy of ours may still write a buffer once the load has returned
            if stream is not None:
                with contextlib.suppress(Exception):
                    stream.synchronize()

    def _read_chunk(self, fd: int, view: memoryview, chunk: _Chunk) -> int:
        """Read ``chunk`` into ``view`` (O_DIRECT: rounded up to whole aligned blocks; its
        offset is aligned already); returns the bytes read."""
        end = chunk.length
        want = -(-end // DIRECT_ALIGN) * DIRECT_ALIGN if self.direct else end
        got = 0
        while got < end:
            try:
                n = os.preadv(fd, [view[got:want]], chunk.offset + got)
            except OSError as exc:
                raise self._err(f"read failed at offset {chunk.offset + got}: {exc.strerror}",
                                chunk.file) from exc
            if n <= 0:
                raise self._err(f"file changed during load: unexpected end of file at offset "
                                f"{chunk.offset + got}", chunk.file)
            got += n
        return got


def fitted_ring(items: Sequence[ReadItem], window_bytes: Optional[int],
                threads: int) -> PinnedRing:
    """Host staging sized to ``items``: ``threads`` x 2 pinned slots, no larger than the items
    need nor (given) ``window_bytes`` in all; larger items are split over several slots."""
    threads = max(1, threads)
    slot = min(DEFAULT_SLOT_BYTES, -(-sum(i.read_bytes for i in items) // threads))
    if window_bytes:
        slot = min(slot, window_bytes // (2 * threads))
    return PinnedRing(threads, max(_PAGE, -(-slot // _PAGE) * _PAGE), lazy=True)


def open_pinned(plan: RankPlan, device: torch.device, options: ReadOptions) -> DeviceLoader:
    """The ``pinned`` backend's factory (io/registry.py): a :class:`DeviceLoader` on
    ``options.ring``, else on the process's staging for ``device`` (io/staging.py; lent for
    the load, page-locked slots reused across loads)."""
    ring, lent = options.ring, False
    if ring is None and options.fit_staging and options.window_bytes:
        # a host-memory bound below the process ring's: staging of its own, that size
        ring = fitted_ring(plan.items, options.window_bytes,
                           options.threads or DEFAULT_DEVICE_THREADS)
    if ring is None:
        ring, lent = lend_ring(device, options.threads), True
    loader = DeviceLoader(plan, device, ring=ring, cancel=options.cancel,
                          on_progress=options.on_progress, direct_io=options.direct_io)
    loader._lent = lent
    return loader


def lend_ring(device: torch.device, threads: Optional[int] = None) -> PinnedRing:
    """The ring a load without one reads through: the process's staging (io/staging.py),
    a ring of its own while another load of this process holds that one, or (no CUDA
    runtime to page-lock with) a plain ring."""
    if process_staging(device, threads) is None:
        return PinnedRing(threads or DEFAULT_DEVICE_THREADS, device=device)
    ring, _ = lend_staging(device, threads)
    return ring


def prepared_staging(device: torch.device, options: ReadOptions) -> PinnedRing:
    """The ``pinned`` backend's staging made ahead of a load (io/registry.py
    ``prepare_staging``): the process's ring for ``device`` (io/staging.py), its slots
    page-locked on a background thread while the caller plans and agrees (a load pauses
    that, reads with what is ready, and resumes it after)."""
    ring = start_staging(device, options.threads)
    if ring is None:
        raise ValueError(f"no CUDA staging for {device}")
    return ring
