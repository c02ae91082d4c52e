"""Phi-3 (Phi3ForCausalLM): a llama-style decoder whose checkpoints store packed projections.

``self_attn.qkv_proj.weight`` holds [q; k; v] rows (query heads, then KV heads, then KV heads,
``head_dim`` each) and ``mlp.gate_up_proj.weight`` holds [gate; up] (``intermediate_size``
rows each). The generic family plans these checkpoints but refuses TP (a packed tensor has no
unambiguous split); this family states the split: qkv as three segments cut by query heads and
KV heads (KV heads replicated when fewer than TP, as for llama), gate_up as two halves, each
split on its own. A TP rank's piece is then [q_r; k_r; v_r] / [gate_r; up_r], the layout of
vLLM's QKVParallelLinear / MergedColumnParallelLinear and of transformers' own module, so the
stored tensor is already the fused target (no ``fused_targets``).
"""
from __future__ import annotations

from .base import Family, ShardRule, SpecView
from .blocks import Shapes, assemble
from .cache_dims import CacheDims
from .common import globals_tensors, llama_globals, uniform_layout, vocab_rules

__all__ = ["FAMILIES", "PHI3"]


def _qkv_rows(spec: SpecView) -> tuple[int, int, int]:
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return (q, kv, kv)


def _qkv_heads(spec: SpecView) -> tuple[int, int, int]:
    return (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)


def _gate_up_rows(spec: SpecView) -> tuple[int, int]:
    inter = spec.int("intermediate_size")
    return (inter, inter)


def _q_heads(spec: SpecView) -> int:
    return spec.num_heads


def _template(spec: SpecView) -> Shapes:
    h, inter = spec.hidden_size, spec.int("intermediate_size")
    q = spec.num_heads * spec.head_dim
    layer: Shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                     "self_attn.qkv_proj.weight": (sum(_qkv_rows(spec)), h),
                     "self_attn.o_proj.weight": (h, q),
                     "mlp.gate_up_proj.weight": (2 * inter, h),
                     "mlp.down_proj.weight": (h, inter)}
    return assemble(spec, globals_tensors(spec), lambda _layer: layer)


PHI3 = Family(
    name="phi3", architectures=("Phi3ForCausalLM",), model_types=frozenset({"phi3"}),
    cache_dims=CacheDims(), layout=uniform_layout, globals=llama_globals(),
    shard_rules=vocab_rules() + (
        ShardRule(r"self_attn\.qkv_proj\.weight", 0, segments=_qkv_rows, units=_qkv_heads),
        ShardRule(r"self_attn\.o_proj\.weight", 1, units=_q_heads),
        ShardRule(r"mlp\.gate_up_proj\.weight", 0, segments=_gate_up_rows),
        ShardRule(r"mlp\.down_proj\.weight", 1)),
    template=_template)

#: this module's families (found by families/__init__.py)
FAMILIES = (PHI3,)
