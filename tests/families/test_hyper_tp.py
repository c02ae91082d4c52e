"""Hyper-connection models under TP through the generic family (families/tp_hyper.py): HY-V4
(hyper connections, gated MLA with sinks), Qwen4-exp (hyper connections, gated-delta-net
and gated attention with an indexer) and DeepSeek-V4 (hyper connections, KV compressors,
grouped output LoRA), tiny transformers checkpoints loaded at PP=2 x TP=k on
the CPU, every tensor of every rank bitwise equal to tests/hyper_tp_ref.py's slice. Before,
TP=2 was refused on ``hc_pre.hc_attn_layer.hc_base`` / ``attn_hyper_connection.*`` /
``attn.compressor.ape`` ("not a known projection")."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import generic_sweep
from tp_check import check_ranks
import json
from typing import Callable

from hyper_tp_ref import deepseek_v4_slice, qwen4_exp_slice, stored_slice

pytest.importorskip("transformers")


def _build(model_type: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(model_type)
    generic_sweep._checkpoint(model_type, generic_sweep.causal_lm_types()[model_type], out)
    return out


@pytest.fixture(scope="module")
def hy_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build("hy_v4", tmp_path_factory)


Slice = Callable[[str, torch.Tensor, int, int], torch.Tensor]


def _check(path: Path, tp: int, reference: Slice = stored_slice) -> set[str]:
    """Every rank's items against the reference; the components some rank holds a slice of."""
    seen, split = check_ranks(path, tp, lambda name, full, rank: reference(name, full, tp, rank),
                              key=lambda name: name.split(".", 3)[-1] if ".layers." in name
                              else name)
    assert set(seen.values()) == {tp}   # each tensor on every TP rank of its stage, once each
    return split


@pytest.mark.parametrize("tp", [2, 4])
def test_hy_v4_pp2_tp_bytes(hy_v4: Path, tp: int) -> None:
    split = _check(hy_v4, tp)
    for comp in ("self_attn.learnable_sink_param", "self_attn.linear_gate.weight",
                 "self_attn.q_b_proj.weight", "self_attn.o_proj.weight",
                 "mlp.linear_gate.weight", "mlp.experts.gate_up_proj"):
        assert comp in split, comp
    assert not any("hc_pre" in c or "indexer" in c for c in split), split


@pytest.mark.parametrize("model_type", ["qwen4_exp", "qwen4_exp_text"])
def test_qwen4_exp_pp2_tp2_bytes(model_type: str, tmp_path_factory: pytest.TempPathFactory
                                 ) -> None:
    path = _build(model_type, tmp_path_factory)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    split = _check(path, 2, lambda name, full, tp, rank: qwen4_exp_slice(name, full, text, tp,
                                                                          rank))
    for comp in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight",
                 "linear_attn.A_log", "linear_attn.out_proj.weight", "self_attn.q_proj.weight",
                 "self_attn.k_proj.weight", "mlp.experts.0.gate_proj.weight"):
        assert comp in split, comp
    assert not any("hyper_connection" in c or "indexer" in c for c in split), split


@pytest.fixture(scope="module")
def deepseek_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build("deepseek_v4", tmp_path_factory)


@pytest.mark.parametrize("tp", [2, 4])
def test_deepseek_v4_pp2_tp_bytes(deepseek_v4: Path, tp: int) -> None:
    split = _check(deepseek_v4, tp, deepseek_v4_slice)
    for comp in ("attn.wq_b.weight", "attn.wo_a.weight", "attn.wo_b.weight", "attn.attn_sink",
                 "ffn.shared_experts.w1.weight", "ffn.experts.0.w2.weight", "head.weight"):
        assert comp in split, comp
    assert not any("hc_" in c or "compressor" in c or "indexer" in c for c in split), split
