"""DeepSeek-V3 (MLA attention, routed + shared experts, multi-token-prediction layers).

Dense MLPs in the first ``first_k_dense_replace`` layers, MoE after. The checkpoint carries
``num_nextn_predict_layers`` MTP layers after the last decoder layer (``model.layers.61.*`` for
a 61-layer model), each a full MoE decoder layer plus ``embed_tokens``, ``enorm``, ``hnorm``,
``eh_proj`` and ``shared_head.{norm,head}``. transformers' ``save_pretrained`` does not write
MTP layers; official checkpoints do. Main-model stages never read them (placement "mtp");
``plan_mtp`` selects one for a draft model.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from .base import CheckpointFormat, Family, Layout, ShardRule, SpecView, cfg, cfg_opt
from .cache_dims import CacheDims, mla_dims
from .blocks import Shapes, expert_rules, expert_tensors, num_experts_of, prefixed
from .common import globals_tensors, llama_globals, mlp_rules, mlp_tensors, vocab_rules
from .fused import GATE_UP, FusedTarget, expert_fusions, gate_up
from .moe import FUSED_MARKER, STACKED_3D


__all__ = ["FAMILIES", "DEEPSEEK_V3", "mla_tensors", "MLA_RULES", "FUSED_QKV_A"]


def _layout(config: Mapping) -> Layout:
    n = int(cfg(config, "num_hidden_layers"))  # type: ignore[arg-type]
    experts = num_experts_of(config, "n_routed_experts")
    first_dense = int(cfg_opt(config, "first_k_dense_replace", 0))  # type: ignore[arg-type]
    moe = frozenset(range(first_dense, n)) if experts else frozenset()
    return Layout(n, ("mla",) * n, moe, experts,
                  int(cfg_opt(config, "num_nextn_predict_layers", 0)))  # type: ignore[arg-type]


def mla_tensors(spec: SpecView, prefix: str = "self_attn.") -> Shapes:
    """Multi-head latent attention: low-rank q (or a plain q_proj), compressed kv + rope key."""
    h, nh = spec.hidden_size, spec.num_heads
    nope, rope = spec.int("qk_nope_head_dim"), spec.int("qk_rope_head_dim")
    v, kv_rank = spec.int("v_head_dim"), spec.int("kv_lora_rank")
    q_rank: Any = spec.config.get("q_lora_rank")
    bias = bool(spec.config.get("attention_bias", False))
    out: Shapes = {}
    if q_rank:
        out.update({"q_a_proj.weight": (int(q_rank), h), "q_a_layernorm.weight": (int(q_rank),),
                    "q_b_proj.weight": (nh * (nope + rope), int(q_rank))})
        if bias:
            out["q_a_proj.bias"] = (int(q_rank),)
    else:
        out["q_proj.weight"] = (nh * (nope + rope), h)
    out.update({"kv_a_proj_with_mqa.weight": (kv_rank + rope, h),
                "kv_a_layernorm.weight": (kv_rank,),
                "kv_b_proj.weight": (nh * (nope + v), kv_rank), "o_proj.weight": (h, nh * v)})
    if bias:
        out.update({"kv_a_proj_with_mqa.bias": (kv_rank + rope,), "o_proj.bias": (h,)})
    return {prefix + k: s for k, s in out.items()}


def _heads(spec: SpecView) -> int:
    return spec.num_heads


#: q_a / kv_a (the shared low-rank inputs) replicated; per-head q_b / q / kv_b column-parallel;
#: o row-parallel by heads.
MLA_RULES = (ShardRule(r"self_attn\.(q_b_proj|q_proj|kv_b_proj)\.weight", 0, units=_heads),
             ShardRule(r"self_attn\.o_proj\.weight", 1, units=_heads))


#: MLA's two replicated low-rank input projections -> one ``fused_qkv_a_proj`` [q_lora_rank +
#: kv_lora_rank + rope, H] (vLLM's MergedColumnParallelLinear, used when q_lora_rank is set).
#: The per-head q_b / kv_b stay separate: vLLM keeps them so (kv_b is absorbed per head).
FUSED_QKV_A = FusedTarget("self_attn.fused_qkv_a_proj.{p}",
                          ("self_attn.q_a_proj.{p}", "self_attn.kv_a_proj_with_mqa.{p}"))


def _is_moe(spec: SpecView, layer: int) -> bool:
    """True when ``layer`` has routed experts (the first ``first_k_dense_replace`` are dense)."""
    first_dense = int(cfg_opt(spec.config, "first_k_dense_replace", 0))  # type: ignore[arg-type]
    return bool(spec.num_experts) and layer >= first_dense


def _decoder_layer(spec: SpecView, layer: int, fused: bool) -> Shapes:
    h = spec.hidden_size
    out: Shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                   **mla_tensors(spec)}
    if _is_moe(spec, layer):
        inter = spec.int("moe_intermediate_size")
        shared = inter * int(cfg_opt(spec.config, "n_shared_experts", 1))  # type: ignore[arg-type]
        out.update({"mlp.gate.weight": (spec.num_experts, h),
                    "mlp.gate.e_score_correction_bias": (spec.num_experts,),
                    **expert_tensors("mlp.experts.", spec.num_experts, h, inter, fused=fused),
                    **mlp_tensors(h, shared, prefix="mlp.shared_experts.")})
    else:
        out.update(mlp_tensors(h, spec.int("intermediate_size")))
    return out


def _mtp_extras(spec: SpecView) -> Shapes:
    h, vocab = spec.hidden_size, spec.vocab_size
    return {"embed_tokens.weight": (vocab, h), "enorm.weight": (h,), "hnorm.weight": (h,),
            "eh_proj.weight": (h, 2 * h), "shared_head.norm.weight": (h,),
            "shared_head.head.weight": (vocab, h)}


def _layered(spec: SpecView, fused: bool = False
             ) -> tuple[Shapes, Callable[[int], Shapes], range]:
    """The template by layer: main layers, then MTP layers ``num_layers ..
    num_layers + num_mtp_layers - 1`` (each a decoder layer plus the MTP extras). A layer's
    components depend only on (MoE, MTP): each kind is built once and shared."""
    kinds: dict[tuple[bool, bool], Shapes] = {}

    def layer(i: int) -> Shapes:
        kind = (_is_moe(spec, i), i >= spec.num_layers)
        out = kinds.get(kind)
        if out is None:
            out = kinds[kind] = _decoder_layer(spec, i, fused)
            if kind[1]:
                out.update(_mtp_extras(spec))
        return out
    return globals_tensors(spec), layer, range(spec.num_layers + spec.num_mtp_layers)


def _template(spec: SpecView, fused: bool = False) -> Shapes:
    """Globals, then every layer (``_layered`` assembled)."""
    globals_, layer, layers = _layered(spec, fused)
    out = dict(globals_)
    for i in layers:
        out.update(prefixed(f"model.layers.{i}.", layer(i)))
    return out


def _moe_inter(spec: SpecView) -> int:
    return spec.int("moe_intermediate_size")


DEEPSEEK_V3 = Family(
    name="deepseek_v3", architectures=("DeepseekV3ForCausalLM",), layout=_layout,
    model_types=frozenset({"deepseek_v3"}), cache_dims=CacheDims(mla=mla_dims),
    globals=llama_globals(), expert_pattern=r"mlp\.experts\.(\d+)\..+",
    fused_expert_pattern=r"mlp\.experts\.(gate_up_proj|down_proj)",
    shard_rules=vocab_rules()
    + (ShardRule(r"embed_tokens\.weight", 0, pad=True),          # MTP layers' own copies
       ShardRule(r"shared_head\.head\.weight", 0, pad=True))
    + MLA_RULES + mlp_rules() + mlp_rules(r"mlp\.shared_experts\.")
    + expert_rules(r"mlp\.experts\.", _moe_inter),
    template=_template, layer_template=_layered,
    fused_targets=(FUSED_QKV_A, GATE_UP, gate_up("mlp.shared_experts."), *expert_fusions(),
                   *STACKED_3D),
    formats=(CheckpointFormat("transformers", FUSED_MARKER,
                              (("template", lambda s: _template(s, fused=True)),
                               ("layer_template", lambda s: _layered(s, fused=True)))),))

#: this module's families (found by families/__init__.py)
FAMILIES = (DEEPSEEK_V3,)
