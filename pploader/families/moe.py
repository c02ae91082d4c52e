"""MoE transformer families: Qwen3-MoE and Mixtral (both expert layouts).

Original naming (transformers' default ``save_pretrained``, as on the Hub): one tensor per
expert, ``mlp.experts.N.{gate,up,down}_proj.weight`` (Mixtral:
``block_sparse_moe.experts.N.w1/w2/w3.weight``). Transformers' own naming
(``save_original_format=False``): fused 3-D ``mlp.experts.gate_up_proj`` [E, 2I, H] and
``mlp.experts.down_proj`` [E, H, I] (Mixtral's block moves from ``block_sparse_moe`` to ``mlp``).
"""
from __future__ import annotations

from typing import Mapping

from ..errors import ConfigError
from .base import (CheckpointFormat, Family, Layout, QuantNaming, ShardRule, SpecView, cfg,
                   cfg_opt)
from .cache_dims import CacheDims
from .windows import qwen_moe_windows, uniform_windows
from .blocks import Shapes, assemble, expert_rules, expert_tensors, num_experts_of
from .common import (attention_rules, attention_tensors, globals_tensors, llama_globals,
                     mlp_rules, mlp_tensors, vocab_rules)
from .fused import GATE_UP, QKV, expert_fusions, stacked_renames


__all__ = ["FAMILIES", "QWEN3_MOE", "MIXTRAL", "FUSED_MARKER", "STACKED_3D", "STACKED_QUANT", "stacked_scales",
           "transformers_formats", "qwen_moe_layers", "qwen_experts"]

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


def _fp8_blocks(spec: SpecView) -> tuple[int, int]:
    """``weight_block_size`` of a fine-grained FP8 config (stacked scales need blocks)."""
    found = spec.config.get("quantization_config") or spec.full_config.get("quantization_config")
    qc: Mapping = found if isinstance(found, Mapping) else {}
    block = qc.get("weight_block_size")
    if str(qc.get("quant_method", "")).lower() != "fp8" or not isinstance(block, list) \
            or len(block) != 2:
        raise ConfigError("stacked experts.*_scale_inv next to per-expert weights are "
                          "transformers' fine-grained FP8 (quant_method fp8 with "
                          f"weight_block_size); this config has {dict(qc)!r}",
                          file="config.json")
    return int(block[0]), int(block[1])


def stacked_scales(spec: SpecView, prefix: str = "mlp.experts.") -> Shapes:
    """transformers' default save of a fine-grained-FP8 MoE: per-expert fp8 weights, their
    block scales stacked as ``FP8Experts`` holds them (``_alloc_expert_proj``: gate_up
    ``[E, max(ceil(2I/bn), 2), ceil(H/bk)]``, down ``[E, ceil(H/bn), ceil(I/bk)]``)."""
    bn, bk = _fp8_blocks(spec)
    e, h, i = spec.num_experts, spec.hidden_size, spec.int("moe_intermediate_size")
    return {prefix + "gate_up_proj_scale_inv": (e, max(-(-2 * i // bn), 2), -(-h // bk)),
            prefix + "down_proj_scale_inv": (e, -(-h // bn), -(-i // bk))}


def _scale_halves(spec: SpecView) -> tuple[int, ...]:
    rows = spec.int("moe_intermediate_size") // _fp8_blocks(spec)[0]
    return (rows, rows)


#: those stacked scales under TP as vLLM's ``RoutedExperts.load_weights`` takes a stacked
#: tensor (``chunk(2, dim=1)``, each half's rows split per rank; down on dim 2); each rank's
#: per-expert weights are whole blocks (else refused on the weight), so the scales are too
STACKED_SCALE_RULES = (
    ShardRule(r"mlp\.experts\.gate_up_proj_scale_inv", 1, segments=_scale_halves,
              replicate=False),
    ShardRule(r"mlp\.experts\.down_proj_scale_inv", 2, replicate=False))

#: the format of those checkpoints: per-expert weights without companions of their own
SCALES_MARKER = r"\.experts\.(gate_up_proj|down_proj)_scale_inv$"
EXTERNAL_SCALES = ("quant_naming", QuantNaming(
    external=r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$"))


def transformers_formats(fused: object, scaled: object, rules: tuple
                         ) -> tuple[CheckpointFormat, ...]:
    """A MoE family's transformers checkpoint formats: the fused naming (template ``fused``:
    stacked 3-D experts, fine-grained FP8 ones included), and transformers' default save of a
    fine-grained-FP8 model (template ``scaled``: per-expert weights, stacked scales; the
    family's shard ``rules`` after the scales' own)."""
    return (CheckpointFormat("transformers", FUSED_MARKER, (("template", fused), STACKED_QUANT)),
            CheckpointFormat("fp8-stacked-scales", SCALES_MARKER, (
                ("template", scaled), EXTERNAL_SCALES,
                ("fused_expert_pattern", r"mlp\.experts\.(gate_up_proj|down_proj)_scale_inv"),
                ("shard_rules", STACKED_SCALE_RULES + rules))))


def _qwen3_moe_template(spec: SpecView, fused: bool = False, scales: bool = False) -> Shapes:
    h = spec.hidden_size
    bias = bool(spec.config.get("attention_bias", False))

    def layer(i: int) -> Shapes:
        out: Shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                       **attention_tensors(spec, bias=bias, o_bias=bias, qk_norm=True)}
        if i in spec.moe_layers:
            out.update(qwen_experts(spec, fused=fused))
            if scales:
                out.update(stacked_scales(spec))
        else:
            out.update(mlp_tensors(h, spec.int("intermediate_size")))
        return out
    return assemble(spec, globals_tensors(spec), layer)


def _moe_inter(spec: SpecView) -> int:
    return spec.int("moe_intermediate_size")


_QWEN3_MOE_RULES = vocab_rules() + attention_rules() + \
    expert_rules(r"mlp\.experts\.", _moe_inter) + mlp_rules()

QWEN3_MOE = Family(
    name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), layout=_qwen3_moe_layout,
    model_types=frozenset({"qwen3_moe"}), cache_dims=CacheDims(windows=qwen_moe_windows),
    globals=llama_globals(), expert_pattern=r"mlp\.experts\.(\d+)\..+",
    fused_expert_pattern=r"mlp\.experts\.(gate_up_proj|down_proj)",
    shard_rules=_QWEN3_MOE_RULES,
    template=_qwen3_moe_template, fused_targets=(QKV, GATE_UP, *expert_fusions(), *STACKED_3D),
    formats=transformers_formats(lambda s: _qwen3_moe_template(s, fused=True),
                                 lambda s: _qwen3_moe_template(s, scales=True),
                                 _QWEN3_MOE_RULES))


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
