"""Qwen hybrids: gated-delta-net (linear attention) + gated full attention.

- Qwen3-Next: ``in_proj_qkvz`` / ``in_proj_ba`` GDN, MoE by ``decoder_sparse_step`` /
  ``mlp_only_layers`` with a gated shared expert.
- Qwen3.5 (dense) and Qwen3.5-MoE (every layer MoE + shared expert): ``in_proj_qkv/z/b/a``.
- Qwen3.5(-MoE) vision-language (``...ForConditionalGeneration``): the language model under
  ``model.language_model.``, its config under ``text_config``, the vision tower
  ``model.visual.*`` placed on the first stage (replicated over TP), ``lm_head`` at the top.

Layer kinds come from ``layer_types`` (``linear_attention`` -> gdn), or, for configs without
it, every ``full_attention_interval``-th layer (default 4) is full attention, as transformers
does.
"""
from __future__ import annotations

from typing import Mapping

from ..errors import ConfigError
from .base import Family, GlobalRule, Layout, SpecView, cfg, cfg_opt
from .cache_dims import CacheDims
from .blocks import (Shapes, assemble, expert_rules, gdn_dims, gdn_rules, gdn_tensors,
                     kinds_from_names, num_experts_of)
from .common import (attention_rules, attention_tensors, globals_tensors, llama_globals,
                     mlp_rules, mlp_tensors, vocab_rules)
from .fused import GATE_UP, QKV, FusedTarget, expert_fusions, gate_up
from .moe import STACKED_3D, qwen_experts, qwen_moe_layers, stacked_scales, transformers_formats


__all__ = ["FAMILIES", "QWEN3_NEXT", "QWEN3_5", "QWEN3_5_MOE", "QWEN3_5_VL", "QWEN3_5_MOE_VL",
           "vision_tensors", "GDN_FUSED"]

_KINDS = {"linear_attention": "gdn", "full_attention": "full_attention"}


def _kinds(config: Mapping, n: int) -> tuple[str, ...]:
    if config.get("layer_types") is not None:
        kinds = kinds_from_names(config["layer_types"], _KINDS, "layer_types")
        if len(kinds) != n:
            raise ConfigError(f"layer_types has {len(kinds)} entries for {n} layers")
        return kinds
    every = int(cfg_opt(config, "full_attention_interval", 4))  # type: ignore[arg-type]
    return tuple("full_attention" if (i + 1) % every == 0 else "gdn" for i in range(n))


def _layout_next(config: Mapping) -> Layout:
    n = int(cfg(config, "num_hidden_layers"))  # type: ignore[arg-type]
    return Layout(n, _kinds(config, n), qwen_moe_layers(config, n),
                  num_experts_of(config, "num_experts", "num_local_experts"))


def _layout_dense(config: Mapping) -> Layout:
    n = int(cfg(config, "num_hidden_layers"))  # type: ignore[arg-type]
    return Layout(n, _kinds(config, n))


def _layout_all_moe(config: Mapping) -> Layout:
    n = int(cfg(config, "num_hidden_layers"))  # type: ignore[arg-type]
    experts = num_experts_of(config, "num_experts", "num_local_experts")
    return Layout(n, _kinds(config, n), frozenset(range(n)) if experts else frozenset(), experts)


def _gated_attention(spec: SpecView) -> Shapes:
    """Full attention with an output gate: q_proj packs [q, gate] per head (2 x head_dim)."""
    bias = bool(spec.config.get("attention_bias", False))
    out = attention_tensors(spec, bias=bias, o_bias=bias, qk_norm=True)
    q = 2 * spec.num_heads * spec.head_dim
    out["self_attn.q_proj.weight"] = (q, spec.hidden_size)
    if bias:
        out["self_attn.q_proj.bias"] = (q,)
    return out


def _shared_expert(spec: SpecView) -> Shapes:
    h = spec.hidden_size
    return {**mlp_tensors(h, spec.int("shared_expert_intermediate_size"),
                          prefix="mlp.shared_expert."),
            "mlp.shared_expert_gate.weight": (1, h)}


def _hybrid_template(spec: SpecView, *, split_proj: bool, fused: bool,
                     prefix: str = "model.", head: str = "lm_head.weight",
                     scales: bool = False) -> Shapes:
    h = spec.hidden_size

    def layer(i: int) -> Shapes:
        out: Shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        if spec.layer_kinds[i] == "gdn":
            out.update(gdn_tensors(spec, split_proj=split_proj))
        else:
            out.update(_gated_attention(spec))
        if i in spec.moe_layers:
            out.update(qwen_experts(spec, fused=fused))
            out.update(_shared_expert(spec))
            if scales:  # transformers' default save of fine-grained FP8 (families/moe.py)
                out.update(stacked_scales(spec))
        else:
            out.update(mlp_tensors(h, spec.int("intermediate_size")))
        return out
    return assemble(spec, globals_tensors(spec, prefix, head), layer, prefix=prefix + "layers.")


def vision_tensors(vision: Mapping, prefix: str = "model.visual.") -> Shapes:
    """The Qwen3.5 vision tower: patch embed, learned positions, ViT blocks, patch merger."""
    hid, inter = int(vision["hidden_size"]), int(vision["intermediate_size"])
    merge = int(vision.get("spatial_merge_size", 2)) ** 2 * hid
    patch, tpatch = int(vision["patch_size"]), int(vision.get("temporal_patch_size", 2))
    out: Shapes = {"patch_embed.proj.weight": (hid, int(vision.get("in_channels", 3)), tpatch,
                                               patch, patch),
                   "patch_embed.proj.bias": (hid,),
                   "pos_embed.weight": (int(vision["num_position_embeddings"]), hid),
                   "merger.norm.weight": (hid,), "merger.norm.bias": (hid,),
                   "merger.linear_fc1.weight": (merge, merge), "merger.linear_fc1.bias": (merge,),
                   "merger.linear_fc2.weight": (int(vision["out_hidden_size"]), merge),
                   "merger.linear_fc2.bias": (int(vision["out_hidden_size"]),)}
    for b in range(int(vision["depth"])):
        out.update({f"blocks.{b}.{k}": s for k, s in {
            "norm1.weight": (hid,), "norm1.bias": (hid,), "norm2.weight": (hid,),
            "norm2.bias": (hid,), "attn.qkv.weight": (3 * hid, hid), "attn.qkv.bias": (3 * hid,),
            "attn.proj.weight": (hid, hid), "attn.proj.bias": (hid,),
            "mlp.linear_fc1.weight": (inter, hid), "mlp.linear_fc1.bias": (inter,),
            "mlp.linear_fc2.weight": (hid, inter), "mlp.linear_fc2.bias": (hid,)}.items()})
    return {prefix + k: s for k, s in out.items()}


def _vl_template(spec: SpecView, *, fused: bool, scales: bool = False) -> Shapes:
    out = _hybrid_template(spec, split_proj=True, fused=fused, prefix="model.language_model.",
                           scales=scales)
    vision = spec.full_config.get("vision_config")
    if not isinstance(vision, Mapping):
        raise ConfigError(f"{spec.architecture} config.json has no vision_config")
    out.update(vision_tensors(vision))
    return out


def _moe_inter(spec: SpecView) -> int:
    return spec.int("moe_intermediate_size")


def _rules(prefix: str = r"model\.") -> tuple:
    return (vocab_rules(prefix) + gdn_rules(r"linear_attn\.") + attention_rules()
            + expert_rules(r"mlp\.experts\.", _moe_inter) + mlp_rules(r"mlp\.shared_expert\.")
            + mlp_rules())


_EXPERTS = dict(expert_pattern=r"mlp\.experts\.(\d+)\..+",
                fused_expert_pattern=r"mlp\.experts\.(gate_up_proj|down_proj)")

#: Official Qwen3-Next / Qwen3.5 checkpoints carry an MTP module (``mtp.fc``, ``mtp.norm``,
#: ``mtp.pre_fc_norm_*``, ``mtp.layers.N.*``) that transformers does not write: known, so strict
#: planning accepts it, and never read by the main model's stages (no draft selection yet).
_MTP = r"mtp\..+"
_GDN_CACHE = CacheDims(gdn=gdn_dims)


#: Qwen3.5's split GDN projections -> vLLM's ``in_proj_qkvz`` ([q; k; v] then z, each as the
#: rank holds it) and ``in_proj_ba`` (b then a). Qwen3-Next stores both already fused.
GDN_FUSED = (FusedTarget("linear_attn.in_proj_qkvz.{p}",
                         ("linear_attn.in_proj_qkv.{p}", "linear_attn.in_proj_z.{p}")),
             FusedTarget("linear_attn.in_proj_ba.{p}",
                         ("linear_attn.in_proj_b.{p}", "linear_attn.in_proj_a.{p}")))
_DENSE_FUSED = (QKV, GATE_UP)
_MOE_FUSED = (QKV, GATE_UP, gate_up("mlp.shared_expert."), *expert_fusions(), *STACKED_3D)


QWEN3_NEXT = Family(
    name="qwen3_next", architectures=("Qwen3NextForCausalLM",), layout=_layout_next,
    model_types=frozenset({"qwen3_next"}), cache_dims=_GDN_CACHE,
    globals=llama_globals(), shard_rules=_rules(), mtp_pattern=_MTP, fused_targets=_MOE_FUSED,
    **_EXPERTS,  # type: ignore[arg-type]
    template=lambda s: _hybrid_template(s, split_proj=False, fused=False),
    formats=transformers_formats(lambda s: _hybrid_template(s, split_proj=False, fused=True),
                   lambda s: _hybrid_template(s, split_proj=False, fused=False, scales=True),
                   _rules()))

QWEN3_5 = Family(
    name="qwen3_5", architectures=("Qwen3_5ForCausalLM",), layout=_layout_dense,
    model_types=frozenset({"qwen3_5_text", "qwen3_5"}), cache_dims=_GDN_CACHE,
    globals=llama_globals(), shard_rules=_rules(), mtp_pattern=_MTP,
    fused_targets=_DENSE_FUSED + GDN_FUSED,
    template=lambda s: _hybrid_template(s, split_proj=True, fused=False))

QWEN3_5_MOE = Family(
    name="qwen3_5_moe", architectures=("Qwen3_5MoeForCausalLM",), layout=_layout_all_moe,
    model_types=frozenset({"qwen3_5_moe_text", "qwen3_5_moe"}), cache_dims=_GDN_CACHE,
    globals=llama_globals(), shard_rules=_rules(), mtp_pattern=_MTP,
    fused_targets=_MOE_FUSED + GDN_FUSED,
    **_EXPERTS,  # type: ignore[arg-type]
    template=lambda s: _hybrid_template(s, split_proj=True, fused=False),
    formats=transformers_formats(lambda s: _hybrid_template(s, split_proj=True, fused=True),
                   lambda s: _hybrid_template(s, split_proj=True, fused=False, scales=True),
                   _rules()))

_VL_PREFIX = r"model\.language_model\."
_VL_GLOBALS = llama_globals("model.language_model.") + (
    GlobalRule(r"model\.visual\..+", "first", "vision"),)

QWEN3_5_VL = Family(
    name="qwen3_5_vl", architectures=("Qwen3_5ForConditionalGeneration",),
    model_types=frozenset({"qwen3_5"}), cache_dims=_GDN_CACHE,
    layout=_layout_dense, layer_prefix=_VL_PREFIX + r"layers\.(\d+)\.", globals=_VL_GLOBALS,
    shard_rules=_rules(_VL_PREFIX), text_config_key="text_config",
    mtp_pattern=_MTP, fused_targets=_DENSE_FUSED + GDN_FUSED,
    template=lambda s: _vl_template(s, fused=False))

QWEN3_5_MOE_VL = Family(
    name="qwen3_5_moe_vl", architectures=("Qwen3_5MoeForConditionalGeneration",),
    model_types=frozenset({"qwen3_5_moe"}), cache_dims=_GDN_CACHE,
    layout=_layout_all_moe, layer_prefix=_VL_PREFIX + r"layers\.(\d+)\.", globals=_VL_GLOBALS,
    shard_rules=_rules(_VL_PREFIX), text_config_key="text_config",
    mtp_pattern=_MTP, fused_targets=_MOE_FUSED + GDN_FUSED,
    **_EXPERTS,  # type: ignore[arg-type]
    template=lambda s: _vl_template(s, fused=False),
    formats=transformers_formats(lambda s: _vl_template(s, fused=True),
                   lambda s: _vl_template(s, fused=False, scales=True), _rules(_VL_PREFIX)))

#: this module's families (found by families/__init__.py)
FAMILIES = (QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE, QWEN3_5_VL, QWEN3_5_MOE_VL)
