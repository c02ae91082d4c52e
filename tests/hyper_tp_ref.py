"""Hyper-connection models under TP, written independently of the planner: the piece of each
stored tensor that TP rank ``rank`` keeps.

HY-V4 (:func:`stored_slice`), spelled from vLLM 0.32's ``models/hy_v4`` (``attention.py``,
``hc.py``, ``moe.py``, ``model.py``'s ``load_weights``) and its parallel linear layers:

- whole: every norm, the hyper-connection mixers (``hc_pre.*``: ``ReplicatedLinear`` and plain
  parameters), MLA's ``q_a_proj`` / ``kv_a_proj_with_mqa`` (one fused replicated GEMM), the
  whole indexer (``wq_b`` replicated; ``wk`` with ``weights_proj`` built ``disable_tp``; its
  ``k_norm``), the router (``mlp.gate.*``);
- rows ``1 / tp``: the vocabulary (embedding and head), ``q_b_proj`` / ``kv_b_proj`` and the
  attention gate ``linear_gate`` (``ColumnParallelLinear``), the per-head
  ``learnable_sink_param`` (``load_weights`` narrows heads), the MLP gates and ``up_proj``
  (transformers saves ``gate_proj`` as ``linear_gate``);
- columns ``1 / tp``: ``o_proj`` and the MLPs' ``down_proj`` (``RowParallelLinear``);
- stacked experts ``[E, 2I, H]`` (gate rows then up rows): each half's ``I / tp`` rows;
  ``down_proj`` ``[E, H, I]``: ``I / tp`` on its last dim (``FusedMoE`` w13 / w2).

Qwen4-exp (:func:`qwen4_exp_slice`), from vLLM's ``models/qwen4_exp`` (``hyperconnection.py``,
``qsa.py``) and ``QwenGatedDeltaNetAttention`` (non-interleaved Qwen3.5 layout):

- whole: norms, the hyper connections (``*_hyper_connection.*``,
  ``model.hyper_connection_mixer.*``: replicated / ``disable_tp``), the indexer (its
  ``index_qk_proj`` is a ``qkv_proj`` shard loaded at shard rank 0 with ``tp`` x its width),
  the router and ``shared_expert_gate``, the gated-delta-net ``norm``;
- ``in_proj_qkv`` and ``conv1d``: the q, k, v parts (key, key, value widths) each ``1 / tp``
  of its rows, concatenated (``MergedColumnParallelLinear`` / ``mamba_v2_sharded_weight_loader``);
- rows ``1 / tp``: vocabulary, ``q_proj`` (``[q, gate]`` per head), ``k_proj`` / ``v_proj``
  (KV heads no fewer than TP here), ``in_proj_z`` / ``b`` / ``a``, ``A_log``, ``dt_bias``,
  the experts' and shared expert's ``gate_proj`` / ``up_proj``;
- columns ``1 / tp``: ``o_proj``, ``out_proj``, ``down_proj``.

DeepSeek-V4 (:func:`deepseek_v4_slice`), from vLLM's ``models/deepseek_v4`` (``attention.py``,
``compressor.py``, ``nvidia/model.py``):

- whole: norms, the hyper connections (``hc_*`` plain parameters), ``wq_a`` / ``wkv`` (one
  ``disable_tp`` GEMM) and their norms, the compressors (``ape``, ``wkv`` / ``wgate``
  ``disable_tp``, ``norm``), the indexer (``ReplicatedLinear``), the router (``gate.*``);
- rows ``1 / tp``: vocabulary (``embed_tokens``, ``head``), ``wq_b`` (heads), ``wo_a``
  (``ColumnParallelLinear`` over ``o_groups x o_lora_rank``), ``attn_sink`` (narrowed to the
  rank's heads), the experts' and shared expert's ``w1`` / ``w3``;
- columns ``1 / tp``: ``wo_b`` (``RowParallelLinear``), ``w2``.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

WHOLE_TOKENS = ("layernorm", "norm.", "hc_pre.", "q_a_proj", "kv_a_proj_with_mqa",
                "indexer.", "mlp.gate.")
ROWS = ("embed_tokens", "lm_head", "q_b_proj", "kv_b_proj", "linear_gate",
        "learnable_sink_param", "up_proj")
COLUMNS = ("o_proj", "down_proj")


def _even(n: int, tp: int, rank: int) -> slice:
    assert n % tp == 0, (n, tp)
    per = n // tp
    return slice(rank * per, (rank + 1) * per)


def stored_slice(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """The rank's piece of the stored tensor ``name`` (see the module docstring)."""
    if name.endswith("experts.gate_up_proj"):
        inter = full.shape[1] // 2
        part = _even(inter, tp, rank)
        return torch.cat([full[:, :inter][:, part], full[:, inter:][:, part]], dim=1)
    if name.endswith("experts.down_proj"):
        return full[:, :, _even(full.shape[2], tp, rank)]
    if name == "model.norm.weight" or any(t in name for t in WHOLE_TOKENS):
        return full
    leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    if leaf in ROWS:
        return full[_even(full.shape[0], tp, rank)]
    if leaf in COLUMNS:
        return full[:, _even(full.shape[1], tp, rank)]
    raise AssertionError(f"the reference has no rule for {name} {list(full.shape)}")


Q4_WHOLE = ("layernorm", "norm.", "hyper_connection", "indexer.", "mlp.gate.",
            "shared_expert_gate")
Q4_ROWS = ("embed_tokens", "lm_head", "q_proj", "k_proj", "v_proj", "in_proj_z", "in_proj_b",
           "in_proj_a", "A_log", "dt_bias", "gate_proj", "up_proj")
Q4_COLUMNS = ("o_proj", "out_proj", "down_proj")


def qwen4_exp_slice(name: str, full: torch.Tensor, config: Mapping[str, Any], tp: int,
                    rank: int) -> torch.Tensor:
    """Qwen4-exp's rank piece of the stored tensor ``name`` (see the module docstring);
    ``config`` is the text config."""
    if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
        key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
        assert full.shape[0] == 2 * key + value, (name, full.shape)
        parts, start = [], 0
        for width in (key, key, value):
            parts.append(full[start:start + width][_even(width, tp, rank)])
            start += width
        return torch.cat(parts)
    if name == "model.norm.weight" or any(t in name for t in Q4_WHOLE):
        return full
    leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    if leaf in Q4_ROWS:
        return full[_even(full.shape[0], tp, rank)]
    if leaf in Q4_COLUMNS:
        return full[:, _even(full.shape[1], tp, rank)]
    raise AssertionError(f"the reference has no rule for {name} {list(full.shape)}")


V4_WHOLE = ("norm.", "hc_", "wq_a", "attn.wkv", "compressor.", "indexer.", "ffn.gate.")
V4_ROWS = ("embed_tokens", "head", "wq_b", "wo_a", "attn_sink", "w1", "w3")
V4_COLUMNS = ("wo_b", "w2")


def deepseek_v4_slice(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """DeepSeek-V4's rank piece of the stored tensor ``name`` (see the module docstring)."""
    if name == "model.norm.weight" or any(t in name for t in V4_WHOLE):
        return full
    leaf = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    if leaf in V4_ROWS:
        return full[_even(full.shape[0], tp, rank)]
    if leaf in V4_COLUMNS:
        return full[:, _even(full.shape[1], tp, rank)]
    raise AssertionError(f"the reference has no rule for {name} {list(full.shape)}")
