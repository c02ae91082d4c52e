"""byte_runs against the bytes a tensor slice holds, and relative items moved into place."""
from __future__ import annotations

import random

import torch

from pploader.planning.header import TensorEntry
from pploader.planning.items import placed_item, read_item, relative_item
from pploader.planning.shard import Selection, byte_runs


def _slice_bytes(shape: tuple[int, ...], itemsize: int, sel: Selection) -> bytes:
    """The selection's bytes of a tensor whose byte k is k % 251 (torch indexing)."""
    n = 1
    for s in shape:
        n *= s
    raw = (torch.arange(n * itemsize) % 251).to(torch.uint8).reshape(*shape, itemsize)
    for dim, intervals in sel.dims:
        raw = torch.cat([raw.narrow(dim, a, k) for a, k in intervals], dim=dim)
    return bytes(raw.contiguous().flatten().tolist())


def _run_bytes(shape: tuple[int, ...], itemsize: int, base: int,
               runs: list[tuple[int, int]]) -> bytes:
    n = 1
    for s in shape:
        n *= s
    whole = bytes((k % 251) for k in range(n * itemsize))
    return b"".join(whole[a - base:a - base + k] for a, k in runs)


def test_byte_runs_match_torch_slices() -> None:
    rng = random.Random(7)
    for _ in range(400):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        itemsize = rng.choice((1, 2, 4))
        dims = []
        for d in rng.sample(range(len(shape)), rng.randint(1, len(shape))):
            a = rng.randrange(shape[d])
            dims.append((d, ((a, rng.randint(0, shape[d] - a)),)))
        sel = Selection(tuple(sorted(dims)))
        base = rng.randint(0, 64)
        runs = byte_runs(shape, itemsize, base, sel)
        assert _run_bytes(shape, itemsize, base, runs) == _slice_bytes(shape, itemsize, sel)
        assert all(k > 0 for _, k in runs)
        # merged: no run ends where the next begins
        assert all(a + k != b for (a, k), (b, _) in zip(runs, runs[1:]))


def test_one_dim_shard_is_evenly_spaced() -> None:
    sel = Selection(((1, ((3, 4),)),))
    runs = byte_runs((6, 10), 2, 100, sel)
    assert runs == [(100 + (r * 10 + 3) * 2, 8) for r in range(6)]


def test_relative_item_moved_equals_direct_plan() -> None:
    for sel in (Selection(((1, ((0, 8),)),)), Selection(((0, ((4, 4),)),)), Selection()):
        entry = TensorEntry("w", "a.safetensors", "BF16", (8, 16), 1000, 1000 + 8 * 16 * 2)
        direct = read_item(entry, "t", sel, 0)
        moved = placed_item(relative_item("BF16", (8, 16), sel, 0), entry, "t")
        assert moved == direct
