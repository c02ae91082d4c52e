"""Strict accounting of a plan: a stage's (or a draft's) tensors equal the family template's,
shapes too, quantization companions included. Pure: the index's headers and the template in,
a PlanError naming the first tensor out.

The common case (everything matches) is decided with whole-stage passes at C speed (``map``,
``filter``, set differences, list compares); only a mismatch walks the names one by one, so
the messages are those of the per-name checks.
"""
from __future__ import annotations

import re
from collections import deque
from itertools import compress, repeat
from operator import attrgetter, itemgetter, not_
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

_shape_of, _dtype_of = attrgetter("shape"), attrgetter("dtype")
_placement_of = attrgetter("placement")
_LAYER = "layer"


def check_expected(roles: CheckpointRoles, index: CheckpointIndex,
                   chosen: Mapping[str, TensorRole], window: StageWindow,
                   experts: Optional[tuple[int, int]], topology: Topology) -> None:
    """Strict accounting: the stage's tensors must equal the family template's, shapes too.

    A layer whose signature (its names, shapes and dtypes, and its template, all relative to
    the layer's prefix) equals that of a layer checked before passes as that one did, so only
    the first layer of each kind is checked name by name (a MoE model: ~3 of 61)."""
    chosen = _check_shared(roles, index, chosen, window, experts, topology)
    found = roles.stage_template(window)
    if found is None:
        return
    template, template_only = found
    entries = index.entry_map(set(map(index.weight_map.__getitem__, chosen)))
    signatures, like_earlier = _layer_signatures(roles, entries, window, experts)
    first_of_kind, names = template, chosen
    if like_earlier:
        first_of_kind, names = dict(template), dict(chosen)
        for layer in like_earlier:
            deque(map(names.pop, roles.layers[layer]), maxlen=0)
            deque(map(first_of_kind.pop, signatures[layer][1]), maxlen=0)
    try:
        _check_names(roles, index, entries, first_of_kind, template_only, names, window,
                     experts, topology)
    except PlanError:
        if like_earlier:  # the error names what the whole stage lacks, as a full check does
            _check_names(roles, index, entries, template, template_only, chosen, window,
                         experts, topology)
        raise
    for sig, _, key in signatures.values():  # the candidates of later stages
        checked = roles.checked_layers.setdefault(key, [])
        if not any(map(sig.__eq__, checked)):
            checked.append(sig)


def _check_shared(roles: CheckpointRoles, index: CheckpointIndex,
                  chosen: Mapping[str, TensorRole], window: StageWindow,
                  experts: Optional[tuple[int, int]], topology: Topology
                  ) -> Mapping[str, TensorRole]:
    """Every tied copy the stage uses (``Family.shared``: a parameter the model ties to a
    stored tensor, e.g. Zamba's shared block in each hybrid layer) must have its source read
    by the stage; a PlanError names the first one that is not (the class of plan that loads
    every stored tensor once yet leaves a stage without weights it runs). Returns ``chosen``
    without the sources read for other layers' names, for the template check."""
    shared = roles.spec.family.shared
    if not shared:
        return chosen
    where = f"stage {window.pp_rank} (layers {window.start_layer}-{window.end_layer - 1})"
    for target, source, place in shared:
        if not roles.shared_used(target, place, window, experts):
            continue
        if source not in index.weight_map:
            raise PlanError(f"{where} uses {target}, a tied copy of {source}, which the "
                            "checkpoint lacks", tensor=source, rank=topology.rank)
        if source not in chosen:
            what = "a tensor every layer uses" if target == source else \
                f"a tied copy of {source}"
            raise PlanError(f"{where} uses {target}, {what}, but does not "
                            "read it (the plan would leave the stage without that weight)",
                            tensor=target, rank=topology.rank)
    borrowed = {s for s, r, _ in roles.shared_reads(window, experts)}
    return {n: r for n, r in chosen.items() if n not in borrowed} if borrowed else chosen


def _layer_signatures(roles: CheckpointRoles, entries: Mapping[str, TensorEntry],
                      window: StageWindow,
                      experts: Optional[tuple[int, int]]
                      ) -> tuple[dict[int, tuple[tuple, Sequence[str], int]], list[int]]:
    """(layer -> (signature, its template's names, its template's id)) of the window's layers,
    and the layers
    whose signature equals one checked before or an earlier layer's of this window. Only
    with a per-layer template and all experts (an EP rank's stage is small)."""
    if roles.layered is None or experts is not None or roles.spec.family.unrun:
        return {}, []  # (unrun names: a layer's names and its template differ by them)
    _, components_of, ids = roles.layered
    out: dict[int, tuple[tuple, Sequence[str], int]] = {}
    like: list[int] = []
    # candidates by template object (a family shares one per kind of layer); a layer is
    # "like" a candidate only when the whole signature is equal (no hashing of ~100 k shapes)
    seen = {key: list(sigs) for key, sigs in roles.checked_layers.items()}
    for layer in range(window.start_layer, window.end_layer):
        names = roles.layers.get(layer)
        if not names or layer not in ids:
            continue
        template = components_of(layer)  # relative to the layer's prefix, as the names are
        ents = list(map(entries.__getitem__, names))
        sig = (roles.layer_components(layer), tuple(map(_shape_of, ents)),
               tuple(map(_dtype_of, ents)), tuple(template), tuple(map(tuple, template.values())))
        out[layer] = (sig, tuple(roles.layer_template(layer)), id(template))
        candidates = seen.setdefault(id(template), [])
        if any(map(sig.__eq__, candidates)):
            like.append(layer)
        else:
            candidates.append(sig)
    return out, like


def _check_names(roles: CheckpointRoles, index: CheckpointIndex,
                 entries: Mapping[str, TensorEntry], template: Mapping[str, tuple[int, ...]],
                 template_only: Mapping[str, Optional[TensorRole]],
                 chosen: Mapping[str, TensorRole], window: StageWindow,
                 experts: Optional[tuple[int, int]], topology: Topology) -> None:
    """The name-by-name check of ``chosen`` against ``template`` (the whole stage, or its
    globals and first layer of each kind)."""
    spec = roles.spec
    in_template = list(filter(template.__contains__, chosen))
    expected = dict(zip(in_template, map(tuple, map(template.__getitem__, in_template))))
    expected.update({n: tuple(template[n]) for n, r in template_only.items()
                     if r is not None and wanted(r, window, experts)})
    scheme = quant_scheme(spec)
    if scheme is not None:  # quantized weights: stored shape + companions (a missing scale is
        expected = _expand(scheme, expected, entries)  # an error like any missing tensor)
    # the stage's names, as ``wanted`` keeps them (a chosen "layer" name always is)
    have = _stage_names(chosen, window, experts)
    if len(have) == len(expected):  # the common case in one pass: every name of the stage
        try:  # expected and as many as expected = the same set (no missing, no unexpected:
            want = list(map(expected.__getitem__, have))  # the stage's names are the index's)
        except KeyError:
            want = None
        if want is not None and list(map(_shape_of, map(entries.__getitem__, have))) == want:
            return  # every shape exactly as expected too
    missing = sorted(expected.keys() - index.weight_map.keys())
    unexpected = sorted(set(have) - expected.keys())
    where = f"stage {window.pp_rank} (layers {window.start_layer}-{window.end_layer - 1})"
    if missing or unexpected:
        _refuse_stacked(spec, scheme, missing, unexpected, topology)
    if missing:  # with the unexpected ones too: together they show a layout mismatch
        also = (f"; {len(unexpected)} tensor(s) not expected for this config: "
                + ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
                ) if unexpected else ""
        raise PlanError(f"{where}: {len(missing)} required tensor(s) missing from the checkpoint: "
                        + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "") + also,
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


def _stage_names(chosen: Mapping[str, TensorRole], window: StageWindow,
                 experts: Optional[tuple[int, int]]) -> list[str]:
    """The names of ``chosen`` the stage holds: every "layer" one, the others as ``wanted``
    keeps them (the few globals, looked at one by one; the ~90 k layer names in C passes)."""
    roles = list(chosen.values())
    keep = list(map(_LAYER.__eq__, map(_placement_of, roles)))
    at = -1
    while True:
        try:
            at = keep.index(False, at + 1)
        except ValueError:
            return list(compress(chosen, keep))
        keep[at] = wanted(roles[at], window, experts)


def _refuse_stacked(spec: ModelSpec, scheme: Optional[QuantScheme], missing: Sequence[str],
                    unexpected: Sequence[str], topology: Topology) -> None:
    """A clearer refusal when the stage's surplus names are quantization tensors of stacked
    (3-D) experts (``experts.gate_up_proj_scale_inv``, ``experts.down_proj.weight_packed``):
    only stacked fine-grained FP8 in a family's transformers naming is planned (the layout
    transformers' ``FP8Experts`` saves and vLLM's ``RoutedExperts.load_weights`` loads)."""
    fam = spec.family
    if scheme is None or fam.fused_expert_pattern is None:
        return
    stacked, layer = re.compile(fam.fused_expert_pattern), re.compile(fam.layer_prefix)
    tails = {"_" + c.suffix[len("weight_"):] for c in scheme.companions  # transformers'
             if c.suffix.startswith("weight_")}  # naming of stacked scales: <param>_scale_inv
    first = fam.classify(missing[0], spec.num_layers, spec.num_mtp_layers) if missing else None
    for name in unexpected:
        m = layer.match(name)
        comp = name[m.end():] if m else name
        hit = stacked.match(comp)
        if hit is None or hit.end() == len(comp):
            continue
        if comp[hit.end():] in tails and first is not None and first.expert is not None:
            why = (f"next to per-expert weights, not planned for {fam.name}: "
                   "transformers' default save_pretrained of a fine-grained-FP8 MoE reverts "
                   "the weights to experts.N.* tensors but keeps their scales stacked (a "
                   "layout only families with that format plan: Qwen3-MoE, Qwen3-Next, "
                   "Qwen3.5-MoE); "
                   "save it with save_original_format=False (stacked weights and scales, "
                   "planned where the family names stacked quantized experts: "
                   "QuantNaming.stacked)")
        else:
            why = (f"in {scheme.name} storage, not planned for {fam.name}: pploader plans "
                   "stacked quantized experts only where the family names them "
                   "(QuantNaming.stacked: transformers' fine-grained FP8 experts, "
                   "<param> + <param>_scale_inv, which vLLM's RoutedExperts.load_weights "
                   "loads); AWQ / GPTQ / compressed-tensors MoE checkpoints store experts one "
                   "by one")
        raise PlanError(f"a quantization tensor of stacked (3-D) experts {why}",
                        tensor=name, rank=topology.rank)


def _expand(scheme: QuantScheme, expected: Mapping[str, tuple[int, ...]],
            entries: Mapping[str, TensorEntry]) -> dict[str, tuple[int, ...]]:
    """``expand_template(scheme, expected, dtype_of=<stored dtype>)``, computed once per
    (shape, stored dtype, weight-named) and applied by name: a layer's thousands of expert
    weights share a handful of such keys. The keys are made, and the names whose expansion
    is themselves alone (not quantized) copied, in C passes; only quantized names are
    expanded one by one (the result's order is immaterial: it is looked up and diffed).
    compressed-tensors config groups of several schemes expand name by name; of one scheme,
    as that scheme (the stored weights are checked against the groups and the ignore list
    when the stage's reads are planned: quant_groups.mixed_columns)."""
    if scheme.mixed and len(scheme.schemes) > 1:  # type: ignore[attr-defined]
        return expand_template(scheme, expected, dtype_of=lambda n: _dtype_of(
            entries.get(n, _ABSENT)))
    if scheme.mixed:
        scheme = scheme.schemes[0]  # type: ignore[attr-defined]
    names = list(expected)
    weight = scheme.naming.logical  # the template's weight name (stored: naming.weight)
    naming = scheme.naming
    if naming.stacked or naming.external:  # stacked expert parameters are weights too; a
        weighty: list[str] = [  # weight with its companions elsewhere expands to itself
            n.rpartition(".")[2] if naming.is_stacked(n) else
            weight if (n == weight or n.endswith("." + weight)) and naming.has_companions(n)
            else "" for n in names]
    elif weight in expected:  # a bare "weight" is weight-named too
        weighty = [weight if n == weight or n.endswith("." + weight) else "" for n in names]
    else:
        weighty = [weight if w else "" for w in map(str.endswith, names, repeat("." + weight))]
    stored = names if scheme.naming.weight == weight else \
        list(map(scheme.naming.stored, names))  # AWQ / GPTQ: x.weight stored as x.qweight
    keys = list(zip(expected.values(),
                    map(_dtype_of, map(entries.get, stored, repeat(_ABSENT))), weighty))
    made: dict[tuple, tuple[tuple[Optional[str], tuple[int, ...]], ...]] = {}
    for key in set(keys):  # the expansion of a stand-in name "x.weight" / "x", relative to it
        probe = "x." + key[2] if key[2] else "x"
        got = expand_template(scheme, {probe: key[0]}, dtype_of=_stored(key[1]))
        stem = probe[:-len(key[2])] if key[2] else probe
        made[key] = tuple((n[len(stem):] if n != probe else None, s) for n, s in got.items())
    itself = {k for k, rel in made.items() if len(rel) == 1 and rel[0][0] is None}
    plain = list(map(itself.__contains__, keys))
    out = dict(zip(compress(names, plain),  # rel[0][1]: the shape of the name itself
                   map(itemgetter(1), map(itemgetter(0), map(made.__getitem__,
                                                              compress(keys, plain))))))
    if all(plain):
        return out
    quantized: dict[str, tuple[int, ...]] = {}
    mixed = list(map(not_, plain))
    for name, key in zip(compress(names, mixed), compress(keys, mixed)):
        stem = name[:-len(key[2])] if key[2] else name
        for suffix, s in made[key]:
            quantized[name if suffix is None else stem + suffix] = s
    if quantized.keys().isdisjoint(out):
        out.update(quantized)
        return out
    out = {}  # a companion also named by the template: applied in the template's order
    for name, key in zip(names, keys):
        stem = name[:-len(key[2])] if key[2] else name
        for suffix, s in made[key]:
            out[name if suffix is None else stem + suffix] = s
    return out


class _Absent:
    """Stands in for the entry of a template name the checkpoint lacks (no dtype)."""

    dtype: Optional[str] = None


_ABSENT = _Absent()


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
