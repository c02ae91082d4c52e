"""integrations/placed.py (what vLLM's weight loaders are handed), without an engine: placed
tensors hold exactly this TP rank's bytes, NaN elsewhere; read_stage holds them for a reload."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch


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
    reader, stream = stage_weights(staged, "placed")
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


@pytest.mark.parametrize("tp_mode", ["placed", "full"])
def test_read_stage_holds_what_stage_weights_streams(llama: Path, tp_mode: str) -> None:
    """A reload reads everything first (read_stage), then streams the same tensors as a load."""
    from pploader import Topology, plan_stage
    from pploader.integrations.placed import read_stage, stage_weights
    staged = plan_stage(llama, Topology(1, 2, 1, 1), range_cost_bytes=0)
    reader, replay = read_stage(staged, tp_mode)
    assert reader.stats.read_bytes == (staged.plan.ideal_bytes if tp_mode == "placed"
                                       else staged.plan.planned_read_bytes)
    _, stream = stage_weights(staged, tp_mode)
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
        _, stream = stage_weights(staged, "placed")
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
reader, stream = stage_weights(staged, "placed")
for _ in stream:
    pass
print(json.dumps({"rchar": rchar_bytes() - before, "read": reader.stats.read_bytes}))
'''


def test_first_placed_load_rchar_counts_checkpoint_bytes_only(llama: Path) -> None:
    """vLLM's report compares /proc/self/io rchar with the planned bytes: in a fresh process the
    first placed read must not add the read backend's module import to rchar."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _FIRST_LOAD_RCHAR, str(llama)],
                         capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["read"] <= res["rchar"] <= res["read"] + 4096, res
