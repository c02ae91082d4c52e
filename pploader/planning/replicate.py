"""A stage's read items, planned once per distinct layer and replicated onto its repeats.

A tensor's read at offset 0 and its exchange choice follow from its *planning key*: role
component, fused-experts flag, shape and dtype (and, for a quantization companion, its
weight's shape and dtype); ``plan.plan_rank`` memoises them per key. Layers repeat: DeepSeek-V3
has 58 MoE layers of ~1.5 k tensors with equal keys position by position. So a layer's keys
are gathered with C-level maps, the whole list is looked up once, and a layer seen before
reuses the planned reads of every position; each tensor then only costs its move to its own
file and offset (a frozen copy built without ``__init__``). Pure: entries in, items out.
"""
from __future__ import annotations

from operator import attrgetter, itemgetter
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from ..families.base import TensorRole
from .header import TensorEntry

__all__ = ["Planned", "planning_key", "stage_items"]

#: a tensor's read at offset 0 (a ReadItem) and its exchange choice (None: read directly)
Planned = tuple[Any, Any]
#: (key, name, role, entry, weight name, weight entry) -> Planned (memoised by key)
PlanOne = Callable[[tuple, str, TensorRole, TensorEntry, Optional[str], Optional[TensorEntry]],
                   Planned]

_component, _fused = attrgetter("component"), attrgetter("fused_experts")
_shape, _dtype = attrgetter("shape"), attrgetter("dtype")
_first = itemgetter(0)


def planning_key(role: TensorRole, entry: TensorEntry, wentry: Optional[TensorEntry]) -> tuple:
    """What a tensor's planned read depends on besides the rank (see the module docstring)."""
    if wentry is None:
        return (role.component, role.fused_experts, entry.shape, entry.dtype)
    return (role.component, role.fused_experts, entry.shape, entry.dtype, wentry.shape,
            wentry.dtype)


def stage_items(singles: Iterable[tuple[str, TensorRole, str]],
                layers: Sequence[tuple[str, ...]], roles: Mapping[str, TensorRole],
                entries: Mapping[str, TensorEntry], links: Mapping[str, str],
                entry: Callable[[str], TensorEntry], plan_one: PlanOne,
                layer_memo: dict[tuple, list[Planned]],
                take: Optional[Callable[[TensorEntry, str, Any], Any]]) -> list:
    """The items of the ``(name, role, target)`` reads in ``singles`` (tensor by tensor), then
    of every name of ``layers`` (read as themselves, layer by layer). ``layer_memo`` keeps a
    layer's planned reads by its tuple of planning keys; ``take`` records exchange choices."""
    items: list = []
    append = items.append
    for name, role, target in singles:
        ent = entries[name]
        weight = links.get(name)
        wentry = None if weight is None else entry(weight)
        made, choice = plan_one(planning_key(role, ent, wentry), name, role, ent, weight, wentry)
        if choice is not None:
            take(ent, target, choice)  # type: ignore[misc]
        append(_moved(made, name, target, ent))
    for names in layers:
        ents = list(map(entries.__getitem__, names))
        layer_roles = list(map(roles.__getitem__, names))
        keys: list[tuple] = list(zip(map(_component, layer_roles), map(_fused, layer_roles),
                                     map(_shape, ents), map(_dtype, ents)))
        weights = list(map(links.get, names))
        linked = [i for i, w in enumerate(weights) if w is not None] \
            if weights.count(None) != len(weights) else []
        for i in linked:
            wentry = entry(weights[i])  # type: ignore[arg-type]
            keys[i] += (wentry.shape, wentry.dtype)
        signature = tuple(keys)
        planned = layer_memo.get(signature)
        if planned is None:  # a layer not seen before: position by position (memoised by key)
            planned = layer_memo[signature] = [
                plan_one(key, name, role, ent, w, None if w is None else entry(w))
                for key, name, role, ent, w in zip(keys, names, layer_roles, ents, weights)]
        if take is not None:
            for (_, choice), ent, name in zip(planned, ents, names):
                if choice is not None:
                    take(ent, name, choice)
        items.extend(map(_moved, map(_first, planned), names, names, ents))
    return items


def _moved(made: Any, name: str, target: str, ent: TensorEntry) -> Any:
    """``made`` (planned at offset 0) moved to ``ent``'s file and offset, named ``name`` and
    read as ``target``: a frozen copy built without ``__init__``."""
    fields = made.__dict__.copy()
    fields["name"], fields["target"], fields["file"] = name, target, ent.file
    ranges, start = made.ranges, ent.start
    fields["ranges"] = ((start + ranges[0][0], ranges[0][1]),) if len(ranges) == 1 \
        else tuple((start + a, n) for a, n in ranges)
    item = _new(type(made))
    _set(item, "__dict__", fields)
    return item


_new, _set = object.__new__, object.__setattr__
