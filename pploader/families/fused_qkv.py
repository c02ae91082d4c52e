"""TP rules for fused QKV projections and per-model names, as the serving engines split them.

The generic family refuses what it cannot read from a tensor's name alone; these layouts need
the model: the same name means different things (``mlp.c_fc`` is a transposed ``Conv1D`` in
GPT-2 and an ``nn.Linear`` in StarCoder2 / GPT-BigCode), and a fused ``query_key_value``
orders its rows per model. Keyed by ``model_type``; each split is the engine's loader's
(vLLM 0.32 / SGLang 0.5.23; what a rank holds in the stored layout):

- **GPT-2, gpt-sw3** (vLLM ``gpt2.py``: ``Conv1D`` weights transposed on load, so the stored
  layout is ``[in, out]``): ``attn.c_attn`` ``[H, 3H]`` is q | k | v on dim 1, each split by
  heads (``QKVParallelLinear``); its bias likewise on dim 0; ``attn.c_proj`` rows by heads
  (row-parallel on the transposed layout), ``mlp.c_fc`` columns (bias rows), ``mlp.c_proj``
  rows; row-parallel biases whole.
- **GPT-BigCode** (SGLang ``gpt_bigcode.py``, ``nn.Linear``): ``c_attn`` rows are q ``[H]``
  then k and v of ``kv`` heads each (1 with ``multi_query``, else all heads), q by heads and
  k / v by KV heads, a single KV head replicated on every rank; ``c_proj`` columns by heads;
  ``mlp.c_fc`` rows, ``mlp.c_proj`` columns.
- **Bloom** (vLLM ``bloom.py``), **Persimmon** (SGLang ``persimmon.py``), **GPT-NeoX** (vLLM's
  transformers backend, ``colwise``): ``query_key_value`` rows are ``[heads, 3, head_dim]``
  (the engines reorder to q | k | v after loading), so a rank's heads are one contiguous block
  of whole heads.
- **Falcon** (vLLM ``falcon.py``): rows ``[kv, q_per_kv + 2, head_dim]`` with ``kv`` =
  ``num_kv_heads`` (new decoder architecture), 1 (``multi_query``) or the heads: with one KV
  head, q by heads and k / v replicated; else whole KV groups a rank (a group holds query
  heads, so fewer groups than TP ranks is refused: vLLM would split inside a group, which a
  rule of whole units cannot express).
- **CodeGen** (vLLM's transformers backend, ``colwise``): ``qkv_proj`` rows are transformers'
  4 blocks (``mp_num``) of q | v | k; a rank takes whole blocks (TP must divide 4: the model's
  forward views its rows as whole blocks).
- **StarCoder2** (SGLang ``starcoder2.py``): ``mlp.c_fc`` rows (bias too), ``mlp.c_proj``
  columns (bias whole).
- **EXAONE** (vLLM ``exaone.py``): ``mlp.c_fc_0`` / ``c_fc_1`` rows (``gate_up_proj``),
  ``mlp.c_proj`` columns; its ``attn.attention.*`` projections are the generic rules'.
- **LFM2, LFM2-MoE** (vLLM ``lfm2.py`` / ``lfm2_moe.py``): the dense ``feed_forward.w1`` /
  ``w3`` rows (``w13``), ``w2`` columns (their short-convolution mixers are not ruled here).
- **MiMo-V2-Flash** (vLLM ``mimo_v2.py``) and **Beam** (SGLang ``beam.py``): the per-head
  vectors ``self_attn.attention_sink_bias`` / ``self_attn.gate_bias``, ``heads / tp`` a rank.
- **Sarvam-MoE** (vLLM ``sarvam.py`` = Bailing-MoE's attention): ``attention.query_key_value``
  rows q | k | v, q by heads, k / v by KV heads; ``attention.dense`` is the generic rules'.
- **DBRX** (vLLM / SGLang ``dbrx.py``): ``norm_attn_norm.attn.Wqkv`` rows q | k | v
  (``QKVParallelLinear``), q by ``n_heads``, k / v by ``attn_config.kv_n_heads`` (a KV head
  replicated on ``tp / kv`` ranks when fewer than TP); ``out_proj`` and the stacked experts
  are the generic rules'.
- **Laguna** (vLLM / SGLang ``laguna.py``): a layer's query heads are
  ``num_attention_heads_per_layer[i]`` (not ``num_attention_heads``); ``q_proj`` rows and
  ``o_proj`` columns by those heads, and the attention gate ``self_attn.g_proj`` (one row per
  head, or per head channel; ``ColumnParallelLinear``) rows likewise. Each layer's rows split
  evenly, so the rule's units are the heads every layer's count divides into (their gcd): a
  TP that does not divide some layer's heads is refused, as vLLM asserts. The router's
  ``mlp.experts.e_score_correction_bias`` (stored under the experts) is replicated.
- **dots3 Note** (vLLM ``models/dots3_note``): the attention gate ``self_attn.g_proj``, one
  row per head (``headwise``, the only kind transformers' model builds), is vLLM's
  ``ReplicatedLinear``: whole on every rank (SGLang's ``dots3`` narrows it to the rank's
  heads; this follows vLLM, whose loader needs the whole gate; vLLM's elementwise gate,
  ``heads x v_head_dim`` rows, is refused: transformers has no such layout). ``k_rope_only_layernorm`` (``RMSNorm`` of
  ``qk_rope_head_dim``) is whole; its MLA projections and indexer are the generic rules'.
- **LongCat-Flash** (vLLM / SGLang ``longcat_flash.py``): a layer's two attention and MLP
  sub-blocks are numbered (``input_layernorm.{0,1}``, ``post_attention_layernorm.{0,1}``:
  whole ``RMSNorm``s; ``self_attn.{i}`` MLA and ``mlps.{i}`` the generic rules'); the router
  ``mlp.router.classifier`` and its ``e_score_correction_bias`` (rows: the routed plus the
  zero experts) are whole (``GateLinear``, a plain parameter).

MPT's ``Wqkv`` stays refused: vLLM removed MPT (0.28.0) and SGLang has no MPT model.
"""
from __future__ import annotations

import math
import re
from functools import partial
from typing import Any, Callable, Mapping, Optional

from ..errors import PlanError
from .base import ShardRule, SpecView
from .hf_meta import MetaModel, Naming
from .mxfp4 import engine_tp_rules

__all__ = ["engine_rules", "fused_tp_rules", "component_rules", "kv_aliases", "FUSED_TP_TYPES"]

RuleFactory = Callable[[str], ShardRule]
_Builder = Callable[[str, tuple[int, ...], Mapping[str, Any]], Optional[RuleFactory]]


def _value(values: Any, _spec: SpecView) -> Any:
    return values


def _split(pattern: str, dim: Optional[int], segments: Optional[tuple[int, ...]] = None,
           units: Any = None, replicate: bool = True) -> ShardRule:
    return ShardRule(pattern, dim, segments=None if segments is None else partial(_value, segments),
                     units=None if units is None else partial(_value, units), replicate=replicate)


def _refusal(reason: str, spec: SpecView) -> tuple[int, ...]:
    raise PlanError(f"tensor parallelism refused for {spec.architecture}: {reason}")


def _refuse(comp: str, reason: str) -> RuleFactory:
    """A rule that refuses TP > 1 (plan_rank names the tensor)."""
    return lambda pattern: ShardRule(pattern, 0, segments=partial(_refusal, f"{comp}: {reason}"))


def _rule(dim: Optional[int], segments: Optional[tuple[int, ...]] = None, units: Any = None,
          replicate: bool = True) -> RuleFactory:
    return partial(_split, dim=dim, segments=segments, units=units, replicate=replicate)


def _int(text: Mapping[str, Any], *keys: str) -> Optional[int]:
    for key in keys:
        value = text.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _geometry(text: Mapping[str, Any]) -> tuple[int, int, int]:
    """``(hidden, heads, head_dim)`` under any of these models' config names (0 if absent)."""
    hidden = _int(text, "hidden_size", "n_embd", "d_model") or 0
    heads = _int(text, "num_attention_heads", "n_head") or 0
    head_dim = _int(text, "head_dim") or (hidden // heads if heads else 0)
    return hidden, heads, head_dim


def _leaf(comp: str) -> tuple[str, str]:
    """``(module path, weight | bias)`` of a layer component."""
    module, _, kind = comp.rpartition(".")
    return module, kind


def _gpt2(comp: str, shape: tuple[int, ...], text: Mapping[str, Any]) -> Optional[RuleFactory]:
    """GPT-2's ``Conv1D`` layers, stored ``[in, out]`` (vLLM transposes them on load)."""
    module, kind = _leaf(comp)
    hidden, heads, _ = _geometry(text)
    if module == "attn.c_attn":
        want = (hidden, 3 * hidden) if kind == "weight" else (3 * hidden,)
        if shape != want or not heads:
            return _refuse(comp, f"{list(shape)} is not q | k | v of {heads} heads x "
                           f"hidden {hidden} (expected {list(want)})")
        return _rule(len(shape) - 1, (hidden,) * 3, heads)
    if module == "attn.c_proj":
        return _rule(None) if kind == "bias" else _rule(0, units=heads)
    if module == "mlp.c_fc":
        return _rule(len(shape) - 1)
    if module == "mlp.c_proj":
        return _rule(None) if kind == "bias" else _rule(0)
    return None


def _linear_mlp(comp: str, columns: tuple[str, ...], rows: tuple[str, ...]
                ) -> Optional[RuleFactory]:
    """An ``nn.Linear`` MLP: ``columns`` split their output rows (bias too), ``rows`` their
    input columns (bias whole)."""
    module, kind = _leaf(comp)
    if module in columns:
        return _rule(0)
    if module in rows:
        return _rule(None) if kind == "bias" else _rule(1)
    return None


def _qkv_rows(comp: str, shape: tuple[int, ...], hidden: int, heads: int, kv: int,
              head_dim: int) -> RuleFactory:
    """q | k | v concatenated on dim 0 (``nn.Linear``): q by heads, k and v by KV heads."""
    q, k = heads * head_dim, kv * head_dim
    if not heads or not kv or not shape or shape[0] != q + 2 * k or \
            len(shape) == 2 and shape[1] != hidden:
        return _refuse(comp, f"{list(shape)} is not q | k | v of {heads} heads and {kv} KV "
                       f"heads of {head_dim} (hidden {hidden})")
    return _rule(0, (q, k, k), (heads, kv, kv))


def _gpt_bigcode(comp: str, shape: tuple[int, ...], text: Mapping[str, Any]
                 ) -> Optional[RuleFactory]:
    module, kind = _leaf(comp)
    hidden, heads, head_dim = _geometry(text)
    if module == "attn.c_attn":
        kv = _kv_heads("gpt_bigcode", text) or heads
        return _qkv_rows(comp, shape, hidden, heads, kv, head_dim)
    if module == "attn.c_proj":
        return _rule(None) if kind == "bias" else _rule(1, units=heads)
    return _linear_mlp(comp, ("mlp.c_fc",), ("mlp.c_proj",))


def _per_head(comp: str, shape: tuple[int, ...], text: Mapping[str, Any]
              ) -> Optional[RuleFactory]:
    """``query_key_value`` stored ``[heads, 3, head_dim]`` (Bloom, Persimmon, GPT-NeoX)."""
    module, _ = _leaf(comp)
    if module.rpartition(".")[2] != "query_key_value":
        return None
    hidden, heads, head_dim = _geometry(text)
    if not heads or not shape or shape[0] != 3 * heads * head_dim:
        return _refuse(comp, f"{list(shape)} is not [heads {heads}, 3, head_dim {head_dim}]")
    return _rule(0, units=heads)


def _kv_heads(model_type: str, text: Mapping[str, Any]) -> Optional[int]:
    """The KV heads of a fused qkv whose config does not say ``num_key_value_heads``: Falcon's
    ``num_kv_heads`` (new decoder architecture), else 1 with ``multi_query`` (also
    GPT-BigCode), else every head; None for other model types."""
    heads = _geometry(text)[1]
    if model_type == "falcon" and text.get("new_decoder_architecture"):
        return _int(text, "num_kv_heads") or heads
    if model_type in ("falcon", "gpt_bigcode"):
        return 1 if text.get("multi_query", True) else heads
    return None


def kv_aliases(model_type: str, text: Mapping[str, Any]) -> dict[str, int]:
    """``{"num_key_value_heads": n}`` for the models whose config spells the KV heads its own
    way (Falcon, GPT-BigCode): the spec's KV heads, for the TP head check and the KV cache
    pools (a config.json stating ``num_key_value_heads`` still wins)."""
    kv = _kv_heads(model_type, text)
    return {} if kv is None else {"num_key_value_heads": kv}


def _falcon(comp: str, shape: tuple[int, ...], text: Mapping[str, Any]
            ) -> Optional[RuleFactory]:
    module, _ = _leaf(comp)
    if module.rpartition(".")[2] != "query_key_value":
        return None
    hidden, heads, head_dim = _geometry(text)
    kv = _kv_heads("falcon", text) or heads
    if not heads or not kv or heads % kv or not shape or \
            shape[0] != (heads + 2 * kv) * head_dim:
        return _refuse(comp, f"{list(shape)} is not [{kv} KV groups, {heads // max(kv, 1)} + 2 "
                       f"heads, head_dim {head_dim}]")
    if kv == 1:  # [q heads..., k, v]: q by heads, the one KV head on every rank
        return _rule(0, (heads * head_dim, head_dim, head_dim), (heads, 1, 1))
    return _rule(0, units=kv, replicate=False)


def _codegen(comp: str, shape: tuple[int, ...], text: Mapping[str, Any]
             ) -> Optional[RuleFactory]:
    module, _ = _leaf(comp)
    if module != "attn.qkv_proj":
        return None
    hidden, heads, _ = _geometry(text)
    blocks = 4  # transformers' CodeGenAttention.mp_num (fixed in the model, not the config)
    if not shape or shape[0] != 3 * hidden or heads % blocks:
        return _refuse(comp, f"{list(shape)} is not {blocks} blocks of q | v | k (hidden "
                       f"{hidden}, {heads} heads)")
    return _rule(0, units=blocks, replicate=False)


def _sarvam(comp: str, shape: tuple[int, ...], text: Mapping[str, Any]
            ) -> Optional[RuleFactory]:
    module, _ = _leaf(comp)
    if module != "attention.query_key_value":
        return None
    hidden, heads, head_dim = _geometry(text)
    kv = _int(text, "num_key_value_heads") or heads
    return _qkv_rows(comp, shape, hidden, heads, kv, head_dim)


def _dbrx(comp: str, shape: tuple[int, ...], text: Mapping[str, Any]) -> Optional[RuleFactory]:
    """DBRX's fused ``Wqkv``: heads from ``n_heads``, KV heads from ``attn_config.kv_n_heads``
    (vLLM's dbrx.py reads these, not the top-level ``num_key_value_heads``)."""
    if comp != "norm_attn_norm.attn.Wqkv.weight":
        return None
    hidden, heads = _int(text, "d_model") or 0, _int(text, "n_heads") or 0
    attn = text.get("attn_config")
    kv = _int(attn, "kv_n_heads") if isinstance(attn, Mapping) else None
    return _qkv_rows(comp, shape, hidden, heads, kv or heads, hidden // heads if heads else 0)


def _laguna(comp: str, shape: tuple[int, ...], text: Mapping[str, Any]
            ) -> Optional[RuleFactory]:
    """Laguna's per-layer query heads: q_proj / g_proj rows and o_proj columns, ``1 / tp`` of
    every layer's heads a rank (units: the gcd of the layers' head counts)."""
    if comp == "mlp.experts.e_score_correction_bias":
        return _rule(None)  # the router's score correction, stored under the experts
    module, kind = _leaf(comp)
    if kind != "weight" or module not in ("self_attn.q_proj", "self_attn.g_proj",
                                          "self_attn.o_proj"):
        return None
    per_layer = text.get("num_attention_heads_per_layer")
    counts = [h for h in per_layer if isinstance(h, int)] if isinstance(per_layer, list) \
        else [_int(text, "num_attention_heads") or 0]
    heads = math.gcd(*counts) if counts else 0
    if not heads:
        return _refuse(comp, "the config has no per-layer query head counts")
    return _rule(1 if module == "self_attn.o_proj" else 0, units=heads, replicate=False)


def _dots3(comp: str, shape: tuple[int, ...], text: Mapping[str, Any]
           ) -> Optional[RuleFactory]:
    """dots3 Note's headwise attention gate and its RoPE key norm, both replicated as vLLM's
    dots3_note builds them."""
    if comp == "self_attn.k_rope_only_layernorm.weight":
        return _rule(None)
    if comp != "self_attn.g_proj.weight":
        return None
    heads = _int(text, "num_attention_heads") or 0
    if heads and shape[:1] == (heads,):
        return _rule(None)   # headwise: vLLM's ReplicatedLinear
    return _refuse(comp, f"{list(shape)} is not one row per head ({heads}): not a headwise "
                   "gate")


#: LongCat-Flash's replicated components: the numbered norms and the router (rows: routed plus
#: zero experts, which the generic router check, counting routed experts only, misses)
_LONGCAT_WHOLE = re.compile(r"(input|post_attention)_layernorm\.\d+\.weight|"
                            r"mlp\.router\.(classifier\.weight|e_score_correction_bias)")


def _head_vector(comp: str, name: str) -> Optional[RuleFactory]:
    """A vector of one value per query head of its layer (``[heads]``), split as the engine
    narrows it: ``heads / tp`` a rank (vLLM's MiMo-V2 ``attention_sink_bias``, SGLang's Beam
    ``load_gate_bias``); the layer's own length, as its heads may differ from the config's."""
    return _rule(0) if comp == name else None


#: LFM2's dense MLP: w1 (gate) and w3 (up) column-parallel, w2 row-parallel (vLLM lfm2.py /
#: lfm2_moe.py load w1 / w3 into ``w13``, a MergedColumnParallelLinear; routed experts'
#: ``experts.{e}.w1`` stay the generic rules')
_LFM2_COLUMNS = ("feed_forward.w1", "feed_forward.w3")

#: model_type -> the builder of its engine rules (component, shape, text config -> rule)
FUSED_TP_TYPES: dict[str, _Builder] = {
    "gpt2": _gpt2, "gpt-sw3": _gpt2, "gpt_bigcode": _gpt_bigcode,
    "bloom": _per_head, "persimmon": _per_head, "gpt_neox": _per_head,
    "falcon": _falcon, "codegen": _codegen, "sarvam_moe": _sarvam,
    "starcoder2": lambda comp, _s, _t: _linear_mlp(comp, ("mlp.c_fc",), ("mlp.c_proj",)),
    "exaone": lambda comp, _s, _t: _linear_mlp(comp, ("mlp.c_fc_0", "mlp.c_fc_1"),
                                               ("mlp.c_proj",)),
    "mimo_v2_flash": lambda comp, _s, _t: _head_vector(comp, "self_attn.attention_sink_bias"),
    "beam": lambda comp, _s, _t: _head_vector(comp, "self_attn.gate_bias"),
    "dbrx": _dbrx,
    "laguna": _laguna,
    "dots3_note": _dots3, "dots3_note_text": _dots3,
    "longcat_flash": lambda comp, _s, _t: _rule(None) if _LONGCAT_WHOLE.fullmatch(comp) else None,
    "lfm2": lambda comp, _s, _t: _linear_mlp(comp, _LFM2_COLUMNS, ("feed_forward.w2",)),
    "lfm2_moe": lambda comp, _s, _t: _linear_mlp(comp, _LFM2_COLUMNS, ("feed_forward.w2",)),
}


def fused_tp_rules(model_type: str, naming: Naming, text: Mapping[str, Any]
                   ) -> dict[str, RuleFactory]:
    """``{component: pattern -> ShardRule}`` for the layer tensors of ``naming`` whose split
    the engine serving ``model_type`` defines (see the module docstring); empty for other
    model types, whose rules stay the generic family's."""
    build = FUSED_TP_TYPES.get(model_type)
    return {} if build is None else component_rules(naming, build, text)


def component_rules(naming: Naming, build: _Builder, text: Mapping[str, Any], *,
                    globals_too: bool = False) -> dict[str, RuleFactory]:
    """``build(component, shape, text)`` over each distinct layer component of ``naming``
    (and, with ``globals_too``, each non-layer tensor under its full name), the rules it
    gives kept: the walk every per-model-type rule table shares."""
    prefix = re.compile(naming.layer_prefix)
    out: dict[str, RuleFactory] = {}
    for name, shape in naming.template.items():
        m = prefix.match(name)
        comp = name[m.end():] if m else (name if globals_too else None)
        if comp is None or comp in out:
            continue
        factory = build(comp, tuple(shape), text)
        if factory is not None:
            out[comp] = factory
    return out


def engine_rules(meta: MetaModel, naming: Naming) -> dict[str, RuleFactory]:
    """Every engine-defined rule of ``naming``'s layer components, for the generic family:
    these fused layouts' and gpt-oss's stacked experts' (``mxfp4.engine_tp_rules``)."""
    return {**fused_tp_rules(meta.model_type, naming, meta.text_config),
            **engine_tp_rules(meta.architecture, naming)}
