"""Gemma 4's and Gemma 3n's TP slices, written from vLLM 0.32's ``gemma4.py`` /
``gemma4_mm.py`` / ``gemma3n.py`` loaders, independently of the planner.

What TP rank ``rank`` of ``tp`` holds of each stored tensor:

- ``embed_tokens`` and the per-layer embedding ``embed_tokens_per_layer``
  (``VocabParallelEmbedding``), the head if untied: ``ceil(V / tp)`` vocabulary rows a rank,
  zero-padded;
- ``per_layer_model_projection`` (``ColumnParallelLinear``): rows evenly;
- attention (``QKVParallelLinear`` / ``RowParallelLinear``): ``q_proj`` rows and ``o_proj``
  columns by ``num_attention_heads``; ``k_proj`` / ``v_proj`` rows by the layer's own KV heads
  (``per_layer_config[i].num_key_value_heads``, else ``num_key_value_heads``), one head copied
  on ``tp / kv`` ranks when fewer than TP;
- MLP: ``gate_proj`` / ``up_proj`` rows, ``down_proj`` columns; the MoE layers' stacked
  experts (``FusedMoE``): ``experts.gate_up_proj`` ``[E, 2I, H]`` the rank's share of the gate
  half's and of the up half's rows, ``experts.down_proj`` ``[E, H, I]`` its share of ``I``;
  the router (``scale``, ``per_expert_scale``, ``proj``) whole;
- everything else whole: norms (``q_norm`` / ``k_norm`` per head, ``per_layer_projection_norm``,
  ``post_per_layer_input_norm``), ``per_layer_input_gate`` / ``per_layer_projection``
  (``ReplicatedLinear``), ``layer_scalar``.

Gemma 3n besides: ``altup_projections.{i}`` / ``altup_unembed_projections.{i}``
(``ColumnParallelLinear``) rows evenly, ``laurel.linear_left`` rows, ``laurel.linear_right``
columns (``RowParallelLinear``); the ``altup`` block of a layer (``ReplicatedLinear`` and its
scales) whole.

The MTP assistants (SGLang 0.5.23 ``gemma4_mtp``): every tensor outside the layers whole
(``pre_projection`` / ``post_projection`` ``ReplicatedLinear``, ``embed_tokens`` an
``nn.Embedding`` whose tied head's logits are never gathered); their layers as above.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import torch


def _share(n: int, tp: int, rank: int) -> slice:
    assert n % tp == 0, (n, tp)
    per = n // tp
    return slice(rank * per, (rank + 1) * per)


def _vocab(w: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    per = -(-w.shape[0] // tp)
    part = w[rank * per:(rank + 1) * per]
    pad = per - part.shape[0]
    return torch.cat([part, part.new_zeros((pad,) + tuple(part.shape[1:]))]) if pad else part


def layer_kv_heads(text: Mapping[str, Any], layer: int) -> int:
    """Layer ``layer``'s KV heads: its ``per_layer_config`` entry's, else the config's."""
    own = (text.get("per_layer_config") or {}).get(str(layer)) or {}
    return int(own.get("num_key_value_heads") or text["num_key_value_heads"])


def _kv_rows(w: torch.Tensor, kv: int, tp: int, rank: int) -> torch.Tensor:
    hd = w.shape[0] // kv
    if kv >= tp:
        return w[_share(kv, tp, rank).start * hd:_share(kv, tp, rank).stop * hd]
    head = rank // (tp // kv)
    return w[head * hd:(head + 1) * hd]


def gemma4_slice(name: str, full: torch.Tensor, config: Mapping[str, Any], tp: int, rank: int
                 ) -> torch.Tensor:
    """Rank ``rank``'s part of the stored tensor ``name`` (``config``: config.json)."""
    text = config.get("text_config") or config
    if config.get("model_type", "").endswith("_assistant") and ".layers." not in name:
        return full
    heads = text["num_attention_heads"]
    leaf = name.rsplit(".", 2)[-2:]
    if name.endswith(("embed_tokens.weight", "embed_tokens_per_layer.weight", "lm_head.weight")):
        return _vocab(full, tp, rank)
    if name.endswith("per_layer_model_projection.weight") or \
            re.search(r"altup_(unembed_)?projections\.\d+\.weight$", name) or \
            name.endswith("laurel.linear_left.weight"):
        return full[_share(full.shape[0], tp, rank)]
    if name.endswith("experts.gate_up_proj"):
        gate, up = full.chunk(2, dim=1)
        s = _share(gate.shape[1], tp, rank)
        return torch.cat([gate[:, s], up[:, s]], dim=1)
    if name.endswith("experts.down_proj"):
        return full[:, :, _share(full.shape[2], tp, rank)]
    m = re.search(r"\.layers\.(\d+)\.", name)
    if m is None or leaf[-1] != "weight":
        return full
    role = leaf[0]
    if role == "q_proj":
        hd = full.shape[0] // heads
        s = _share(heads, tp, rank)
        return full[s.start * hd:s.stop * hd]
    if role in ("k_proj", "v_proj"):
        return _kv_rows(full, layer_kv_heads(text, int(m.group(1))), tp, rank)
    if role == "o_proj":
        hd = full.shape[1] // heads
        s = _share(heads, tp, rank)
        return full[:, s.start * hd:s.stop * hd]
    if role in ("gate_proj", "up_proj"):
        return full[_share(full.shape[0], tp, rank)]
    if role == "down_proj" or name.endswith("laurel.linear_right.weight"):
        return full[:, _share(full.shape[1], tp, rank)]
    return full
