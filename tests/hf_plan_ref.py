"""The slice of each tensor a TP rank holds when vLLM serves the model through its transformers
backend, written independently of the planner from transformers' ``base_model_tp_plan`` of
each model (copied below as data) and vLLM's layer classes: ``colwise`` /
``colwise_gather_output`` -> ``ColumnParallelLinear`` (weight rows and bias in ``1 / tp``),
``rowwise`` -> ``RowParallelLinear`` (weight columns in ``1 / tp``, bias whole), the
vocabulary embedding and the head (its bias too) in ``ceil(V / tp)`` rows (the project's
vocabulary rule), ``FusedMoE`` experts (gate / up rows and down columns in ``1 / tp`` of the
intermediate size), every other tensor whole. Where vLLM's fusers merge q / k / v into a
``QKVParallelLinear`` ("heads" below; vLLM 0.32's trace with transformers 5.19), each rank holds
whole heads of ``HEAD_DIM`` rows: ``1 / tp`` of the query heads, and of the KV heads when there
are at least ``tp`` of them, else the one KV head ``rank * kv // tp`` (copied on ``tp / kv``
ranks); a GLU's gate / up (``MergedColumnParallelLinear``) each in ``1 / tp`` of its rows, the
projection after them row-parallel. Used by tests/families/test_hf_tp_plan.py.
"""
from __future__ import annotations

import re
from typing import Sequence

from gpt_oss_ref import Slices

__all__ = ["HEAD_DIM", "PLANS", "VOCAB", "plan_slices"]

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
    # vLLM's fusers decide these whatever the plans name (families/hf_fusers.py)
    # MLA: q_a / kv_a one unsplit linear, q_b (the model's q_gate_proj) / kv_b by rows
    "axk2": {"self_attn.q_b_proj": "col", "self_attn.kv_b_proj": "col",
             "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col",
             "mlp.down_proj": "row", "mlp.shared_experts.gate_proj": "col",
             "mlp.shared_experts.up_proj": "col", "mlp.shared_experts.down_proj": "row",
             "mlp.experts.#.gate_proj": "col", "mlp.experts.#.up_proj": "col",
             "mlp.experts.#.down_proj": "row"},
    # the text layers by the plan (fused qkv / gate_up evenly); the audio and vision towers'
    # attention fused by heads (their other linears: ``embedding_rowwise`` -> whole)
    "phi4_multimodal": {"self_attn.qkv_proj": "col", "self_attn.o_proj": "row",
                        "mlp.gate_up_proj": "col", "mlp.down_proj": "row",
                        "self_attn.q_proj": "heads", "self_attn.k_proj": "heads",
                        "self_attn.v_proj": "heads", "self_attn.out_proj": "row"},
}

#: per model type: the head size of its fused attention (the tiny configs' ``head_dim``)
HEAD_DIM: dict[str, int] = {"phi4_multimodal": 16}

#: per model type: the vocabulary-parallel tensors (input embedding, head, head bias)
VOCAB: dict[str, frozenset[str]] = {
    "gpt_neox": frozenset({"gpt_neox.embed_in.weight", "embed_out.weight"}),
    "codegen": frozenset({"transformer.wte.weight", "lm_head.weight", "lm_head.bias"}),
    "doge": frozenset({"model.embed_tokens.weight", "lm_head.weight"}),
    "flex_olmo": frozenset({"model.embed_tokens.weight", "lm_head.weight"}),
    **{t: frozenset({"model.embed_tokens.weight", "lm_head.weight"})
       for t in ("axk2", "phi4_multimodal")},
}

_LAYER = re.compile(r"^.*?\.(?:layers|h|encoders)\.\d+\.(.+)\.(weight|bias)$")


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
    if how == "heads":
        hd = HEAD_DIM[model_type]
        heads = shape[0] // hd
        assert heads * hd == shape[0], (name, shape, hd)
        if heads >= tp:
            assert heads % tp == 0, (name, heads, tp)
            per = heads // tp
            first = rank * per
        else:  # fewer KV heads than ranks: each rank one whole head, copied
            per, first = 1, rank * heads // tp
        out = list(whole)
        out[0] = slice(first * hd, (first + per) * hd)
        return tuple(out), 0
    dim = 0 if how == "col" else 1
    n = shape[dim] // tp
    assert n * tp == shape[dim], (name, shape, tp)
    out = list(whole)
    out[dim] = slice(rank * n, (rank + 1) * n)
    return tuple(out), 0
