"""Multi-head latent attention models under TP, written independently of the planner: the
slice of each tensor a TP rank holds, as vLLM's DeepSeek-V2 / V3 / V3.2 and GLM-5 loaders
shard them (``DeepseekV2MLAAttention``, ``Indexer``, ``FusedMoE``,
``VocabParallelEmbedding``). Used by tests/planning/test_real_scale_mla.py (sparse published
layouts) and tests/families/test_mla_tp.py (tiny checkpoints, bytes compared).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from gpt_oss_ref import Slices

__all__ = ["mla_slices"]


def mla_slices(name: str, shape: Sequence[int], config: Mapping[str, Any], tp: int,
               rank: int) -> tuple[Slices, int]:
    """``(slices of the full tensor, zero rows padded after dim 0)`` TP rank ``rank`` holds,
    as vLLM's DeepSeek-V2/V3/V3.2 and GLM-5 loaders shard them: q_b / kv_b rows and o's
    columns by heads, the low-rank inputs q_a / kv_a_proj_with_mqa, their norms, the
    sparse-attention indexer, routers, norms and the MTP ``eh_proj`` whole, every MLP's and
    expert's gate / up rows and down columns in ``1 / tp`` of the intermediate size, the
    vocabulary (embeddings, head, the MTP layer's own copies) in ``ceil(V / tp)`` rows."""
    whole: Slices = tuple(slice(0, n) for n in shape)
    heads = config["num_attention_heads"]
    per_head = {"q_b_proj": config["qk_nope_head_dim"] + config["qk_rope_head_dim"],
                "q_proj": config["qk_nope_head_dim"] + config["qk_rope_head_dim"],
                "kv_b_proj": config["qk_nope_head_dim"] + config["v_head_dim"]}
    module, leaf = name.split(".")[-2], name.split(".")[-1]

    def part(d: int, unit: int) -> Slices:
        out = list(whole)
        n = shape[d] // tp
        assert n * tp == shape[d] and n % unit == 0, (name, shape, tp)
        out[d] = slice(rank * n, (rank + 1) * n)
        return tuple(out)

    if ".indexer." in name or leaf != "weight":  # the indexer, router bias: whole
        return whole, 0
    if module in per_head and ".self_attn." in name:
        assert shape[0] == heads * per_head[module], (name, shape)
        return part(0, per_head[module]), 0
    if module == "o_proj":
        assert shape[1] == heads * config["v_head_dim"], (name, shape)
        return part(1, config["v_head_dim"]), 0
    if module in ("gate_proj", "up_proj"):
        return part(0, 1), 0
    if module == "down_proj":
        return part(1, 1), 0
    if module in ("embed_tokens", "lm_head", "head"):
        per = -(-shape[0] // tp)
        start = min(rank * per, shape[0])
        stop = min(start + per, shape[0])
        return (slice(start, stop),) + whole[1:], per - (stop - start)
    assert module in ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm",
                      "gate", "norm", "input_layernorm", "post_attention_layernorm", "enorm",
                      "hnorm", "eh_proj") or module.endswith("norm"), name
    return whole, 0
