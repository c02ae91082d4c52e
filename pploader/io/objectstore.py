"""The ``s3`` read backend: a rank's planned byte ranges fetched from an object store with ranged
GETs, merged into large requests, many in flight, straight into the reader's buffers.

Picked automatically for a plan whose files are ``s3://`` objects (io/registry.py). The plan's
items are taken in order in batches of at most half the window (``window_bytes``, default
512 MiB), so two batches are in flight at most: one being fetched while the previous one is
handed out. In a batch, every item's ranges become views of its buffer (the caller's destination
itself for a contiguous CPU read, else a scratch buffer, page-locked for a GPU); views that are
adjacent in an object are merged into one request of at most ``REQUEST_BYTES``; ``threads``
requests run at once. Every GET names the planned ETag and is checked against the planned size
(storage/s3.py), so an object rewritten mid-load fails the read.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Iterator, Mapping, Optional

import torch

from ..errors import ReadError
from ..planning.header import ObjectIdentity
from ..planning.items import ReadItem
from ..planning.rank_plan import RankPlan
from ..storage import ObjectInfo
from ..storage.s3 import ObjectStoreError, S3Options, S3Storage, split_uri
from .backend import ReadOptions, ReadStats, item_dtype, materialise

__all__ = ["ObjectStoreBackend", "open_s3", "REQUEST_BYTES", "DEFAULT_WINDOW_BYTES",
           "DEFAULT_REQUESTS"]

logger = logging.getLogger(__name__)

#: the largest merged request (bytes): large enough to amortise a request's latency, small
#: enough that a big tensor is fetched by many requests at once
REQUEST_BYTES = 16 << 20
#: host bytes in flight by default (two batches of half this)
DEFAULT_WINDOW_BYTES = 512 << 20
#: requests in flight by default (``ReadOptions.threads`` overrides)
DEFAULT_REQUESTS = 16


@dataclass
class _Request:
    """One ranged GET: ``length`` bytes of ``name`` from ``start`` into ``views`` in order."""

    file: str
    start: int
    length: int
    views: list[memoryview] = field(default_factory=list)
    tensor: str = ""


class _Stop:
    """Set when this load stops (a failed request) or the caller cancels."""

    def __init__(self, outer: Optional[threading.Event]) -> None:
        self.own, self.outer = threading.Event(), outer

    def is_set(self) -> bool:
        return self.own.is_set() or (self.outer is not None and self.outer.is_set())


class ObjectStoreBackend:
    """Reads a plan of ``s3://`` objects (see the module docstring)."""

    def __init__(self, plan: RankPlan, device: torch.device, options: ReadOptions,
                 s3: Optional[S3Options] = None) -> None:
        self.plan, self.device, self.options, self.stats = plan, device, options, ReadStats()
        self.requests = max(1, options.threads or DEFAULT_REQUESTS)
        self.batch_bytes = max(1, (options.window_bytes or DEFAULT_WINDOW_BYTES) // 2)
        s3 = s3 or S3Options()
        if self.requests > s3.max_connections:  # else planning's client is shared
            s3 = replace(s3, max_connections=self.requests)
        buckets: dict[str, S3Storage] = {}
        self._objects: dict[str, tuple[S3Storage, str, ObjectInfo]] = {}
        for file in plan.files:
            bucket, key = split_uri(str(plan.paths[file]))
            store = buckets.setdefault(bucket, S3Storage(bucket, "", s3))
            ident = plan.identities[file]
            etag = ident.etag if isinstance(ident, ObjectIdentity) else ""
            self._objects[file] = (store, key, ObjectInfo(ident.size, etag))

    def _err(self, msg: str, file: str, tensor: Optional[str]) -> ReadError:
        return ReadError(msg, file=file, tensor=tensor, rank=self.plan.topology.rank)

    def _fetch(self, req: _Request, stop: _Stop) -> int:
        store, key, info = self._objects[req.file]
        try:
            return store.read_into(key, req.start, req.views, info, cancel=stop)
        except ObjectStoreError as exc:
            raise self._err(exc.detail, exc.uri, req.tensor) from None

    def _prepare(self, batch: list[ReadItem],
                 destinations: Optional[Mapping[str, torch.Tensor]]
                 ) -> tuple[list[tuple[ReadItem, torch.Tensor, torch.Tensor]], list[_Request]]:
        """Each item's destination and raw buffer, and the batch's merged requests."""
        staged, pieces = [], []
        pin = self.device.type == "cuda"
        for item in batch:
            dst = torch.empty(item.shape, dtype=item_dtype(item), device=self.device) \
                if destinations is None else destinations.get(item.target)
            if dst is None or tuple(dst.shape) != item.shape or not dst.is_contiguous() \
                    or dst.dtype != item_dtype(item) or dst.device.type != self.device.type:
                raise self._err(f"destination {item.target} is not a contiguous "
                                f"{self.device.type} tensor of {item.shape} {item_dtype(item)}",
                                item.file, item.name)
            if item.direct and dst.device.type == "cpu":
                raw = dst.reshape(-1).view(torch.uint8)[:item.read_bytes]
            else:
                raw = torch.empty(item.read_bytes, dtype=torch.uint8, pin_memory=pin)
            view, pos = memoryview(raw.numpy()).cast("B"), 0  # type: ignore[arg-type]
            for offset, length in item.ranges:
                pieces.append((item.file, offset, length, view[pos:pos + length], item.name))
                pos += length
            staged.append((item, dst, raw))
        return staged, _merge(pieces)

    def _each(self, destinations: Optional[Mapping[str, torch.Tensor]]
              ) -> Iterator[tuple[str, torch.Tensor]]:
        start = time.perf_counter()
        stop = _Stop(self.options.cancel)
        pool = ThreadPoolExecutor(self.requests, thread_name_prefix="pploader-s3")
        batches = iter(_batches(self.plan.items, self.batch_bytes))

        def submit() -> Optional[tuple[list, list[Future]]]:
            batch = next(batches, None)
            if batch is None:
                return None
            staged, reqs = self._prepare(batch, destinations)
            self.stats.syscalls += len(reqs)
            inflight = sum(r.length for r in reqs)
            self.stats.peak_inflight_bytes = max(self.stats.peak_inflight_bytes, inflight)
            return staged, [pool.submit(self._fetch, r, stop) for r in reqs]
        try:
            pending = submit()
            while pending is not None:
                staged, futures = pending
                pending = submit()  # the next batch is fetched while this one is handed out
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                failed = [f for f in done if f.exception() is not None]
                if failed:
                    stop.own.set()
                    raise failed[0].exception()  # type: ignore[misc]
                self.stats.read_bytes += sum(f.result() for f in futures)
                for item, dst, raw in staged:
                    if self.options.cancel is not None and self.options.cancel.is_set():
                        raise self._err("cancelled: another rank failed", item.file, item.name)
                    src = raw if raw.device == dst.device else raw.to(dst.device,
                                                                      non_blocking=True)
                    materialise(item, src, dst)
                    self.stats.items += 1
                    if self.options.on_progress is not None:
                        self.options.on_progress(item.read_bytes)
                    yield item.target, dst
        finally:
            stop.own.set()
            pool.shutdown(wait=True, cancel_futures=True)
            self.stats.seconds = time.perf_counter() - start
            logger.debug("rank %d: fetched %d bytes in %d request(s)", self.plan.topology.rank,
                         self.stats.read_bytes, self.stats.syscalls)

    def load(self, destinations: Optional[Mapping[str, torch.Tensor]] = None
             ) -> dict[str, torch.Tensor]:
        """Every item as a fresh tensor on the device, or fetched into ``destinations``."""
        return dict(self._each(destinations))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._each(None)


def _batches(items: tuple[ReadItem, ...], limit: int) -> Iterator[list[ReadItem]]:
    """Consecutive items whose read bytes sum to at most ``limit`` (at least one each)."""
    batch: list[ReadItem] = []
    size = 0
    for item in items:
        if batch and size + item.read_bytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += item.read_bytes
    if batch:
        yield batch


def _merge(pieces: list[tuple[str, int, int, memoryview, str]]) -> list[_Request]:
    """Views adjacent in the same object merged into requests of at most ``REQUEST_BYTES``
    (a larger view is cut); nothing is fetched that no view needs."""
    out: list[_Request] = []
    last: Optional[_Request] = None
    for file, offset, length, view, tensor in sorted(pieces, key=lambda p: (p[0], p[1])):
        pos = 0
        while pos < length:
            if last is None or last.file != file or last.start + last.length != offset + pos \
                    or last.length >= REQUEST_BYTES:
                last = _Request(file, offset + pos, 0, tensor=tensor)
                out.append(last)
            take = min(length - pos, REQUEST_BYTES - last.length)
            last.views.append(view[pos:pos + take])
            last.length += take
            pos += take
    return out


def open_s3(plan: RankPlan, device: torch.device, options: ReadOptions) -> ObjectStoreBackend:
    """The ``s3`` backend's factory (io/registry.py)."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the s3 backend loads onto cpu or cuda, not {device}")
    return ObjectStoreBackend(plan, device, options)
