"""DBRX's, Laguna's, dots3 Note's and LongCat-Flash's TP slices, written from the engines' loaders, independently
of the planner.

What TP rank ``rank`` of ``tp`` holds of each stored tensor (vLLM 0.32 ``dbrx.py`` /
``laguna.py`` / ``models/dots3_note`` / ``longcat_flash.py``; SGLang 0.5.23 splits DBRX,
Laguna and LongCat alike):

- DBRX: ``Wqkv`` is q | k | v rows (``QKVParallelLinear``: q by ``n_heads``, k / v by
  ``attn_config.kv_n_heads``, one KV head copied on ``tp / kv`` ranks when fewer than TP);
  ``out_proj`` columns (``RowParallelLinear``); the stacked experts ``w1`` / ``v1`` / ``w2``
  ``[E * I, d_model]`` viewed ``[E, I, d_model]``, every expert's ``I / tp`` rows
  (``DbrxExperts.weight_loader``: ``reshape(-1, I * tp, d)``, ``w2`` transposed after);
- Laguna: layer ``i`` has ``num_attention_heads_per_layer[i]`` query heads; ``q_proj`` rows and
  ``o_proj`` columns by those heads, ``g_proj`` rows (``ColumnParallelLinear``), ``k_proj`` /
  ``v_proj`` by KV heads, every MLP (dense, shared, each expert) gate / up rows and down
  columns; the router and its ``e_score_correction_bias`` whole;
- dots3 Note: DeepSeek-V3.2's MLA and indexer (tests/mla_ref.py), plus the attention gate
  ``g_proj``, one row per head (headwise, transformers' only kind): vLLM's
  ``ReplicatedLinear``, whole on every rank;
- LongCat-Flash: its two numbered MLA sub-blocks ``self_attn.{i}`` and dense ``mlps.{i}`` as
  DeepSeek's (tests/mla_ref.py), the numbered norms and the router (``classifier``, rows the
  routed plus the zero experts; ``e_score_correction_bias``) whole;
- DBRX, Laguna: the vocabulary rows ``ceil(V / tp)`` a rank, zero-padded (``VocabParallelEmbedding`` /
  ``ParallelLMHead``); norms whole.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from mla_ref import mla_slices


def _share(n: int, tp: int, rank: int) -> slice:
    assert n % tp == 0, (n, tp)
    per = n // tp
    return slice(rank * per, (rank + 1) * per)


def _kv(kv: int, hd: int, tp: int, rank: int) -> slice:
    """A rank's KV rows: kv / tp heads, or the one head it shares with tp / kv - 1 others."""
    if kv >= tp:
        return _share(kv * hd, tp, rank)
    head = rank // (tp // kv)
    return slice(head * hd, (head + 1) * hd)


def _vocab(w: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    per = -(-w.shape[0] // tp)
    part = w[rank * per:(rank + 1) * per]
    pad = per - part.shape[0]
    return torch.cat([part, part.new_zeros((pad,) + tuple(part.shape[1:]))]) if pad else part


def dbrx_slice(name: str, full: torch.Tensor, config: Mapping[str, Any], tp: int, rank: int,
               ep: int = 1, ep_rank: int = 0) -> torch.Tensor:
    """With ``ep`` > 1 a rank's experts are the ``ep_rank``-th of ``ep`` equal blocks, each
    expert's rows its TP share (vLLM's expert parallelism inside the TP split)."""
    d, heads = config["d_model"], config["n_heads"]
    kv, hd = config["attn_config"]["kv_n_heads"], d // heads
    inter = config["ffn_config"]["ffn_hidden_size"]
    if name.endswith(("wte.weight", "lm_head.weight")):
        return _vocab(full, tp, rank)
    if name.endswith("attn.Wqkv.weight"):
        q, k, v = full.split([heads * hd, kv * hd, kv * hd])
        rows = _kv(kv, hd, tp, rank)
        return torch.cat([q[_share(heads * hd, tp, rank)], k[rows], v[rows]])
    if name.endswith("attn.out_proj.weight"):
        return full[:, _share(full.shape[1], tp, rank)]
    if re.search(r"experts\.mlp\.(w1|v1|w2)$", name):
        experts = full.reshape(-1, inter, d)
        block = experts[_share(experts.shape[0], ep, ep_rank)]
        return block[:, _share(inter, tp, rank)].reshape(-1, d)
    return full   # norms, the router


def laguna_slice(name: str, full: torch.Tensor, config: Mapping[str, Any], tp: int, rank: int
                 ) -> torch.Tensor:
    hd, kv = config["head_dim"], config["num_key_value_heads"]
    m = re.search(r"layers\.(\d+)\.", name)
    heads = config["num_attention_heads_per_layer"][int(m.group(1))] if m else 0
    module = name.split(".")[-2]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return _vocab(full, tp, rank)
    if module == "q_proj":
        return full[_share(heads, tp, rank).start * hd:_share(heads, tp, rank).stop * hd]
    if module == "o_proj":
        return full[:, _share(heads, tp, rank).start * hd:_share(heads, tp, rank).stop * hd]
    if module == "g_proj":                       # one row per head (or per head channel)
        return full[_share(full.shape[0], tp, rank)]
    if module in ("k_proj", "v_proj"):
        return full[_kv(kv, hd, tp, rank)]
    if module in ("gate_proj", "up_proj"):
        return full[_share(full.shape[0], tp, rank)]
    if module == "down_proj":
        return full[:, _share(full.shape[1], tp, rank)]
    return full   # norms, q / k norms of head_dim, the router and its score correction


def dots3_slice(name: str, full: torch.Tensor, config: Mapping[str, Any], tp: int, rank: int
                ) -> torch.Tensor:
    if name.endswith("self_attn.g_proj.weight"):
        assert full.shape[0] == config["num_attention_heads"], (name, full.shape)
        return full                                       # headwise: replicated
    slices, pad = mla_slices(name, full.shape, config, tp, rank)
    want = full[slices]
    return torch.cat([want, want.new_zeros((pad,) + tuple(want.shape[1:]))]) if pad else want


def longcat_slice(name: str, full: torch.Tensor, config: Mapping[str, Any], tp: int, rank: int
                  ) -> torch.Tensor:
    if re.search(r"_layernorm\.\d\.weight$|\.router\.", name):
        return full
    slices, pad = mla_slices(name, full.shape, config, tp, rank)
    want = full[slices]
    return torch.cat([want, want.new_zeros((pad,) + tuple(want.shape[1:]))]) if pad else want
