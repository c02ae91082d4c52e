"""The generic family: any decoder-only model the installed transformers can build.

``find_family`` falls back to it when no hand-written family names the architecture (those
stay first: they add fused targets, TP rules for packed tensors and cache-pool knowledge).
Everything comes from the model built on the ``meta`` device (``hf_meta.derive``): the layer
prefix, the first-/last-stage tensors (run before / after the decoder layers: a
vision-language model's towers and projector first), experts (per-expert names or stacked 3-D
parameters, expert dim 0), tied weights, and the strict template in each on-disk naming (what
``save_pretrained`` writes; transformers' own with ``save_original_format=False``; for towers
whose prefix transformers strips on load, the older prefixed one, ``vision_tower.vision_model.*``,
``hf_multimodal.py``). MTP layers numbered after the decoder layers (``num_nextn_predict_layers``)
are never read by a stage; ``plan_mtp`` plans one for a draft (their template:
families/generic_mtp.py). A separate ``mtp.*`` module is known and skipped.

TP rules are derived only where a tensor's role is unambiguous (q/k/v/o, gate/up/down by name,
head counts from the config dividing the shape, norms of width hidden or head_dim, routers,
vocab; a vision-language model's encoders and projector replicated, ``hf_multimodal.py``);
any other tensor gets a rule that refuses TP > 1 naming the tensor, never a guess.
Layer kinds: attention (odd projection names included) / MLA / Mamba1 / Mamba2 / gated delta
net / short convolution / lightning attention / RG-LRU / RWKV from the layer's own parameters,
sliding vs full from ``layer_types``; anything else is ``unknown`` (no cache pool).
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from functools import lru_cache
from typing import Any, Mapping, Optional

from .cache_dims import key_projection, param_cache_dims
from .generic_mtp import num_mtp_layers, with_mtp
from .base import CheckpointFormat, Family, GlobalRule, Layout, QuantNaming, SpecView
from .hf_experts import STACKED_FP8_TYPES
from .hf_meta import MetaModel, Naming, derive
from .fused_qkv import kv_aliases
from .generic_tp import shard_rules
from .mxfp4 import is_mxfp4, mxfp4_naming
from .windows import layout_windows

__all__ = ["family_for", "layer_kinds", "GENERIC_NAME"]

GENERIC_NAME = "generic"

_SLIDING = {"sliding_attention", "sliding", "local", "local_attention", "chunked_attention"}
_FULL = {"full_attention", "attention", "global", "global_attention", "full"}


def family_for(config: Mapping[str, Any]) -> Family:
    """The generic Family of ``config`` (built from the meta model; cached per config, so
    equal configs give the same Family value and plans share their memoised work)."""
    return _family_cached(json.dumps(config, sort_keys=True, default=str))


@lru_cache(maxsize=64)
def _family_cached(key: str) -> Family:
    config = json.loads(key)
    meta = derive(config)
    if is_mxfp4(config):  # stacked experts stored as blocks + scales (families/mxfp4.py)
        meta = replace(meta, namings=tuple(mxfp4_naming(n, config) for n in meta.namings))
    return _family(meta)


def _family(meta: MetaModel) -> Family:
    num_mtp = num_mtp_layers(meta.text_config)
    kinds = layer_kinds(meta)
    layout = Layout(meta.num_layers, kinds, meta.moe_layers if meta.num_experts else frozenset(),
                    meta.num_experts, num_mtp)
    text = meta.text_config
    mtp_pattern = r"mtp\..+" if int(text.get("mtp_num_hidden_layers") or 0) > 0 else None
    original = meta.namings[0]
    fields = _naming_fields(original, meta)
    formats = []
    for naming in meta.namings[1:]:
        marker = _marker(naming, original)
        if marker is not None:
            changes = {k: v for k, v in _naming_fields(naming, meta).items() if k != "format"}
            formats.append(CheckpointFormat(naming.name, marker, tuple(changes.items())))
    aliases = {k: v for k, v in {**text, **kv_aliases(meta.model_type, text)}.items()
               if k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                        "vocab_size", "num_hidden_layers", "tie_word_embeddings")}
    # the config class's defaults, as transformers (Gemma-3 ties by default; Falcon's KV heads)
    params = tuple(dict(p) for p in meta.layer_params)
    dims = replace(param_cache_dims(kinds, params, _gqa_from_params(kinds, params)),
                   windows=lambda _spec: layout_windows(text, kinds))  # class-normalised
    return Family(name=f"{GENERIC_NAME}:{meta.model_type}", architectures=(meta.architecture,),
                  layout=lambda _config: layout, mtp_pattern=mtp_pattern, cache_dims=dims,
                  config_defaults=aliases, native_dtypes=_integer_dtypes(meta),
                  formats=tuple(formats), **fields)


def _integer_dtypes(meta: MetaModel) -> dict[str, str]:
    """Tensors the meta model keeps as integers or bools whatever the model dtype (e.g.
    DeepSeek-V4's ``ffn.gate.tid2eid``): name -> safetensors dtype code, for the dtype policy."""
    codes = {"int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
             "bool": "BOOL"}
    return {name: codes[d] for name, d in meta.dtypes.items() if d in codes}


def _naming_fields(naming: Naming, meta: MetaModel) -> dict[str, Any]:
    """The Family fields that change with the naming: prefix, globals, experts, rules (MTP
    layers in the template and rules: families/generic_mtp.py)."""
    naming, mtp_only = with_mtp(naming, meta.text_config, meta.num_layers)
    globals_: list[GlobalRule] = []
    for name in naming.first:
        globals_.append(GlobalRule.exact(name, "first",
                                         "embed" if name == naming.embed else "other"))
    for name in naming.last:
        globals_.append(GlobalRule.exact(name, "last",
                                         "head" if name == naming.head else "other"))
    if naming.head and naming.head not in naming.template:  # tied: the head's name, never read
        globals_.append(GlobalRule.exact(naming.head, "last", "head"))
    template = dict(naming.template)
    head, head_shape = naming.head, naming.head_shape

    def template_of(spec: SpecView) -> Mapping[str, tuple[int, ...]]:
        if head and head not in template and not spec.tie_word_embeddings:
            return {**template, head: head_shape}  # tied config, head stored: read as head
        return template
    fused = "|".join(re.escape(c) for c in naming.fused_components) or None
    stacked = tuple(sorted({c.rpartition(".")[2] for c in naming.fused_components})) \
        if meta.model_type in STACKED_FP8_TYPES else ()
    return dict(layer_prefix=naming.layer_prefix, globals=tuple(globals_),
                quant_naming=QuantNaming(stacked=stacked),
                expert_pattern=naming.expert_pattern, fused_expert_pattern=fused,
                template=template_of, format=naming.name, shared=naming.shared,
                unrun=frozenset(naming.unrun),
                shard_rules=shard_rules(naming, meta, mtp_only))


def _marker(naming: Naming, original: Naming) -> Optional[str]:
    """A regex that hits only names of ``naming`` (a few, enough to recognise it)."""
    only = sorted(set(naming.template) - set(original.template))
    if not only:
        return None
    return "|".join(f"^{re.escape(n)}$" for n in only[:16])


# ---- layer kinds ------------------------------------------------------------------------------

def layer_kinds(meta: MetaModel) -> tuple[str, ...]:
    """Cache kind of every decoder layer, from its parameters and ``layer_types``."""
    types = meta.text_config.get("layer_types")
    if not isinstance(types, (list, tuple)) or len(types) != meta.num_layers:
        types = None
    out = []
    for i, params in enumerate(meta.layer_params):
        out.append(_kind(dict(params), str(types[i]) if types else None))
    return tuple(out)


#: attention whose projections other names spell: BERT-style ``attention.self.{query,key,
#: value}``, CTRL ``Wq/Wk/Wv``, CPM-Ant ``project_q/k/v``, Moshi ``k_proj.linear``, JetMoE's
#: ``kv_proj`` beside its attention experts (K / V sizes: cache_dims.param_gqa_dims)
_ODD_ATTENTION = re.compile(r"(^|\.)(self\.key|Wk|project_k|k_proj\.linear)\.weight$"
                            r"|(^|\.)self_attention\.kv_proj\.weight$")


def _kind(params: Mapping[str, tuple[int, ...]], declared: Optional[str]) -> str:
    a_logs = {n[:-len("A_log")]: s for n, s in params.items() if n.endswith("A_log")}
    a_log = list(a_logs.values())
    # a gated delta rule with separate projections (OLMo-hybrid's linear_attn; Kimi / Bailing
    # delta attention, A_log in its forget_gate): the mixer owns q/k/v, b and the conv; not
    # attention, not Mamba
    mixers = {p[:-len("forget_gate.")] if p.endswith("forget_gate.") else p for p in a_logs}
    split_gdn = [p for p in mixers if all(p + f"{x}.weight" in params for x in (
        "q_proj", "k_proj", "v_proj", "b_proj", "conv1d"))]
    names = {n for n in params if not any(n.startswith(p) for p in split_gdn)}
    leaf = {n.rsplit(".", 2)[-2] if n.count(".") else n for n in names}
    mla = any("kv_a_proj_with_mqa" in n for n in names)
    odd = any(_ODD_ATTENTION.search(n) for n in names) and (
        not any(n.endswith("kv_proj.weight") for n in names)
        or any(".experts." in n and n.startswith("self_attention.") for n in names))
    attention = mla or odd or bool(leaf & {"q_proj", "k_proj", "qkv_proj", "query_key_value",
                                           "Wqkv", "c_attn", "qkv"})
    if any(re.search(r"(^|\.)crossattention\.", n) for n in names):  # a BERT-style decoder
        return "unknown"  # with cross-attention: the encoder's KV is not pooled
    gdn = bool(split_gdn) or bool(a_log) and any(
        re.search(r"in_proj_(qkvz|qkv)\b", n) for n in names)
    # a Mamba mixer owns its conv (Bailing's / Kimi's forget-gate A_log does not: unknown)
    mamba = bool(a_log) and not gdn and any(p + "conv1d.weight" in params for p in a_logs)
    if gdn and not attention:
        return "gdn"
    if mamba and not attention:
        return "mamba1" if len(a_log[0]) == 2 else "mamba2"
    if mamba and attention and len(a_log[0]) in (1, 3):  # 3: Zamba's multi-head Mamba
        return "hybrid_attention_mamba2"
    if mla and not a_log:
        return "mla"
    if {"attention.time_decay", "attention.time_first"} <= names:
        return "rwkv"  # RWKV (v4) time mixing: token shifts + the WKV numerator / denominator
    if any(n.endswith("rg_lru.recurrent_param") for n in names) and "conv_1d" in leaf:
        return "rg_lru"  # RecurrentGemma's recurrent block: conv + real-gated linear recurrence
    if any(n.endswith("slope_rate") for n in names) and "qkv_proj" in leaf:
        return "lightning_attention"  # MiniMax: decayed linear attention, one KV state per head
    if attention and not a_log:
        if declared in _SLIDING:
            return "sliding_attention"
        if declared is None or declared in _FULL:
            return "full_attention"
        return "unknown"
    if not a_log and not attention and _SHORT_CONV <= {n.split(".", 1)[1] for n in names
                                                          if n.startswith("conv.")}:
        return "short_conv"
    if not a_log and (declared is None or declared not in _FULL | _SLIDING) and all(
            re.search(r"(^|\.)(mlp|experts|shared_experts?|norm|\w*layernorm|\w*_norm)\b", n)
            for n in names):
        return "mlp"
    return "unknown"


#: LFM2's gated short convolution block (``conv.*``), its state sized by
#: cache_dims.param_short_conv_dims
_SHORT_CONV = {"conv.weight", "in_proj.weight", "out_proj.weight"}


def _gqa_from_params(kinds: tuple[str, ...],
                     layer_params: tuple[Mapping[str, tuple[int, ...]], ...]) -> bool:
    """Whether K / V come from the first attention layer's own key projection (not the spec's
    ``num_kv_heads`` / ``head_dim``): odd projection names (``_ODD_ATTENTION``), or Zamba's
    hybrid layers, whose attention runs over twice the hidden width."""
    for kind, params in zip(kinds, layer_params):
        if kind in ("full_attention", "sliding_attention", "hybrid_attention_mamba2"):
            found = key_projection(params)
            return found is not None and (not found[0].endswith("k_proj.weight") or any(
                n.endswith("A_log") and len(s) == 3 for n, s in params.items()))
    return False
