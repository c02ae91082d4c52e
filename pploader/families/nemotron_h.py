"""NemotronH: one block per layer (Mamba2, attention, MLP or MoE), named by ``layers_block_type``.

Original naming (as on the Hub, transformers' default): prefix ``backbone.``, embedding
``backbone.embeddings``, final norm ``backbone.norm_f``, per-expert ungated experts
``mixer.experts.N.{up,down}_proj.weight``. Transformers' own naming
(``save_original_format=False``): prefix ``model.`` and fused ``mixer.experts.{up,down}_proj``.

Block types: ``layers_block_type`` (``mamba``/``linear_attention``, ``attention``/
``full_attention``, ``mlp``, ``moe``) or the older ``hybrid_override_pattern`` (``M * - E``).
MLP and MoE blocks have no sequence mixer (layer kind ``mlp``, no cache). MTP blocks
(``num_nextn_predict_layers``) are not written by transformers and not modelled here.
"""
from __future__ import annotations

from typing import Mapping

from ..errors import ConfigError
from .base import CheckpointFormat, Family, GlobalRule, Layout, ShardRule, SpecView, cfg_opt
from .cache_dims import CacheDims
from .blocks import (Mamba2Dims, Shapes, assemble, expert_rules, expert_tensors,
                     kinds_from_names, mamba2_rules, mamba2_tensors, mlp_biased, num_experts_of)
from .common import attention_rules, attention_tensors
from .fused import expert_fusions, qkv, stacked_renames


__all__ = ["FAMILIES", "NEMOTRON_H", "block_types"]

_BLOCKS = {"mamba": "mamba", "linear_attention": "mamba", "M": "mamba",
           "attention": "attention", "full_attention": "attention", "*": "attention",
           "mlp": "mlp", "-": "mlp", "moe": "moe", "E": "moe"}
_KIND = {"mamba": "mamba2", "attention": "full_attention", "mlp": "mlp", "moe": "mlp"}


def block_types(config: Mapping) -> tuple[str, ...]:
    """Normalised block type per layer: mamba | attention | mlp | moe."""
    if config.get("layers_block_type") is not None:
        return kinds_from_names(config["layers_block_type"], _BLOCKS, "layers_block_type")
    pattern = config.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        return kinds_from_names(list(pattern), _BLOCKS, "hybrid_override_pattern")
    raise ConfigError("NemotronH config.json has neither layers_block_type nor "
                      "hybrid_override_pattern")


def _layout(config: Mapping) -> Layout:
    blocks = block_types(config)
    moe = frozenset(i for i, b in enumerate(blocks) if b == "moe")
    experts = num_experts_of(config, "n_routed_experts", "num_local_experts")
    if moe and not experts:
        raise ConfigError("MoE blocks in layers_block_type but no n_routed_experts")
    return Layout(len(blocks), tuple(_KIND[b] for b in blocks), moe, experts if moe else 0)


def _dims(spec: SpecView) -> Mamba2Dims:
    heads, head_dim = spec.int("mamba_num_heads"), spec.int("mamba_head_dim")
    return Mamba2Dims(heads * head_dim, heads, head_dim, spec.int("n_groups"),
                      spec.int("ssm_state_size"), spec.int("conv_kernel"))


def _template(spec: SpecView, prefix: str = "backbone.", fused: bool = False) -> Shapes:
    c, h = spec.config, spec.hidden_size
    blocks = block_types(c)
    mlp_bias = bool(cfg_opt(c, "mlp_bias", False))

    def layer(i: int) -> Shapes:
        out: Shapes = {"norm.weight": (h,)}
        if blocks[i] == "mamba":
            bias = bool(cfg_opt(c, "use_bias", False))
            out.update(mamba2_tensors(_dims(spec), h, in_bias=bias, out_bias=bias, norm=True,
                                      conv_bias=bool(cfg_opt(c, "use_conv_bias", True)),
                                      prefix="mixer."))
        elif blocks[i] == "attention":
            out.update(attention_tensors(spec, prefix="mixer."))
        elif blocks[i] == "mlp":
            out.update(mlp_biased(h, spec.int("intermediate_size"), "mixer.", bias=mlp_bias,
                                  names=("up_proj", "down_proj")))
        else:
            latent = c.get("moe_latent_size")
            width = int(latent) if latent else h  # type: ignore[call-overload]
            out.update({"mixer.gate.weight": (spec.num_experts, h),
                        "mixer.gate.e_score_correction_bias": (spec.num_experts,),
                        **expert_tensors("mixer.experts.", spec.num_experts, width,
                                         spec.int("moe_intermediate_size"), fused=fused,
                                         gated=False, fused_names=("up_proj", "down_proj")),
                        **mlp_biased(h, spec.int("moe_shared_expert_intermediate_size"),
                                     "mixer.shared_experts.", bias=mlp_bias,
                                     names=("up_proj", "down_proj"))})
            if latent:
                out.update(mlp_biased(h, width, "mixer.", bias=mlp_bias,
                                      names=("fc1_latent_proj", "fc2_latent_proj")))
        return out
    glob: Shapes = {prefix + "embeddings.weight": (spec.vocab_size, h),
                    prefix + "norm_f.weight": (h,)}
    if not spec.tie_word_embeddings:
        glob["lm_head.weight"] = (spec.vocab_size, h)
    return assemble(spec, glob, layer, prefix=prefix + "layers.")


def _globals(prefix: str) -> tuple[GlobalRule, ...]:
    """``prefix``: the layer prefix's text (``backbone.`` or ``model.``)."""
    return (GlobalRule.exact(prefix + "embeddings.weight", "first", "embed"),
            GlobalRule.exact(prefix + "norm_f.weight", "last", "final_norm"),
            GlobalRule.exact("lm_head.weight", "last", "head"))


def _rules(prefix: str) -> tuple[ShardRule, ...]:
    return ((ShardRule(prefix + r"embeddings\.weight", 0, pad=True),
             ShardRule(r"lm_head\.weight", 0, pad=True))
            + attention_rules(r"mixer\.") + mamba2_rules(r"mixer\.", _dims)
            + expert_rules(r"mixer\.experts\.", lambda s: s.int("moe_intermediate_size"),
                           gated=False, col="up_proj", fused_col="up_proj")
            + (ShardRule(r"mixer\.(shared_experts\.)?up_proj\.(weight|bias)", 0),
               ShardRule(r"mixer\.(shared_experts\.)?down_proj\.weight", 1)))


NEMOTRON_H = Family(
    name="nemotron_h", architectures=("NemotronHForCausalLM",), layout=_layout,
    model_types=frozenset({"nemotron_h"}), cache_dims=CacheDims(mamba2=_dims),
    layer_prefix=r"backbone\.layers\.(\d+)\.", globals=_globals("backbone."),
    expert_pattern=r"mixer\.experts\.(\d+)\..+",
    fused_expert_pattern=r"mixer\.experts\.(up_proj|down_proj)",
    shard_rules=_rules(r"backbone\."), template=_template,
    # ungated experts: w13_weight holds up alone (vLLM maps up_proj to w1); no MLP fusion
    fused_targets=(qkv("mixer."), *expert_fusions("mixer.experts.", gate=None),
                   *stacked_renames("mixer.experts.up_proj", "mixer.experts.down_proj",
                                    "mixer.experts.")),
    formats=(CheckpointFormat("transformers", r"^model\.", (
        ("layer_prefix", r"model\.layers\.(\d+)\."), ("globals", _globals("model.")),
        ("shard_rules", _rules(r"model\.")),
        ("template", lambda s: _template(s, "model.", fused=True)))),))

#: this module's families (found by families/__init__.py)
FAMILIES = (NEMOTRON_H,)
