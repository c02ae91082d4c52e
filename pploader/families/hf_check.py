"""The generic family's cross-check against ``save_pretrained``'s conversion, on sampled layers.

``hf_meta`` derives each distinct kind of decoder layer once (its representative) and gives
every other layer of that kind the same components under its own index. This module checks
that derivation against transformers' own whole-state conversion (``revert_weight_conversion``)
on every tensor outside the layers and on two layers of each kind: the representative and the
last layer of the kind (the one whose index differs most, usually in its digit count), plus
any layer whose stored dtypes differ from its representative's. Converting every layer's
tensors (44 k names for a 92-layer, 160-expert model) cost more than the rest of the derivation
together. Not seen: a conversion that spells one layer of a kind differently from that kind's
first and last by its index alone (transformers' patterns match layer ids by wildcard;
tests/derive_snapshot.py found the sampled and the whole check equal on 207 configs).

``pin_conversions`` computes the model's conversion list once, as ``revert_weight_conversion``
would on each of its calls (a walk of the whole module tree each time), and leaves it where that
function reads it first (``model._weight_conversions``, as ``from_pretrained`` does).

Read from the meta model; nothing here reads weights.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import ConfigError
from .saved_splits import released_shapes

__all__ = ["sampled_layers", "check_conversion", "pin_conversions"]


def pin_conversions(model: Any) -> None:
    """Give the private meta ``model`` the conversion list ``revert_weight_conversion`` would
    derive on each call: ``get_model_conversion_mapping(model, add_legacy=False)`` without
    ``PrefixChange`` transforms. An empty list is not pinned (that function then returns the
    state unchanged, after the same lookup); an installed transformers without these names
    keeps its own per-call lookup."""
    if getattr(model, "_weight_conversions", None) is not None:
        return
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return
    found = [c for c in get_model_conversion_mapping(model, add_legacy=False)
             if not isinstance(c, PrefixChange)]
    if found:
        model._weight_conversions = found


def sampled_layers(signature: Mapping[int, tuple], reps: Mapping[tuple, int],
                   state: Mapping[str, Any], layers_prefix: str) -> frozenset[int]:
    """The layers the conversion is checked on (see the module docstring). ``signature[i]``:
    layer ``i``'s ``(relative key, shape)`` pairs; ``reps``: signature -> its first layer."""
    def dtypes(i: int) -> tuple[str, ...]:
        return tuple(str(state[f"{layers_prefix}{i}.{rel}"].dtype) for rel, _ in signature[i])
    last: dict[tuple, int] = {}
    for i, sig in signature.items():
        last[sig] = i
    out = set(reps.values()) | set(last.values())
    rep_dtypes = {r: dtypes(r) for r in reps.values()}
    out |= {i for i, sig in signature.items() if dtypes(i) != rep_dtypes[reps[sig]]}
    return frozenset(out)


def check_conversion(model: Any, state: Mapping[str, Any], layer_of: Mapping[str, tuple[int, str]],
                     sample: frozenset[int], template: Mapping[str, tuple[int, ...]],
                     layer_names: Mapping[int, Mapping[str, str]]) -> dict[str, str]:
    """Raise ConfigError unless ``template`` (the original naming) equals transformers'
    conversion of the sampled state; return the dtype of every state key and saved name.

    ``layer_names[i]``: saved name of layer ``i`` -> the same component's name in the layer
    it was derived from (itself for a representative)."""
    from transformers.core_model_loading import revert_weight_conversion
    part = {k: v for k, v in state.items() if k not in layer_of or layer_of[k][0] in sample}
    reverted = revert_weight_conversion(model, part)
    got = released_shapes(model.config.model_type, model.config.get_text_config(),
                          {k: tuple(v.shape) for k, v in reverted.items()})
    in_layers = {n for i, names in layer_names.items() for n in names}
    want = {n: s for n, s in template.items() if n not in in_layers}
    for i in sample:
        want.update((n, template[n]) for n in layer_names[i])
    if want != got:
        diff = sorted(set(got) ^ set(want))[:4] or sorted(n for n in got if got[n] != want[n])[:4]
        raise ConfigError(f"per-tensor derivation of the saved names disagrees with "
                          f"save_pretrained's conversion (e.g. {diff})", file="config.json")
    dtypes = {k: _dtype(v) for k, v in state.items()}  # the model's names and the saved ones
    dtypes.update((k, _dtype(v)) for k, v in reverted.items())
    for i, names in layer_names.items():
        if i not in sample:
            dtypes.update((n, dtypes[src]) for n, src in names.items())
    return dtypes


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).replace("torch.", "")
