"""Inkling in its release naming (``model.llm.*``), as vLLM 0.32's ``models/inkling`` loads it.

vLLM serves Inkling only in the naming its release checkpoints use (config ``model_type``
``inkling_model`` for the text model, ``inkling_mm_model`` with the text config under
``text_config`` beside the vision / audio towers); transformers' ``inkling_text``
(``self_attn.q_proj`` ..., saved by ``save_pretrained``) stays with the generic family. Per
decoder layer (``model.llm.layers.{i}.``), with ``local_layer_ids`` taking the ``swa_*`` head
counts and head dim and ``sliding_window_size`` as their relative extent:

- ``attn.wq_du`` / ``wk_dv`` / ``wv_dv`` / ``wr_du``: the four parts vLLM stacks into its
  ``attn.qkvr`` (``MergedColumnParallelLinear``), each cut on its own by heads (q and r by
  query heads, k and v by KV heads); ``attn.wo_ud`` by query-head columns (row parallel);
- ``attn.k_sconv`` / ``v_sconv`` ``[kv x hd, 1, W]``: by KV heads (``InklingShortConv``'s
  loader: ``dim / tp`` rows at ``tp_rank``); ``attn_sconv`` / ``mlp_sconv`` ``[H, 1, W]``:
  ``H / tp`` rows (the residual-stream convs run on the reduce-scattered shard);
- dense MLP (layers below ``dense_mlp_idx``): ``mlp.w13_dn`` ``[2I, H]`` with gate / up rows
  interleaved, contiguous ``2I / tp`` rows (a plain ``ColumnParallelLinear``, pairs kept
  together); ``mlp.w2_md`` columns;
- MoE: ``mlp.experts.w13_weight`` ``[E, 2I, H]`` (interleaved) contiguous ``2I / tp`` rows of
  every expert, ``w2_weight`` ``[E, H, I]`` on dim 2; the shared "sink" experts
  ``mlp.shared_experts.shared_w13_weight`` / ``shared_w2_weight`` the same, replicated over EP;
  the router ``mlp.gate.weight`` ``[E + S, H]`` (its ``bias``, ``global_scale``) whole;
- whole: norms, ``attn.q_norm`` / ``k_norm``, ``attn.rel_logits_proj.proj``, the embedding
  (``model.llm.embed``: vLLM replicates it on every TP rank); ``model.llm.unembed`` is
  vocabulary parallel.

``model.mtp.*`` (the draft head) is known and never read: vLLM's causal LM drops it. The
multimodal towers (``model.visual.*``, ``model.audio.*``) go whole to the first stage.

Refused (``check_parallel``), as vLLM asserts or would load wrongly: a TP size that does not
divide the query heads, the KV heads (a larger TP replicates K / V in ``qkvr`` but
``InklingShortConv`` cuts ``k_sconv`` past its rows), the hidden size or an intermediate size
(the interleaved gate / up pairs); an EP size that does not divide the routed experts (vLLM
pads them to a multiple of EP and places equal blocks, not pploader's linear split).
Caches: every layer holds KV and four short-conv streams in one paged block (vLLM's
``InklingConvState``), a kind pploader's pools do not size: layer kind ``unknown``. EP with
TP together is refused too: vLLM's EP keeps every routed expert whole.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from ..errors import ConfigError, PlanError
from .base import Family, GlobalRule, Layout, ShardRule, SpecView, cfg, cfg_opt
from .blocks import Shapes, assemble


__all__ = ["FAMILIES", "INKLING", "INKLING_MM", "InklingDims", "inkling_dims"]

_PREFIX = "model.llm."


@dataclass(frozen=True)
class InklingDims:
    """The sizes vLLM's ``InklingModelConfig`` derives from a config (its defaults and the
    transformers aliases included)."""

    hidden: int
    layers: int
    vocab_rows: int            # the embedding / head rows: padded_vocab_size when given
    heads: int
    kv_heads: int
    head_dim: int
    swa_heads: int
    swa_kv_heads: int
    swa_head_dim: int
    d_rel: int
    rel_extent: int
    window: int                # sliding_window_size: the local layers' relative extent
    local: frozenset[int]
    kernel: int                # sconv_kernel_size
    dense_inter: int
    moe_inter: int
    dense_mlp_idx: int
    routed: int
    shared: int
    gate_bias: bool
    global_scale: bool
    o_bias: bool
    embed_norm: bool

    def attn(self, layer: int) -> tuple[int, int, int]:
        """(query heads, KV heads, head dim) of ``layer``."""
        if layer in self.local:
            return self.swa_heads, self.swa_kv_heads, self.swa_head_dim
        return self.heads, self.kv_heads, self.head_dim

    def is_moe(self, layer: int) -> bool:
        return layer >= self.dense_mlp_idx


def _int(config: Mapping, key: str, default: int) -> int:
    return int(cfg_opt(config, key, default))


def inkling_dims(config: Mapping) -> InklingDims:
    """Read a (text) config as vLLM's ``InklingModelConfig.__init__`` does."""
    hidden = int(cfg(config, "hidden_size"))
    heads = int(cfg(config, "num_attention_heads"))
    kv = _int(config, "num_key_value_heads", 4)
    head_dim = _int(config, "head_dim", hidden // heads)
    inter = config.get("intermediate_size")
    moe, dense = config.get("moe_intermediate_size"), config.get("dense_intermediate_size")
    if moe is not None and inter is not None and dense is None:  # transformers' names
        dense, inter = inter, moe
    if inter is None:
        inter = 768
    kernel = config.get("sconv_kernel_size")
    if kernel is None:
        kernel = cfg_opt(config, "conv_kernel_size", 4)
    vocab = int(cfg(config, "vocab_size"))
    if config.get("q_bias"):
        raise ConfigError("q_bias is set: vLLM's merged qkvr bias spans q / k / v / r and no "
                          "release checkpoint states which of them it stores")
    if config.get("tie_word_embeddings"):
        raise ConfigError("tie_word_embeddings is set: vLLM's Inkling never ties its head "
                          "(it loads model.llm.unembed.weight)")
    local = cfg_opt(config, "local_layer_ids", []) or []
    if not isinstance(local, list):
        raise ConfigError(f"local_layer_ids must be a list, got {local!r}")
    return InklingDims(
        hidden=hidden, layers=int(cfg(config, "num_hidden_layers")),
        vocab_rows=_int(config, "padded_vocab_size", vocab), heads=heads, kv_heads=kv,
        head_dim=head_dim, swa_heads=_int(config, "swa_num_attention_heads", heads),
        swa_kv_heads=_int(config, "swa_num_key_value_heads", kv),
        swa_head_dim=_int(config, "swa_head_dim", head_dim), d_rel=_int(config, "d_rel", 16),
        rel_extent=_int(config, "rel_extent", 1024),
        window=_int(config, "sliding_window_size", 512),
        local=frozenset(int(i) for i in local), kernel=int(kernel),
        dense_inter=int(dense if dense is not None else inter), moe_inter=int(inter),
        dense_mlp_idx=_int(config, "dense_mlp_idx", 0),
        routed=_int(config, "n_routed_experts", 0), shared=_int(config, "n_shared_experts", 0),
        gate_bias=bool(config.get("use_gate_bias")),
        global_scale=bool(config.get("use_global_scale")), o_bias=bool(config.get("o_bias")),
        embed_norm=bool(config.get("use_embed_norm")))


def _layout(config: Mapping) -> Layout:
    d = inkling_dims(config)
    moe = frozenset(i for i in range(d.layers) if d.is_moe(i))
    if moe and (d.routed <= 0 or d.shared <= 0):
        raise ConfigError(f"layers from dense_mlp_idx {d.dense_mlp_idx} are MoE, which vLLM "
                          f"builds with routed and shared experts; n_routed_experts {d.routed}, "
                          f"n_shared_experts {d.shared}")
    # one paged block of KV and four conv streams a layer: no pool kind sizes it
    return Layout(d.layers, ("unknown",) * d.layers, moe, d.routed if moe else 0)


def _layer(d: InklingDims, i: int) -> Shapes:
    h, w = d.hidden, d.kernel
    q, kv, hd = d.attn(i)
    out: Shapes = {
        "attn_norm.weight": (h,), "mlp_norm.weight": (h,),
        "attn.wq_du.weight": (q * hd, h), "attn.wk_dv.weight": (kv * hd, h),
        "attn.wv_dv.weight": (kv * hd, h), "attn.wr_du.weight": (q * d.d_rel, h),
        "attn.wo_ud.weight": (h, q * hd),
        "attn.q_norm.weight": (hd,), "attn.k_norm.weight": (hd,),
        "attn.rel_logits_proj.proj": (d.d_rel, d.window if i in d.local else d.rel_extent),
        "attn.k_sconv.weight": (kv * hd, 1, w), "attn.v_sconv.weight": (kv * hd, 1, w),
        "attn_sconv.weight": (h, 1, w), "mlp_sconv.weight": (h, 1, w)}
    if d.o_bias:
        out["attn.wo_ud.bias"] = (h,)
    if not d.is_moe(i):
        out.update({"mlp.w13_dn.weight": (2 * d.dense_inter, h),
                    "mlp.w2_md.weight": (h, d.dense_inter)})
        if d.global_scale:
            out["mlp.global_scale"] = (1,)
        return out
    e, s, inter = d.routed, d.shared, d.moe_inter
    out.update({"mlp.gate.weight": (e + s, h),
                "mlp.experts.w13_weight": (e, 2 * inter, h),
                "mlp.experts.w2_weight": (e, h, inter),
                "mlp.shared_experts.shared_w13_weight": (s, 2 * inter, h),
                "mlp.shared_experts.shared_w2_weight": (s, h, inter)})
    if d.gate_bias:
        out["mlp.gate.bias"] = (e,)
    if d.global_scale:
        out["mlp.gate.global_scale"] = (1,)
    return out


def _template(spec: SpecView) -> Shapes:
    d = inkling_dims(spec.config)
    glob: Shapes = {_PREFIX + "embed.weight": (d.vocab_rows, d.hidden),
                    _PREFIX + "norm.weight": (d.hidden,),
                    _PREFIX + "unembed.weight": (d.vocab_rows, d.hidden)}
    if d.embed_norm:
        glob[_PREFIX + "embed_norm.weight"] = (d.hidden,)
    return assemble(spec, glob, lambda i: _layer(d, i), prefix=_PREFIX + "layers.")


def _q_units(spec: SpecView) -> int:
    """Query heads as units of every layer (global and local): their gcd, so a TP size
    dividing both counts splits each by heads."""
    d = inkling_dims(spec.config)
    return math.gcd(d.heads, d.swa_heads) if d.local else d.heads


def _kv_units(spec: SpecView) -> int:
    d = inkling_dims(spec.config)
    return math.gcd(d.kv_heads, d.swa_kv_heads) if d.local else d.kv_heads


def _moe_pairs(spec: SpecView) -> int:
    return inkling_dims(spec.config).moe_inter


def _dense_pairs(spec: SpecView) -> int:
    return inkling_dims(spec.config).dense_inter


#: vLLM's split of every tensor it cuts (first full match on the component wins; the rest
#: are whole). Interleaved gate / up rows split in whole (gate, up) pairs; KV heads are never
#: replicated (``check_parallel`` refuses a TP above them first, naming ``k_sconv``).
_RULES = (
    ShardRule(r"model\.llm\.unembed\.weight", 0, pad=True),
    ShardRule(r"attn\.w[qr]_du\.weight", 0, units=_q_units, replicate=False),
    ShardRule(r"attn\.w[kv]_dv\.weight", 0, units=_kv_units, replicate=False),
    ShardRule(r"attn\.[kv]_sconv\.weight", 0, units=_kv_units, replicate=False),
    ShardRule(r"attn\.wo_ud\.weight", 1, units=_q_units, replicate=False),
    ShardRule(r"(attn|mlp)_sconv\.weight", 0),
    ShardRule(r"mlp\.w13_dn\.weight", 0, units=_dense_pairs, replicate=False),
    ShardRule(r"mlp\.w2_md\.weight", 1),
    ShardRule(r"mlp\.(experts\.w13_weight|shared_experts\.shared_w13_weight)", 1,
              units=_moe_pairs, replicate=False),
    ShardRule(r"mlp\.(experts\.w2_weight|shared_experts\.shared_w2_weight)", 2),
)


def _refuse(what: str, tensor: str, tp: int) -> PlanError:
    return PlanError(f"--tp {tp}: {what}; vLLM's Inkling does not load that size", tensor=tensor)


def check_parallel(spec: SpecView, tp: int, ep: int) -> None:
    """Refuse the TP / EP sizes vLLM's Inkling does not load as pploader would plan."""
    d = inkling_dims(spec.config)
    layer = _PREFIX + "layers.{}."
    if ep > 1 and d.routed % ep:
        raise PlanError(f"--ep {ep} does not divide the {d.routed} routed experts: vLLM's "
                        "Inkling pads them to a multiple of EP and gives each rank an equal "
                        "block, not the linear split pploader plans; use an EP dividing "
                        f"{d.routed}", tensor=layer.format(min(spec.moe_layers, default=0))
                        + "mlp.experts.w13_weight")
    if ep > 1 and tp > 1:
        raise PlanError(f"--ep {ep} with --tp {tp}: vLLM's Inkling under expert parallelism keeps "
                        "every routed expert whole (its MoE TP size is 1, the experts spread "
                        "over the TP x DP ranks), while --ep x --tp cuts each expert by TP "
                        "inside its EP block; use --ep alone (attention data parallel) or --tp "
                        "alone", tensor=layer.format(min(spec.moe_layers, default=0))
                        + "mlp.experts.w13_weight")
    if tp <= 1:
        return
    for i in sorted({min(d.local, default=0), min(set(range(d.layers)) - d.local, default=0)}):
        q, kv, _ = d.attn(i)
        kind = "local (swa_*)" if i in d.local else "global"
        if q % tp:
            raise _refuse(f"does not divide the {q} query heads of the {kind} layers "
                          "(InklingAttention asserts it)", layer.format(i) + "attn.wq_du.weight",
                          tp)
        if kv % tp:
            raise _refuse(f"does not divide the {kv} KV heads of the {kind} layers "
                          "(with TP above the KV heads InklingShortConv's loader cuts "
                          "k_sconv / v_sconv rows the tensor does not have)",
                          layer.format(i) + "attn.k_sconv.weight", tp)
    if d.hidden % tp:
        raise _refuse(f"does not divide hidden_size {d.hidden} (the residual-stream short "
                      "convs run on a hidden / tp shard)", layer.format(0) + "attn_sconv.weight",
                      tp)
    dense = [i for i in range(d.layers) if not d.is_moe(i)]
    if dense and d.dense_inter % tp:
        raise _refuse(f"does not divide the dense intermediate size {d.dense_inter} (whole "
                      "interleaved gate / up pairs a rank)", layer.format(dense[0])
                      + "mlp.w13_dn.weight", tp)
    if spec.moe_layers and d.moe_inter % tp:
        raise _refuse(f"does not divide the MoE intermediate size {d.moe_inter}",
                      layer.format(min(spec.moe_layers)) + "mlp.experts.w13_weight", tp)


_GLOBALS = (GlobalRule.exact(_PREFIX + "embed.weight", "first", "embed"),
            GlobalRule.exact(_PREFIX + "embed_norm.weight", "first"),
            GlobalRule.exact(_PREFIX + "norm.weight", "last", "final_norm"),
            GlobalRule.exact(_PREFIX + "unembed.weight", "last", "head"))

INKLING = Family(
    name="inkling", architectures=("InklingForCausalLM",), layout=_layout,
    model_types=frozenset({"inkling_model"}), layer_prefix=r"model\.llm\.layers\.(\d+)\.",
    globals=_GLOBALS, fused_expert_pattern=r"mlp\.experts\.(w13_weight|w2_weight)",
    shard_rules=_RULES, template=_template, mtp_pattern=r"model\.mtp\..+",
    check_parallel=check_parallel)

def is_release_mm_config(config: Mapping) -> bool:
    """True for the multimodal release's config. transformers' ``InklingForConditionalGeneration``
    shares its ``model_type`` (``inkling_mm_model``) but nests ``inkling_text`` (and saves
    ``model.language_model.*``); that one goes to the generic family."""
    text = config.get("text_config")
    return not (isinstance(text, Mapping) and text.get("model_type") == "inkling_text")


#: the multimodal release: the same text model under ``text_config``, the towers whole on the
#: first stage (vLLM builds them on every rank; only the first runs them). No template: the
#: vision tower's layer widths come from an assignment over its patch scales (vLLM's
#: ``plan_out_scales``), so its names are accepted by pattern, the shapes unchecked.
INKLING_MM = Family(
    name="inkling_mm", architectures=("InklingForConditionalGeneration",), layout=_layout,
    model_types=frozenset({"inkling_mm_model"}), text_config_key="text_config",
    layer_prefix=r"model\.llm\.layers\.(\d+)\.",
    globals=_GLOBALS + (GlobalRule(r"model\.(visual|audio)\..+", "first", "vision"),),
    fused_expert_pattern=r"mlp\.experts\.(w13_weight|w2_weight)", shard_rules=_RULES,
    mtp_pattern=r"model\.mtp\..+", check_parallel=check_parallel,
    config_match=is_release_mm_config)

#: this module's families (found by families/__init__.py)
FAMILIES = (INKLING, INKLING_MM)
