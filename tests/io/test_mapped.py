"""The ``mapped`` backend (io/mapped.py): warm items are views of the page cache (no copy),
cold ones positional reads; a mix keeps plan order and equals the threaded backend bitwise."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from helpers import evict_or_skip, make_model, tiny_config
from pploader import Topology, load_stage, plan_stage
from pploader.io.backend import ReadOptions
from pploader.io.mapped import MappedBackend


@pytest.fixture()
def llama(tmp_path: Path) -> Path:
    return make_model(tmp_path / "llama", tiny_config(vocab_size=250), shard_bytes=40_000)



@pytest.mark.parametrize("tp", [1, 2])
def test_half_warm_half_cold_equals_threaded(llama: Path, tp: int) -> None:
    staged = plan_stage(llama, Topology(1, tp, 1, tp - 1), range_cost_bytes=0)
    ref = load_stage(staged, io_backend="threaded").state_dict
    files = sorted({i.file for i in staged.plan.items})
    assert len(files) > 2
    gc.collect()
    cold = files[::2]
    for f in cold:
        evict_or_skip([llama / f])
    backend = MappedBackend(staged.plan, ReadOptions())
    got = list(backend)
    assert [t for t, _ in got] == [i.target for i in staged.plan.items]   # plan order
    for target, tensor in got:
        assert torch.equal(tensor, ref[target]), target
    cold_bytes = sum(i.read_bytes for i in staged.plan.items if i.file in cold)
    assert backend.stats.read_bytes == staged.plan.read_bytes
    assert backend.mapped_bytes == staged.plan.read_bytes - cold_bytes
    assert 0 < backend.warm_items < len(staged.plan.items)


def test_warm_whole_items_are_views_and_copy_on_write(llama: Path) -> None:
    """A view shares the file's pages (no fresh buffer); writing into it never reaches the
    file (private mapping)."""
    staged = plan_stage(llama, Topology(1))
    for path in llama.glob("*.safetensors"):
        path.read_bytes()
    before = {p.name: p.read_bytes() for p in llama.glob("*.safetensors")}
    backend = MappedBackend(staged.plan, ReadOptions())
    tensors = dict(backend)
    item = max(staged.plan.items, key=lambda i: i.read_bytes)
    t = tensors[item.target]
    assert t.untyped_storage().nbytes() == (llama / item.file).stat().st_size
    t.zero_()
    assert {p.name: p.read_bytes() for p in llama.glob("*.safetensors")} == before


def test_destinations_are_filled(llama: Path) -> None:
    staged = plan_stage(llama, Topology(1, 2, 1, 1), range_cost_bytes=0)
    ref = load_stage(staged, io_backend="threaded").state_dict
    dst = {k: torch.empty_like(v) for k, v in ref.items()}
    out = MappedBackend(staged.plan, ReadOptions()).load(dst)
    for k, v in ref.items():
        assert out[k] is dst[k] and torch.equal(dst[k], v), k


def _evicted(llama: Path) -> None:
    gc.collect()   # no earlier view still maps the files (mapped pages stay resident)
    evict_or_skip(sorted(llama.glob("*.safetensors")))


@pytest.mark.parametrize("tp", [1, 2])
def test_readahead_cold_items_are_views_equal_to_threaded(llama: Path, tp: int) -> None:
    """``cold="readahead"``: cold items arrive as views of the mapping too (no read syscall,
    no fresh buffer for a whole-range item), counted as read ahead, in plan order."""
    staged = plan_stage(llama, Topology(1, tp, 1, tp - 1), range_cost_bytes=0)
    ref = {k: v.clone() for k, v in load_stage(staged, io_backend="threaded")
           .state_dict.items()}
    _evicted(llama)
    backend = MappedBackend(staged.plan, ReadOptions(), cold="readahead")
    got = list(backend)
    assert [t for t, _ in got] == [i.target for i in staged.plan.items]
    for target, tensor in got:
        assert torch.equal(tensor, ref[target]), target
    assert backend.stats.read_bytes == backend.mapped_bytes == staged.plan.read_bytes
    assert 0 < backend.readahead_bytes <= staged.plan.read_bytes
    assert backend.mapped_items == len(staged.plan.items)
    assert backend.stats.syscalls == 0


def test_whole_items_are_full_tensor_views_counting_only_their_ranges(llama: Path) -> None:
    """``whole``: a TP slice is handed as its full source tensor (a view of the mapping),
    while only the slice's bytes count as read; ``whole`` needs ``cold="readahead"``."""
    from helpers import reference_tensors
    staged = plan_stage(llama, Topology(1, 2, 1, 1), range_cost_bytes=0)
    split = [i for i in staged.plan.items if i.shape != i.source_shape]
    assert split
    whole = {i.target: (staged.index.entry(i.name).start, staged.index.entry(i.name).nbytes)
             for i in split}
    ref = reference_tensors(llama)
    backend = MappedBackend(staged.plan, ReadOptions(), cold="readahead", whole=whole)
    got = dict(backend)
    for item in split:
        assert got[item.target].shape == item.source_shape
        assert torch.equal(got[item.target], ref[item.name]), item.name
    assert backend.stats.read_bytes == staged.plan.read_bytes
    with pytest.raises(ValueError, match="readahead"):
        MappedBackend(staged.plan, ReadOptions(), whole=whole)


def test_readahead_refuses_a_file_changed_after_planning(llama: Path, tmp_path: Path) -> None:
    """A shard rewritten shorter after planning: ReadError naming it before any view."""
    from pploader.errors import ReadError
    staged = plan_stage(llama, Topology(1))
    first = staged.plan.items[0].file
    with open(llama / first, "r+b") as fh:
        fh.truncate((llama / first).stat().st_size - 1000)
    with pytest.raises(ReadError, match="changed during load") as info:
        list(MappedBackend(staged.plan, ReadOptions(), cold="readahead"))
    assert first in str(info.value)
