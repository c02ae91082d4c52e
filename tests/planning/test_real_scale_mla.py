"""Multi-head latent attention models through the generic family at real scale: GLM-5
(``glm_moe_dsa``: 78 layers, 256 experts, its MTP layer 78) and DeepSeek-V3.2-Exp
(``deepseek_v32``: 61 layers, MTP layer 61), sparse copies of their published layouts
(tests/real_layouts.py ``build_generic_layout`` with the MTP layer; the configs in
``tests/data/real_configs_generic`` are written by hand from the published ones, V3.2's
without its FP8 ``quantization_config``: the bfloat16 form).

At PP=2 x TP=8 every item of every rank must deliver exactly the slice written here
independently of the planner (tests/mla_ref.py ``mla_slices``: vLLM's ``DeepseekV2MLAAttention`` /
``Indexer`` / ``FusedMoE`` / ``VocabParallelEmbedding`` arithmetic), checked by shape and
by the file offsets of sampled elements; every index name except the MTP layer's is read
by exactly one stage, and the MTP draft (``plan_mtp``) reads exactly the MTP layer, sliced
the same way.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping

import pytest

from gpt_oss_ref import check_item
from mla_ref import mla_slices
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all, plan_mtp
from pploader.planning.spec import load_spec
from pploader.planning.topology import Topology
from real_layouts import build_generic_layout

pytestmark = pytest.mark.slow  # each meta model takes ~10 s to derive on the 2-core VM

TP = 8
#: (layout, decoder layers: the MTP layer's id)
MODELS = [("glm-5", 78), ("deepseek-v3.2-exp", 61)]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@pytest.fixture(scope="module", params=MODELS, ids=[m[0] for m in MODELS])
def layout(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, int]:
    model, layers = request.param
    return build_generic_layout(model, tmp_path_factory.mktemp("mla"), mtp=True), layers


def _check(plan: Any, index: Any, config: Mapping[str, Any], rename: dict[str, str]) -> int:
    topo = plan.topology
    for item in plan.items:
        entry = index.entry(item.name)
        slices, pad = mla_slices(item.name, entry.shape, config, TP, topo.tp_rank)
        problem = check_item(item, entry.start, entry.shape, slices, pad, limit=64,
                             seed=topo.rank)
        assert problem is None, (topo.rank, item.name, problem)
        assert item.target == rename.get(item.name, item.name)
    return len(plan.items)


def test_mla_exact_at_pp2_tp8_with_mtp_draft(layout: tuple[Path, int]) -> None:
    path, layers = layout
    spec, index = load_spec(path), open_checkpoint(path)
    config = json.loads((path / "config.json").read_text())
    assert spec.family.name.startswith("generic:")
    assert (spec.num_layers, spec.num_mtp_layers) == (layers, 1)
    mtp = {n for n in index.weight_map if (m := _LAYER.match(n)) and int(m.group(1)) == layers}
    assert {f"model.layers.{layers}.{c}" for c in (
        "eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.head.weight",
        "embed_tokens.weight", "self_attn.indexer.k_norm.bias",
        "self_attn.kv_a_layernorm.weight", "mlp.experts.255.down_proj.weight")} <= mtp
    owner: dict[str, set[int]] = defaultdict(set)
    for plan in plan_all(spec, index, 2, TP, 1):
        _check(plan, index, config, {})
        for item in plan.items:
            owner[item.name].add(plan.topology.pp_rank)
    assert set(owner) == set(index.weight_map) - mtp
    assert all(len(s) == 1 for s in owner.values())
    prefix = f"model.layers.{layers}."
    for rank in range(TP):
        draft = plan_mtp(spec, index, 0, Topology(1, TP, 1, rank))
        assert set(draft.tensors) == mtp
        _check(draft, index, config,
               {n: n.replace(prefix, "model.layers.0.", 1) for n in mtp})
