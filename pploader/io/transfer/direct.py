"""Transfer ``direct``: the rank reads its own plan through one read backend.

Streamed onto a GPU (``iter``, what an engine's ``load_weights`` consumes) the plan is read
under a bounded device budget. The pinned backend streams it continuously
(``DeviceLoader.stream``, io/device_stream.py): each tensor is handed over as soon as it has
landed and released when the consumer moves on, so reads, host-to-device copies and the
consumer's device-to-device ``copy_`` overlap throughout. Another backend on a GPU (``s3``)
is read in windows: a background thread loads window k+1 while the consumer copies window k,
at most two windows of half the budget alive.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Sequence

import torch

from ...planning.items import ReadItem
from ..backend import ReadBackend, ReadOptions, ReadStats, sum_stats
from ..device_stream import stream_device_bytes
from ..registry import open_backend, shared_staging

if TYPE_CHECKING:  # pragma: no cover
    from ...distributed.comm import Comm
    from ...planning.stage import StagePlan

__all__ = ["DirectTransfer", "DEFAULT_DEVICE_WINDOW_BYTES", "device_windows"]

#: Device bytes a streamed GPU load may hold at once (stream-owned tensors not yet released).
#: Measured on 2x H200 (docs/benchmarks-gpu.md, issue 28 round 7): with 1 GiB an 8 GB llama
#: stage's readers stalled 7-9 ms at its 1.05 GB embedding (the next layer's tensors waited
#: for it to be handed over), with 2 GiB 1 ms; 256 MiB ran at 0.6x. The windowed stream this
#: replaced held two windows of 2 GiB, each run with its start and drain.
DEFAULT_DEVICE_WINDOW_BYTES = 2 << 30


def device_windows(items: Sequence[ReadItem], window_bytes: int) -> list[tuple[ReadItem, ...]]:
    """``items`` in plan order, cut into consecutive windows of at most ``window_bytes``
    device bytes each (an item larger than that is a window of its own)."""
    out: list[tuple[ReadItem, ...]] = []
    current: list[ReadItem] = []
    used = 0
    for item in items:
        size = stream_device_bytes(item)
        if current and used + size > window_bytes:
            out.append(tuple(current))
            current, used = [], 0
        current.append(item)
        used += size
    if current:
        out.append(tuple(current))
    return out


class DirectTransfer:
    """The plan read by one backend (``open_backend``); ``load(destinations)`` fills the
    caller's tensors in place, as the backend does. Iterated on a CUDA device: the device
    stream (module docstring; ``options.device_window_bytes``, default
    ``DEFAULT_DEVICE_WINDOW_BYTES``); ``stats.peak_inflight_bytes`` is then the largest
    device bytes the stream held at once."""

    kind = "direct"

    def __init__(self, staged: "StagePlan", device: torch.device, options: ReadOptions,
                 comm: Optional["Comm"] = None, io_backend: Optional[str] = None) -> None:
        self.plan, self.device, self.io_backend = staged.plan, device, io_backend
        self.window_bytes = options.device_window_bytes or DEFAULT_DEVICE_WINDOW_BYTES
        self.options = options
        self.backend: ReadBackend = open_backend(staged.plan, device, options, io_backend)
        self._window_stats: list[ReadStats] = []
        self._stream_stats: Optional[ReadStats] = None

    @property
    def stats(self) -> ReadStats:  # type: ignore[override]
        return self._stream_stats if self._stream_stats is not None else self.backend.stats

    def load(self, destinations: Optional[Mapping[str, torch.Tensor]] = None
             ) -> dict[str, torch.Tensor]:
        return self.backend.load(destinations)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.device.type != "cuda":
            return iter(self.backend)
        stream = getattr(self.backend, "stream", None)
        if stream is not None:  # the pinned backend: continuous, under the budget
            self._stream_stats = self.backend.stats
            return stream(self.window_bytes)  # type: ignore[no-any-return]
        return self._windowed()

    def report(self) -> dict[str, Any]:
        if self._stream_stats is None:
            return {}
        out = {"budget_bytes": self.window_bytes,
               "peak_device_bytes": self._stream_stats.peak_inflight_bytes}
        if self._window_stats:  # the windowed stream
            out["windows"] = len(self._window_stats)
        return {"device_stream": out}

    # ---- the windowed device stream (backends without a stream of their own) --------------
    def _windowed(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Windows of half the budget loaded in a background thread, two alive at most; the
        loader waits, on its stream, for the consumer's work on a window before reusing its
        memory (the consumer may copy on another stream)."""
        start = time.perf_counter()
        # one staging (the pinned ring) for every window's backend run
        options = shared_staging(self.plan, self.device, self.options, self.io_backend)
        windows = device_windows(self.plan.items, max(1, self.window_bytes // 2))
        ready: "queue.Queue[Any]" = queue.Queue()
        freed: "queue.Queue[Optional[torch.cuda.Event]]" = queue.Queue()
        for _ in range(2):
            freed.put(None)  # two windows may be alive before the consumer frees one
        stop = threading.Event()
        alive: list[int] = [0]
        peak = [0]
        lock = threading.Lock()

        def load_windows() -> None:
            try:
                for window in windows:
                    done = freed.get()
                    if stop.is_set():
                        return
                    if done is not None:  # the consumer's copies out of a freed window
                        torch.cuda.current_stream(self.device).wait_event(done)
                    size = sum(map(stream_device_bytes, window))
                    with lock:
                        alive[0] += size
                        peak[0] = max(peak[0], alive[0])
                    backend = open_backend(replace(self.plan, items=window, redistribute=None),
                                           self.device, options, self.io_backend)
                    self._window_stats.append(backend.stats)
                    ready.put((window, size, backend.load()))
            except BaseException as exc:  # noqa: BLE001 - raised in the consumer
                ready.put(exc)

        with torch.cuda.device(self.device):
            loader = threading.Thread(target=load_windows, name="pploader-device-stream",
                                      daemon=True)
            loader.start()
        try:
            for _ in windows:
                got = ready.get()
                if isinstance(got, BaseException):
                    raise got
                window, size, tensors = got
                for item in window:
                    yield item.target, tensors.pop(item.target)
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
                with lock:
                    alive[0] -= size
                freed.put(done)
        finally:
            stop.set()
            freed.put(None)
            loader.join()
            self._stream_stats = sum_stats(self._window_stats, time.perf_counter() - start)
            self._stream_stats.peak_inflight_bytes = peak[0]
