"""The device stream's scheduling (io/device_stream.py), run on the CPU: CUDA's events and
streams are stand-ins, the readers are plain threads doing what io/device.py's readers do
(take, read, before_copy, copy the pieces, after_copy). Checked: every tensor equals a whole
load's, in plan order; the live bytes stay within the budget (plus one item when the
consumer's next item needs it); a budget smaller than any item still completes; a consumer
that leaves early or a failing reader stops every thread. The real path: tests/gpu."""
from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch

from pploader import Topology, plan_stage
from pploader.io.device_stream import DeviceStream, stream_device_bytes
from pploader.io.registry import open_backend
from pploader.io.requests import Chunk, chunks, pieces


class _Event:
    def record(self, stream: Any = None) -> None:
        pass


class _Stream:
    def wait_event(self, event: Any) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _Stream:
    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return stream


def _open(path: Path, tp: int, slot_bytes: int) -> tuple[Any, list[Chunk], dict]:
    staged = plan_stage(path, Topology(2, tp, rank=0))
    plan = staged.plan
    reqs = chunks([p for i, item in enumerate(plan.items) for p in pieces(item, i)],
                  slot_bytes)
    whole = open_backend(plan, "cpu").load()
    return plan, reqs, whole


def _readers(feed: DeviceStream, plan: Any, stream: _Stream, n: int,
             fail_at: Optional[int] = None) -> tuple[list[threading.Thread], list]:
    errors: list[BaseException] = []
    fds = {f: os.open(p, os.O_RDONLY) for f, p in plan.paths.items()}
    taken = [0]

    def read() -> None:
        try:
            while not errors:
                chunk = feed.take()
                if chunk is None:
                    break
                taken[0] += 1
                if fail_at is not None and taken[0] >= fail_at:
                    raise OSError(f"read failed in {chunk.file}")
                data = os.pread(fds[chunk.file], chunk.length, chunk.offset)
                if not feed.before_copy(chunk, stream):  # type: ignore[arg-type]
                    break
                for p in chunk.pieces:
                    pos = p.offset - chunk.offset
                    feed.buffer(p.target)[p.pos:p.pos + p.length].copy_(
                        torch.frombuffer(bytearray(data[pos:pos + p.length]), dtype=torch.uint8))
                feed.after_copy(chunk, _Event())  # type: ignore[arg-type]
        except BaseException as exc:  # noqa: BLE001 - the consumer raises it
            errors.append(exc)
            feed.stop()
    threads = [threading.Thread(target=read) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, errors


def _run(plan: Any, reqs: list[Chunk], budget: int, stream: _Stream, n: int = 3
         ) -> Iterator[tuple[str, torch.Tensor, DeviceStream]]:
    feed = DeviceStream(plan, torch.device("cpu"), budget)
    threads, errors = _readers(feed, plan, stream, n)  # they wait for begin()
    feed.begin(reqs)
    try:
        for target, tensor in feed.items(errors):
            yield target, tensor, feed
    finally:
        feed.stop()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("tp", [1, 2])
def test_stream_hands_every_tensor_in_plan_order_within_the_budget(
        tiny_llama: Path, fake_cuda: _Stream, tp: int) -> None:
    plan, reqs, whole = _open(tiny_llama, tp, slot_bytes=4096)
    sizes = [stream_device_bytes(i) for i in plan.items]
    budget = 3 * max(sizes)
    assert sum(sizes) > 2 * budget  # the budget binds
    if tp == 2:
        assert any(not i.direct for i in plan.items)  # boxes gathered when handed
    got, feed = [], None
    for target, tensor, feed in _run(plan, reqs, budget, fake_cuda):
        assert torch.equal(tensor, whole[target]), target
        got.append(target)
    assert feed is not None and got == [i.target for i in plan.items]
    assert max(sizes) <= feed.peak_bytes <= budget + max(sizes)
    assert feed._alive == 0 and feed.handed == len(plan.items)


@pytest.mark.timeout(60)  # without the progress rule this deadlocks
def test_stream_completes_with_a_budget_smaller_than_any_item(
        tiny_llama: Path, fake_cuda: _Stream) -> None:
    plan, reqs, whole = _open(tiny_llama, 1, slot_bytes=4096)
    spans: dict[int, int] = {}
    for c in reqs:
        for t in {p.target for p in c.pieces}:
            spans[t] = spans.get(t, 0) + 1
    assert max(spans.values()) > 1  # items span chunks
    assert any(len({p.target for p in c.pieces}) > 1 for c in reqs)  # chunks share items
    feed = None
    for target, tensor, feed in _run(plan, reqs, 1, fake_cuda):
        assert torch.equal(tensor, whole[target])
    assert feed is not None and feed.handed == len(plan.items)
    # over budget only by what the consumer's next item needed: two items at most
    sizes = sorted(stream_device_bytes(i) for i in plan.items)
    assert feed.peak_bytes <= sizes[-1] + sizes[-2]


def test_stream_stops_every_reader_when_the_consumer_leaves(
        tiny_llama: Path, fake_cuda: _Stream) -> None:
    plan, reqs, _ = _open(tiny_llama, 1, slot_bytes=4096)
    budget = 2 * max(stream_device_bytes(i) for i in plan.items)
    stream = _run(plan, reqs, budget, fake_cuda)
    for _ in range(2):
        next(stream)
    stream.close()  # the finally joins the readers (asserted there)


def test_a_failing_reader_raises_in_the_consumer_and_stops_the_rest(
        tiny_llama: Path, fake_cuda: _Stream) -> None:
    plan, reqs, _ = _open(tiny_llama, 1, slot_bytes=4096)
    feed = DeviceStream(plan, torch.device("cpu"), 1 << 20)
    feed.begin(reqs)
    threads, errors = _readers(feed, plan, fake_cuda, 3, fail_at=5)
    with pytest.raises(OSError, match="read failed in"):
        for _ in feed.items(errors):
            pass
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.timeout(30)
def test_an_empty_tensor_is_handed_at_once(tiny_llama: Path, fake_cuda: _Stream) -> None:
    """An item with no bytes to read (a zero-size tensor) has no chunk: it is handed at its
    place in the order without waiting for any reader (nor the consumer's 1 s poll)."""
    import dataclasses
    import time

    from pploader.planning.items import ReadItem
    plan, reqs, whole = _open(tiny_llama, 1, slot_bytes=4096)
    first = plan.items[0]
    empty = ReadItem(name="empty", target="empty", file=first.file, dtype=first.dtype,
                     shape=(0, 4), source_shape=(0, 4), ranges=(), buffer_shape=(0, 4))
    plan = dataclasses.replace(plan, items=(first, empty, *plan.items[1:]))
    reqs = chunks([p for i, item in enumerate(plan.items) for p in pieces(item, i)], 4096)
    start, got = time.perf_counter(), {}
    for target, tensor, _ in _run(plan, reqs, 1 << 30, fake_cuda):
        got[target] = tensor
    assert time.perf_counter() - start < 0.9
    assert got["empty"].shape == (0, 4) and list(got) == [i.target for i in plan.items]
    assert all(torch.equal(got[k], v) for k, v in whole.items())


@pytest.mark.timeout(60)
def test_an_allocation_failure_raises_in_the_consumer(
        tiny_llama: Path, fake_cuda: _Stream, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader's allocation error (a device out of memory) is what the consumer raises,
    and every reader stops."""
    plan, reqs, _ = _open(tiny_llama, 1, slot_bytes=4096)

    def fail(self: DeviceStream, targets: list[int]) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
    monkeypatch.setattr(DeviceStream, "_allocate", fail)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="out of memory"):
        for _ in _run(plan, reqs, 1 << 20, fake_cuda):
            pass
