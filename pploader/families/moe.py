"""MoE transformer families: Qwen3-MoE and Mixtral (both expert layouts).

Original naming (transformers' default ``save_pretrained``, as on the Hub): one tensor per
expert, ``mlp.experts.N.{gate,up,down}_proj.weight`` (Mixtral:
``block_sparse_moe.experts.N.w1/w2/w3.weight``). Transformers' own naming
(``save_original_format=False``): fused 3-D ``mlp.experts.gate_up_proj`` [E, 2I, H] and
``mlp.experts.down_proj`` [E, H, I] (Mixtral's block moves from ``block_sparse_moe`` to ``mlp``).
"""
from __future__ import annotations

from typing import Mapping

from .base import CheckpointFormat, Family, Layout, QuantNaming, SpecView, cfg, cfg_opt
from .cache_dims import CacheDims
from .windows import qwen_moe_windows, uniform_windows
from .blocks import Shapes, assemble, expert_rules, expert_tensors, num_experts_of
from .common import (attention_rules, attention_tensors, globals_tensors, llama_globals,
                     mlp_rules, mlp_tensors, vocab_rules)
from .fused import GATE_UP, QKV, expert_fusions, stacked_renames


__all__ = ["FAMILIES", "QWEN3_MOE", "MIXTRAL", "FUSED_MARKER", "STACKED_3D", "STACKED_QUANT", "qwen_moe_layers",
           "qwen_experts"]

#: A transformers-format checkpoint: some layer holds fused 3-D experts.
FUSED_MARKER = r"\.experts\.gate_up_proj$"

#: transformers' naming of quantized stacked experts (``FP8Experts``: ``gate_up_proj`` fp8
#: [E, 2I, H] with ``gate_up_proj_scale_inv`` [E, 2I/bn, H/bk]; families/base.py QuantNaming),
#: for the families whose vLLM model loads them (AutoWeightsLoader -> ``RoutedExperts.
#: load_weights``: Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE). Not Mixtral: vLLM's Mixtral module is
#: ``block_sparse_moe`` with ``w1`` / ``w3`` names, so transformers' ``mlp.experts.*`` naming
#: is not mapped there.
STACKED_QUANT = ("quant_naming", QuantNaming(stacked=("gate_up_proj", "down_proj")))

#: transformers' 3-D ``mlp.experts.gate_up_proj`` / ``down_proj`` -> ``w13_weight`` / ``w2_weight``
#: (same layout), so one stacked-expert module loads both namings.
STACKED_3D = stacked_renames("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def qwen_moe_layers(config: Mapping, num_layers: int) -> frozenset[int]:
    """Qwen MoE placement: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``."""
    experts = num_experts_of(config, "num_experts", "num_local_experts")
    step = int(cfg_opt(config, "decoder_sparse_step", 1))  # type: ignore[arg-type]
    only = set(cfg_opt(config, "mlp_only_layers", []) or [])  # type: ignore[arg-type]
    return frozenset(i for i in range(num_layers)
                     if experts > 0 and i not in only and (i + 1) % step == 0)


def _qwen3_moe_layout(config: Mapping) -> Layout:
    n = int(cfg(config, "num_hidden_layers"))  # type: ignore[arg-type]
    return Layout(n, ("full_attention",) * n, qwen_moe_layers(config, n),
                  num_experts_of(config, "num_experts", "num_local_experts"))


def qwen_experts(spec: SpecView, *, fused: bool, prefix: str = "mlp.") -> Shapes:
    """Router + routed experts of a Qwen MoE block (``mlp.gate`` / ``mlp.experts``)."""
    h = spec.hidden_size
    return {prefix + "gate.weight": (spec.num_experts, h),
            **expert_tensors(prefix + "experts.", spec.num_experts, h,
                             spec.int("moe_intermediate_size"), fused=fused)}


def _qwen3_moe_template(spec: SpecView, fused: bool = False) -> Shapes:
    h = spec.hidden_size
    bias = bool(spec.config.get("attention_bias", False))

    def layer(i: int) -> Shapes:
        out: Shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                       **attention_tensors(spec, bias=bias, o_bias=bias, qk_norm=True)}
        if i in spec.moe_layers:
            out.update(qwen_experts(spec, fused=fused))
        else:
            out.update(mlp_tensors(h, spec.int("intermediate_size")))
        return out
    return assemble(spec, globals_tensors(spec), layer)


def _moe_inter(spec: SpecView) -> int:
    return spec.int("moe_intermediate_size")


QWEN3_MOE = Family(
    name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), layout=_qwen3_moe_layout,
    model_types=frozenset({"qwen3_moe"}), cache_dims=CacheDims(windows=qwen_moe_windows),
    globals=llama_globals(), expert_pattern=r"mlp\.experts\.(\d+)\..+",
    fused_expert_pattern=r"mlp\.experts\.(gate_up_proj|down_proj)",
    shard_rules=vocab_rules() + attention_rules() + expert_rules(r"mlp\.experts\.", _moe_inter)
    + mlp_rules(),
    template=_qwen3_moe_template, fused_targets=(QKV, GATE_UP, *expert_fusions(), *STACKED_3D),
    formats=(CheckpointFormat("transformers", FUSED_MARKER,
                              (("template", lambda s: _qwen3_moe_template(s, fused=True)),
                               STACKED_QUANT)),))


def _mixtral_layout(config: Mapping) -> Layout:
    n = int(cfg(config, "num_hidden_layers"))  # type: ignore[arg-type]
    return Layout(n, ("full_attention",) * n, frozenset(range(n)),
                  num_experts_of(config, "num_local_experts", "num_experts"))


def _mixtral_template(spec: SpecView, fused: bool = False) -> Shapes:
    h, inter = spec.hidden_size, spec.int("intermediate_size")
    block = "mlp." if fused else "block_sparse_moe."

    def layer(i: int) -> Shapes:
        return {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                **attention_tensors(spec), block + "gate.weight": (spec.num_experts, h),
                **expert_tensors(block + "experts.", spec.num_experts, h, inter, fused=fused,
                                 names=("w1", "w3", "w2"))}
    return assemble(spec, globals_tensors(spec), layer)


def _dense_inter(spec: SpecView) -> int:
    return spec.int("intermediate_size")


MIXTRAL = Family(
    name="mixtral", architectures=("MixtralForCausalLM",), layout=_mixtral_layout,
    model_types=frozenset({"mixtral"}), cache_dims=CacheDims(windows=uniform_windows(None)),
    globals=llama_globals(), expert_pattern=r"block_sparse_moe\.experts\.(\d+)\..+",
    fused_expert_pattern=r"mlp\.experts\.(gate_up_proj|down_proj)",
    shard_rules=vocab_rules() + attention_rules()
    + expert_rules(r"block_sparse_moe\.experts\.", _dense_inter, col="w1|w3", row="w2")
    + expert_rules(r"mlp\.experts\.", _dense_inter),
    template=_mixtral_template,
    fused_targets=(QKV, *expert_fusions("block_sparse_moe.experts.", "w1", "w3", "w2"),
                   *STACKED_3D),  # transformers' naming moves the block to ``mlp.``
    formats=(CheckpointFormat("transformers", FUSED_MARKER,
                              (("template", lambda s: _mixtral_template(s, fused=True)),)),))

#: this module's families (found by families/__init__.py)
FAMILIES = (QWEN3_MOE, MIXTRAL)
