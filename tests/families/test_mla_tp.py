"""Multi-head latent attention through the generic family under TP (DeepSeek-V2, V3.2,
GLM-5's ``glm_moe_dsa``, GLM-4.7-Flash's ``glm4_moe_lite``): tiny transformers checkpoints
loaded at PP=2 x TP=2, every tensor of every rank bitwise equal to the slice vLLM's loaders
hold (tests/mla_ref.py, written independently of the planner: q_b / kv_b by heads, o's
columns by heads, the low-rank inputs, their norms and the sparse-attention indexer whole).
Before the MLA rules these were refused on ``kv_a_layernorm`` ("norm of width
kv_lora_rank").
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import generic_sweep
from helpers import reference_tensors
from mla_ref import mla_slices
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec

pytest.importorskip("transformers")


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v32", "glm_moe_dsa",
                                        "glm4_moe_lite"])
def test_mla_pp2_tp2_bytes_equal_the_engine_slices(model_type: str, tmp_path: Path) -> None:
    arch = generic_sweep.causal_lm_types()[model_type]
    generic_sweep._checkpoint(model_type, arch, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    assert spec.family.name.startswith("generic:")
    ref = reference_tensors(tmp_path)
    kinds: set[str] = set()
    seen: set[str] = set()
    for plan in plan_all(spec, index, 2, 2, 1):
        got = dict(Reader(plan))
        for item in plan.items:
            full = ref[item.name]
            slices, pad = mla_slices(item.name, full.shape, config, 2, plan.topology.tp_rank)
            want = full[slices]
            if pad:
                want = torch.cat([want, want.new_zeros((pad,) + tuple(want.shape[1:]))])
            assert torch.equal(got[item.target], want), (plan.topology.rank, item.name)
            if want.shape != full.shape:
                kinds.add(item.name.split(".")[-2])
            seen.add(item.name)
    assert seen == set(index.weight_map)
    assert {"kv_b_proj", "o_proj"} <= kinds  # split by heads (q_b_proj / q_proj too)
    assert not kinds & {"kv_a_layernorm", "kv_a_proj_with_mqa", "q_a_proj"}
