"""Fused tensors whose released parts transformers' save splits wrongly.

transformers 5 loads some checkpoints through a conversion that concatenates several saved
tensors into one (``conversion_mapping``: ``Concatenate``); the generic family finds the
saved names and shapes by running that conversion backwards on its meta model, which cuts the
fused tensor into equal parts. Where the released parts have different widths, those are
the shapes a released checkpoint holds (and the engines load), not the equal parts:

- OLMo-hybrid's gated-delta-net convolutions, ``linear_attn.{q,k,v}_conv1d``: [key, key,
  value] rows (``linear_num_{key,value}_heads x linear_{key,value}_head_dim``), as vLLM's
  ``olmo_hybrid`` loads them; the real config's key width is half its value width.

A checkpoint re-saved by transformers with these equal parts is refused by the planner's
shape check (naming the tensor); neither vLLM nor the released layout can hold it.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = ["released_shapes"]

Shapes = dict[str, tuple[int, ...]]


def _olmo_hybrid(text: Any) -> dict[str, int]:
    def size(heads: str, dim: str) -> int:
        return int(getattr(text, heads, 0) or 0) * int(getattr(text, dim, 0) or 0)
    key = size("linear_num_key_heads", "linear_key_head_dim")
    value = size("linear_num_value_heads", "linear_value_head_dim")
    return {"linear_attn.q_conv1d.weight": key, "linear_attn.k_conv1d.weight": key,
            "linear_attn.v_conv1d.weight": value}


#: model type -> (its text config -> the released dim-0 width of each part, by component)
RELEASED: dict[str, Callable[[Any], Mapping[str, int]]] = {"olmo_hybrid": _olmo_hybrid}


def released_shapes(model_type: str, text: Any, shapes: Shapes) -> Shapes:
    """``shapes`` (one layer's saved names, as the reverse conversion gave them) with the
    released dim-0 widths of :data:`RELEASED`'s parts, where all of a part group is present
    and the parts' rows add up to the fused tensor's."""
    rule = RELEASED.get(model_type)
    if rule is None:
        return shapes
    widths = rule(text)
    out = dict(shapes)
    groups: dict[str, list[str]] = {}
    for name in shapes:
        for comp in widths:
            if name.endswith(comp):
                groups.setdefault(name[:-len(comp)], []).append(name)
    for prefix, names in groups.items():
        if len(names) != len(widths) or not all(widths.values()):
            continue
        if sum(shapes[n][0] for n in names) != sum(widths[n[len(prefix):]] for n in names):
            continue
        for n in names:
            out[n] = (widths[n[len(prefix):]],) + tuple(shapes[n][1:])
    return out
