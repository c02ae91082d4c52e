"""ZAYA1 in its release naming, as SGLang's ``zaya`` model (ZAYA's only engine) loads it.

ZAYA1 is saved under two namings that share ``ZayaForCausalLM`` and ``model_type: zaya``:

- the release naming (Zyphra's checkpoints; SGLang loads it and nothing else): separate,
  alternately numbered layers, attention at even ids (``self_attn.qkv.linear_q`` /
  ``linear_k`` / ``val_proj{1,2}`` / ``conv_qk.{0,1}`` / ``temp``, ``self_attn.o_proj``) and
  MoE at odd ids (``zaya_block.router.*``, ``zaya_block.experts.local_experts.{e}.linear_fc1``
  = [gate; up] and ``linear_fc2``), each with ``input_norm`` and ``res_scale``; the final
  ``model.final_norm`` / ``model.res_scale``. This family plans it.
- transformers' naming (``save_pretrained`` of transformers' ``ZayaForCausalLM``): hybrid
  layers holding both, fused 3-D experts, other names; planned by the generic family.

No tensor-name conversion links the two, and family dispatch reads config.json only, so the
config decides (:func:`is_release_config`): the release config carries SGLang's fields
(``zaya_layers``, ``ffn_hidden_size``, ``zaya_mlp_expansion``, ``num_query_groups``) and none
of the ZAYA fields transformers' config always writes (``layer_types``,
``moe_intermediate_size``, ``router_hidden_size``). A config with both goes to the generic
family (transformers loads such a repository with no renaming, so its tensors are in
transformers' naming).

Layers and PP: SGLang builds ``num_hidden_layers`` layers (``len(zaya_layers)`` when given),
attention at even ids and MoE at odd ids (``_layer_class``), and splits them over PP stages
with its ``get_pp_indices`` (``--partition sglang`` gives exactly its windows). TP, as
SGLang's weight loaders take each tensor (head-parallel CCA):

- ``linear_q`` / ``linear_k`` (and biases): rows by query / key heads (``ColumnParallelLinear``);
- ``conv_qk.{0,1}`` weights and biases: the rank's query-head rows, then its key-head rows
  (SGLang's ``conv_row_loader``); ``temp``: the rank's key heads;
- ``o_proj.weight``: columns by query heads (``RowParallelLinear``; its bias whole);
- ``val_proj1`` / ``val_proj2``, the router, norms and residual scales: whole on every rank;
- experts: ``linear_fc1``'s gate and up halves each by rows, ``linear_fc2`` by columns
  (``FusedMoE`` ``w1`` / ``w3`` / ``w2``); under EP a rank holds experts
  ``[r * E / ep, (r + 1) * E / ep)``; ``load_stage_into`` stacks them into a module's
  ``zaya_block.experts.w13_weight`` / ``w2_weight`` (``fused_targets``) where it has them;
- ``embed_tokens`` / ``lm_head``: vocabulary rows (the padded split every family uses).

SGLang refuses (and so does :func:`check_parallel`): a TP that does not divide the query or
the key heads (no KV-head copies: its grouped mean and ``conv_qk.1`` are per head), a TP above
the expert count, an expert intermediate (``ffn_hidden_size / 2``) TP does not divide, and an
EP that does not divide the experts; and a vocabulary whose SGLang split (padded to a multiple
of 64 first) is not pploader's ``ceil(V / tp)`` rows a rank (never for ZAYA1's 262,272).

Cache pools, as SGLang sizes them (``ZayaConfig.mamba2_cache_params`` and the attention's
``RadixAttention``): an attention layer (kind ``cca_attention``) keeps K / V of its
``num_query_groups / tp`` key heads per token, and per request CCA's conv state
(``(q + k heads) x head_dim / tp`` channels x ``cca_time0 + cca_time1 - 2`` inputs) and the
previous token's hidden state (``hidden_size`` x 1, every rank whole); the MoE layers (``mlp``)
cache nothing.
"""
from __future__ import annotations

from typing import Mapping

from ..errors import ConfigError, PlanError
from .base import Family, GlobalRule, Layout, ShardRule, SpecView, cfg
from .blocks import Shapes, assemble
from .cache_dims import CacheDims, CcaDims, GqaDims
from .common import vocab_rules
from .fused import FusedTarget

__all__ = ["FAMILIES", "ZAYA", "is_release_config", "check_parallel"]

#: fields SGLang's release config has (any one marks it) / ZAYA fields transformers' config
#: always writes (even at their defaults: the base config class lacks them); the generic
#: ``rms_norm_eps`` is left out, a release config may carry it too
RELEASE_KEYS = ("zaya_layers", "ffn_hidden_size", "zaya_mlp_expansion", "num_query_groups")
TRANSFORMERS_KEYS = ("layer_types", "moe_intermediate_size", "router_hidden_size")

#: SGLang's ``ZayaConfig`` defaults for the release fields a config may leave out
DEFAULTS: Mapping[str, object] = {
    "tie_word_embeddings": True, "zaya_use_mod": True, "zaya_use_eda": True,
    "scale_residual_merge": True, "normalization": "RMSNorm", "attention_bias": False,
    "lm_head_bias": False, "cca_time0": 2, "cca_time1": 2, "zaya_mlp_expansion": 256}

_ATTN = "self_attn.qkv."
_EXPERTS = "zaya_block.experts.local_experts."


def is_release_config(config: Mapping) -> bool:
    """True for a ZAYA1 release config (SGLang's fields, none of transformers')."""
    return any(config.get(k) is not None for k in RELEASE_KEYS) and \
        not any(k in config for k in TRANSFORMERS_KEYS)


def _first_set(config: Mapping, list_key: str, key: str, *fallbacks: str) -> int:
    """SGLang's reading of a per-layer list field: its first non-zero entry, else the scalar."""
    values = config.get(list_key)
    if isinstance(values, (list, tuple)):
        for v in values:
            if v:
                return int(v)
    return int(cfg(config, key, *fallbacks))


def num_layers(config: Mapping) -> int:
    layers = config.get("zaya_layers")
    return len(layers) if isinstance(layers, (list, tuple)) and layers else \
        int(cfg(config, "num_hidden_layers"))


def q_heads(config: Mapping) -> int:
    return _first_set(config, "cca_num_q_heads", "num_attention_heads")


def k_heads(config: Mapping) -> int:
    return _first_set(config, "num_query_groups_list", "num_query_groups", "num_key_value_heads")


def head_dim(config: Mapping) -> int:
    return int(cfg(config, "head_dim", "kv_channels"))


def ffn(config: Mapping) -> int:
    """``ffn_hidden_size``: an expert's merged gate + up rows (each half is its intermediate)."""
    return _first_set(config, "ffn_hidden_size_list", "ffn_hidden_size")


def expansion(config: Mapping) -> int:
    """The router's width (``zaya_mlp_expansion``, a scalar or per-layer list)."""
    value = config.get("zaya_mlp_expansion", 256)
    if isinstance(value, (list, tuple)):
        return next((int(v) for v in value if v), 256)
    return int(value)  # type: ignore[call-overload]


def _layout(config: Mapping) -> Layout:
    n = num_layers(config)
    layers = config.get("zaya_layers")
    if isinstance(layers, (list, tuple)) and layers:
        odd = [i for i, t in enumerate(layers) if (t == "a") != (i % 2 == 0)]
        if odd:
            raise ConfigError(f"zaya_layers puts attention ('a') at layers other than the even "
                              f"ids SGLang builds attention at (first: layer {odd[0]} is "
                              f"{layers[odd[0]]!r})")
    if ffn(config) % 2:
        raise ConfigError(f"ffn_hidden_size {ffn(config)} is not even: an expert's linear_fc1 "
                          "holds gate and up halves")
    nq, nk = q_heads(config), k_heads(config)
    kv = config.get("num_key_value_heads")
    if kv is not None and int(kv) != nk:  # type: ignore[call-overload]
        raise ConfigError(f"num_query_groups {nk} != num_key_value_heads {kv} (SGLang requires "
                          "them equal for ZAYA1)")
    if nq % nk:
        raise ConfigError(f"{nq} query heads are not a multiple of the {nk} key heads")
    experts = int(cfg(config, "num_experts"))
    kinds = tuple("cca_attention" if i % 2 == 0 else "mlp" for i in range(n))
    return Layout(n, kinds, frozenset(range(1, n, 2)), experts)


def _norm(config: Mapping, prefix: str, h: int) -> Shapes:
    out: Shapes = {prefix + "weight": (h,)}
    if config.get("normalization") == "LayerNorm":
        out[prefix + "bias"] = (h,)
    elif config.get("normalization") != "RMSNorm":
        raise ConfigError(f"normalization {config.get('normalization')!r}: SGLang's ZAYA builds "
                          "RMSNorm or LayerNorm")
    return out


def _res_scale(config: Mapping, prefix: str, h: int, residual: bool) -> Shapes:
    if not config.get("scale_residual_merge"):
        return {}
    names = ("hidden_states_scale", "hidden_states_bias") + \
        (("residual_scale", "residual_bias") if residual else ())
    return {f"{prefix}res_scale.{n}": (h,) for n in names}


def _attention(config: Mapping, h: int) -> Shapes:
    nq, nk, d = q_heads(config), k_heads(config), head_dim(config)
    ch = (nq + nk) * d
    bias = bool(config.get("attention_bias"))
    out: Shapes = {}
    for name, rows in (("linear_q", nq * d), ("linear_k", nk * d), ("val_proj1", nk * d // 2),
                       ("val_proj2", nk * d // 2)):
        out[f"{_ATTN}{name}.weight"] = (rows, h)
        if bias:
            out[f"{_ATTN}{name}.bias"] = (rows,)
    out.update({_ATTN + "conv_qk.0.weight": (ch, 1, int(config["cca_time0"])),  # type: ignore[call-overload]
                _ATTN + "conv_qk.0.bias": (ch,),
                _ATTN + "conv_qk.1.weight": (ch, d, int(config["cca_time1"])),  # type: ignore[call-overload]
                _ATTN + "conv_qk.1.bias": (ch,),
                _ATTN + "temp": (nk,),
                "self_attn.o_proj.weight": (h, nq * d)})
    if bias:
        out["self_attn.o_proj.bias"] = (h,)
    return out


def _moe(config: Mapping, h: int) -> Shapes:
    x, e, f = expansion(config), int(config["num_experts"]), ffn(config)  # type: ignore[call-overload]
    slots = e + 1 if config.get("zaya_use_mod") else e  # MOD's skip expert
    r = "zaya_block.router."
    out: Shapes = {r + "down_proj.weight": (x, h), r + "down_proj.bias": (x,),
                   r + "rmsnorm_eda.weight": (x,)}
    if config.get("zaya_use_eda"):
        out[r + "router_states_scale"] = (x,)
    for i in (0, 2):
        out.update({f"{r}router_mlp.{i}.weight": (x, x), f"{r}router_mlp.{i}.bias": (x,)})
    out.update({r + "router_mlp.4.weight": (slots, x), r + "balancing_biases": (slots,)})
    for j in range(e):
        out.update({f"{_EXPERTS}{j}.linear_fc1.weight": (f, h),
                    f"{_EXPERTS}{j}.linear_fc2.weight": (h, f // 2)})
    return out


def _template(spec: SpecView) -> Shapes:
    c, h, v = spec.config, spec.hidden_size, spec.vocab_size
    attention, moe = _attention(c, h), _moe(c, h)

    def layer(i: int) -> Shapes:
        return {**(attention if i % 2 == 0 else moe), **_norm(c, "input_norm.", h),
                **_res_scale(c, "", h, i != 0)}
    glob: Shapes = {"model.embed_tokens.weight": (v, h), **_norm(c, "model.final_norm.", h),
                    **_res_scale(c, "model.", h, True)}
    if not spec.tie_word_embeddings:
        glob["lm_head.weight"] = (v, h)
        if c.get("lm_head_bias"):
            glob["lm_head.bias"] = (v,)
    return assemble(spec, glob, layer)


def _globals() -> tuple[GlobalRule, ...]:
    return (GlobalRule.exact("model.embed_tokens.weight", "first", "embed"),
            GlobalRule(r"model\.final_norm\.(weight|bias)", "last", "final_norm"),
            GlobalRule(r"model\.res_scale\.(hidden_states|residual)_(scale|bias)", "last"),
            GlobalRule.exact("lm_head.weight", "last", "head"),
            GlobalRule.exact("lm_head.bias", "last"))


def _q(spec: SpecView) -> int:
    return q_heads(spec.config)


def _k(spec: SpecView) -> int:
    return k_heads(spec.config)


def _conv_rows(spec: SpecView) -> tuple[int, int]:
    d = head_dim(spec.config)
    return _q(spec) * d, _k(spec) * d


def _conv_units(spec: SpecView) -> tuple[int, int]:
    return _q(spec), _k(spec)


def _halves(spec: SpecView) -> tuple[int, int]:
    half = ffn(spec.config) // 2
    return half, half


def _rules() -> tuple[ShardRule, ...]:
    a = r"self_attn\.qkv\."
    return (*vocab_rules(head=r"lm_head\.(weight|bias)"),
            ShardRule(a + r"linear_q\.(weight|bias)", 0, units=_q, replicate=False),
            ShardRule(a + r"linear_k\.(weight|bias)", 0, units=_k, replicate=False),
            ShardRule(a + r"conv_qk\.[01]\.(weight|bias)", 0, segments=_conv_rows,
                      units=_conv_units, replicate=False),
            ShardRule(a + r"temp", 0, units=_k, replicate=False),
            ShardRule(r"self_attn\.o_proj\.weight", 1, units=_q, replicate=False),
            ShardRule(r"zaya_block\.experts\.local_experts\.\d+\.linear_fc1\.weight", 0,
                      segments=_halves),
            ShardRule(r"zaya_block\.experts\.local_experts\.\d+\.linear_fc2\.weight", 1))


def _kv(spec: SpecView) -> GqaDims:
    return GqaDims(k_heads(spec.config), head_dim(spec.config))


def _cca(spec: SpecView) -> CcaDims:
    c = spec.config
    return CcaDims(q_heads(c), k_heads(c), head_dim(c), spec.hidden_size,
                   int(c["cca_time0"]) + int(c["cca_time1"]) - 2)  # type: ignore[call-overload]


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def check_parallel(spec: SpecView, tp: int, ep: int) -> None:
    """Refuse the TP / EP sizes SGLang's ZAYA refuses, naming the first tensor they fail on."""
    c = spec.config
    first_attn = "model.layers.0." + _ATTN
    first_moe = f"model.layers.1.{_EXPERTS}0."
    if tp > 1:
        nq, nk = q_heads(c), k_heads(c)
        if nq % tp:
            raise PlanError(f"--tp {tp} does not divide the {nq} query heads: SGLang's ZAYA CCA "
                            "is head-parallel and requires num_attention_heads divisible by "
                            "the TP size", tensor=first_attn + "linear_q.weight")
        if nk % tp:
            raise PlanError(f"--tp {tp} does not divide the {nk} key heads (num_query_groups): "
                            "SGLang's ZAYA does not copy key heads over ranks (its grouped mean "
                            f"and conv_qk.1 are per head); use a TP dividing {nk}",
                            tensor=first_attn + "linear_k.weight")
        experts, half = int(c["num_experts"]), ffn(c) // 2  # type: ignore[call-overload]
        if spec.num_layers > 1 and tp > experts:
            raise PlanError(f"--tp {tp} is greater than the {experts} experts, which SGLang's "
                            "ZayaBlock refuses", tensor=first_moe + "linear_fc1.weight")
        if spec.num_layers > 1 and half % tp:
            raise PlanError(f"--tp {tp} does not divide the experts' intermediate size {half} "
                            "(ffn_hidden_size / 2), as SGLang's FusedMoE requires",
                            tensor=first_moe + "linear_fc2.weight")
    if tp > 1:
        vocab = spec.vocab_size
        pad = 64 if _round_up(vocab, 64) % tp == 0 else 64 * tp  # VocabParallelEmbedding
        if _round_up(vocab, pad) // tp != -(-vocab // tp):
            raise PlanError(f"--tp {tp}: SGLang pads the vocabulary of {vocab} to "
                            f"{_round_up(vocab, pad)} rows before splitting it, "
                            f"{_round_up(vocab, pad) // tp} a rank, and pploader's split "
                            f"({-(-vocab // tp)} a rank) would give other rows",
                            tensor="model.embed_tokens.weight")
    if ep > 1 and spec.num_experts % ep:
        raise PlanError(f"--ep {ep} does not divide the {spec.num_experts} experts: SGLang's "
                        "FusedMoE gives every EP rank the same number",
                        tensor=first_moe + "linear_fc1.weight")


#: SGLang's ``FusedMoE`` parameters: an expert's ``linear_fc1`` piece (the rank's gate rows,
#: then its up rows) is its ``w13_weight`` row as is, ``linear_fc2`` its ``w2_weight`` row
FUSED_EXPERTS = (FusedTarget("zaya_block.experts.w13_weight",
                             (_EXPERTS + "{e}.linear_fc1.weight",)),
                 FusedTarget("zaya_block.experts.w2_weight",
                             (_EXPERTS + "{e}.linear_fc2.weight",)))

ZAYA = Family(
    name="zaya", architectures=("ZayaForCausalLM",), layout=_layout,
    model_types=frozenset({"zaya"}), config_match=is_release_config,
    check_parallel=check_parallel, config_defaults=DEFAULTS, globals=_globals(),
    cache_dims=CacheDims(gqa=_kv, cca=_cca),
    expert_pattern=r"zaya_block\.experts\.local_experts\.(\d+)\..+",
    shard_rules=_rules(), template=_template, fused_targets=FUSED_EXPERTS)

#: this module's families (found by families/__init__.py)
FAMILIES = (ZAYA,)
