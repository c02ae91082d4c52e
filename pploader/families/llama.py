"""Dense llama-style families: Llama/Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Llama and Qwen3 read the optional biases of their configs: ``attention_bias`` (q, k, v and o
projections) and ``mlp_bias`` (gate, up, down; Llama only), as transformers builds them."""
from __future__ import annotations


from .base import Family, SpecView
from .cache_dims import CacheDims
from .blocks import mlp_biased
from .common import (attention_rules, attention_tensors, globals_tensors, llama_globals,
                     mlp_rules, uniform_layout, vocab_rules)
from .fused import GATE_UP, QKV
from .windows import mistral_windows, qwen_windows


__all__ = ["FAMILIES", "FAMILY", "QWEN2", "QWEN3", "dense_template"]


def dense_template(spec: SpecView, *, bias: bool = False, qk_norm: bool = False,
                   optional_bias: bool = False) -> dict:
    """``optional_bias``: biases as the config's ``attention_bias`` / ``mlp_bias`` say."""
    h = spec.hidden_size
    out = globals_tensors(spec)
    attn_bias = optional_bias and bool(spec.config.get("attention_bias", False))
    mlp_bias = optional_bias and bool(spec.config.get("mlp_bias", False))
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             **attention_tensors(spec, bias=bias or attn_bias, o_bias=attn_bias, qk_norm=qk_norm),
             **mlp_biased(h, spec.int("intermediate_size"), "mlp.", bias=mlp_bias)}
    for i in range(spec.num_layers):
        out.update({f"model.layers.{i}.{k}": v for k, v in layer.items()})
    return out


_RULES = vocab_rules() + attention_rules() + mlp_rules()
_FUSED = (QKV, GATE_UP)  # used when the module has qkv_proj / gate_up_proj

FAMILY = Family(
    name="llama", architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    model_types=frozenset({"llama", "mistral"}), cache_dims=CacheDims(windows=mistral_windows),
    layout=uniform_layout, globals=llama_globals(), shard_rules=_RULES, fused_targets=_FUSED,
    template=lambda spec: dense_template(spec, optional_bias=True))

QWEN2 = Family(
    name="qwen2", architectures=("Qwen2ForCausalLM",),
    model_types=frozenset({"qwen2"}), cache_dims=CacheDims(windows=qwen_windows),
    layout=uniform_layout, globals=llama_globals(), shard_rules=_RULES, fused_targets=_FUSED,
    template=lambda spec: dense_template(spec, bias=True))

QWEN3 = Family(
    name="qwen3", architectures=("Qwen3ForCausalLM",),
    model_types=frozenset({"qwen3"}), cache_dims=CacheDims(windows=qwen_windows),
    layout=uniform_layout, globals=llama_globals(), shard_rules=_RULES, fused_targets=_FUSED,
    template=lambda spec: dense_template(spec, qk_norm=True, optional_bias=True))

#: this module's families (found by families/__init__.py)
FAMILIES = (FAMILY, QWEN3, QWEN2)
