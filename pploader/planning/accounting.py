"""Strict accounting of a plan: a stage's (or a draft's) tensors equal the family template's,
shapes too, quantization companions included. Pure: the index's headers and the template in,
a PlanError naming the first tensor out.

The common case (everything matches) is decided with whole-stage passes at C speed (``map``,
``filter``, set differences, list compares); only a mismatch walks the names one by one, so
the messages are those of the per-name checks.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Callable, Mapping, Optional, Sequence

from ..errors import PlanError
from ..families.base import TensorRole
from .checkpoint import CheckpointIndex, TensorEntry
from .partition import StageWindow
from .quant import QuantScheme, expand_template, quant_scheme, same_shape
from .roles import CheckpointRoles, wanted
from .spec import ModelSpec
from .topology import Topology

__all__ = ["check_expected", "check_mtp"]

_shape_of = attrgetter("shape")


def check_expected(roles: CheckpointRoles, index: CheckpointIndex,
                   chosen: Mapping[str, TensorRole], window: StageWindow,
                   experts: Optional[tuple[int, int]], topology: Topology) -> None:
    """Strict accounting: the stage's tensors must equal the family template's, shapes too."""
    spec, found = roles.spec, roles.stage_template(window)
    if found is None:
        return
    template, template_only = found
    in_template = list(filter(template.__contains__, chosen))
    expected = dict(zip(in_template, map(tuple, map(template.__getitem__, in_template))))
    expected.update({n: tuple(template[n]) for n, r in template_only.items()
                     if r is not None and wanted(r, window, experts)})
    entries = index.entry_map({index.weight_map[n] for n in chosen})
    scheme = quant_scheme(spec)
    if scheme is not None:  # quantized weights: stored shape + companions (a missing scale is
        expected = _expand(scheme, expected, entries)  # an error like any missing tensor)
    # the stage's names, as ``wanted`` keeps them (a chosen "layer" name always is)
    have = [n for n, r in chosen.items() if r.placement == "layer" or wanted(r, window, experts)]
    missing = sorted(expected.keys() - index.weight_map.keys())
    unexpected = sorted(set(have) - expected.keys())
    where = f"stage {window.pp_rank} (layers {window.start_layer}-{window.end_layer - 1})"
    if missing:
        raise PlanError(f"{where}: {len(missing)} required tensor(s) missing from the checkpoint: "
                        + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""),
                        tensor=missing[0], rank=topology.rank)
    if unexpected:
        raise PlanError(f"{where}: {len(unexpected)} tensor(s) not expected for this config: "
                        + ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else ""),
                        tensor=unexpected[0], rank=topology.rank)
    if list(map(_shape_of, map(entries.__getitem__, have))) == \
            list(map(expected.__getitem__, have)):
        return  # every shape exactly as expected: the common case, one list compare
    differ = [n for n in have if entries[n].shape != expected[n]]
    for name in sorted(differ):
        entry = entries[name]
        if not same_shape(expected[name], entry.shape):
            raise PlanError(f"shape {list(entry.shape)} in the checkpoint != {list(expected[name])} "
                            "expected from config.json", file=entry.file, tensor=name,
                            rank=topology.rank)


def _expand(scheme: QuantScheme, expected: Mapping[str, tuple[int, ...]],
            entries: Mapping[str, TensorEntry]) -> dict[str, tuple[int, ...]]:
    """``expand_template(scheme, expected, dtype_of=<stored dtype>)``, computed once per
    (shape, stored dtype, weight-named) and applied by name: a layer's thousands of expert
    weights share a handful of such keys. Names whose expansion is themselves alone (not
    quantized) are copied in one pass."""
    names = list(expected)
    weight = "weight"
    keys = [(shape, entry.dtype if entry is not None else None,
             name == weight or name.endswith(".weight"))
            for name, shape, entry in zip(names, expected.values(), map(entries.get, names))]
    made: dict[tuple, tuple[tuple[Optional[str], tuple[int, ...]], ...]] = {}
    for key in set(keys):  # the expansion of a stand-in name "x.weight" / "x", relative to it
        probe = "x." + weight if key[2] else "x"
        got = expand_template(scheme, {probe: key[0]}, dtype_of=_stored(key[1]))
        stem = probe[:-len(weight)] if key[2] else probe
        made[key] = tuple((n[len(stem):] if n != probe else None, s) for n, s in got.items())
    out: dict[str, tuple[int, ...]] = {}
    for name, key in zip(names, keys):
        rel = made[key]
        if len(rel) == 1 and rel[0][0] is None:  # not quantized: itself, as expected
            out[name] = rel[0][1]
            continue
        stem = name[:-len(weight)] if key[2] else name
        for suffix, s in rel:
            out[name if suffix is None else stem + suffix] = s
    return out


def _stored(dtype: Optional[str]) -> Callable[[str], Optional[str]]:
    """``dtype_of`` for a stand-in name: the stored dtype of the names it stands for."""
    return lambda _name: dtype


def check_mtp(spec: ModelSpec, index: CheckpointIndex, layer: int, names: Sequence[str],
              experts: Optional[tuple[int, int]]) -> None:
    """Strict accounting of a draft plan: the MTP layer's tensors (local experts) equal the
    template's, shapes too (quantized: stored shapes + companions, as for stages)."""
    if spec.family.template is None:
        return
    expected = {}
    for name, shape in spec.family.template(spec).items():
        role = spec.family.classify(name, spec.num_layers, spec.num_mtp_layers)
        if role is not None and role.placement == "mtp" and role.layer == layer and (
                role.expert is None or experts is None or experts[0] <= role.expert < experts[1]):
            expected[name] = tuple(shape)
    scheme = quant_scheme(spec)
    if scheme is not None:
        expected = expand_template(
            scheme, expected,
            dtype_of=lambda n: index.entry(n).dtype if n in index.weight_map else None)
    missing = sorted(set(expected) - set(index.weight_map))
    unexpected = sorted(set(names) - set(expected))
    for what, bad in (("missing from the checkpoint", missing), ("not expected", unexpected)):
        if bad:
            raise PlanError(f"MTP layer {layer}: {len(bad)} tensor(s) {what}: "
                            + ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else ""), tensor=bad[0])
    for name in names:
        entry = index.entry(name)
        if not same_shape(expected[name], entry.shape):
            raise PlanError(f"shape {list(entry.shape)} in the checkpoint != "
                            f"{list(expected[name])} expected from config.json", file=entry.file,
                            tensor=name)
