"""A fused gate/up linear layer under TP through the generic family (GLM / GLM-4's
``mlp.gate_up_proj``, MiniMax-M3's shared experts): tiny transformers checkpoints loaded at
PP=2 x TP=2; each rank's ``gate_up_proj`` is the rank's rows of the gate half followed by the
same rows of the up half (vLLM's ``MergedColumnParallelLinear`` loading a fused checkpoint
tensor: each of the two output sizes split on its own), its ``down_proj`` the matching
columns, written here from the shapes alone and compared bitwise. Before, these were refused
on ``gate_up_proj`` ("not a known projection").
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import generic_sweep
from helpers import reference_tensors
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec

pytest.importorskip("transformers")
TP = 2


def _want(name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    """The rank's slice of a fused MLP tensor (gate_up: [2I, H] / [2I]; down: [H, I])."""
    if ".gate_up_proj." in name:
        inter = full.shape[0] // 2
        per = inter // TP
        gate, up = full[:inter], full[inter:]
        return torch.cat([gate[rank * per:(rank + 1) * per], up[rank * per:(rank + 1) * per]])
    per = full.shape[1] // TP
    return full[:, rank * per:(rank + 1) * per]


@pytest.mark.parametrize("model_type", ["glm", "glm4", "minimax_m3_vl_text"])
def test_fused_gate_up_pp2_tp2_bytes(model_type: str, tmp_path: Path) -> None:
    arch = generic_sweep.causal_lm_types()[model_type]
    generic_sweep._checkpoint(model_type, arch, tmp_path)
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    ref = reference_tensors(tmp_path)
    fused = {n for n in index.weight_map if ".gate_up_proj." in n and ".experts." not in n}
    downs = {n.replace(".gate_up_proj.", ".down_proj.") for n in fused if n.endswith(".weight")}
    assert fused and downs <= set(index.weight_map)
    checked = set()
    for plan in plan_all(spec, index, 2, TP, 1):
        got = dict(Reader(plan))
        for item in plan.items:
            if item.name in fused | downs:
                want = _want(item.name, ref[item.name], plan.topology.tp_rank)
                assert torch.equal(got[item.target], want), (plan.topology.rank, item.name)
                checked.add(item.name)
    assert checked == fused | downs
