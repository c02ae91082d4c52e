"""Mamba hybrids with the ``model.`` prefix: Jamba (Mamba1 + attention, MoE every other layer),
Bamba (Mamba2 + attention at ``attn_layer_indices``), Falcon-H1 (every layer runs attention and
Mamba2 side by side: kind ``hybrid_attention_mamba2``).

All three end with ``model.final_layernorm``. Jamba places attention where
``i % attn_layer_period == attn_layer_offset`` and experts where
``i % expert_layer_period == expert_layer_offset`` (``num_experts > 1``); its fused naming
(``save_original_format=False``) stacks ``feed_forward.experts.{gate_up,down}_proj``.
"""
from __future__ import annotations

from typing import Mapping

from ..errors import ConfigError
from .base import CheckpointFormat, Family, GlobalRule, Layout, ShardRule, SpecView, cfg, cfg_opt
from .cache_dims import CacheDims
from .blocks import (Mamba2Dims, Shapes, assemble, expert_rules, expert_tensors, int_opt,
                     mamba1_dims, mamba1_rules, mamba1_tensors, mamba2_rules, mamba2_tensors,
                     mlp_biased,
                     num_experts_of)
from .common import attention_rules, attention_tensors, globals_tensors, mlp_rules, vocab_rules
from .fused import QKV, expert_fusions, gate_up, stacked_renames
from .moe import FUSED_MARKER


__all__ = ["FAMILIES", "JAMBA", "BAMBA", "FALCON_H1", "final_layernorm_globals",
           "bamba_mamba2_dims"]


def final_layernorm_globals() -> tuple[GlobalRule, ...]:
    return (GlobalRule.exact("model.embed_tokens.weight", "first", "embed"),
            GlobalRule.exact("model.final_layernorm.weight", "last", "final_norm"),
            GlobalRule.exact("lm_head.weight", "last", "head"))


def _globals_tensors(spec: SpecView) -> Shapes:
    out = globals_tensors(spec)
    out["model.final_layernorm.weight"] = out.pop("model.norm.weight")
    return out


def bamba_mamba2_dims(spec: SpecView) -> Mamba2Dims:
    """Mamba2 sizes from ``mamba_*`` keys (Bamba, GraniteMoeHybrid, Falcon-H1's ``mamba_d_ssm``)."""
    c = spec.config
    d_inner = int_opt(c, "mamba_d_ssm", 0) or int_opt(c, "mamba_expand", 2) * spec.hidden_size
    heads = spec.int("mamba_n_heads")
    auto = c.get("mamba_d_head") in (None, "auto")
    head_dim = d_inner // heads if auto else spec.int("mamba_d_head")
    return Mamba2Dims(d_inner, heads, head_dim, int_opt(c, "mamba_n_groups", 1),
                      spec.int("mamba_d_state"), int_opt(c, "mamba_d_conv", 4))


def _attention(spec: SpecView) -> Shapes:
    bias = bool(spec.config.get("attention_bias", False))
    return attention_tensors(spec, bias=bias, o_bias=bias)


def _ff(spec: SpecView) -> Shapes:
    return mlp_biased(spec.hidden_size, spec.int("intermediate_size"), "feed_forward.",
                      bias=bool(spec.config.get("mlp_bias", False)))


# ---- Jamba ------------------------------------------------------------------------------------

def _jamba_layout(config: Mapping) -> Layout:
    n = int(cfg(config, "num_hidden_layers"))  # type: ignore[arg-type]
    a_period = int_opt(config, "attn_layer_period", 8)
    a_offset = int_opt(config, "attn_layer_offset", 4)
    e_period = int_opt(config, "expert_layer_period", 2)
    e_offset = int_opt(config, "expert_layer_offset", 1)
    if a_offset >= a_period or e_offset >= e_period:
        raise ConfigError("attn/expert layer offset must be smaller than its period")
    experts = num_experts_of(config, "num_experts")
    kinds = tuple("full_attention" if i % a_period == a_offset else "mamba1" for i in range(n))
    moe = frozenset(i for i in range(n) if experts > 1 and i % e_period == e_offset)
    return Layout(n, kinds, moe, experts if moe else 0)


def _jamba_template(spec: SpecView, fused: bool = False) -> Shapes:
    h = spec.hidden_size

    def layer(i: int) -> Shapes:
        out: Shapes = {"input_layernorm.weight": (h,), "pre_ff_layernorm.weight": (h,)}
        out.update(attention_tensors(spec) if spec.layer_kinds[i] == "full_attention"
                   else mamba1_tensors(spec))
        if i in spec.moe_layers:
            out["feed_forward.router.weight"] = (spec.num_experts, h)
            out.update(expert_tensors("feed_forward.experts.", spec.num_experts, h,
                                      spec.int("intermediate_size"), fused=fused))
        else:
            out.update(_ff(spec))
        return out
    return assemble(spec, _globals_tensors(spec), layer)


def _dense_inter(spec: SpecView) -> int:
    return spec.int("intermediate_size")


JAMBA = Family(
    name="jamba", architectures=("JambaForCausalLM",), layout=_jamba_layout,
    model_types=frozenset({"jamba"}), cache_dims=CacheDims(mamba1=mamba1_dims),
    globals=final_layernorm_globals(), expert_pattern=r"feed_forward\.experts\.(\d+)\..+",
    fused_expert_pattern=r"feed_forward\.experts\.(gate_up_proj|down_proj)",
    shard_rules=vocab_rules() + attention_rules() + mamba1_rules(r"mamba\.")
    + expert_rules(r"feed_forward\.experts\.", _dense_inter) + mlp_rules(r"feed_forward\."),
    template=_jamba_template,
    fused_targets=(QKV, gate_up("feed_forward."), *expert_fusions("feed_forward.experts."),
                   *stacked_renames("feed_forward.experts.gate_up_proj",
                                    "feed_forward.experts.down_proj", "feed_forward.experts.")),
    formats=(CheckpointFormat("transformers", FUSED_MARKER,
                              (("template", lambda s: _jamba_template(s, fused=True)),)),))


# ---- Bamba ------------------------------------------------------------------------------------

def _bamba_layout(config: Mapping) -> Layout:
    n = int(cfg(config, "num_hidden_layers"))  # type: ignore[arg-type]
    attn = set(cfg_opt(config, "attn_layer_indices", []) or [])  # type: ignore[arg-type]
    return Layout(n, tuple("full_attention" if i in attn else "mamba2" for i in range(n)))


def _mamba2(spec: SpecView, *, out_bias_key: str = "mamba_proj_bias", norm: bool = True
            ) -> Shapes:
    c = spec.config
    return mamba2_tensors(bamba_mamba2_dims(spec), spec.hidden_size,
                          conv_bias=bool(cfg_opt(c, "mamba_conv_bias", True)),
                          in_bias=bool(cfg_opt(c, "mamba_proj_bias", False)),
                          out_bias=bool(cfg_opt(c, out_bias_key, False)), norm=norm)


def _bamba_template(spec: SpecView) -> Shapes:
    h = spec.hidden_size

    def layer(i: int) -> Shapes:
        out: Shapes = {"input_layernorm.weight": (h,), "pre_ff_layernorm.weight": (h,)}
        out.update(_attention(spec) if spec.layer_kinds[i] == "full_attention" else _mamba2(spec))
        out.update(_ff(spec))
        return out
    return assemble(spec, _globals_tensors(spec), layer)


_MAMBA2_CACHE = CacheDims(mamba2=bamba_mamba2_dims)

_MAMBA_FF_RULES = (vocab_rules() + attention_rules() + mamba2_rules(r"mamba\.", bamba_mamba2_dims)
                   + mlp_rules(r"feed_forward\.")
                   + (ShardRule(r"feed_forward\.(gate_proj|up_proj)\.bias", 0),))

BAMBA = Family(
    name="bamba", architectures=("BambaForCausalLM",), layout=_bamba_layout,
    model_types=frozenset({"bamba"}), cache_dims=_MAMBA2_CACHE,
    globals=final_layernorm_globals(), shard_rules=_MAMBA_FF_RULES, template=_bamba_template,
    fused_targets=(QKV, gate_up("feed_forward.")))


# ---- Falcon-H1 --------------------------------------------------------------------------------

def _falcon_layout(config: Mapping) -> Layout:
    n = int(cfg(config, "num_hidden_layers"))  # type: ignore[arg-type]
    return Layout(n, ("hybrid_attention_mamba2",) * n)


def _falcon_template(spec: SpecView) -> Shapes:
    h = spec.hidden_size
    norm = bool(spec.config.get("mamba_rms_norm", False))

    def layer(i: int) -> Shapes:
        return {"input_layernorm.weight": (h,), "pre_ff_layernorm.weight": (h,),
                **_attention(spec), **_mamba2(spec, out_bias_key="projectors_bias", norm=norm),
                **_ff(spec)}
    return assemble(spec, _globals_tensors(spec), layer)


FALCON_H1 = Family(
    name="falcon_h1", architectures=("FalconH1ForCausalLM",), layout=_falcon_layout,
    model_types=frozenset({"falcon_h1"}), cache_dims=_MAMBA2_CACHE,
    globals=final_layernorm_globals(), shard_rules=_MAMBA_FF_RULES, template=_falcon_template,
    fused_targets=(QKV, gate_up("feed_forward.")))

#: this module's families (found by families/__init__.py)
FAMILIES = (JAMBA, BAMBA, FALCON_H1)
