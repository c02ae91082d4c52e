"""Fused QKV projections and per-model MLP names under TP through the generic family
(families/fused_qkv.py): tiny transformers checkpoints loaded at PP=2 x TP=k on the CPU, every
tensor of every rank bitwise equal to tests/fused_qkv_ref.py's stored slice, and each fused
qkv / Conv1D piece, put through the engine's own load transform with the rank's head counts,
equal to the parameter the engine builds from the whole tensor. Before, all of these were
refused at TP=2 (``c_attn``, ``query_key_value``, ``qkv_proj``, ``c_fc``, ``c_fc_0``, LFM2's
``feed_forward.w1``: "not a known projection"); MPT (no engine) still is.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tp_check import build_tiny, check_ranks
from fused_qkv_ref import engine_param, engine_view, stored_slice
from pploader.errors import PlanError
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec

transformers = pytest.importorskip("transformers")
FUSED = ("c_attn", "query_key_value", "qkv_proj")


def _build(model_type: str, out: Path, **overrides: Any) -> dict[str, Any]:
    return build_tiny(model_type, out, **overrides)


def _check(model_type: str, path: Path, config: dict[str, Any], tp: int) -> set[str]:
    """Every rank's items against the reference, each fused qkv / Conv1D piece through the
    engine's own load transform too; the module names split by some rank."""
    def engine(name: str, full: torch.Tensor, piece: torch.Tensor, rank: int) -> None:
        if name.split(".")[-2] in FUSED or model_type in ("gpt2", "gpt-sw3"):
            assert torch.equal(engine_view(model_type, name, piece, config, tp),
                               engine_param(model_type, name, full, config, tp, rank)), (rank, name)
    return check_ranks(path, tp, lambda name, full, rank:
                       stored_slice(model_type, name, full, config, tp, rank), also=engine)[1]


CASES = {  # model type -> (overrides, modules that must be split)
    "gpt2": ({}, {"c_attn", "c_proj", "c_fc"}),
    "gpt-sw3": ({}, {"c_attn", "c_proj", "c_fc"}),
    "gpt_bigcode": ({}, {"c_attn", "c_proj", "c_fc"}),
    "bloom": ({}, {"query_key_value", "dense", "dense_h_to_4h"}),
    "persimmon": ({}, {"query_key_value", "dense"}),
    "gpt_neox": ({}, {"query_key_value", "dense_h_to_4h"}),
    "codegen": ({}, {"qkv_proj", "out_proj", "fc_in"}),
    "starcoder2": ({}, {"c_fc", "c_proj", "q_proj"}),
    "exaone": ({}, {"c_fc_0", "c_fc_1", "c_proj", "out_proj"}),
    "sarvam_moe": ({}, {"query_key_value", "dense"}),
    "lfm2": ({}, {"w1", "w3", "w2"}),        # the tiny one's layers are all attention
    "mimo_v2_flash": ({}, {"self_attn"}),    # attention_sink_bias (module "self_attn")
    "beam": ({}, {"self_attn", "gate_proj"}),  # gate_bias, the attention's gate_proj
}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_fused_pp2_tp2_bytes(model_type: str, tmp_path: Path) -> None:
    overrides, must = CASES[model_type]
    config = _build(model_type, tmp_path, **overrides)
    split = _check(model_type, tmp_path, config, 2)
    assert must <= split, split


FALCON = {  # the three query_key_value layouts: [heads, 3, hd], [heads + 2, hd], [kv, q/kv + 2, hd]
    "mha": dict(multi_query=False, new_decoder_architecture=False, bias=True),
    "multi_query": dict(multi_query=True, new_decoder_architecture=False, bias=True),
    "groups": dict(new_decoder_architecture=True, num_kv_heads=2, num_attention_heads=4),
    "groups4": dict(new_decoder_architecture=True, num_kv_heads=4, num_attention_heads=8,
                    bias=True),   # two groups of 2 q heads a rank at TP=2, one at TP=4
}


@pytest.mark.parametrize("layout", sorted(FALCON))
def test_falcon_layouts_tp2(layout: str, tmp_path: Path) -> None:
    config = _build("falcon", tmp_path, **FALCON[layout])
    assert config.get("new_decoder_architecture") == layout.startswith("groups")
    split = _check("falcon", tmp_path, config, 2)
    assert {"query_key_value", "dense", "dense_h_to_4h"} <= split


@pytest.mark.parametrize("model_type,overrides", [
    ("gpt_bigcode", {}),                     # one KV head replicated on 4 ranks
    ("sarvam_moe", {}),                      # 2 KV heads over 4 ranks: each on 2
    ("falcon", FALCON["multi_query"]),
    ("falcon", FALCON["groups4"]),
    ("gpt2", {}),
    ("codegen", {}),                         # 4 blocks, one a rank
])
def test_fused_pp2_tp4_bytes(model_type: str, overrides: dict, tmp_path: Path) -> None:
    config = _build(model_type, tmp_path, **overrides)
    assert _check(model_type, tmp_path, config, 4)


def _refusal(path: Path, tp: int) -> PlanError:
    spec, index = load_spec(path), open_checkpoint(path)
    with pytest.raises(PlanError) as err:
        plan_all(spec, index, 2, tp, 1)
    return err.value


def test_falcon_fewer_groups_than_tp_refused(tmp_path: Path) -> None:
    """vLLM splits inside a KV group there (each group's heads over tp / kv ranks); pploader's
    whole-group rule would replicate a group, so it refuses naming the tensor."""
    _build("falcon", tmp_path, **FALCON["groups"])
    exc = _refusal(tmp_path, 4)
    assert "query_key_value" in str(exc.tensor) and "fewer than the 4 TP ranks" in str(exc)


def test_codegen_tp_beyond_blocks_refused(tmp_path: Path) -> None:
    """8 heads allow TP=8, but transformers' CodeGen views qkv rows as 4 whole blocks."""
    _build("codegen", tmp_path, n_head=8)
    exc = _refusal(tmp_path, 8)
    assert "qkv_proj" in str(exc.tensor) and "4 units" in str(exc)


def test_mpt_still_refused(tmp_path: Path) -> None:
    """No engine splits MPT's Wqkv (vLLM removed MPT in 0.28.0; SGLang has none)."""
    _build("mpt", tmp_path)
    exc = _refusal(tmp_path, 2)
    assert "Wqkv" in str(exc.tensor)


def test_gpt2_mlp_not_dividing_refused(tmp_path: Path) -> None:
    """vLLM's ColumnParallelLinear asserts its output divides by TP: an MLP width of 66 at
    TP=4 is refused naming the Conv1D ``mlp.c_fc`` (its columns), heads dividing."""
    _build("gpt2", tmp_path, n_inner=66)
    exc = _refusal(tmp_path, 4)
    assert "mlp.c_fc" in str(exc.tensor) and "does not divide" in str(exc)


@pytest.mark.parametrize("layout,kv", [("mha", 4), ("multi_query", 1), ("groups", 2),
                                       ("groups4", 4)])
def test_falcon_kv_heads_for_pools(layout: str, kv: int, tmp_path: Path) -> None:
    """Falcon spells its KV heads ``num_kv_heads`` / ``multi_query``; the spec's KV heads (the
    TP head check, the KV cache pools) are the groups its query_key_value holds."""
    config = _build("falcon", tmp_path, **FALCON[layout])
    assert "num_key_value_heads" not in config
    spec = load_spec(tmp_path)
    assert spec.num_kv_heads == kv
    assert spec.family.cache_dims.of_gqa(spec).kv_heads == kv
