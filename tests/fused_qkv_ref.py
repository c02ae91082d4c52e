"""Fused QKV projections and per-model MLP names under TP, written independently of the planner.

Two views of what TP rank ``rank`` holds of a stored tensor, both spelled from the engines'
loaders (vLLM 0.32: ``gpt2.py``, ``bloom.py``, ``falcon.py``, ``exaone.py``, ``sarvam.py`` /
``bailing_moe.py``, ``lfm2.py``, ``mimo_v2.py``, its transformers backend's ``colwise`` / ``rowwise`` for GPT-NeoX and
CodeGen; SGLang 0.5.23: ``gpt_bigcode.py``, ``persimmon.py``, ``starcoder2.py``, ``beam.py``):

- :func:`engine_param`: the parameter the engine builds on that rank from the *whole* stored
  tensor (its load-time reorder / transpose, then ``QKVParallelLinear`` / column / row
  sharding with KV heads replicated when fewer than TP);
- :func:`stored_slice`: the rank's piece of the *stored* tensor (what pploader must read),
  by index arithmetic on the stored layout;
- :func:`engine_view`: the engine's load transform applied to that piece with the rank's
  local head counts. ``engine_view(stored_slice(...)) == engine_param(...)`` is the check
  that the stored piece is exactly the bytes the engine keeps.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

CONV1D = {"gpt2", "gpt-sw3"}             # transformers Conv1D: stored [in, out]
CONV1D_MODULES = {"c_attn", "c_proj", "c_fc"}   # what vLLM's gpt2 ``_transpose_conv1d`` flips
PER_HEAD = {"bloom", "persimmon", "gpt_neox"}   # query_key_value rows [heads, 3, head_dim]
COLUMN = {"c_fc", "c_fc_0", "c_fc_1", "dense_h_to_4h", "fc_in", "q_proj", "k_proj", "v_proj",
          "gate_proj", "up_proj", "w1", "w3"}
ROW = {"c_proj", "dense", "dense_4h_to_h", "fc_out", "out_proj", "o_proj", "down_proj", "w2"}
VOCAB = {"wte", "word_embeddings", "embed_in", "embed_out", "embed_tokens", "lm_head"}
HEAD_VECTORS = {"attention_sink_bias", "gate_bias"}   # one value per query head: heads / tp


def geometry(config: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """``(hidden, heads, kv heads, head_dim)`` as each model's own config defines them."""
    hidden = config.get("hidden_size") or config["n_embd"]
    heads = config.get("num_attention_heads") or config["n_head"]
    mt = config["model_type"]
    if mt == "falcon":
        kv = config.get("num_kv_heads") or heads if config.get("new_decoder_architecture") \
            else 1 if config.get("multi_query", True) else heads
    elif mt == "gpt_bigcode":
        kv = 1 if config.get("multi_query", True) else heads
    else:
        kv = config.get("num_key_value_heads") or heads
    return hidden, heads, kv, config.get("head_dim") or hidden // heads


def _share(n: int, tp: int, rank: int) -> slice:
    """Even rows of ``n`` (vLLM: ``divide(n, tp)``, rank r from ``r * per``)."""
    assert n % tp == 0, (n, tp)
    per = n // tp
    return slice(rank * per, (rank + 1) * per)


def _kv_rows(kv: int, hd: int, tp: int, rank: int) -> slice:
    """QKVParallelLinear's KV rows of a rank: kv / tp heads, or one head replicated on tp / kv
    ranks (``shard_rank = tp_rank // num_kv_head_replicas``)."""
    if kv >= tp:
        return _share(kv * hd, tp, rank)
    head = rank // (tp // kv)
    return slice(head * hd, (head + 1) * hd)


def qkv_parallel(w: torch.Tensor, heads: int, kv: int, hd: int, tp: int, rank: int
                 ) -> torch.Tensor:
    """QKVParallelLinear's weight_loader (no shard id) on rows q | k | v: local q, k, v."""
    q, k, v = w.split([heads * hd, kv * hd, kv * hd])
    return torch.cat([q[_share(heads * hd, tp, rank)], k[_kv_rows(kv, hd, tp, rank)],
                      v[_kv_rows(kv, hd, tp, rank)]])


def _to_qkv(model_type: str, w: torch.Tensor, heads: int, kv: int, hd: int) -> torch.Tensor:
    """The engine's load-time reorder of a stored fused qkv (rows, engine layout) to q | k | v
    (Bloom / Persimmon: ``view(heads, 3, -1).transpose``; Falcon: ``view(kv, q_per_kv + 2,
    -1)``, q heads then k then v)."""
    if model_type in ("bloom", "persimmon"):
        return w.reshape((heads, 3, -1) + tuple(w.shape[1:])).transpose(0, 1).reshape(w.shape)
    if model_type == "falcon":
        g = w.reshape((kv, heads // kv + 2, -1) + tuple(w.shape[1:]))
        flat = lambda t: t.reshape((-1,) + tuple(w.shape[1:]))  # noqa: E731
        return torch.cat([flat(g[:, :-2]), flat(g[:, -2]), flat(g[:, -1])])
    return w


def _conv1d(model_type: str, module: str, leaf: str) -> bool:
    return model_type in CONV1D and module in CONV1D_MODULES and leaf == "weight"


def _module(name: str) -> tuple[str, str]:
    module, leaf = name.split(".")[-2:]
    return module, leaf


def engine_param(model_type: str, name: str, full: torch.Tensor, config: Mapping[str, Any],
                 tp: int, rank: int) -> torch.Tensor:
    """The engine's parameter on TP rank ``rank``, built from the whole stored tensor."""
    hidden, heads, kv, hd = geometry(config)
    module, leaf = _module(name)
    w = full.t() if _conv1d(model_type, module, leaf) else full
    if module in ("c_attn", "query_key_value", "qkv_proj"):
        if model_type in ("gpt_neox", "codegen"):   # transformers backend: colwise, even rows
            return w[_share(w.shape[0], tp, rank)]
        return qkv_parallel(_to_qkv(model_type, w, heads, kv, hd), heads, kv, hd, tp, rank)
    return _plain(module, leaf, w, tp, rank)


def _plain(module: str, leaf: str, w: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if leaf in HEAD_VECTORS:  # vLLM's MiMo-V2 / SGLang's Beam: narrow(0, rank * n / tp, n / tp)
        return w[_share(w.shape[0], tp, rank)]
    if module in VOCAB:  # ParallelLMHead / VocabParallelEmbedding: ceil(V / tp), zero padded
        per = -(-w.shape[0] // tp)
        part = w[rank * per:(rank + 1) * per]
        pad = per - part.shape[0]
        return torch.cat([part, part.new_zeros((pad,) + tuple(part.shape[1:]))]) if pad else part
    if module in COLUMN:
        return w[_share(w.shape[0], tp, rank)]
    if module in ROW and leaf == "weight":
        return w[:, _share(w.shape[1], tp, rank)]
    return w  # norms, position embeddings, row-parallel biases: whole on every rank


def engine_view(model_type: str, name: str, piece: torch.Tensor, config: Mapping[str, Any],
                tp: int) -> torch.Tensor:
    """The engine's load transform of a rank's stored piece, with the rank's local counts
    (heads / tp, KV heads / tp or the one replicated KV head)."""
    _, heads, kv, hd = geometry(config)
    module, leaf = _module(name)
    w = piece.t() if _conv1d(model_type, module, leaf) else piece
    if module in ("c_attn", "query_key_value", "qkv_proj"):
        return _to_qkv(model_type, w, heads // tp, max(1, kv // tp), hd)
    return w


def stored_slice(model_type: str, name: str, full: torch.Tensor, config: Mapping[str, Any],
                 tp: int, rank: int) -> torch.Tensor:
    """The rank's piece of the stored tensor, by index arithmetic on the stored layout."""
    hidden, heads, kv, hd = geometry(config)
    module, leaf = _module(name)
    conv = _conv1d(model_type, module, leaf)
    if module == "c_attn" and model_type in CONV1D:   # [H, 3H]: q | k | v columns
        out = full if conv else full.unsqueeze(0)
        cols = [out[:, i * hidden:(i + 1) * hidden][:, _share(hidden, tp, rank)]
                for i in range(3)]
        got = torch.cat(cols, dim=1)
        return got if conv else got.squeeze(0)
    if module in ("c_attn", "query_key_value") and model_type in ("gpt_bigcode", "sarvam_moe"):
        return qkv_parallel(full, heads, kv, hd, tp, rank)   # stored q | k | v already
    if module == "query_key_value" and model_type in PER_HEAD:  # whole heads of 3 x hd rows
        return full[_share(heads, tp, rank).start * 3 * hd:_share(heads, tp, rank).stop * 3 * hd]
    if module == "query_key_value" and model_type == "falcon":
        if kv == 1:   # [q heads, k, v]: q by heads, k and v on every rank
            q = full[:heads * hd][_share(heads * hd, tp, rank)]
            return torch.cat([q, full[heads * hd:]])
        groups = _share(kv, tp, rank)     # whole groups of q_per_kv + 2 heads
        size = (heads // kv + 2) * hd
        return full[groups.start * size:groups.stop * size]
    if module == "qkv_proj" and model_type == "codegen":     # 4 whole blocks of q | v | k
        return full[_share(4, tp, rank).start * full.shape[0] // 4:
                    _share(4, tp, rank).stop * full.shape[0] // 4]
    if conv:   # Conv1D [in, out]: column-parallel on dim 1, row-parallel on dim 0
        if module in COLUMN:
            return full[:, _share(full.shape[1], tp, rank)]
        if module in ROW:
            return full[_share(full.shape[0], tp, rank)]
    return _plain(module, leaf, full, tp, rank)
