"""GraniteMoeHybrid (Granite 4.0-H): Mamba2 or attention per ``layer_types``, every layer a
shared MLP plus (when ``num_local_experts > 0``) a fused-expert MoE block.

Experts are 3-D in both namings: the original (transformers' default, as on the Hub)
``block_sparse_moe.input_linear.weight`` [E, 2I, H] ([gate; up] on dim 1),
``block_sparse_moe.output_linear.weight`` [E, H, I], router ``block_sparse_moe.router.layer``;
transformers' own naming (``save_original_format=False``) ``block_sparse_moe.experts.
{gate_up,down}_proj`` and ``block_sparse_moe.router.weight``.
"""
from __future__ import annotations

from typing import Mapping

from .base import CheckpointFormat, Family, Layout, ShardRule, SpecView, cfg, cfg_opt
from .cache_dims import CacheDims
from .blocks import Shapes, assemble, expert_rules, kinds_from_names, mamba2_rules, mamba2_tensors
from .common import attention_rules, attention_tensors, globals_tensors, llama_globals, vocab_rules
from .mamba import bamba_mamba2_dims
from .fused import QKV, stacked_renames
from .moe import FUSED_MARKER


__all__ = ["FAMILIES", "GRANITE_MOE_HYBRID"]

_KINDS = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "full_attention",
          "full_attention": "full_attention"}


def _layout(config: Mapping) -> Layout:
    n = int(cfg(config, "num_hidden_layers"))  # type: ignore[arg-type]
    types = config.get("layer_types", config.get("layers_block_type"))
    kinds = (kinds_from_names(types, _KINDS, "layer_types") if types is not None
             else ("mamba2",) * n)
    experts = int(cfg_opt(config, "num_local_experts", 0))  # type: ignore[arg-type]
    return Layout(n, kinds, frozenset(range(n)) if experts > 0 else frozenset(), max(experts, 0))


def _template(spec: SpecView, fused: bool = False) -> Shapes:
    c, h = spec.config, spec.hidden_size
    inter, shared = spec.int("intermediate_size"), spec.int("shared_intermediate_size")
    bias = bool(cfg_opt(c, "attention_bias", False))

    def layer(i: int) -> Shapes:
        out: Shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                       "shared_mlp.input_linear.weight": (2 * shared, h),
                       "shared_mlp.output_linear.weight": (h, shared)}
        if spec.layer_kinds[i] == "mamba2":
            out.update(mamba2_tensors(bamba_mamba2_dims(spec), h,
                                      conv_bias=bool(cfg_opt(c, "mamba_conv_bias", True)),
                                      in_bias=bool(cfg_opt(c, "mamba_proj_bias", False)),
                                      out_bias=bool(cfg_opt(c, "mamba_proj_bias", False)),
                                      norm=True))
        else:
            out.update(attention_tensors(spec, bias=bias, o_bias=bias))
        if i in spec.moe_layers:
            e = spec.num_experts
            if fused:
                out.update({"block_sparse_moe.experts.gate_up_proj": (e, 2 * inter, h),
                            "block_sparse_moe.experts.down_proj": (e, h, inter),
                            "block_sparse_moe.router.weight": (e, h)})
            else:
                out.update({"block_sparse_moe.input_linear.weight": (e, 2 * inter, h),
                            "block_sparse_moe.output_linear.weight": (e, h, inter),
                            "block_sparse_moe.router.layer.weight": (e, h)})
        return out
    return assemble(spec, globals_tensors(spec), layer)


def _inter(spec: SpecView) -> int:
    return spec.int("intermediate_size")


def _shared_halves(spec: SpecView) -> tuple[int, int]:
    return (spec.int("shared_intermediate_size"),) * 2


GRANITE_MOE_HYBRID = Family(
    name="granitemoehybrid", architectures=("GraniteMoeHybridForCausalLM",), layout=_layout,
    model_types=frozenset({"granitemoehybrid"}), cache_dims=CacheDims(mamba2=bamba_mamba2_dims),
    globals=llama_globals(),
    fused_expert_pattern=r"block_sparse_moe\.(input_linear\.weight|output_linear\.weight"
                         r"|experts\.gate_up_proj|experts\.down_proj)",
    shard_rules=vocab_rules() + attention_rules() + mamba2_rules(r"mamba\.", bamba_mamba2_dims)
    + expert_rules(r"block_sparse_moe\.", _inter, fused_col="input_linear",
                   fused_row="output_linear")
    + expert_rules(r"block_sparse_moe\.experts\.", _inter)
    + (ShardRule(r"shared_mlp\.input_linear\.weight", 0, segments=_shared_halves),
       ShardRule(r"shared_mlp\.output_linear\.weight", 1)),
    template=_template,
    # experts are 3-D in both namings: renamed to vLLM's block_sparse_moe.experts.w13/w2_weight;
    # shared_mlp.input_linear is [gate; up] on disk already
    fused_targets=(QKV, *stacked_renames("block_sparse_moe.input_linear.weight",
                                         "block_sparse_moe.output_linear.weight",
                                         "block_sparse_moe.experts."),
                   *stacked_renames("block_sparse_moe.experts.gate_up_proj",
                                    "block_sparse_moe.experts.down_proj",
                                    "block_sparse_moe.experts.")),
    formats=(CheckpointFormat("transformers", FUSED_MARKER,
                              (("template", lambda s: _template(s, fused=True)),)),))

#: this module's families (found by families/__init__.py)
FAMILIES = (GRANITE_MOE_HYBRID,)
