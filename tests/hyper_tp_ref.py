"""HY-V4 under TP, written independently of the planner: the piece of each stored tensor that
TP rank ``rank`` keeps, spelled from vLLM 0.32's ``models/hy_v4`` (``attention.py``,
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
"""
from __future__ import annotations

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
