"""Building blocks shared by families: standard globals, attention/MLP templates and rules."""
from __future__ import annotations

from typing import Mapping

from .base import GlobalRule, Layout, ShardRule, SpecView, cfg


__all__ = ["llama_globals", "attention_tensors", "mlp_tensors", "attention_rules",
           "mlp_rules", "vocab_rules", "uniform_layout", "globals_tensors"]


def llama_globals(prefix: str = "model.", head: str = "lm_head.weight") -> tuple[GlobalRule, ...]:
    """embed on the first stage; final norm and head on the last."""
    return (GlobalRule.exact(prefix + "embed_tokens.weight", "first", "embed"),
            GlobalRule.exact(prefix + "norm.weight", "last", "final_norm"),
            GlobalRule.exact(head, "last", "head"))


def globals_tensors(spec: SpecView, prefix: str = "model.",
                    head: str = "lm_head.weight") -> dict[str, tuple[int, ...]]:
    out = {prefix + "embed_tokens.weight": (spec.vocab_size, spec.hidden_size),
           prefix + "norm.weight": (spec.hidden_size,)}
    if not spec.tie_word_embeddings:
        out[head] = (spec.vocab_size, spec.hidden_size)
    return out


def uniform_layout(config: Mapping) -> Layout:
    n = int(cfg(config, "num_hidden_layers"))  # type: ignore[arg-type]
    return Layout(n, ("full_attention",) * n)


def attention_tensors(spec: SpecView, *, bias: bool = False, o_bias: bool = False,
                      qk_norm: bool = False, prefix: str = "self_attn.") -> dict[str, tuple]:
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    out: dict[str, tuple] = {prefix + "q_proj.weight": (q, h), prefix + "k_proj.weight": (kv, h),
                             prefix + "v_proj.weight": (kv, h), prefix + "o_proj.weight": (h, q)}
    if bias:
        out.update({prefix + "q_proj.bias": (q,), prefix + "k_proj.bias": (kv,),
                    prefix + "v_proj.bias": (kv,)})
    if o_bias:
        out[prefix + "o_proj.bias"] = (h,)
    if qk_norm:
        out.update({prefix + "q_norm.weight": (d,), prefix + "k_norm.weight": (d,)})
    return out


def mlp_tensors(hidden: int, inter: int, prefix: str = "mlp.",
                names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> dict:
    g, u, dn = names
    return {f"{prefix}{g}.weight": (inter, hidden), f"{prefix}{u}.weight": (inter, hidden),
            f"{prefix}{dn}.weight": (hidden, inter)}


def _kv_heads(spec: SpecView) -> int:
    return spec.num_kv_heads


def _q_heads(spec: SpecView) -> int:
    return spec.num_heads


def attention_rules(prefix: str = r"self_attn\.") -> tuple[ShardRule, ...]:
    """Column-parallel q/k/v by heads (kv heads replicated when fewer than tp), row-parallel o."""
    return (ShardRule(prefix + r"q_proj\.(weight|bias)", 0, units=_q_heads),
            ShardRule(prefix + r"[kv]_proj\.(weight|bias)", 0, units=_kv_heads),
            ShardRule(prefix + r"o_proj\.weight", 1, units=_q_heads))


def mlp_rules(prefix: str = r"mlp\.", col: str = "gate_proj|up_proj",
              row: str = "down_proj") -> tuple[ShardRule, ...]:
    """Column-parallel gate/up (weights and optional biases), row-parallel down (its bias,
    added after the reduction, replicated)."""
    return (ShardRule(prefix + rf"({col})\.(weight|bias)", 0),
            ShardRule(prefix + rf"({row})\.weight", 1))


def vocab_rules(prefix: str = r"model\.", head: str = r"lm_head\.weight") -> tuple[ShardRule, ...]:
    return (ShardRule(prefix + r"embed_tokens\.weight", 0, pad=True), ShardRule(head, 0, pad=True))
