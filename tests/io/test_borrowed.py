"""Borrowed streaming: the reuse hazard is real, owned() avoids it, the default never has it;
and the ring never drops items (regression: small windows used to end the stream early)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pploader import Topology, is_borrowed, owned, plan_stage
from pploader.io.read import Reader

from helpers import reference_tensors


def _plan(model_dir: Path):  # type: ignore[no-untyped-def]
    return plan_stage(model_dir, Topology(1)).plan


def test_keeping_borrowed_tensors_sees_them_overwritten(tiny_llama: Path) -> None:
    plan, ref = _plan(tiny_llama), reference_tensors(tiny_llama)
    kept = dict(Reader(plan, mode="borrowed", window_bytes=2 * plan.largest_item_bytes))
    assert len(kept) == len(plan.items)
    wrong = [n for n, t in kept.items() if not torch.equal(t, ref[n])]
    assert len(wrong) > len(kept) // 2  # the hazard is real: most were overwritten


def test_owned_keeps_correct_values(tiny_llama: Path) -> None:
    plan, ref = _plan(tiny_llama), reference_tensors(tiny_llama)
    kept = {}
    for name, t in Reader(plan, mode="borrowed", window_bytes=2 * plan.largest_item_bytes):
        assert is_borrowed(t) and is_borrowed(t.view(-1)[:3])  # views count as borrowed too
        kept[name] = owned(t)
        assert not is_borrowed(kept[name])
    assert all(torch.equal(kept[n], ref[n]) for n in ref)


def test_default_mode_never_exposes_the_hazard(tiny_llama: Path) -> None:
    plan, ref = _plan(tiny_llama), reference_tensors(tiny_llama)
    kept = dict(Reader(plan, window_bytes=plan.largest_item_bytes))
    assert not any(is_borrowed(t) for t in kept.values())
    assert all(owned(t) is t for t in kept.values())
    assert set(kept) == set(ref) and all(torch.equal(kept[n], ref[n]) for n in ref)
    ptrs = [t.untyped_storage().data_ptr() for t in kept.values()]
    assert len(set(ptrs)) == len(ptrs)  # every tensor has its own storage


@pytest.mark.parametrize("factor", [1.0, 1.5, 2.0, 3.3])
def test_small_rings_yield_every_item_correctly(tiny_llama: Path, factor: float) -> None:
    """Adjacent items are batched into one read; a batch larger than the ring (or one that
    wrapped around) used to stop the stream silently, dropping the remaining items."""
    plan, ref = _plan(tiny_llama), reference_tensors(tiny_llama)
    window = int(plan.largest_item_bytes * factor)
    reader = Reader(plan, mode="borrowed", window_bytes=window)
    got = [(n, torch.equal(t, ref[n])) for n, t in reader]  # compared while still valid
    assert [n for n, _ in got] == [i.target for i in plan.items]
    assert all(ok for _, ok in got)
    assert reader.stats.peak_inflight_bytes <= window

