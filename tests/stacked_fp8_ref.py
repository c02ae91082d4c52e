"""Stacked (3-D) fine-grained FP8 experts under EP and TP, written independently of the
planner from the serving engine's documented rule.

The layout is transformers' ``FP8Experts`` (``integrations/finegrained_fp8.py``,
``_alloc_expert_proj``) as ``save_pretrained(save_original_format=False)`` writes it:
``experts.gate_up_proj`` fp8 ``[E, 2I, H]`` with ``experts.gate_up_proj_scale_inv`` f32
``[E, 2I/bn, H/bk]``, ``experts.down_proj`` ``[E, H, I]`` with ``down_proj_scale_inv``
``[E, H/bn, I/bk]``.

vLLM 0.32 loads it through ``RoutedExperts.load_weights`` (``fused_moe/routed_experts.py``):
a 3-D tensor without an expert index is "fused"; ``experts.gate_up_proj`` (and, by substring,
``experts.gate_up_proj_scale_inv``: block scales keep the weight's layout) is cut in two on
dim 1 (``chunk(2, dim=1)``: gate, then up), each half loaded as ``w1`` / ``w3``; ``_load_w13``
narrows each half on its rows to ``rows // tp`` from ``tp_rank * (rows // tp)``;
``down_proj`` and its scales are narrowed on dim 2 (``_load_w2``) the same way. Under EP a
rank holds experts ``[ep_rank * E / ep, (ep_rank + 1) * E / ep)`` (linear placement).

transformers' default save (``save_original_format=True``) writes the weights per expert
(``experts.N.gate_proj.weight`` ``[I, H]``...) and keeps the scales stacked; the same loader
takes a per-expert weight as expert ``N``'s ``w1`` / ``w3`` (rows ``rows // tp`` from
``tp_rank * (rows // tp)``) or ``w2`` (columns alike), and the stacked scales as above.
"""
from __future__ import annotations

import torch


def _rows(n: int, tp: int, rank: int) -> slice:
    per = n // tp
    return slice(rank * per, (rank + 1) * per)


def expert_slice(name: str, full: torch.Tensor, tp: int, tp_rank: int, ep: int,
                 ep_rank: int) -> torch.Tensor:
    """What rank (``tp_rank``, ``ep_rank``) holds of stacked expert tensor ``name``."""
    per_ep = full.shape[0] // ep
    t = full[ep_rank * per_ep:(ep_rank + 1) * per_ep]
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("gate_up_proj", "gate_up_proj_scale_inv"):
        gate, up = t.chunk(2, dim=1)
        return torch.cat([gate[:, _rows(gate.shape[1], tp, tp_rank)],
                          up[:, _rows(up.shape[1], tp, tp_rank)]], dim=1)
    if leaf in ("down_proj", "down_proj_scale_inv"):
        return t[:, :, _rows(t.shape[2], tp, tp_rank)]
    raise AssertionError(f"no reference for {name}")


def per_expert_slice(name: str, full: torch.Tensor, tp: int, tp_rank: int) -> torch.Tensor:
    """What TP rank ``tp_rank`` holds of per-expert weight ``name`` (an expert of its EP
    block: ``expert_id`` below)."""
    proj = name.rsplit(".", 2)[-2]
    if proj in ("gate_proj", "up_proj"):
        return full[_rows(full.shape[0], tp, tp_rank)]
    if proj == "down_proj":
        return full[:, _rows(full.shape[1], tp, tp_rank)]
    raise AssertionError(f"no reference for {name}")


def expert_id(name: str) -> int:
    """``N`` of ``...experts.N.<proj>.weight``."""
    return int(name.split(".experts.")[1].split(".")[0])
