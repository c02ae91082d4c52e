"""The family test table: one row per hand-written family, everything the tests expect of it.

tests/families/test_families.py (transformers-built checkpoints, TP reference slices, the tiny config's
layout), tests/families/test_fused_families.py (fused / stacked targets), tests/cache/test_pools.py (cache
geometry by hand and against transformers' mixers) and tests/families/test_generic.py read it. Adding a
family = its module under pploader/families/, ``configs/models/tiny-<family>.json`` and one
``Row`` here (docs/families.md). Every value is written from the architecture and the config
text, never from pploader's family code; ``test_family_table_covers_every_family`` fails when a
registered family or a bundled tiny config has no row.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from safetensors.torch import save_file

from family_expect import (FF_ROWS, MLP_ROWS, QKV, SHARED_ROWS, Fusion, Slicer, TpSlice,
                           attention, experts, gate_up, gdn, halves, per_expert, replicated,
                           row_halves, segments, stacked_down, stacked_gate_up, whole)
from helpers import reference_tensors

BF16, F32 = 2, 4

# ---- transformers-built checkpoints (config sizes shared by the build cases) ----------------
COMMON = dict(vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, intermediate_size=64, max_position_embeddings=64)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=8, linear_conv_kernel_dim=4)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
              mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)

Fused = Callable[[Mapping, int], tuple[tuple[Fusion, ...], tuple[tuple[str, Slicer], ...]]]
KindNumbers = dict[str, tuple[int, dict[str, tuple[int, ...]]]]   # kind -> (kv B/token, states)
Geometry = tuple[dict, tuple[str, ...], dict[int, KindNumbers]]   # config, kinds, {tp: numbers}


@dataclass(frozen=True)
class Row:
    """One family. ``tiny``: its bundled config stem; ``kinds`` / ``experts``: that config's
    layer kinds and routed experts, read off the config text. ``case`` (+ ``overrides`` of
    COMMON, or ``builder``): a checkpoint written by transformers' ``save_pretrained``, also in
    transformers' own naming when ``fused_naming``. ``fused``: fused targets + reference
    slicing (None: the family is not in the fused-binding test). ``tp_slices``: TP=2 reference
    slices of the tiny checkpoint by component suffix. ``pools`` / ``geometry`` / ``real_fields``
    / ``hf_mixer``: cache numbers by hand for the tiny config and for a hand config, the config
    fields the family reads its kinds from, transformers' mixer classes (tests/cache/test_pools.py)."""

    family: str
    model_type: str
    tiny: Optional[str] = None
    kinds: tuple[str, ...] = ()
    experts: int = 0
    case: Optional[str] = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    fused_naming: bool = False
    builder: Optional[Callable[[], torch.nn.Module]] = None
    fused: Optional[Fused] = None
    tp_slices: Mapping[str, TpSlice] = field(default_factory=dict)
    pools: Optional[tuple[int, dict[int, KindNumbers]]] = None
    geometry: Optional[Geometry] = None
    real_fields: Mapping[str, Any] = field(default_factory=dict)
    hf_mixer: Optional[tuple[str, str]] = None


def _vl_model() -> torch.nn.Module:
    from transformers.models.qwen3_5_moe import (Qwen3_5MoeConfig,
                                                 Qwen3_5MoeForConditionalGeneration)
    text = dict(COMMON, num_hidden_layers=4, num_experts=4, shared_expert_intermediate_size=16,
                layer_types=["linear_attention", "full_attention"] * 2, dtype="float32",
                **MOE, **GDN)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                  patch_size=4, num_position_embeddings=16, temporal_patch_size=2,
                  spatial_merge_size=2)
    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text,
                                                               vision_config=vision))


# ---- fused targets per family (layer-relative names, slice order) ----------------------------

def _qwen3_moe(cfg: Mapping, e: int) -> tuple:
    inter = cfg["moe_intermediate_size"]
    return ((QKV, gate_up("mlp."), *experts("mlp.experts."),
             ("mlp.experts.w13_weight", ("mlp.experts.gate_up_proj",)),
             ("mlp.experts.w2_weight", ("mlp.experts.down_proj",))),
            attention(cfg) + MLP_ROWS + per_expert(r"mlp\.experts\.")
            + ((r"mlp\.experts\.gate_up_proj", stacked_gate_up(e, inter)),
               (r"mlp\.experts\.down_proj", stacked_down(e))))


def _mixtral(cfg: Mapping, e: int) -> tuple:  # w1 = gate, w3 = up, w2 = down
    return ((QKV, *experts("block_sparse_moe.experts.", "w1", "w3", "w2")),
            attention(cfg) + per_expert(r"block_sparse_moe\.experts\.", "w1|w3", "w2"))


def _deepseek_v3(cfg: Mapping, e: int) -> tuple:  # MLA: the replicated low-rank inputs fuse
    return ((("self_attn.fused_qkv_a_proj.weight",
              ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")),
             gate_up("mlp."), gate_up("mlp.shared_experts."), *experts("mlp.experts.")),
            ((r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight", replicated()),)
            + MLP_ROWS + SHARED_ROWS + per_expert(r"mlp\.experts\."))


def _qwen3_5_moe(cfg: Mapping, e: int) -> tuple:  # gated q ([q, gate] per head), split GDN
    fusions, slicers = gdn(cfg)
    return ((QKV, *fusions, gate_up("mlp.shared_expert."), *experts("mlp.experts.")),
            attention(cfg) + slicers + SHARED_ROWS + per_expert(r"mlp\.experts\."))


def _qwen3_5(cfg: Mapping, e: int) -> tuple:
    fusions, slicers = gdn(cfg)
    return (QKV, gate_up("mlp."), *fusions), attention(cfg) + slicers + MLP_ROWS


def _qwen3_next(cfg: Mapping, e: int) -> tuple:  # GDN in_proj_qkvz / ba stored fused already
    return ((QKV, gate_up("mlp."), gate_up("mlp.shared_expert."), *experts("mlp.experts.")),
            attention(cfg) + MLP_ROWS + SHARED_ROWS + per_expert(r"mlp\.experts\."))


def _mamba_ff(cfg: Mapping, e: int) -> tuple:  # bamba, falcon_h1
    return (QKV, gate_up("feed_forward.")), attention(cfg) + FF_ROWS


def _jamba(cfg: Mapping, e: int) -> tuple:  # Mamba1 in_proj is fused on disk already
    return ((QKV, gate_up("feed_forward."), *experts("feed_forward.experts.")),
            attention(cfg) + FF_ROWS + per_expert(r"feed_forward\.experts\."))


def _nemotron_h(cfg: Mapping, e: int) -> tuple:  # ungated experts: w13 holds up alone
    return ((("mixer.qkv_proj.weight", tuple(f"mixer.{n}_proj.weight" for n in "qkv")),
             *experts("mixer.experts.", gate="")),
            attention(cfg, r"mixer\.") + per_expert(r"mixer\.experts\.", "up_proj"))


def _granite(cfg: Mapping, e: int) -> tuple:  # experts 3-D on disk: renamed into w13 / w2
    inter = cfg["intermediate_size"]
    return ((QKV,
             ("block_sparse_moe.experts.w13_weight", ("block_sparse_moe.input_linear.weight",)),
             ("block_sparse_moe.experts.w2_weight", ("block_sparse_moe.output_linear.weight",))),
            attention(cfg)
            + ((r"block_sparse_moe\.input_linear\.weight", stacked_gate_up(e, inter)),
               (r"block_sparse_moe\.output_linear\.weight", stacked_down(e))))


def _phi3(cfg: Mapping, e: int) -> tuple:  # qkv_proj / gate_up_proj are fused on disk
    return (), ()


# ---- cache numbers by hand -------------------------------------------------------------------
# Hand configs (transformers 5.24 key names) and {tp: {kind: (kv bytes/token, {state: shape})}}.
ATTN = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 64}
# GQA: K+V = 2 parts x kv_heads_local x 16 x bf16; kv 2 < tp 4 -> one head replicated
GEO_LLAMA: Geometry = (dict(ATTN), ("full_attention",) * 4, {
    1: {"full_attention": (2 * 2 * 16 * BF16, {})},
    2: {"full_attention": (2 * 1 * 16 * BF16, {})},
    4: {"full_attention": (2 * 1 * 16 * BF16, {})}})
# MLA: latent 32 + rope 8 = 40 per token, the same on every TP rank
GEO_MLA: Geometry = ({**ATTN, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
                      "v_head_dim": 16}, ("mla",) * 4, {
    1: {"mla": (40 * BF16, {})}, 2: {"mla": (40 * BF16, {})}, 4: {"mla": (40 * BF16, {})}})
# nemotron_h: heads 8 x head_dim 8 = 64, groups 2, d_state 16, K 4; mlp layers: no cache
# conv_dim = 64 + 2*2*16 = 128 | tp2: 32 + 2*1*16 = 64 | tp4: 16 + 2*1*16 = 48 (groups repl.)
GEO_NEMOTRON: Geometry = ({**ATTN, "mamba_num_heads": 8, "mamba_head_dim": 8,
                           "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "expand": 2},
                          ("mamba2", "mlp", "full_attention", "mamba2"), {
    1: {"mamba2": (0, {"conv": (128, 3), "ssm": (8, 8, 16)}), "mlp": (0, {}),
        "full_attention": (128, {})},
    2: {"mamba2": (0, {"conv": (64, 3), "ssm": (4, 8, 16)}), "mlp": (0, {}),
        "full_attention": (64, {})},
    4: {"mamba2": (0, {"conv": (48, 3), "ssm": (2, 8, 16)}), "mlp": (0, {}),
        "full_attention": (64, {})}})
# bamba (and granitemoehybrid: the same keys): d_head "auto" = expand 2 x hidden 32 / heads 8
# = 8; groups 1 (replicated at tp2); conv_dim = 64 + 2*1*16 = 96 | tp2: 32 + 32 = 64
GEO_BAMBA: Geometry = ({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "vocab_size": 64, "mamba_n_heads": 8, "mamba_d_head": "auto",
                        "mamba_expand": 2, "mamba_n_groups": 1, "mamba_d_state": 16,
                        "mamba_d_conv": 4}, ("mamba2", "full_attention"), {
    1: {"mamba2": (0, {"conv": (96, 3), "ssm": (8, 8, 16)}),
        "full_attention": (2 * 2 * 8 * BF16, {})},
    2: {"mamba2": (0, {"conv": (64, 3), "ssm": (4, 8, 16)}),
        "full_attention": (2 * 1 * 8 * BF16, {})}})
# falcon_h1: every layer attention AND mamba2; d_ssm 48 / 6 heads = 8; groups 2, d_state 8
# conv_dim = 48 + 2*2*8 = 80 | tp2: 24 + 2*1*8 = 40
GEO_FALCON: Geometry = ({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                         "vocab_size": 64, "mamba_d_ssm": 48, "mamba_n_heads": 6,
                         "mamba_d_head": 8, "mamba_n_groups": 2, "mamba_d_state": 8,
                         "mamba_d_conv": 4, "mamba_expand": 2},
                        ("hybrid_attention_mamba2",) * 3, {
    1: {"hybrid_attention_mamba2": (2 * 2 * 8 * BF16, {"conv": (80, 3), "ssm": (6, 8, 8)})},
    2: {"hybrid_attention_mamba2": (2 * 1 * 8 * BF16, {"conv": (40, 3), "ssm": (3, 8, 8)})}})
# jamba (mamba1): d_inner = 2 x 32 = 64, d_state 8, K 4
GEO_JAMBA: Geometry = ({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "vocab_size": 64, "mamba_expand": 2, "mamba_d_state": 8,
                        "mamba_d_conv": 4}, ("mamba1", "mamba1", "full_attention", "mamba1"), {
    1: {"mamba1": (0, {"conv": (64, 3), "ssm": (64, 8)}), "full_attention": (64, {})},
    2: {"mamba1": (0, {"conv": (32, 3), "ssm": (32, 8)}), "full_attention": (32, {})}})
# gdn (qwen3_next, qwen3_5, qwen3_5_moe: the same linear_* keys): Hk 2 x dk 8, Hv 4 x dv 8:
# conv_dim = 2*2*8 + 4*8 = 64 | tp2: 2*1*8 + 2*8 = 32 | tp4: Hk 2 < 4 replicated: 2*1*8 + 1*8 = 24
GEO_GDN: Geometry = ({"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "head_dim": 8, "vocab_size": 64, "linear_num_key_heads": 2,
                      "linear_key_head_dim": 8, "linear_num_value_heads": 4,
                      "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4},
                     ("gdn", "gdn", "gdn", "full_attention"), {
    1: {"gdn": (0, {"conv": (64, 3), "temporal": (4, 8, 8)}), "full_attention": (64, {})},
    2: {"gdn": (0, {"conv": (32, 3), "temporal": (2, 8, 8)}), "full_attention": (32, {})},
    4: {"gdn": (0, {"conv": (24, 3), "temporal": (1, 8, 8)}), "full_attention": (32, {})}})

# The bundled tiny configs, from the config text. GQA everywhere: 2 kv heads x head_dim 16 x (K, V).
_GQA = {1: 2 * 2 * 16 * BF16, 2: 2 * 1 * 16 * BF16}
# GDN: Hk 2 x dk 16, Hv 4 x dv 16, K 4: conv_dim = 2*2*16 + 4*16 = 128 (tp2: 2*1*16 + 2*16 = 64),
# temporal [Hv, dv, dk] = [4, 16, 16] (tp2: [2, 16, 16])
TINY_GDN = (BF16, {1: {"full_attention": (_GQA[1], {}),
                       "gdn": (0, {"conv": (128, 3), "temporal": (4, 16, 16)})},
                   2: {"full_attention": (_GQA[2], {}),
                       "gdn": (0, {"conv": (64, 3), "temporal": (2, 16, 16)})}})
# bamba / granitemoehybrid: 8 heads x d_head 16 = 128, 1 group, d_state 16:
# conv_dim = 128 + 2*1*16 = 160 (tp2: 64 + 2*1*16 = 96, the group replicated)
TINY_BAMBA = (BF16, {tp: {"full_attention": (_GQA[tp], {}),
                          "mamba2": (0, {"conv": (160 if tp == 1 else 96, 3),
                                         "ssm": (8 // tp, 16, 16)})} for tp in (1, 2)})
TINY_DENSE = (BF16, {tp: {"full_attention": (_GQA[tp], {})} for tp in (1, 2)})

_GDN_LAYERS = ("gdn",) * 3 + ("full_attention",)
_HF_QWEN3_5 = ("qwen3_5.Qwen3_5TextConfig", "qwen3_5.Qwen3_5GatedDeltaNet")
_HF_QWEN3_5_MOE = ("qwen3_5_moe.Qwen3_5MoeTextConfig", "qwen3_5_moe.Qwen3_5MoeGatedDeltaNet")
_ATTN8 = ("full_attention",) * 8


def _gdn_real(arch: str) -> dict:
    return {"architectures": [arch], "num_hidden_layers": 4, "num_experts": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"]}


# ---- the table ---------------------------------------------------------------------------------
ROWS: tuple[Row, ...] = (
    Row("llama", "llama", "tiny-llama", _ATTN8, case="llama",
        overrides=dict(num_hidden_layers=4), pools=TINY_DENSE, geometry=GEO_LLAMA,
        real_fields={"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}),
    Row("qwen2", "qwen2"),
    Row("qwen3", "qwen3", "tiny-qwen3", ("full_attention",) * 4, case="qwen3_tied",
        overrides=dict(num_hidden_layers=4, tie_word_embeddings=True), pools=TINY_DENSE),
    Row("qwen3_moe", "qwen3_moe", "tiny-qwen3_moe", ("full_attention",) * 6, 8,
        case="qwen3_moe", fused_naming=True, fused=_qwen3_moe, pools=TINY_DENSE,
        overrides=dict(num_hidden_layers=4, num_experts=4, mlp_only_layers=[1], **MOE)),
    Row("mixtral", "mixtral", "tiny-mixtral", ("full_attention",) * 4, 8, case="mixtral_bf16",
        fused_naming=True, fused=_mixtral, pools=TINY_DENSE,
        overrides=dict(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
                       dtype="bfloat16")),
    Row("deepseek_v3", "deepseek_v3", "tiny-deepseek_v3", ("mla",) * 4, 8, case="deepseek_v3",
        fused_naming=True, fused=_deepseek_v3, geometry=GEO_MLA,
        overrides=dict(num_hidden_layers=4, num_key_value_heads=4, n_routed_experts=4,
                       n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                       q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                       n_group=2, topk_group=1, num_nextn_predict_layers=2, **MOE),
        # MLA: low-rank inputs replicated, per-head projections split
        tp_slices={"self_attn.q_a_proj.weight": whole,
                   "self_attn.kv_a_proj_with_mqa.weight": whole,
                   "self_attn.q_b_proj.weight": halves, "self_attn.kv_b_proj.weight": halves,
                   "self_attn.o_proj.weight": row_halves,
                   "mlp.shared_experts.gate_proj.weight": halves},
        # MLA: kv_lora_rank 32 + qk_rope_head_dim 8 = 40 x bf16, not split by TP
        pools=(BF16, {1: {"mla": (80, {})}, 2: {"mla": (80, {})}}),
        real_fields={"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 4,
                     "first_k_dense_replace": 1, "n_routed_experts": 4}),
    Row("qwen3_next", "qwen3_next", "tiny-qwen3_next", _GDN_LAYERS * 2, 8, case="qwen3_next",
        fused_naming=True, fused=_qwen3_next, pools=TINY_GDN, geometry=GEO_GDN,
        overrides=dict(num_hidden_layers=4, num_experts=4, mlp_only_layers=[2],
                       shared_expert_intermediate_size=16, **MOE, **GDN),
        # GDN, Qwen3-Next naming: qkvz / ba interleaved per key-head group -> whole groups
        tp_slices={"linear_attn.in_proj_qkvz.weight": halves,
                   "linear_attn.in_proj_ba.weight": halves,
                   "mlp.shared_expert_gate.weight": whole, "mlp.gate.weight": whole},
        real_fields=_gdn_real("Qwen3NextForCausalLM"),
        hf_mixer=("qwen3_next.Qwen3NextConfig", "qwen3_next.Qwen3NextGatedDeltaNet")),
    Row("qwen3_5", "qwen3_5_text", "tiny-qwen3_5", _GDN_LAYERS * 2, case="qwen3_5",
        overrides=dict(num_hidden_layers=4, **GDN), fused=_qwen3_5, pools=TINY_GDN,
        geometry=GEO_GDN, real_fields=_gdn_real("Qwen3_5ForCausalLM"), hf_mixer=_HF_QWEN3_5,
        # GDN, Qwen3.5 naming: [q; k; v] blocks (2 k heads x 16, 4 v heads x 16)
        tp_slices={"linear_attn.in_proj_qkv.weight": lambda t, r: segments(t, r, [32, 32, 64]),
                   "linear_attn.conv1d.weight": lambda t, r: segments(t, r, [32, 32, 64]),
                   "linear_attn.in_proj_z.weight": halves, "linear_attn.in_proj_b.weight": halves,
                   "linear_attn.A_log": halves, "linear_attn.norm.weight": whole,
                   "linear_attn.out_proj.weight": row_halves,
                   "self_attn.q_proj.weight": halves, "self_attn.o_proj.weight": row_halves}),
    Row("qwen3_5_moe", "qwen3_5_moe_text", "tiny-qwen3_5_moe", _GDN_LAYERS * 2, 8,
        case="qwen3_5_moe", fused_naming=True, fused=_qwen3_5_moe, pools=TINY_GDN,
        geometry=GEO_GDN, real_fields=_gdn_real("Qwen3_5MoeForCausalLM"),
        hf_mixer=_HF_QWEN3_5_MOE,
        overrides=dict(num_hidden_layers=4, num_experts=4, shared_expert_intermediate_size=16,
                       **MOE, **GDN)),
    Row("qwen3_5_vl", "qwen3_5", hf_mixer=_HF_QWEN3_5),
    Row("qwen3_5_moe_vl", "qwen3_5_moe", "tiny-qwen3_5_moe_vl", _GDN_LAYERS, 8,
        case="qwen3_5_moe_vl", fused_naming=True, builder=_vl_model, fused=_qwen3_5_moe,
        pools=TINY_GDN, hf_mixer=_HF_QWEN3_5_MOE),
    Row("jamba", "jamba", "tiny-jamba", ("mamba1", "mamba1", "full_attention", "mamba1") * 2, 8,
        case="jamba", fused_naming=True, fused=_jamba, geometry=GEO_JAMBA,
        overrides=dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                       attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                       expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=4,
                       mamba_expand=2, mamba_dt_rank=4),
        # Mamba1: in_proj = [x; z], x_proj row-parallel
        tp_slices={"mamba.in_proj.weight": lambda t, r: segments(t, r, [128, 128]),
                   "mamba.x_proj.weight": row_halves, "mamba.dt_proj.weight": halves,
                   "mamba.A_log": halves, "mamba.dt_layernorm.weight": whole},
        # d_inner = expand 2 x hidden 64 = 128, d_state 16, K 4
        pools=(BF16, {tp: {"full_attention": (_GQA[tp], {}),
                           "mamba1": (0, {"conv": (128 // tp, 3), "ssm": (128 // tp, 16)})}
                      for tp in (1, 2)}),
        real_fields={"architectures": ["JambaForCausalLM"], "num_hidden_layers": 4,
                     "attn_layer_period": 4, "attn_layer_offset": 2, "expert_layer_period": 2,
                     "expert_layer_offset": 1, "num_experts": 4},
        hf_mixer=("jamba.JambaConfig", "jamba.JambaMambaMixer")),
    Row("bamba", "bamba", "tiny-bamba", ("mamba2", "mamba2", "full_attention") * 2,
        case="bamba", fused=_mamba_ff, pools=TINY_BAMBA, geometry=GEO_BAMBA,
        overrides=dict(num_hidden_layers=4, attn_layer_indices=[1, 3], **MAMBA2),
        # Mamba2, 8 heads x 16, 1 group x 16 state (< tp: B and C replicated), d_inner 128
        tp_slices={
            "mamba.in_proj.weight": lambda t, r: segments(t, r, [128, 128, 16, 16, 8], (2, 3)),
            "mamba.conv1d.weight": lambda t, r: segments(t, r, [128, 16, 16], (1, 2)),
            "mamba.conv1d.bias": lambda t, r: segments(t, r, [128, 16, 16], (1, 2)),
            "mamba.A_log": halves, "mamba.D": halves, "mamba.dt_bias": halves,
            "mamba.norm.weight": halves, "mamba.out_proj.weight": row_halves,
            "self_attn.k_proj.weight": halves, "feed_forward.down_proj.weight": row_halves,
            "input_layernorm.weight": whole},
        real_fields={"architectures": ["BambaForCausalLM"], "num_hidden_layers": 2,
                     "attn_layer_indices": [1]},
        hf_mixer=("bamba.BambaConfig", "bamba.BambaMixer")),
    Row("falcon_h1", "falcon_h1", "tiny-falcon_h1", ("hybrid_attention_mamba2",) * 4,
        case="falcon_h1", fused=_mamba_ff, geometry=GEO_FALCON,
        overrides=dict(num_hidden_layers=4, mamba_d_ssm=64, **MAMBA2),
        # float32 model: every layer K+V (2 x 2 x 16 x 4 B) and mamba2 with d_ssm 128 = 8 heads
        # x 16, 1 group, d_state 16: conv_dim 160 (tp2: 96)
        pools=(F32, {tp: {"hybrid_attention_mamba2": (
            2 * (2 // tp) * 16 * F32, {"conv": (160 if tp == 1 else 96, 3),
                                       "ssm": (8 // tp, 16, 16)})} for tp in (1, 2)}),
        real_fields={"architectures": ["FalconH1ForCausalLM"], "num_hidden_layers": 3},
        hf_mixer=("falcon_h1.FalconH1Config", "falcon_h1.FalconH1Mixer")),
    Row("nemotron_h", "nemotron_h", "tiny-nemotron_h",
        ("mamba2", "mlp", "mamba2", "full_attention", "mamba2", "mlp", "mamba2", "mlp"), 8,
        case="nemotron_h", fused_naming=True, fused=_nemotron_h, geometry=GEO_NEMOTRON,
        overrides=dict(layers_block_type=["mamba", "attention", "moe", "mlp", "mamba"],
                       n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=16,
                       moe_shared_expert_intermediate_size=16, num_experts_per_tok=2,
                       mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8,
                       chunk_size=8),
        # Mamba2 with 2 groups: B and C split by group
        tp_slices={"mixer.in_proj.weight": lambda t, r: segments(t, r, [128, 128, 32, 32, 8]),
                   "mixer.conv1d.weight": lambda t, r: segments(t, r, [128, 32, 32]),
                   "mixer.experts.3.up_proj.weight": halves,
                   "mixer.experts.3.down_proj.weight": row_halves},
        # 8 heads x 16 = 128, n_groups 2, d_state 16: conv_dim = 128 + 2*2*16 = 192
        # (tp2: 64 + 2*1*16 = 96); MLP / MoE blocks: no cache
        pools=(BF16, {tp: {"full_attention": (_GQA[tp], {}), "mlp": (0, {}),
                           "mamba2": (0, {"conv": (192 if tp == 1 else 96, 3),
                                          "ssm": (8 // tp, 16, 16)})} for tp in (1, 2)}),
        real_fields={"architectures": ["NemotronHForCausalLM"],
                     "layers_block_type": ["mamba", "mlp", "attention", "mamba"]},
        hf_mixer=("nemotron_h.NemotronHConfig", "nemotron_h.NemotronHMamba2Mixer")),
    Row("granitemoehybrid", "granitemoehybrid", "tiny-granitemoehybrid",
        ("mamba2", "mamba2", "full_attention") * 2, 8, case="granitemoehybrid_tied",
        fused_naming=True, fused=_granite, pools=TINY_BAMBA, geometry=GEO_BAMBA,
        overrides=dict(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba",
                                                         "attention"],
                       num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
                       tie_word_embeddings=True, **MAMBA2),
        # fused experts: input_linear [E, 2I, H] = [gate; up] on dim 1
        tp_slices={
            "block_sparse_moe.input_linear.weight": lambda t, r: segments(t, r, [32, 32], dim=1),
            "block_sparse_moe.output_linear.weight": lambda t, r: halves(t, r, 2),
            "shared_mlp.input_linear.weight": lambda t, r: segments(t, r, [64, 64]),
            "shared_mlp.output_linear.weight": row_halves},
        real_fields={"architectures": ["GraniteMoeHybridForCausalLM"], "num_hidden_layers": 2,
                     "layer_types": ["mamba", "attention"], "num_local_experts": 4},
        hf_mixer=("granitemoehybrid.GraniteMoeHybridConfig",
                  "granitemoehybrid.GraniteMoeHybridMambaLayer")),
    # Phi-3: q/k/v and gate/up packed on disk. qkv_proj = [q 4 heads x 16; k 2 x 16; v 2 x 16],
    # each part halved by heads; gate_up_proj = [gate 128; up 128], each half halved
    Row("phi3", "phi3", "tiny-phi3", ("full_attention",) * 4, case="phi3",
        overrides=dict(num_hidden_layers=4, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        fused=_phi3, pools=TINY_DENSE,
        tp_slices={"self_attn.qkv_proj.weight": lambda t, r: segments(t, r, [64, 32, 32]),
                   "self_attn.o_proj.weight": row_halves,
                   "mlp.gate_up_proj.weight": lambda t, r: segments(t, r, [128, 128]),
                   "mlp.down_proj.weight": row_halves, "input_layernorm.weight": whole}),
    # ZAYA1's release naming (SGLang's zaya): no transformers model writes it, so no bundled
    # tiny config or transformers case; tests/families/test_zaya.py builds and checks it
    Row("zaya", "zaya"),
    # Inkling in its release naming (vLLM's models/inkling; transformers writes no such
    # checkpoint): tested by tests/families/test_inkling.py against tests/inkling_ref.py
    Row("inkling", "inkling_model"),
    Row("inkling_mm", "inkling_mm_model"),
)

BY_FAMILY: dict[str, Row] = {r.family: r for r in ROWS}
#: transformers-built checkpoint cases: case id -> row
BY_CASE: dict[str, Row] = {r.case: r for r in ROWS if r.case}
VARIANTS = [(c, "original") for c in BY_CASE] + \
    [(c, "fused") for c, r in BY_CASE.items() if r.fused_naming]
IDS = [f"{c}-{f}" for c, f in VARIANTS]
#: rows with a bundled tiny config
TINY_ROWS = [r for r in ROWS if r.tiny]


# ---- the rows' checkpoints (session fixtures in tests/conftest.py) ----------------------------

def _build(case: str) -> torch.nn.Module:
    """The case's model, built by transformers (its row's builder or config overrides)."""
    import transformers
    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    row = BY_CASE[case]
    if row.builder is not None:
        return row.builder()
    kw = {**COMMON, "dtype": "float32", **row.overrides}
    config = transformers.AutoConfig.for_model(row.model_type, **kw)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, kw["dtype"]))


def _append_mtp(model_dir: Path, num_layers: int, num_mtp: int) -> None:
    """Add DeepSeek-style MTP layers ``num_layers + k`` (transformers does not save them): a
    copy of the last decoder layer's tensors plus enorm/hnorm/eh_proj/shared_head/embed_tokens,
    in a shard of their own, registered in the index."""
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    ref = reference_tensors(model_dir)
    hidden = ref["model.norm.weight"].shape[0]
    vocab = ref["model.embed_tokens.weight"].shape[0]
    last = f"model.layers.{num_layers - 1}."
    gen = torch.Generator().manual_seed(1)
    for k in range(num_mtp):
        prefix = f"model.layers.{num_layers + k}."
        tensors = {prefix + n[len(last):]: torch.randn(t.shape, generator=gen)
                   for n, t in ref.items() if n.startswith(last)}
        for name, shape in {"enorm.weight": (hidden,), "hnorm.weight": (hidden,),
                            "eh_proj.weight": (hidden, 2 * hidden),
                            "shared_head.norm.weight": (hidden,),
                            "shared_head.head.weight": (vocab, hidden),
                            "embed_tokens.weight": (vocab, hidden)}.items():
            tensors[prefix + name] = torch.randn(shape, generator=gen)
        fname = f"model-mtp-{k}.safetensors"
        save_file(tensors, str(model_dir / fname), metadata={"format": "pt"})
        index["weight_map"].update({n: fname for n in tensors})
    index_path.write_text(json.dumps(index))


class HfCheckpoints:
    """Each case's checkpoint written by transformers' ``save_pretrained`` (both namings where
    the family has two), built on first use, once per session (fixture ``hf_checkpoints``)."""

    def __init__(self, root: Path) -> None:
        self.root, self.dirs = root, {}

    def __call__(self, case: str, fmt: str) -> Path:
        key = (case, fmt)
        if key not in self.dirs:
            model = _build(case)
            row = BY_CASE[case]
            for f in ("original", "fused") if row.fused_naming else ("original",):
                out = self.root / f"{case}-{f}"
                model.save_pretrained(out, save_original_format=f == "original",
                                      max_shard_size="40KB")
                if case == "deepseek_v3":
                    _append_mtp(out, row.overrides["num_hidden_layers"], 2)
                self.dirs[(case, f)] = out
        return self.dirs[key]
