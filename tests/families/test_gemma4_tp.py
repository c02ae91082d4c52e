"""Gemma 4 under TP through the generic family (families/tp_gemma.py): tiny transformers
checkpoints loaded at PP=2 x TP=k on the CPU, every tensor of every rank bitwise equal to
tests/gemma4_ref.py's slice. Before, all were refused at TP=2: the models on the per-layer
embedding ``embed_tokens_per_layer``, the MoE variant on ``router.scale``, the MTP assistants
on ``post_projection``, Gemma 3n on ``altup_projections.0`` ("not a known projection").
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tp_check import build_tiny, check_ranks
from gemma4_ref import gemma4_slice, layer_kv_heads
from pploader.errors import PlanError
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec
from sweep_shrink import model_config, tiny_config

transformers = pytest.importorskip("transformers")


def _build(model_type: str, out: Path, **overrides: Any) -> dict[str, Any]:
    return build_tiny(model_type, out, **overrides)


def _check(path: Path, config: dict[str, Any], tp: int) -> set[str]:
    """Every rank's bytes against the reference; the modules some rank holds a part of."""
    return check_ranks(path, tp, lambda name, full, rank:
                       gemma4_slice(name, full, config, tp, rank))[1]


@pytest.mark.parametrize("model_type,tp", [("gemma4_text", 2), ("gemma4_text", 4),
                                           ("gemma4", 2)])
def test_gemma4_pp2_tp_bytes(model_type: str, tp: int, tmp_path: Path) -> None:
    """The per-layer embedding split by vocabulary rows, its projection by rows, the
    per-layer gate / projection whole; at TP=4 the tiny one's 2 KV heads are copied."""
    config = _build(model_type, tmp_path)
    split = _check(tmp_path, config, tp)
    assert {"embed_tokens", "embed_tokens_per_layer", "per_layer_model_projection", "q_proj",
            "k_proj", "o_proj", "gate_proj", "down_proj"} <= split, split
    assert not split & {"per_layer_input_gate", "per_layer_projection"}, split


@pytest.mark.parametrize("model_type", ["gemma4_assistant", "gemma4_unified_assistant"])
def test_gemma4_assistant_pp2_tp2_bytes(model_type: str, tmp_path: Path) -> None:
    """The MTP drafter: its layers' q / o and MLP split, the pre / post projections and the
    embedding (the tied head) whole. Before, refused on ``post_projection``."""
    config = _build(model_type, tmp_path)
    split = _check(tmp_path, config, 2)
    assert {"q_proj", "o_proj", "gate_proj", "down_proj"} <= split, split
    assert not split & {"pre_projection", "post_projection", "embed_tokens"}, split


@pytest.mark.parametrize("tp", [2, 4])
def test_gemma3n_pp2_tp_bytes(tp: int, tmp_path: Path) -> None:
    """Gemma 3n: the AltUp projections by rows, LAuReL's left rows and right columns, the
    per-layer embedding by vocabulary rows; each layer's AltUp coefficients whole. Before,
    refused on ``altup_projections.0``."""
    config = _build("gemma3n_text", tmp_path)
    split = _check(tmp_path, config, tp)
    assert {"0", "1", "2", "linear_left", "linear_right", "embed_tokens_per_layer",
            "per_layer_model_projection", "q_proj", "down_proj"} <= split, split
    assert not split & {"correction_coefs", "prediction_coefs", "modality_router", "altup",
                        "per_layer_input_gate", "router_norm"}, split


def _global_kv(kv: int) -> dict[str, Any]:
    """Full-attention layers (2, 3 of the tiny one) with ``kv`` KV heads and head_dim 32."""
    return {"per_layer_config": {str(i): {"head_dim": 32, "num_key_value_heads": kv}
                                 for i in (2, 3)}}


def test_gemma4_global_kv_heads_tp2(tmp_path: Path) -> None:
    """Sliding layers with 4 KV heads, full-attention layers with 2: each layer's own heads
    split at TP=2."""
    config = _build("gemma4_text", tmp_path, num_key_value_heads=4, **_global_kv(2))
    assert [layer_kv_heads(config, i) for i in range(4)] == [4, 4, 2, 2]
    assert "k_proj" in _check(tmp_path, config, 2)


def test_gemma4_global_kv_heads_below_tp_refused(tmp_path: Path) -> None:
    """One KV head in the full-attention layers, 2 in the others, at TP=2: vLLM copies the
    one head of those layers only, which one rule for every layer's k_proj cannot say."""
    _build("gemma4_text", tmp_path, **_global_kv(1))
    with pytest.raises(PlanError, match="k_proj"):
        plan_all(load_spec(tmp_path), open_checkpoint(tmp_path), 2, 2, 1)


def test_gemma4_moe_pp2_tp2_bytes(tmp_path: Path) -> None:
    """The MoE variant (``enable_moe_block``, as Gemma-4-26B-A4B): the stacked experts' halves
    split, the router whole. Before, refused on ``router.scale``."""
    config = _build("gemma4_text", tmp_path, enable_moe_block=True, top_k_experts=2)
    split = _check(tmp_path, config, 2)
    assert {"experts", "down_proj", "embed_tokens_per_layer"} <= split, split  # (the module
    #                                          of ``experts.gate_up_proj`` is ``experts``)
    assert not split & {"router", "proj"}, split


def test_gemma4_k_eq_v_global_heads_tp2(tmp_path: Path) -> None:
    """As the larger Gemma 4 releases: ``attention_k_eq_v`` with ``num_global_key_value_heads``
    (the full-attention layers ship ``k_proj`` only, 2 KV heads of head_dim 32; the sliding
    ones 4). Each layer's own heads split at TP=2."""
    tiny = {k: v for k, v in tiny_config("gemma4_text").to_dict().items()
            if k != "per_layer_config"}  # transformers derives it from the release's keys
    cls = transformers.Gemma4ForCausalLM
    made = model_config(type(tiny_config("gemma4_text")).from_dict(
        {**tiny, "num_key_value_heads": 4, "attention_k_eq_v": True,
         "num_global_key_value_heads": 2, "global_head_dim": 32}), cls)
    made.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(0)
    cls._from_config(made, dtype=torch.float32).save_pretrained(tmp_path, max_shard_size="40KB")
    config = json.loads((tmp_path / "config.json").read_text())
    assert [layer_kv_heads(config, i) for i in range(4)] == [4, 4, 2, 2]
    names = set(open_checkpoint(tmp_path).weight_map)
    assert "model.layers.2.self_attn.v_proj.weight" not in names
    assert "k_proj" in _check(tmp_path, config, 2)


def test_gemma4_kv_shared_layers_tp2(tmp_path: Path) -> None:
    """``num_kv_shared_layers`` (as the E2B / E4B releases): the last layer has ``q_proj``
    only (its K/V are an earlier layer's); every rank's slices as without sharing."""
    config = _build("gemma4_text", tmp_path, num_kv_shared_layers=1)
    names = set(open_checkpoint(tmp_path).weight_map)
    assert "model.layers.3.self_attn.k_proj.weight" not in names
    assert {"q_proj", "k_proj", "embed_tokens_per_layer"} <= _check(tmp_path, config, 2)
