"""Int4 MoE checkpoints at real scale: Qwen3-30B-A3B as GPTQ-Int4, AWQ (GEMM) and
compressed-tensors W4A16, sparse files whose headers follow each format's layout
(tests/real_layouts.py, configs in tests/data/real_configs_quant with their sources).

Every rank's read items are checked element by element against the engine's slice of the
stored tensor (``quant_int4.engine_slices``: vLLM's parameter attributes, written apart from
the planner; ``gpt_oss_ref.check_item`` interprets an item's byte ranges), every tensor is
read by exactly the stage and EP rank that own it, and a TP size whose split cuts a
128-input group of the experts' down_proj (768 inputs over tp=4: 192 each) is refused
naming the tensor and the block.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

import pytest

from gpt_oss_ref import check_item
from pploader import PlanError
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import checkpoint_roles, make_windows, plan_rank
from pploader.planning.spec import load_spec
from pploader.planning.topology import Topology
from quant_int4 import engine_slices
from real_layouts import QUANT_MODELS, build_layout, real_config

METHOD = {"qwen3-30b-a3b-gptq-int4": "gptq", "qwen3-30b-a3b-awq": "awq",
          "qwen3-30b-a3b-w4a16": "w4a16"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real-quant")


def _owner(name: str, pp_layers: list[tuple[int, int]], experts: int, ep: int
           ) -> tuple[Optional[int], Optional[int]]:
    """(stage, EP rank or None) that must read ``name`` (None stage: first and last)."""
    m = _LAYER.match(name)
    if m is None:
        return (0 if "embed_tokens" in name else len(pp_layers) - 1), None
    layer = int(m.group(1))
    stage = next(i for i, (a, b) in enumerate(pp_layers) if a <= layer < b)
    e = _EXPERT.search(name)
    return stage, (int(e.group(1)) // (experts // ep) if e and ep > 1 else None)


@pytest.mark.parametrize("model", QUANT_MODELS)
@pytest.mark.parametrize("pp, tp, ep, ranks", [
    (4, 1, 1, [0, 3]), (2, 2, 1, [1, 2]), (2, 2, 4, [0, 5, 10, 15])])
def test_int4_moe_plans_the_engine_slices(root: Path, model: str, pp: int, tp: int, ep: int,
                                          ranks: Optional[list[int]]) -> None:
    method, cfg = METHOD[model], real_config(model)
    group = cfg["quantization_config"].get("group_size") or cfg["quantization_config"][
        "config_groups"]["group_0"]["weights"]["group_size"]
    path = build_layout(model, root)
    spec, index = load_spec(path), open_checkpoint(path)
    spec = spec.for_checkpoint(index.weight_map)
    roles = checkpoint_roles(spec, index)
    windows = make_windows(spec, index, pp, roles=roles)
    bounds = [(w.start_layer, w.end_layer) for w in windows]
    owners = {n: _owner(n, bounds, spec.num_experts, ep) for n in index.weight_map}
    quantized = [n for n in index.weight_map if n.endswith((".qweight", ".weight_packed"))]
    assert len(quantized) == 48 * (4 + 128 * 3), len(quantized)  # attention + experts
    for topo in Topology(pp, tp, ep).all_ranks():
        if ranks is not None and topo.rank not in ranks:
            continue
        plan = plan_rank(spec, index, topo, windows[topo.pp_rank], roles=roles)
        want = {n for n, (stage, e) in owners.items()
                if stage == topo.pp_rank and (e is None or e == topo.ep_rank)}
        got = {i.name for i in plan.items}
        assert got == want, (model, topo.describe(), sorted(got ^ want)[:4])
        for item in plan.items:
            entry = index.entry(item.name)
            slices, pad = engine_slices(item.name, entry.shape, cfg, method, tp, topo.tp_rank,
                                        group)
            bad = check_item(item, entry.start, entry.shape, slices, pad, limit=16)
            assert bad is None, (model, topo.describe(), item.name, bad)


@pytest.mark.parametrize("model", QUANT_MODELS)
def test_int4_moe_tp_cutting_a_group_is_refused(root: Path, model: str) -> None:
    path = build_layout(model, root)
    spec, index = load_spec(path), open_checkpoint(path)
    spec = spec.for_checkpoint(index.weight_map)
    windows = make_windows(spec, index, 1)
    with pytest.raises(PlanError) as err:
        plan_rank(spec, index, Topology(1, 4, 1, 3), windows[0])
    msg = str(err.value)
    assert "mlp.experts." in msg and "down_proj" in msg and "block 128" in msg, msg
