"""The slice of each tensor a TP rank holds when vLLM serves the model through its transformers
backend, written independently of the planner from transformers' ``base_model_tp_plan`` of
each model (copied below as data) and vLLM's layer classes: ``colwise`` /
``colwise_gather_output`` -> ``ColumnParallelLinear`` (weight rows and bias in ``1 / tp``),
``rowwise`` -> ``RowParallelLinear`` (weight columns in ``1 / tp``, bias whole), the
vocabulary embedding and the head (its bias too) in ``ceil(V / tp)`` rows (the project's
vocabulary rule), ``FusedMoE`` experts (gate / up rows and down columns in ``1 / tp`` of the
intermediate size), every other tensor whole. Used by tests/families/test_hf_tp_plan.py.
"""
from __future__ import annotations

import re
from typing import Sequence

from gpt_oss_ref import Slices

__all__ = ["PLANS", "VOCAB", "plan_slices"]

#: per model type: module (inside a decoder layer) -> "col" / "row", from transformers'
#: ``base_model_tp_plan`` of the model's config (5.24), ``layers.*.`` / ``h.*.`` dropped
PLANS: dict[str, dict[str, str]] = {
    "gpt_neox": {"attention.query_key_value": "col", "attention.dense": "row",
                 "mlp.dense_h_to_4h": "col", "mlp.dense_4h_to_h": "row"},
    "codegen": {"attn.qkv_proj": "col", "attn.out_proj": "row", "mlp.fc_in": "col",
                "mlp.fc_out": "row"},
    "doge": {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
             "self_attn.dt_proj": "row", "self_attn.o_proj": "row", "mlp.gate_proj": "col",
             "mlp.up_proj": "col", "mlp.down_proj": "row"},
    "flex_olmo": {"self_attn.q_proj": "col", "self_attn.k_proj": "col",
                  "self_attn.v_proj": "col", "self_attn.o_proj": "row",
                  # the experts: vLLM's FusedMoE (w1 / w3 rows, w2 columns)
                  "mlp.experts.#.gate_proj": "col", "mlp.experts.#.up_proj": "col",
                  "mlp.experts.#.down_proj": "row"},
}

#: per model type: the vocabulary-parallel tensors (input embedding, head, head bias)
VOCAB: dict[str, frozenset[str]] = {
    "gpt_neox": frozenset({"gpt_neox.embed_in.weight", "embed_out.weight"}),
    "codegen": frozenset({"transformer.wte.weight", "lm_head.weight", "lm_head.bias"}),
    "doge": frozenset({"model.embed_tokens.weight", "lm_head.weight"}),
    "flex_olmo": frozenset({"model.embed_tokens.weight", "lm_head.weight"}),
}

_LAYER = re.compile(r"^.*?\.(?:layers|h)\.\d+\.(.+)\.(weight|bias)$")


def plan_slices(model_type: str, name: str, shape: Sequence[int], tp: int,
                rank: int) -> tuple[Slices, int]:
    """``(slices of the full tensor, zero rows padded after dim 0)`` TP rank ``rank`` holds."""
    whole: Slices = tuple(slice(0, n) for n in shape)
    if name in VOCAB[model_type]:
        per = -(-shape[0] // tp)
        start = min(rank * per, shape[0])
        stop = min(start + per, shape[0])
        return (slice(start, stop),) + whole[1:], per - (stop - start)
    m = _LAYER.match(name)
    if m is None:
        return whole, 0  # final norms
    module = re.sub(r"\.experts\.\d+\.", ".experts.#.", m.group(1))
    how = PLANS[model_type].get(module)
    if how is None or how == "row" and m.group(2) == "bias":
        return whole, 0  # norms, residual scales, routers, a row-parallel bias
    dim = 0 if how == "col" else 1
    n = shape[dim] // tp
    assert n * tp == shape[dim], (name, shape, tp)
    out = list(whole)
    out[dim] = slice(rank * n, (rank + 1) * n)
    return tuple(out), 0
