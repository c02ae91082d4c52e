"""integrations/placed.py (what vLLM's weight loaders are handed), without an engine: placed
tensors hold exactly this TP rank's bytes, NaN elsewhere; read_stage holds them for a reload."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import evict_or_skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers import make_model, tiny_config
    cfg = tiny_config(num_hidden_layers=5, head_dim=32, hidden_size=128, vocab_size=200)
    return make_model(tmp_path_factory.mktemp("llama"), cfg, shard_bytes=80_000)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_placed_tensors_hold_exactly_the_rank_bytes(llama: Path, tp_rank: int) -> None:
    """Narrowed where pploader's TP rule cut, a placed tensor equals the checkpoint; every
    other element is NaN; bytes read are the plan's ideal bytes."""
    from helpers import reference_tensors

    from pploader import Topology, plan_stage
    from pploader.integrations.placed import stage_weights
    ref = reference_tensors(llama)
    topo = Topology(1, 2, 1, tp_rank)
    staged = plan_stage(llama, topo, range_cost_bytes=0)
    sliced = {item.target: item for item in staged.plan.items}
    reader, stream = stage_weights(staged, "placed", "threaded")
    seen = 0
    for name, tensor in stream:
        full = ref[name]
        assert tensor.shape == full.shape and tensor.dtype == full.dtype
        known = ~torch.isnan(tensor.float())
        assert torch.equal(tensor[known], full[known])
        item = sliced[name]
        assert int(known.sum()) * full.element_size() == item.read_bytes
        seen += 1
    assert seen == len(staged.plan.items)
    assert reader.stats.read_bytes == staged.plan.ideal_bytes


@pytest.mark.parametrize("backend", ["threaded", "mapped"])
@pytest.mark.parametrize("tp_mode", ["placed", "full"])
def test_read_stage_holds_what_stage_weights_streams(llama: Path, tp_mode: str,
                                                     backend: str) -> None:
    """A reload reads everything first (read_stage), then streams the same tensors as a load."""
    from pploader import Topology, plan_stage
    from pploader.integrations.placed import read_stage, stage_weights
    staged = plan_stage(llama, Topology(1, 2, 1, 1), range_cost_bytes=0)
    reader, replay = read_stage(staged, tp_mode, backend)
    if backend == "threaded":
        assert reader.stats.read_bytes == (staged.plan.ideal_bytes if tp_mode == "placed"
                                           else staged.plan.planned_read_bytes)
    _, stream = stage_weights(staged, tp_mode, backend)
    streamed = dict(stream)
    held = dict(replay())
    assert held.keys() == streamed.keys()
    for name, tensor in held.items():
        assert torch.equal(tensor.view(torch.uint8), streamed[name].view(torch.uint8)), name


def test_placed_reads_refuse_a_file_changed_after_planning(llama: Path) -> None:
    """The placed stream reads through the backend seam, whose end checks each file's identity:
    a shard rewritten between planning and reading is an error naming it."""
    import os

    from pploader import Topology, plan_stage
    from pploader.errors import ReadError
    from pploader.integrations.placed import stage_weights
    staged = plan_stage(llama, Topology(1, 2, 1, 0), range_cost_bytes=0)
    shard = llama / staged.plan.items[-1].file
    st = shard.stat()
    try:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        _, stream = stage_weights(staged, "placed")   # the default (mapped) backend
        with pytest.raises(ReadError, match=staged.plan.items[-1].file):
            for _ in stream:
                pass
    finally:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))


_FIRST_LOAD_RCHAR = r'''
import json, sys
from pploader import Topology, plan_stage
from pploader.integrations.placed import rchar_bytes, stage_weights
staged = plan_stage(sys.argv[1], Topology(1, 2, 1, 0), range_cost_bytes=0)
before = rchar_bytes()
reader, stream = stage_weights(staged, "placed", sys.argv[2])
for _ in stream:
    pass
print(json.dumps({"rchar": rchar_bytes() - before, "read": reader.stats.read_bytes,
                  "mapped": getattr(reader, "mapped_bytes", 0)}))
'''


@pytest.mark.parametrize("backend", ["threaded", "mapped"])
def test_first_placed_load_rchar_counts_checkpoint_bytes_only(llama: Path, backend: str) -> None:
    """vLLM's report compares /proc/self/io rchar with the planned bytes: in a fresh process the
    first placed read must not add the read backend's module import to rchar (bytes taken
    from the page cache's mapping are no read syscalls: rchar leaves them out)."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _FIRST_LOAD_RCHAR, str(llama), backend],
                         capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    syscalls = res["read"] - res["mapped"]
    assert syscalls <= res["rchar"] <= syscalls + 4096, res
    assert res["mapped"] == (res["read"] if backend == "mapped" else 0), res



def _warm(model: Path) -> None:
    for path in model.glob("*.safetensors"):
        path.read_bytes()


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_mapped_warm_hands_views_of_the_page_cache(llama: Path, tp_rank: int) -> None:
    """Warm files, default backend: every tensor is the checkpoint's whole tensor as a view of
    the file mapping (no copy before the engine's own; the engine narrows it), equal to
    safe_open's; the tied or not, names are the checkpoint's."""
    from helpers import reference_tensors

    from pploader import Topology, plan_stage
    from pploader.integrations.placed import stage_weights
    _warm(llama)
    ref = reference_tensors(llama)
    staged = plan_stage(llama, Topology(1, 2, 1, tp_rank), range_cost_bytes=0)
    sizes = {p.name: p.stat().st_size for p in llama.glob("*.safetensors")}
    files = {i.name: i.file for i in staged.plan.items}
    reader, stream = stage_weights(staged, "placed")
    for name, tensor in stream:
        assert torch.equal(tensor, ref[name]), name
        # a view into the whole file's mapping, not a fresh buffer
        assert tensor.untyped_storage().nbytes() == sizes[files[name]], name
    assert reader.mapped_bytes == reader.stats.read_bytes >= staged.plan.ideal_bytes


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_mapped_cold_reads_the_rank_pages_ahead_then_hands_views(llama: Path,
                                                                 tp_rank: int) -> None:
    """Cold files, default backend: no read syscall and no fresh buffer; the rank's pages are
    read ahead by the kernel and every tensor is the checkpoint's whole tensor as a view of the
    mapping (the engine narrows it), equal to safe_open's."""
    from helpers import reference_tensors

    from pploader import Topology, plan_stage
    from pploader.integrations.placed import rchar_bytes, stage_weights
    import gc
    ref = {k: v.clone() for k, v in reference_tensors(llama).items()}   # not mapping views
    staged = plan_stage(llama, Topology(1, 2, 1, tp_rank), range_cost_bytes=0)
    sizes = {p.name: p.stat().st_size for p in llama.glob("*.safetensors")}
    files = {i.name: i.file for i in staged.plan.items}
    gc.collect()   # no earlier test's view still maps the files (mapped pages stay resident)
    evict_or_skip(sorted(llama.glob("*.safetensors")))
    before = rchar_bytes()
    reader, stream = stage_weights(staged, "placed")
    got = dict(stream)
    after = rchar_bytes()
    assert got.keys() == {i.name for i in staged.plan.items}
    for name, tensor in got.items():
        assert torch.equal(tensor, ref[name]), name
        assert tensor.untyped_storage().nbytes() == sizes[files[name]], name
    assert reader.stats.read_bytes == reader.mapped_bytes == staged.plan.ideal_bytes
    assert 0 < reader.readahead_bytes <= staged.plan.ideal_bytes
    assert reader.mapped_items == len(staged.plan.items)
    if before is not None and after is not None:
        assert after - before < 64 << 10   # no positional reads of tensor data
    del got
    _warm(llama)


def test_tied_last_stage_hands_the_embedding_under_both_names(tmp_path: Path) -> None:
    """PP=2, tied: the last stage's embedding replica is handed as model.embed_tokens.weight
    (what vLLM's tied head loads from) and lm_head.weight (one tensor, read once)."""
    from helpers import make_model, reference_tensors, tiny_config

    from pploader import Topology, plan_stage
    from pploader.integrations.placed import stage_weights
    model = make_model(tmp_path / "tied", tiny_config(num_hidden_layers=4,
                                                      tie_word_embeddings=True))
    ref = reference_tensors(model)
    assert "lm_head.weight" not in ref
    for backend in ("threaded", "mapped"):
        staged = plan_stage(model, Topology(2, 1, 1, 1))
        reader, stream = stage_weights(staged, "placed", backend)
        got = list(stream)
        names = [n for n, _ in got]
        assert names.count("model.embed_tokens.weight") == names.count("lm_head.weight") == 1
        tensors = dict(got)
        assert tensors["lm_head.weight"] is tensors["model.embed_tokens.weight"]
        assert torch.equal(tensors["lm_head.weight"], ref["model.embed_tokens.weight"])
        assert reader.stats.read_bytes == staged.plan.planned_read_bytes


def test_uniform_row_runs_are_placed_in_one_strided_copy() -> None:
    """``_place``'s fast path (equal runs at a constant stride: a dim-1 TP slice) writes the
    same bytes as placing each run by itself, and irregular runs take the loop."""
    from pploader.integrations.placed import _uniform_runs
    assert _uniform_runs(((100, 8), (132, 8), (164, 8))) == (32, 8)
    assert _uniform_runs(((100, 8), (132, 8), (170, 8))) is None
    assert _uniform_runs(((100, 8),)) is None
    assert _uniform_runs(((100, 8), (104, 8))) is None  # overlapping: not a row slice
    rows, stride, n, first = 5, 32, 8, 12
    compact = torch.arange(rows * n, dtype=torch.uint8)
    loop = torch.zeros(first + rows * stride, dtype=torch.uint8)
    for i in range(rows):
        loop[first + i * stride: first + i * stride + n] = compact[i * n:(i + 1) * n]
    fast = torch.zeros_like(loop)
    block = fast[first:first + (rows - 1) * stride + n]
    torch.as_strided(block, (rows, n), (stride, 1)).copy_(compact.view(rows, n))
    assert torch.equal(fast, loop)
