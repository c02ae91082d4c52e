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
