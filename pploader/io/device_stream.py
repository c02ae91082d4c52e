"""The pinned backend streamed onto its GPU under a device budget (``DeviceLoader.stream``).

The readers of io/device.py read the plan's chunks in order, as in a whole load, but each
item's device tensor is allocated only when its first chunk is taken, and a chunk is taken
only while the stream's live device bytes fit the budget. The consumer receives the items in
plan order, each as soon as all of its pieces have been copied (its stream waits on the
copies' events: no host synchronisation), and an item's memory is released when the consumer
moves on. Reading, host-to-device copies and the consumer's own copies thus overlap all the
way through, with no drain between windows.

Progress: the consumer waits for one item at a time, and the chunks up to that item's last are
always taken, over budget if need be (at most about one item's bytes over), so a budget
smaller than the largest item, or a plan whose items interleave in a file, still completes.

Memory reuse: every tensor is allocated on the consumer's stream (current when the stream
started) and the readers' streams wait for the allocation's event before writing, so a block
freed by the consumer is rewritten only after the consumer's queued work on it. A consumer on
another stream is covered by ``record_stream`` when its item is released.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from ..planning.checkpoint import DTYPES
from ..planning.items import ReadItem
from ..planning.rank_plan import RankPlan
from .backend import materialise, zero_padding
from .requests import Chunk

__all__ = ["DeviceStream", "stream_device_bytes"]


def stream_device_bytes(item: ReadItem) -> int:
    """Device bytes one item holds while streamed: the tensor, plus the box a coalesced
    strided read stages on the device before its gather."""
    return item.nbytes + (0 if item.direct else item.read_bytes)


@dataclass(eq=False)
class _Item:
    """One item's state in the stream (guarded by the stream's condition)."""

    nbytes: int                      # device bytes while alive
    first_chunk: int = -1
    last_chunk: int = -1
    remaining: int = 0               # pieces not yet queued for copy
    ready: threading.Event = field(default_factory=threading.Event)
    made: Optional[torch.cuda.Event] = None      # the allocation, on the allocating stream
    copies: list[torch.cuda.Event] = field(default_factory=list)
    buffer: Optional[torch.Tensor] = None        # the bytes the pieces land in
    tensor: Optional[torch.Tensor] = None        # what the consumer receives


class DeviceStream:
    """A :class:`~pploader.io.device.Feed` that allocates per item under ``budget_bytes``
    and hands items over in plan order (:meth:`items`)."""

    def __init__(self, plan: RankPlan, device: torch.device, budget_bytes: int) -> None:
        self.plan, self.device, self.budget_bytes = plan, device, max(1, budget_bytes)
        self.chunk_count = 0
        self._chunks: Optional[list[Chunk]] = None  # set by begin(); readers wait for it
        self._items = [_Item(stream_device_bytes(item)) for item in plan.items]
        self._new: list[list[int]] = []  # per chunk: the items whose first chunk it is
        self._cond = threading.Condition()
        self._take_lock = threading.Lock()  # chunks are taken one at a time, in order
        self._next = 0
        self._awaited = 0                  # the item the consumer needs next
        self._alive = 0
        self._stopped = False
        self._alloc_stream = torch.cuda.current_stream(device)
        self.peak_bytes = 0
        self.handed = 0
        self.timings: dict[str, float] = {"consumer_wait_s": 0.0, "budget_wait_s": 0.0,
                                          "allocate_s": 0.0}

    def begin(self, chunks: list[Chunk]) -> None:
        """The plan's read requests, in order: the readers start taking them."""
        new: list[list[int]] = [[] for _ in chunks]
        for c, chunk in enumerate(chunks):
            for p in chunk.pieces:
                state = self._items[p.target]
                if state.first_chunk < 0:
                    state.first_chunk = c
                    new[c].append(p.target)
                state.last_chunk = c
                state.remaining += 1
        with self._cond:
            self._new, self.chunk_count, self._chunks = new, len(chunks), chunks
            self._cond.notify_all()

    # ---- the readers' side (Feed) ---------------------------------------------------------
    def take(self) -> Optional[Chunk]:
        with self._take_lock:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._chunks is not None)
                c = self._next
                if self._chunks is None or c >= self.chunk_count or self._stopped:
                    return None
                new = self._new[c]
                need = sum(self._items[i].nbytes for i in new)
                t0 = time.perf_counter()
                self._cond.wait_for(lambda: self._stopped or self._admits(c, need))
                self.timings["budget_wait_s"] += time.perf_counter() - t0
                if self._stopped:
                    return None
                self._next = c + 1
                self._alive += need
                self.peak_bytes = max(self.peak_bytes, self._alive)
                chunk = self._chunks[c]
        if new:
            self._allocate(new)
        return chunk

    def _admits(self, c: int, need: int) -> bool:
        """Chunk ``c`` may be read: its new items fit the budget, nothing is alive, or the
        consumer's next item needs it."""
        return (self._alive + need <= self.budget_bytes or self._alive == 0
                or (self._awaited < len(self._items)
                    and c <= self._items[self._awaited].last_chunk))

    def _allocate(self, targets: list[int]) -> None:
        """The items' device tensors, on the consumer's stream, then their event (set as
        made even on failure: the waiters then see the stop)."""
        made: Optional[torch.cuda.Event] = None
        t0 = time.perf_counter()
        try:
            with torch.cuda.stream(self._alloc_stream):
                for i in targets:
                    self._make(i)
                made = torch.cuda.Event()
                made.record(self._alloc_stream)
        finally:
            self.timings["allocate_s"] += time.perf_counter() - t0
            for i in targets:
                self._items[i].made = made
                self._items[i].ready.set()

    def _make(self, i: int) -> None:
        item, state = self.plan.items[i], self._items[i]
        dst = torch.empty(item.shape, dtype=DTYPES[item.dtype][0], device=self.device)
        if item.direct:
            state.buffer = dst.reshape(-1).view(torch.uint8)
            zero_padding(item, dst)
        else:  # coalesced strided read: the box lands on the device, gathered when handed
            state.buffer = torch.empty(item.read_bytes, dtype=torch.uint8, device=self.device)
        state.tensor = dst

    def before_copy(self, chunk: Chunk, stream: torch.cuda.Stream) -> bool:
        waited: set[int] = set()
        for p in chunk.pieces:
            state = self._items[p.target]
            state.ready.wait()
            if self._stopped or state.made is None:
                return False
            if id(state.made) not in waited:
                waited.add(id(state.made))
                stream.wait_event(state.made)
        return True

    def buffer(self, target: int) -> torch.Tensor:
        buf = self._items[target].buffer
        assert buf is not None
        return buf

    def after_copy(self, chunk: Chunk, event: torch.cuda.Event) -> None:
        with self._cond:
            done = False
            for p in chunk.pieces:
                state = self._items[p.target]
                if not state.copies or state.copies[-1] is not event:
                    state.copies.append(event)
                state.remaining -= 1
                done = done or state.remaining == 0
            if done:
                self._cond.notify_all()

    def prepare(self, allocate: Callable[[], None]) -> None:
        allocate()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for state in self._items:
            state.ready.set()

    # ---- the consumer's side --------------------------------------------------------------
    def items(self, errors: list[BaseException],
              readers_done: Callable[[], bool] = lambda: False
              ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(target, tensor)`` in plan order; ``errors``: the readers' (raised here);
        ``readers_done``: True once every reader has exited (then nothing more arrives)."""
        for i, item in enumerate(self.plan.items):
            state = self._items[i]
            t0 = time.perf_counter()
            with self._cond:
                self._awaited = i
                self._cond.notify_all()
                while not (state.remaining == 0 or errors or self._stopped):
                    if not self._cond.wait(timeout=1.0) and readers_done():
                        break
            self.timings["consumer_wait_s"] += time.perf_counter() - t0
            if errors:
                raise errors[0]
            if state.remaining:
                raise RuntimeError(f"device stream of rank {self.plan.topology.rank} ended "
                                   f"before {item.target!r} arrived")
            if state.tensor is None:  # nothing to read (an empty tensor): made here
                with torch.cuda.stream(self._alloc_stream):
                    self._make(i)
            current = torch.cuda.current_stream(self.device)
            for event in state.copies:
                current.wait_event(event)
            tensor = state.tensor
            assert tensor is not None and state.buffer is not None
            if not item.direct:
                materialise(item, state.buffer, tensor)
            self.handed += 1
            yield item.target, tensor
            self._release(state, torch.cuda.current_stream(self.device))
            del tensor

    def _release(self, state: _Item, current: torch.cuda.Stream) -> None:
        """The consumer moved on: the item's memory may be reused (after its queued work)."""
        if current != self._alloc_stream:
            for t in (state.buffer, state.tensor):
                if t is not None:
                    t.record_stream(current)
        state.buffer = state.tensor = None
        state.copies = []
        if state.first_chunk >= 0:  # counted when its first chunk was taken
            with self._cond:
                self._alive -= state.nbytes
                self._cond.notify_all()
