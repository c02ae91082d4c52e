"""TP rules of hyper-connection models, as the serving engines split them (vLLM 0.32 / SGLang
0.5.23), for the generic family. Keyed by ``model_type``; what a rank holds in the stored
layout:

- **HY-V4** (vLLM ``models/hy_v4``; SGLang's ``hunyuan_v4`` alike: replicated ``hc_fn``,
  column-parallel ``linear_gate``, sinks narrowed by heads): the hyper-connection mixers
  (``hc_pre.hc_attn_layer.*`` / ``hc_pre.hc_mlp_layer.*`` of every layer, the head's
  ``model.hc_pre.hc_head.*``) are whole on every rank (``ReplicatedLinear`` ``hc_fn``, plain
  ``hc_base`` / ``hc_scale`` parameters). The per-head ``self_attn.learnable_sink_param`` is
  narrowed to the rank's ``heads / tp`` (vLLM's loader slices it like q / k / v); the
  attention gate ``self_attn.linear_gate`` (one row per head, or ``v_head_dim`` rows per head)
  is a ``ColumnParallelLinear``: rows by heads. transformers saves every ``gate_proj`` of the
  model as ``linear_gate`` (its conversion renames ``.linear_gate`` to ``.gate_proj`` on
  load), so ``mlp.linear_gate`` / ``mlp.shared_experts.linear_gate`` are the MLP gates:
  rows split as ``gate_proj`` (``MergedColumnParallelLinear`` ``gate_up_proj``). Its MLA,
  indexer and experts are the generic rules'.
- **Qwen4-exp** (vLLM ``models/qwen4_exp``): each layer's ``attn_hyper_connection`` /
  ``mlp_hyper_connection`` and the final ``model.hyper_connection_mixer`` (``hc_norm``,
  ``input_mix_weight_down`` with ``block_inject_weight``, ``input_mix_weight_up``) are whole
  on every rank (``ReplicatedLinear``, and a ``MergedColumnParallelLinear`` built with
  ``disable_tp``). The attention indexer's ``index_qk_proj`` is whole too: vLLM packs it as
  a fourth shard of ``qkv_proj`` loaded at shard rank 0 with ``tp`` times its width, so every
  rank holds all of it; its ``q_layernorm`` / ``k_layernorm`` are whole. The gated-delta-net
  layers (``linear_attn.*``, Qwen3.5's split layout, vLLM's ``QwenGatedDeltaNetAttention``)
  take the Qwen3.5 family's rules (``blocks.gdn_rules``): ``in_proj_qkv`` and ``conv1d`` per
  q / k / v part by key / value heads, ``in_proj_z`` / ``b`` / ``a``, ``A_log``, ``dt_bias``
  by value heads, ``out_proj`` columns, the norm whole. The gated attention's ``q_proj``
  (``[q, gate]`` per head, ``2 x heads x head_dim`` rows) splits by heads as vLLM's
  ``Qwen3NextAttention`` ``QKVParallelLinear`` does.
- **DeepSeek-V4** (vLLM ``models/deepseek_v4``; SGLang's ``deepseek_v4`` alike: replicated
  ``wq_a`` / ``wkv`` and compressor, column ``wq_b`` / ``wo_a``, row ``wo_b``): the hyper connections (``hc_attn_*`` /
  ``hc_ffn_*`` plain parameters, ``model.hc_head.*``), ``wq_a`` / ``wkv`` (one
  ``disable_tp`` GEMM) with ``q_norm`` / ``norm``, the KV compressors (``ape``, ``wkv`` /
  ``wgate`` built ``disable_tp``, ``norm``; the indexer's too), the indexer's ``wq_b`` /
  ``weights_proj`` (``ReplicatedLinear``) and the router (``ffn.gate.*``, its hash table
  ``tid2eid`` included) are whole. ``wq_b`` rows and ``attn_sink`` (narrowed by the loader)
  split by heads; the grouped output LoRA ``wo_a`` (``ColumnParallelLinear``, rows
  ``o_groups x o_lora_rank``) rows and ``wo_b`` (``RowParallelLinear``) columns by
  ``o_groups`` (fewer groups than TP ranks refused: vLLM's ``n_groups // tp`` would be 0);
  the shared expert's ``w1`` / ``w3`` rows, ``w2`` columns.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Callable, Mapping, Optional

from .base import ShardRule, SpecView
from .blocks import gdn_rules
from .fused_qkv import component_rules
from .hf_meta import MetaModel, Naming

__all__ = ["hyper_tp_rules", "HYPER_TP_TYPES"]

RuleFactory = Callable[[str], ShardRule]
_Builder = Callable[[str, tuple[int, ...], Mapping[str, Any]], Optional[RuleFactory]]


def _whole(pattern: str) -> ShardRule:
    return ShardRule(pattern, None)


def _rows(pattern: str) -> ShardRule:
    return ShardRule(pattern, 0)


def _columns(pattern: str) -> ShardRule:
    return ShardRule(pattern, 1)


def _heads(spec: SpecView) -> int:
    return spec.num_heads


def _by_heads(pattern: str) -> ShardRule:
    return ShardRule(pattern, 0, units=_heads, replicate=False)


#: HY-V4's replicated hyper-connection parameters (a layer's mixers and the head's)
_HY_WHOLE = re.compile(r"(model\.)?hc_pre\.(hc_attn_layer|hc_mlp_layer|hc_head)\.\w+")

#: HY-V4's MLP gates under transformers' save naming (``gate_proj`` stored as ``linear_gate``)
_HY_MLP_GATES = ("mlp.linear_gate.weight", "mlp.shared_experts.linear_gate.weight")


def _hy_v4(comp: str, shape: tuple[int, ...], text: Mapping[str, Any]
           ) -> Optional[RuleFactory]:
    if _HY_WHOLE.fullmatch(comp):
        return _whole
    if comp in ("self_attn.learnable_sink_param", "self_attn.linear_gate.weight") or \
            comp in _HY_MLP_GATES:
        return _rows  # heads (sink: [heads]; gate: heads x 1 or v_head_dim rows) / MLP rows
    return None


#: Qwen4-exp's replicated hyper-connection modules (per layer and the final mixer) and its
#: attention indexer (``index_qk_proj``: vLLM's replicated fourth ``qkv_proj`` shard), the
#: gated-delta-net's per-head-channel norm (``v_head_dim`` wide)
_QWEN4_WHOLE = re.compile(r"(attn_hyper_connection|mlp_hyper_connection|"
                          r"model\.hyper_connection_mixer)\.\w+\.weight|"
                          r"self_attn\.indexer\.(index_qk_proj|q_layernorm|k_layernorm)\.weight|"
                          r"linear_attn\.norm\.weight")

#: Qwen3.5's gated-delta-net components, which Qwen4-exp's linear-attention layers share
_GDN = re.compile(r"linear_attn\.(in_proj_(qkv|z|b|a)\.weight|conv1d\.weight|A_log|dt_bias|"
                  r"out_proj\.weight)")


def _gdn(comp: str) -> RuleFactory:
    """The Qwen3.5 family's rule for one ``linear_attn`` component, under the generic
    family's pattern (its prefix ``linear_attn.`` stays in the component)."""
    tail = comp[len("linear_attn."):]
    rule = next(r for r in gdn_rules("") if re.fullmatch(r.pattern, tail))
    return lambda pattern: replace(rule, pattern=pattern)


def _qwen4_exp(comp: str, shape: tuple[int, ...], text: Mapping[str, Any]
               ) -> Optional[RuleFactory]:
    if _QWEN4_WHOLE.fullmatch(comp):
        return _whole
    if _GDN.fullmatch(comp):
        return _gdn(comp)
    if comp == "self_attn.q_proj.weight":
        heads, head_dim = text.get("num_attention_heads"), text.get("head_dim")
        if isinstance(heads, int) and isinstance(head_dim, int) and \
                shape[:1] == (2 * heads * head_dim,):
            return _by_heads  # [q, gate] per head (Qwen3-Next's gated attention)
    return None


#: DeepSeek-V4's replicated components: the hyper connections (a layer's ``hc_attn_*`` /
#: ``hc_ffn_*``, the head's ``model.hc_head.*``), the latent down-projections and their
#: norms, the KV compressors (attention's and the indexer's), the indexer, the router
_DSV4_WHOLE = re.compile(r"hc_(attn|ffn)_(fn|base|scale)|model\.hc_head\.hc_(fn|base|scale)|"
                         r"attn\.(wq_a|wkv|q_norm|norm)\.weight|"
                         r"attn\.(indexer\.)?compressor\.(ape|(wkv|wgate|norm)\.weight)|"
                         r"attn\.indexer\.(wq_b|weights_proj)\.weight|"
                         r"ffn\.gate\.(weight|bias|tid2eid)")


#: DeepSeek-V4's shared expert (``w1`` / ``w3``: vLLM's ``gate_up_proj``, ``w2``: ``down_proj``;
#: the routed experts' ``w1`` / ``w2`` / ``w3`` are the generic rules')
_DSV4_MLP = re.compile(r"ffn\.shared_experts\.w[123]\.weight")


def _groups(spec: SpecView) -> int:
    return spec.int("o_groups")


def _deepseek_v4(comp: str, shape: tuple[int, ...], text: Mapping[str, Any]
                 ) -> Optional[RuleFactory]:
    if _DSV4_WHOLE.fullmatch(comp):
        return _whole
    if comp in ("attn.wq_b.weight", "attn.attn_sink"):
        return _by_heads
    if _DSV4_MLP.fullmatch(comp):   # w1 / w3 column-, w2 row-parallel
        return _rows if not comp.endswith("w2.weight") else _columns
    if comp == "attn.wo_a.weight":   # [groups x o_lora_rank, heads x head_dim / groups]
        return lambda pattern: ShardRule(pattern, 0, units=_groups, replicate=False)
    if comp == "attn.wo_b.weight":   # [hidden, groups x o_lora_rank]
        return lambda pattern: ShardRule(pattern, 1, units=_groups, replicate=False)
    return None


#: model_type -> the builder of its rules (component or global name, shape, text config)
HYPER_TP_TYPES: dict[str, _Builder] = {
    "hy_v4": _hy_v4, "deepseek_v4": _deepseek_v4,
    "qwen4_exp": _qwen4_exp, "qwen4_exp_text": _qwen4_exp,
}


def hyper_tp_rules(meta: MetaModel, naming: Naming) -> dict[str, RuleFactory]:
    """``{component: pattern -> ShardRule}`` for the tensors of ``naming`` (layer components,
    and globals under their full name) whose split the engine serving ``meta.model_type``
    defines (see the module docstring); empty for other model types."""
    build = HYPER_TP_TYPES.get(meta.model_type)
    return {} if build is None else component_rules(naming, build, meta.text_config,
                                                    globals_too=True)
