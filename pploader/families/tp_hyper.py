"""TP rules of hyper-connection models, as the serving engines split them (vLLM 0.32 / SGLang
0.5.23), for the generic family. Keyed by ``model_type``; what a rank holds in the stored
layout:

- **HY-V4** (vLLM ``models/hy_v4``): the hyper-connection mixers
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

Qwen4-exp (vLLM ``models/qwen4_exp``) is not ruled here yet: its hyper-connection modules are
whole on every rank there, but its gated-delta-net layers (``linear_attn.*``) and the
indexer's ``index_qk_proj`` (a fourth shard of vLLM's ``qkv_proj``) have no generic rule, so
it stays refused at TP > 1.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional

from .base import ShardRule
from .hf_meta import MetaModel, Naming

__all__ = ["hyper_tp_rules", "HYPER_TP_TYPES"]

RuleFactory = Callable[[str], ShardRule]
_Builder = Callable[[str, tuple[int, ...], Mapping[str, Any]], Optional[RuleFactory]]


def _whole(pattern: str) -> ShardRule:
    return ShardRule(pattern, None)


def _rows(pattern: str) -> ShardRule:
    return ShardRule(pattern, 0)


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


#: model_type -> the builder of its rules (component or global name, shape, text config)
HYPER_TP_TYPES: dict[str, _Builder] = {
    "hy_v4": _hy_v4,
}


def hyper_tp_rules(meta: MetaModel, naming: Naming) -> dict[str, RuleFactory]:
    """``{component: pattern -> ShardRule}`` for the tensors of ``naming`` (layer components,
    and globals under their full name) whose split the engine serving ``meta.model_type``
    defines (see the module docstring); empty for other model types."""
    build = HYPER_TP_TYPES.get(meta.model_type)
    if build is None:
        return {}
    prefix = re.compile(naming.layer_prefix)
    out: dict[str, RuleFactory] = {}
    for name, shape in naming.template.items():
        m = prefix.match(name)
        comp = name[m.end():] if m else name
        if comp in out:
            continue
        factory = build(comp, tuple(shape), meta.text_config)
        if factory is not None:
            out[comp] = factory
    return out
