"""TP rules of Gemma 4's per-layer inputs (PLE), as vLLM 0.32's ``gemma4.py`` /
``gemma4_mm.py`` build them, and of its MTP assistants, as SGLang 0.5.23's ``gemma4_mtp``
does. (SGLang's ``gemma4_causal`` holds the PLE tensors and ``embed_tokens`` whole; vLLM's
split, followed here, is the one a vLLM load needs.)

Gemma 4 adds to every token a per-layer input: a second embedding ``embed_tokens_per_layer``
``[vocab_size_per_layer_input, layers x hidden_size_per_layer_input]`` and a projection of the
hidden state ``per_layer_model_projection`` ``[layers x per_layer, hidden]``; each decoder layer
gates and projects its slice back (``per_layer_input_gate`` / ``per_layer_projection``). The
engines hold them so (what a rank holds in the stored layout):

- ``embed_tokens_per_layer``: ``VocabParallelEmbedding``: vocabulary rows split (padded, as
  ``embed_tokens``); its vocabulary is ``vocab_size_per_layer_input``, not ``vocab_size``.
- ``per_layer_model_projection``: ``ColumnParallelLinear`` (``gather_output``): rows split
  evenly.
- ``per_layer_projection_norm``, a layer's ``post_per_layer_input_norm`` (``RMSNorm`` of
  ``hidden_size_per_layer_input``), ``per_layer_input_gate`` / ``per_layer_projection``
  (``ReplicatedLinear``) and ``layer_scalar`` (a buffer of one value): whole on every rank.
- the MoE layers' router (``Gemma4Router``): its input ``scale`` ``[hidden]``,
  ``per_expert_scale`` ``[experts]`` and ``proj`` (``GateLinear``): whole on every rank; the
  stacked experts are the generic rules' (``FusedMoE``: each half of ``gate_up_proj``'s rows,
  ``down_proj``'s intermediate dim).

Gemma 3n (vLLM ``gemma3n.py``) has the same per-layer inputs, and besides: the AltUp
projections ``altup_projections.{i}`` / ``altup_unembed_projections.{i}``
(``ColumnParallelLinear``, ``gather_output``): rows split evenly; a layer's ``altup`` block
(``correction_coefs`` / ``prediction_coefs`` / ``modality_router``: ``ReplicatedLinear``,
``router_norm``, ``correct_output_scale``): whole; its LAuReL block: ``laurel.linear_left``
rows (``ColumnParallelLinear``), ``laurel.linear_right`` columns (``RowParallelLinear``),
``post_laurel_norm`` whole.

The MTP assistants (``gemma4_assistant``, ``gemma4_unified_assistant``; SGLang 0.5.23
``gemma4_mtp``, vLLM has no such model) hold every model-level tensor whole: ``pre_projection``
/ ``post_projection`` are ``ReplicatedLinear``, ``embed_tokens`` an ``nn.Embedding`` (SGLang's
``Gemma4TextScaledWordEmbedding``) that the tied head reuses, its logits never gathered
(``skip_all_gather``); so are the centroid head's tensors when present. Their layers are a
Gemma 4 text model's (``q_proj`` only: the K/V are the target's).

Its attention and MLP are the generic rules' (q by heads, k / v by KV heads with each layer's
own head_dim, gate / up rows, down columns), except where layers' KV heads differ
(``per_layer_config``: the full-attention layers' ``num_global_key_value_heads``): k / v then
split in the heads every layer's count divides into, and a TP above that is refused (vLLM
would replicate a head of the layers with fewer KV heads than TP; one rule for all layers
cannot say which).
"""
from __future__ import annotations

import math
import re
from functools import partial
from typing import Any, Callable, Mapping, Optional

from .base import ShardRule, SpecView
from .hf_meta import MetaModel, Naming

__all__ = ["gemma_tp_rules", "GEMMA_TP_TYPES"]

RuleFactory = Callable[[str], ShardRule]

#: the model types whose per-layer-input tensors are ruled here
GEMMA_TP_TYPES = frozenset({"gemma4", "gemma4_text", "gemma4_assistant",
                            "gemma4_unified_assistant", "gemma3n_text"})

#: Gemma 4's MTP drafters, served by SGLang's ``gemma4_mtp`` only: every model-level tensor whole
_ASSISTANTS = frozenset({"gemma4_assistant", "gemma4_unified_assistant"})

#: layer components held whole on every rank (ReplicatedLinear, RMSNorm, a scalar buffer)
_LAYER_WHOLE = frozenset({"per_layer_input_gate.weight", "per_layer_projection.weight",
                          "post_per_layer_input_norm.weight", "layer_scalar",
                          "router.scale", "router.per_expert_scale", "router.proj.weight",
                          "altup.correct_output_scale", "altup.correction_coefs.weight",
                          "altup.prediction_coefs.weight", "altup.modality_router.weight",
                          "altup.router_norm.weight", "laurel.post_laurel_norm.weight"})

#: Gemma 3n's LAuReL block: ``linear_left`` column-parallel (rows), ``linear_right``
#: row-parallel (columns)
_LAYER_SPLIT = {"laurel.linear_left.weight": 0, "laurel.linear_right.weight": 1}

#: Gemma 3n's AltUp projections (``ColumnParallelLinear``, ``gather_output``): rows
_ALTUP = re.compile(r"(.*\.)?altup_(unembed_)?projections\.\d+\.weight")

_KV = frozenset({"self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.k_proj.bias", "self_attn.v_proj.bias"})


def _whole(pattern: str) -> ShardRule:
    return ShardRule(pattern, None)


def _split(pattern: str, dim: int) -> ShardRule:
    return ShardRule(pattern, dim)


def _rows(pattern: str) -> ShardRule:
    return ShardRule(pattern, 0)


def _vocab_rows(pattern: str) -> ShardRule:
    return ShardRule(pattern, 0, pad=True)


def _global(name: str, shape: tuple[int, ...], text: Mapping[str, Any]
            ) -> Optional[RuleFactory]:
    """The rule of a model-level PLE tensor (any prefix: ``model.`` or
    ``model.language_model.``); None for others. A shape that is not the config's is left to
    the generic rules (which refuse it)."""
    per_layer, layers = text.get("hidden_size_per_layer_input"), text.get("num_hidden_layers")
    hidden = text.get("hidden_size")
    if not isinstance(per_layer, int) or not isinstance(layers, int) or not per_layer:
        return None
    vocab = text.get("vocab_size_per_layer_input", text.get("vocab_size"))
    if name.endswith(".embed_tokens_per_layer.weight"):
        return _vocab_rows if shape == (vocab, layers * per_layer) else None
    if name.endswith(".per_layer_model_projection.weight"):
        return _rows if shape == (layers * per_layer, hidden) else None
    if name.endswith(".per_layer_projection_norm.weight"):
        return _whole if shape == (per_layer,) else None
    if _ALTUP.fullmatch(name):
        return _rows if shape == (hidden, hidden) else None
    return None


def _kv_counts(text: Mapping[str, Any]) -> set[int]:
    """Every layer's KV heads: ``num_key_value_heads`` and ``per_layer_config``'s overrides
    (Gemma 4's full-attention layers: ``num_global_key_value_heads``)."""
    counts = {text.get("num_key_value_heads") or text.get("num_attention_heads")}
    per_layer = text.get("per_layer_config")
    if isinstance(per_layer, Mapping):
        counts |= {v["num_key_value_heads"] for v in per_layer.values()
                   if isinstance(v, Mapping) and v.get("num_key_value_heads")}
    return {c for c in counts if isinstance(c, int) and c > 0}


def _kv_units(units: int, _spec: SpecView) -> int:
    return units


def _kv_rule(units: int) -> RuleFactory:
    """k / v rows of layers whose KV heads differ: the heads every layer's count divides
    into (their gcd), none replicated: vLLM splits each layer's own heads (replicating a head
    only where that layer has fewer than TP), so a TP above the gcd is refused, not guessed."""
    return lambda pattern: ShardRule(pattern, 0, units=partial(_kv_units, units),
                                     replicate=False)


def gemma_tp_rules(meta: MetaModel, naming: Naming) -> dict[str, RuleFactory]:
    """``{component or global name: pattern -> ShardRule}`` of the Gemma 4 / Gemma 3n tensors
    the engines split their own way (the module docstring); empty for other model types."""
    if meta.model_type not in GEMMA_TP_TYPES:
        return {}
    text = meta.text_config
    prefix = re.compile(naming.layer_prefix)
    out: dict[str, RuleFactory] = {}
    kv = _kv_counts(text)
    for name, shape in naming.template.items():
        m = prefix.match(name)
        if m is None:
            rule = _whole if meta.model_type in _ASSISTANTS else \
                _global(name, tuple(shape), text)
            if rule is not None:
                out[name] = rule
            continue
        comp = name[m.end():]
        if comp in _LAYER_WHOLE:
            out[comp] = _whole
        elif comp in _LAYER_SPLIT:
            out[comp] = partial(_split, dim=_LAYER_SPLIT[comp])
        elif len(kv) > 1 and comp in _KV:
            out[comp] = _kv_rule(math.gcd(*kv))
    return out
