"""ZAYA1's release naming under PP, TP and EP, written from SGLang's ``models/zaya.py``
independently of the planner: which tensors a rank loads and the piece of each it holds.

- Layers: ``num_hidden_layers`` (``len(zaya_layers)``), attention at even ids, MoE at odd ids;
  stage ``s`` owns SGLang's ``get_pp_indices`` window (the last ``n % pp`` stages one more).
  The embedding on the first stage, ``final_norm`` / ``res_scale`` / ``lm_head`` on the last.
- TP (``CCA`` head-parallel): ``linear_q`` / ``linear_k`` rows ``[r * n / tp, (r + 1) * n / tp)``
  (``ColumnParallelLinear``); ``conv_qk.*`` rows = the rank's query-head rows then its key-head
  rows (``conv_row_loader``: ``cat(w[q_start:q_end], w[k_start:k_end])``); ``temp`` the rank's
  key heads; ``o_proj.weight`` columns of the rank's query heads; the vocabulary rows
  ``ceil(V / tp)`` a rank; ``linear_fc1``: rows ``[r * I / tp, ...)`` of the first half (w1)
  then the same of the second (w3); ``linear_fc2``: columns (w2); all else whole.
- EP: expert ``e`` on EP rank ``e // (E / ep)`` (``_map_global_expert_id_to_local_expert_id``).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch


def sglang_window(n: int, pp: int, rank: int) -> tuple[int, int]:
    """SGLang's ``get_pp_indices`` (no partition variable)."""
    base, rem = divmod(n, pp)
    if rank >= pp - rem:
        start = rank * (base + 1) - (pp - rem)
        return start, start + base + 1
    return rank * base, rank * base + base


def layer_of(name: str) -> Optional[int]:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") else None


def expert_of(name: str) -> Optional[int]:
    key = ".local_experts."
    return int(name.split(key)[1].split(".")[0]) if key in name else None


def owns(name: str, config: Mapping[str, Any], pp: int, pp_rank: int, ep: int,
         ep_rank: int) -> bool:
    """Whether a rank at (pp_rank, ep_rank) loads tensor ``name``."""
    n = len(config["zaya_layers"]) if config.get("zaya_layers") else config["num_hidden_layers"]
    start, end = sglang_window(n, pp, pp_rank)
    layer = layer_of(name)
    if layer is None:
        if name.startswith("model.embed_tokens."):
            return pp_rank == 0
        return pp_rank == pp - 1
    if not start <= layer < end:
        return False
    expert = expert_of(name)
    if expert is None or ep == 1:
        return True
    per = config["num_experts"] // ep
    return expert // per == ep_rank


def piece(name: str, full: torch.Tensor, config: Mapping[str, Any], tp: int,
          rank: int) -> torch.Tensor:
    """What TP rank ``rank`` of ``tp`` holds of tensor ``name`` (zero rows padded for the
    vocabulary)."""
    if tp == 1:
        return full
    nq, nk, d = config["num_attention_heads"], config["num_query_groups"], config["head_dim"]

    def rows(t: torch.Tensor, total: int, dim: int = 0) -> torch.Tensor:
        per = total // tp
        return t.narrow(dim, rank * per, per)

    leaf = name.split("self_attn.qkv.")[-1] if "self_attn.qkv." in name else None
    if leaf in ("linear_q.weight", "linear_q.bias"):
        return rows(full, full.shape[0])
    if leaf in ("linear_k.weight", "linear_k.bias", "temp"):
        return rows(full, full.shape[0])
    if leaf is not None and leaf.startswith("conv_qk."):
        q_per, k_per = nq * d // tp, nk * d // tp
        return torch.cat([full[rank * q_per:(rank + 1) * q_per],
                          full[nq * d + rank * k_per:nq * d + (rank + 1) * k_per]])
    if name.endswith("self_attn.o_proj.weight"):
        return rows(full, full.shape[1], 1)
    if name.endswith("linear_fc1.weight"):
        half = full.shape[0] // 2
        return torch.cat([rows(full[:half], half), rows(full[half:], half)])
    if name.endswith("linear_fc2.weight"):
        return rows(full, full.shape[1], 1)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        per = -(-full.shape[0] // tp)
        got = full[rank * per:(rank + 1) * per]
        return torch.cat([got, got.new_zeros((per - got.shape[0],) + tuple(got.shape[1:]))])
    return full
