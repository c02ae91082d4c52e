"""TP rules of stacked expert layouts other than transformers-5's ``gate_up_proj`` /
``down_proj``, for the generic family, as the serving engine's loader splits them.

- DBRX (vLLM ``dbrx.py``, ``DbrxExperts.weight_loader``): ``ffn.experts.mlp.w1`` / ``v1`` /
  ``w2`` are stored 2-D, ``[E x I, H]`` (``w2`` transposed too); vLLM reshapes each to
  ``[E, I, H]`` and takes rows ``[r I/tp, (r+1) I/tp)`` of every expert: ``E`` segments of
  ``I`` rows on dim 0, each split evenly (``ffn_hidden_size`` must divide by TP).
- GraniteMoE / GraniteMoeShared (vLLM ``granitemoe.py``): ``block_sparse_moe.input_linear``
  ``[E, 2I, H]`` is loaded as ``experts.gate_up_proj`` (halves: gate then up, each split on
  its own), ``output_linear`` ``[E, H, I]`` as ``experts.down_proj`` (dim 2); the shared
  MLP's ``shared_mlp.input_linear`` ``[2S, H]`` is a ``MergedColumnParallelLinear`` of two
  halves, ``shared_mlp.output_linear`` ``[H, S]`` row-parallel.
- Aria (vLLM ``aria.py``, ``is_fused_checkpoint_transposed``): ``mlp.experts.fc1.weight``
  ``[E, H, 2I]`` is transposed to gate_up (halves on dim 2), ``fc2.weight`` ``[E, I, H]`` to
  down (dim 1).

Each rule is checked against the pair's shapes; a component that does not fit gets no rule
here (the generic family refuses it, naming the tensor). Under EP the experts' dim 0 (DBRX:
``E x I`` rows) is cut to the rank's expert block by the planner.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Mapping, Optional

from .spec_view import ShardRule, SpecView

__all__ = ["expert3d_tp_rules", "plain_rule", "EXPERT3D_ARCHITECTURES"]

Factory = Callable[[str], ShardRule]

_DBRX = frozenset({"DbrxForCausalLM"})
_GRANITE = frozenset({"GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"})
_ARIA = frozenset({"AriaTextForCausalLM", "AriaForConditionalGeneration"})

#: architectures whose stacked experts this module splits (vLLM's loaders above)
EXPERT3D_ARCHITECTURES = _DBRX | _GRANITE | _ARIA


def _const(value: tuple[int, ...], _spec: SpecView) -> tuple[int, ...]:
    return value


def plain_rule(pattern: str, dim: Optional[int], segments: Optional[tuple[int, ...]] = None
               ) -> ShardRule:
    """A split on ``dim`` (None: whole) in fixed ``segments`` (each split on its own)."""
    return ShardRule(pattern, dim, segments=partial(_const, segments) if segments else None)


def expert3d_tp_rules(architecture: str, comps: Mapping[str, tuple[int, ...]],
                      num_experts: int) -> dict[str, Factory]:
    """``{component: pattern -> ShardRule}`` for the stacked experts of ``comps`` (a layer's
    components -> shapes, any layer) that the architecture's engine loader splits (see the
    module docstring); empty for other architectures."""
    if architecture in _DBRX:
        return _dbrx(comps, num_experts)
    if architecture in _GRANITE:
        return _pairs(comps, ".input_linear.weight", ".output_linear.weight", transposed=False)
    if architecture in _ARIA:
        return _pairs(comps, ".fc1.weight", ".fc2.weight", transposed=True)
    return {}


def _dbrx(comps: Mapping[str, tuple[int, ...]], num_experts: int) -> dict[str, Factory]:
    out: dict[str, Factory] = {}
    stems = {c[:-len("w1")] for c in comps if c.endswith("experts.mlp.w1")}
    for stem in stems:
        parts = [comps.get(stem + p) for p in ("w1", "v1", "w2")]
        shape = parts[0]
        if num_experts <= 0 or shape is None or len(shape) != 2 or shape[0] % num_experts or \
                any(p != shape for p in parts):
            continue
        segments = (shape[0] // num_experts,) * num_experts  # E experts of I rows each
        for p in ("w1", "v1", "w2"):
            out[stem + p] = partial(plain_rule, dim=0, segments=segments)
    return out


def _pairs(comps: Mapping[str, tuple[int, ...]], up: str, down: str, *, transposed: bool
           ) -> dict[str, Factory]:
    """Gated input / output linears by suffix: 3-D stacked experts ``[E, 2I, H]`` / ``[E, H,
    I]`` (``transposed``: ``[E, H, 2I]`` / ``[E, I, H]``) or a 2-D shared MLP ``[2S, H]`` /
    ``[H, S]``; the input's halves split each, the output on its intermediate dim."""
    out: dict[str, Factory] = {}
    for comp, shape in comps.items():
        if not comp.endswith(up):
            continue
        stem = comp[:-len(up)]
        other = comps.get(stem + down)
        if other is None or len(other) != len(shape):
            continue
        if len(shape) == 3 and not transposed and shape[1] == 2 * other[2] and \
                shape[2] == other[1] and shape[0] == other[0]:
            inter, dims = other[2], (1, 2)
        elif len(shape) == 3 and transposed and shape[2] == 2 * other[1] and \
                shape[1] == other[2] and shape[0] == other[0]:
            inter, dims = other[1], (2, 1)
        elif len(shape) == 2 and shape[0] == 2 * other[1] and shape[1] == other[0]:
            inter, dims = other[1], (0, 1)
        else:
            continue
        out[comp] = partial(plain_rule, dim=dims[0], segments=(inter, inter))
        out[stem + down] = partial(plain_rule, dim=dims[1])
    return out
