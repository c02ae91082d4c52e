"""The pinned backend's request planning (pure, CPU): coalesced runs cut into slot-sized,
aligned requests; and the ring's fallback where page-locking is unavailable."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pploader.io.device import PinnedRing
from pploader.io.requests import Piece as _Piece
from pploader.io.requests import chunks as _chunks
from pploader.io.requests import interleave_files as _interleave_files


def _layout(sizes: list[int], gaps: list[int], file: str = "a") -> list[_Piece]:
    out, off = [], 100  # an unaligned start, as after a safetensors header
    for i, (n, g) in enumerate(zip(sizes, gaps)):
        out.append(_Piece(file, off, n, i, 0))
        off += n + g
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 70_000), st.sampled_from([0, 0, 0, 10, 5000])),
                min_size=1, max_size=25),
       st.sampled_from([4096, 8192, 65536]), st.sampled_from([1, 4096]),
       st.sampled_from([0, 4096]))
def test_chunks_cover_every_byte_once_in_full_aligned_requests(
        spec: list[tuple[int, int]], slot: int, align: int, gap: int) -> None:
    pieces = _layout([n for n, _ in spec], [g for _, g in spec])
    chunks = _chunks(pieces, slot, align, gap)
    got: dict[int, list[tuple[int, int]]] = {}
    for c in chunks:
        assert c.offset % align == 0 and 0 < c.length
        assert -(-c.length // align) * align <= slot  # the rounded-up read fits the slot
        for p in c.pieces:
            assert c.offset <= p.offset and p.offset + p.length <= c.offset + c.length
            got.setdefault(p.target, []).append((p.pos, p.offset))
    for p in pieces:  # each target byte comes from its own file byte, exactly once
        parts = sorted(got[p.target])
        assert [pos for pos, _ in parts][0] == 0
        sub = sorted((s.pos, s.length, s.offset) for c in chunks for s in c.pieces
                     if s.target == p.target)
        assert sum(n for _, n, _ in sub) == p.length
        pos = 0
        for spos, n, off in sub:
            assert spos == pos and off - p.offset == spos
            pos += n
    if gap == 0 and all(g == 0 for _, g in spec):  # one run: full requests but the last
        assert all(c.offset + c.length == chunks[i + 1].offset or c.length == slot
                   for i, c in enumerate(chunks[:-1]))
        assert len(chunks) == -(-(sum(n for n, _ in spec) + 100 % align) // slot)


def test_chunks_span_small_gaps_only_when_asked() -> None:
    pieces = _layout([5000, 5000], [300, 0])
    assert len(_chunks(pieces, 65536)) == 2
    one = _chunks(pieces, 65536, 1, gap_bytes=300)
    assert len(one) == 1 and one[0].length == 10300


def test_chunks_refuse_a_slot_not_a_multiple_of_the_alignment() -> None:
    with pytest.raises(ValueError, match="multiple"):
        _chunks(_layout([10], [0]), 5000, 4096)


def test_interleave_files_round_robin_each_file_in_order() -> None:
    pieces = _layout([8192] * 3, [0] * 3, "a") + _layout([8192], [0], "b")
    order = _interleave_files(_chunks(pieces, 8192))
    assert [c.file for c in order] == ["a", "b", "a", "a"]
    assert [c.offset for c in order if c.file == "a"] == sorted(
        c.offset for c in order if c.file == "a")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA fallback")
def test_ring_prepared_without_cuda_stays_pageable_and_usable() -> None:
    ring = PinnedRing(threads=2, slot_bytes=4096, prepare=True)
    ring.prepare().join()
    assert ring.pageable_slots == 4 and ring.nbytes == 0
    ring.pin(0, 0)  # already settled: nothing more
    assert ring.pageable_slots == 4
    tensor, view = ring.slots(1)[1]
    view[:3] = b"abc"
    assert bytes(tensor[:3].numpy()) == b"abc"
    ring.close()
