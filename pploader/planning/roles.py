"""CheckpointRoles: every checkpoint name classified once for a spec (pure, frozen).

Several plans of one checkpoint (every rank of ``pploader plan``, a read-once group, a node's
file list) share it, so a rank classifies names in bulk instead of one regex per tensor.
"""
from __future__ import annotations

import bisect
import re
from itertools import compress, repeat
from functools import partial
from operator import attrgetter, itemgetter
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Optional, Sequence

from ..errors import PlanError
from ..families.base import QuantNaming, TensorRole
from .checkpoint import CheckpointIndex
from .gcpause import without_gc
from .partition import StageWindow
from .quant import QuantScheme, quant_scheme
from .spec import ModelSpec

__all__ = ["CheckpointRoles", "checkpoint_roles", "wanted"]

#: a TensorRole from its six fields as one tuple (no per-field ``__init__`` call)
_make_role = partial(tuple.__new__, TensorRole)
_MISSING = object()


def _three_dicts() -> tuple[dict, dict, dict]:
    return {}, {}, {}


@dataclass(frozen=True)
class CheckpointRoles:
    """Every checkpoint name's role, worked out once per (spec, index) and passed explicitly
    (``plan_all`` and read-once planning share one): names bucketed by layer with one regex
    match each, roles derived per distinct layer component (a MoE model repeats ~1.5 k
    components over 60 layers), and the family template with the names only it has."""

    spec: ModelSpec                                  # resolved to the checkpoint's naming
    layers: Mapping[int, tuple[str, ...]]            # global layer id (MTP ids after) -> names
    components: Mapping[str, Optional[TensorRole]]   # component -> role (layer None); None:
    others: Mapping[str, TensorRole]                 #   classify per name; names off the layers
    #: quant companion name -> its weight's name: the names off the layers, and a layer's once
    #: its roles were asked for (``layer_roles`` links the layer on first use, see ``_unlinked``)
    links: Mapping[str, str]
    #: the whole family template (None: the family has none, or ``layered`` has it by layer)
    template: Optional[Mapping[str, tuple[int, ...]]]
    template_only: Mapping[str, Optional[TensorRole]]  # template names absent from the index
    #: the family's ``layer_template(spec)``: a stage builds only its own layers' part
    layered: Optional[tuple[Mapping[str, tuple[int, ...]],
                            Callable[[int], Mapping[str, tuple[int, ...]]], range]] = None
    #: per-stage results every rank of a stage shares (``stage_value``: its reads and columns,
    #: the plan memos, the stage template, the strict check): keyed by (what, ...); derived
    #: from the fields above only
    _stage_memo: dict[tuple, Any] = field(default_factory=dict, compare=False, repr=False)
    _rules: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    #: (component, whether it links to a weight) -> a role of it in some layer
    _component_roles: dict[tuple, TensorRole] = field(default_factory=dict, compare=False,
                                                      repr=False)
    #: (a layer's components, whether each links to a weight) -> its roles' component,
    #: expert, fused_experts and role columns (in name order): what a layer like it needs
    _layer_fields: dict[tuple, tuple[list, ...]] = field(default_factory=dict, compare=False,
                                                         repr=False)
    _index_names: Collection[str] = field(default=(), compare=False, repr=False)
    #: signatures of layers the strict check passed, by the id of their (relative) template
    #: (planning/accounting.py): a layer with one of them passes as that layer did
    checked_layers: dict[int, list[tuple]] = field(default_factory=dict, compare=False,
                                                   repr=False)
    _components_of: dict[int, tuple[str, ...]] = field(default_factory=dict, compare=False,
                                                       repr=False)
    _layer_templates: dict[int, Mapping[str, tuple[int, ...]]] = field(
        default_factory=dict, compare=False, repr=False)
    #: layer -> (its prefix, positions of its companions among its names, their weights'
    #: components) for the layers not linked yet: a rank links only the layers it plans
    #: (DeepSeek-V3: 46 k companions, of which a PP16 stage needs 3 k)
    _unlinked: dict[int, tuple[str, list[int], list[str]]] = field(
        default_factory=dict, compare=False, repr=False)
    #: quantization companions' naming: the family's, its weight stored under the scheme's
    #: suffix (``qweight``...; planning/quant.py)
    naming: QuantNaming = QuantNaming()
    #: the quantization scheme (None: not quantized); per weight with compressed-tensors
    #: config groups of different schemes (planning/quant_groups.py)
    scheme: Optional[QuantScheme] = None

    def naming_of(self, weight: str) -> QuantNaming:
        """The companion naming of stored weight ``weight``."""
        return self.naming if self.scheme is None else self.scheme.naming_of(weight)

    def _link_layer(self, layer: int) -> None:
        """Add ``layer``'s companions to ``links`` (those whose weight the checkpoint holds)."""
        pending = self._unlinked.pop(layer, None)
        if pending is None:
            return
        _link(self.links, self.layers[layer], *pending, self._index_names)  # type: ignore[arg-type]

    def role(self, name: str, layer: int, component: str) -> TensorRole:
        """The role of ``name`` (in ``layer``; quantization companions take their weight's)."""
        self._link_layer(layer)  # a no-op once the layer is linked
        weight = self.links.get(name)
        if weight is not None:
            naming = self.naming_of(weight)  # the family's naming, no string cutting
            wcomp = naming.weight_component(component, name, weight)
            base = self._plain(weight, layer, wcomp)
            return TensorRole(base.placement,
                              naming.companion_component(base.component, weight, name),
                              base.layer, base.expert, base.fused_experts, base.role)
        return self._plain(name, layer, component)

    def _plain(self, name: str, layer: int, component: str) -> TensorRole:
        known = self.components.get(component)
        if known is None:  # a component some global pattern also matches: per name
            role = self.spec.family.classify(name, self.spec.num_layers, self.spec.num_mtp_layers)
            assert role is not None
            return role
        return TensorRole("layer" if layer < self.spec.num_layers else "mtp", component, layer,
                          known.expert, known.fused_experts)

    def layer_roles(self, layer: int) -> dict[str, TensorRole]:
        """``{name: role}`` of the names of ``layer``. A role whose component the family
        classified once (``components``) depends only on (component, layer, whether it links
        to a weight): its fields are kept per component and copied with the layer set."""
        self._link_layer(layer)
        placement = "layer" if layer < self.spec.num_layers else "mtp"
        memo, links, known = self._component_roles, self.links, self.components
        names = self.layers.get(layer, ())
        comps = self.layer_components(layer)
        linked = tuple(map(links.__contains__, names))
        columns = self._layer_fields.get((comps, linked))
        if columns is not None:  # a layer like an earlier one: every role in one C pass
            components, expert, fused, kind = columns
            return dict(zip(names, map(_make_role, zip(
                repeat(placement), components, repeat(layer), expert, fused, kind))))
        out = {}
        for name, key in zip(names, zip(comps, linked)):
            component = key[0]  # key: (component, whether it links to a weight)
            base = memo.get(key)
            if base is None:
                role = out[name] = self.role(name, layer, component)
                weight = component if not key[1] else \
                    self.naming_of(links[name]).weight_component(component, name, links[name])
                if known.get(weight) is not None and role.layer == layer \
                        and role.placement == placement:
                    memo[key] = role
                continue
            out[name] = _make_role((placement, base.component, layer, base.expert,
                                    base.fused_experts, base.role))
        every = list(map(memo.get, zip(comps, linked)))
        if None not in every:  # a later layer with these components takes the C pass above
            self._layer_fields[comps, linked] = tuple(
                list(map(attrgetter(f), every)) for f in ("component", "expert", "fused_experts",
                                                           "role"))
        return out

    def _prefix_len(self, layer: int) -> int:
        return len(self.spec.family.layer_name(layer, ""))

    def layer_components(self, layer: int) -> tuple[str, ...]:
        """The names of ``layer`` without its prefix, in name order (computed once)."""
        found = self._components_of.get(layer)
        if found is None:
            cut = itemgetter(slice(self._prefix_len(layer), None))
            found = self._components_of[layer] = tuple(map(cut, self.layers.get(layer, ())))
        return found

    def layer_template(self, layer: int) -> Mapping[str, tuple[int, ...]]:
        """The template's names -> shapes of ``layer`` (``layered`` only; computed once)."""
        found = self._layer_templates.get(layer)
        if found is None:
            assert self.layered is not None
            prefix = self.spec.family.layer_name(layer, "")
            found = self._layer_templates[layer] = {
                prefix + c: tuple(s) for c, s in self.layered[1](layer).items()}
        return found

    def items(self) -> list[tuple[str, TensorRole]]:
        """(name, role) of every checkpoint tensor."""
        out = list(self.others.items())
        for layer in self.layers:
            out.extend(self.layer_roles(layer).items())
        return out

    def stage_roles(self, window: StageWindow, experts: Optional[tuple[int, int]]
                    ) -> dict[str, TensorRole]:
        """The roles of the names ``window`` (and ``experts``) reads (a new dict; ``plan_rank``
        keeps it per stage and EP rank with ``stage_value``, every TP rank shares it)."""
        chosen = {n: r for n, r in self.others.items() if wanted(r, window, experts)}
        for layer in range(window.start_layer, window.end_layer):
            if experts is None:  # every name of the layer
                chosen.update(self.layer_roles(layer))
                continue
            for name, role in self.layer_roles(layer).items():
                if role.expert is None or experts[0] <= role.expert < experts[1]:
                    chosen[name] = role
        unrun = self.spec.family.unrun  # stored here, run by another layer (shared_reads)
        return {n: r for n, r in chosen.items() if n not in unrun} if unrun else chosen

    def stage_value(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, worked out once per ``key`` (e.g. ``("columns", window, experts)``):
        what every TP rank of a stage shares. Values are read-only, like the fields."""
        found = self._stage_memo.get(key, _MISSING)
        if found is _MISSING:
            found = self._stage_memo[key] = make()
        return found

    def rule_index(self, component: str) -> int:
        """Position of ``component``'s TP rule in the family's ``shard_rules`` (-1: none,
        replicated); memoised per distinct component, so tensors with the same rule share one
        selection however their names differ (the experts of a layer)."""
        found = self._rules.get(component)
        if found is None:
            rule = self.spec.family.shard_rule(component)
            found = self._rules[component] = -1 if rule is None else next(
                i for i, r in enumerate(self.spec.family.shard_rules) if r is rule)
        return found

    def stage_template(self, window: StageWindow
                       ) -> Optional[tuple[Mapping[str, tuple[int, ...]],
                                           Mapping[str, Optional[TensorRole]]]]:
        """(template names -> shapes, those absent from the index -> their role) covering what
        ``window`` can read: the whole template, or with ``layered`` only the globals and the
        window's layers (names of other layers are never wanted by it). None: no template."""
        unrun = self.spec.family.unrun  # read by the stages running them, as tied sources
        if self.layered is None:
            if self.template is None or not unrun:
                return None if self.template is None else (self.template, self.template_only)
            found = self._stage_memo.get(("template",))
            if found is None:
                found = self._stage_memo["template",] = (
                    {n: s for n, s in self.template.items() if n not in unrun},
                    {n: r for n, r in self.template_only.items() if n not in unrun})
            return found
        key = ("template", window.start_layer, window.end_layer)
        found = self._stage_memo.get(key)
        if found is None:
            globals_, _, ids = self.layered
            part = dict(globals_)
            for i in range(window.start_layer, window.end_layer):
                if i in ids:
                    part.update(self.layer_template(i))
            fam, n, m = self.spec.family, self.spec.num_layers, self.spec.num_mtp_layers
            for name in unrun & part.keys():
                del part[name]
            found = self._stage_memo[key] = (part, {
                t: fam.classify(t, n, m) for t in part.keys() - self._index_names})
        return found

    def plan_memo(self, key: tuple) -> tuple[dict, dict, dict]:
        """The per-tensor memos ``plan.plan_rank`` fills (selections, relative reads, planned
        tensors), one set per ``key`` (everything besides a tensor's component, shape and
        dtype that they depend on), so ranks planned with these roles share them."""
        return self.stage_value(("plan",) + key, _three_dicts)

    def stage_checked(self, window: StageWindow, experts: Optional[tuple[int, int]]) -> bool:
        """True when the strict template check already passed for this stage and EP rank."""
        return ("checked", window, experts) in self._stage_memo

    def mark_checked(self, window: StageWindow, experts: Optional[tuple[int, int]]) -> None:
        self._stage_memo["checked", window, experts] = True

    def shared_reads(self, window: StageWindow, experts: Optional[tuple[int, int]]
                     ) -> list[tuple[str, TensorRole, str]]:
        """(source name, its role, target name) of every tied copy (``Family.shared``) the
        stage uses whose stored source it does not read itself: read under the target's name.
        Empty for families without ties (every hand-written one)."""
        if not self.spec.family.shared:
            return []
        return self.stage_value(("shared", window, experts),
                                partial(self._shared_reads, window, experts))

    def _shared_reads(self, window: StageWindow, experts: Optional[tuple[int, int]]
                      ) -> list[tuple[str, TensorRole, str]]:
        out = []
        for target, source, where in self.spec.family.shared:
            if not self.shared_used(target, where, window, experts):
                continue
            role = self.source_role(source)
            if role is None or wanted(role, window, experts) and \
                    source not in self.spec.family.unrun:
                continue  # absent (the strict check names it) or read anyway: tied locally
            out.append((source, role, target))
        return out

    def shared_used(self, target: str, where: str, window: StageWindow,
                    experts: Optional[tuple[int, int]]) -> bool:
        """Whether the stage of ``window`` uses ``Family.shared`` target ``target``: its
        layer's stage ("layer"), the first / last stage, or every stage ("every": a tensor
        stored outside the layers that the loop over them uses, read by each stage)."""
        if where == "every":
            return True
        if where == "layer":
            fam, spec = self.spec.family, self.spec
            role = fam.classify(target, spec.num_layers, spec.num_mtp_layers)
            return role is not None and role.placement == "layer" and wanted(role, window,
                                                                             experts)
        return wanted(TensorRole(where, target, role="other"), window, experts)

    def source_role(self, name: str) -> Optional[TensorRole]:
        """The role of checkpoint tensor ``name`` (None: not in the checkpoint)."""
        if name in self.others:
            return self.others[name]
        if name not in self._index_names:
            return None
        spec = self.spec
        role = spec.family.classify(name, spec.num_layers, spec.num_mtp_layers)
        if role is None or role.layer is None:
            return role
        return self.layer_roles(role.layer).get(name, role)

    @property
    def stores_head(self) -> bool:
        return any(r.role == "head" for r in self.others.values())


@without_gc
def checkpoint_roles(spec: ModelSpec, index: CheckpointIndex) -> CheckpointRoles:
    """Classify every name of ``index`` for ``spec`` (pure; PlanError on unknown names)."""
    spec = spec.for_checkpoint(index.weight_map)
    fam, n, m = spec.family, spec.num_layers, spec.num_mtp_layers
    scheme = quant_scheme(spec)
    naming = scheme.naming if scheme is not None else fam.quant_naming
    mixed = scheme is not None and scheme.mixed
    match = re.compile(fam.layer_prefix).match
    layers: dict[int, list[str]] = {}
    components: dict[str, Optional[TensorRole]] = {}
    others: dict[str, TensorRole] = {}
    unknown: list[str] = []
    off_layer: list[str] = []
    weight_of: dict[str, Optional[str]] = {}  # component -> its weight's component (companions)
    links: dict[str, str] = {}
    unlinked: dict[int, tuple[str, list[int], list[str]]] = {}
    wmap = index.weight_map
    by_prefix = _bucket_by_prefix(list(wmap), fam.layer_prefix, off_layer)
    companions: set[str] = set()   # components naming a quantization companion
    per_name: set[str] = set()     # components that a global pattern also matches
    #: a layer's components (in name order) -> what follows from them alone: positions of
    #: its companions, their weights' components, the names to keep (None: all); layers
    #: repeat (DeepSeek-V3: 58 MoE layers of ~1.5 k names), so each distinct one is worked
    #: out once and the others cost a tuple compare and a few C-level maps
    by_comps: dict[tuple[str, ...], tuple[list[int], list[str], Optional[list[bool]]]] = {}
    for prefix, names in by_prefix.items():
        layer, cut = int(match(prefix).group(1)), len(prefix)  # type: ignore[union-attr]
        if layer >= n + m:
            unknown.extend(names)
            continue
        comps = tuple(map(itemgetter(slice(cut, None)), names))
        known = by_comps.get(comps)
        if known is None:
            present = set(comps)
            for component in present - components.keys():
                role = fam.classify(prefix + component, n, m)
                components[component] = (  # the role without its layer (a new value)
                    TensorRole(role.placement, role.component, None, role.expert,
                               role.fused_experts, role.role)
                    if role is not None and role.placement in ("layer", "mtp") else None)
                if not mixed:
                    link = scheme.weight_of(component) if scheme is not None else None
                    weight_of[component] = link[0] if link is not None else None
                    if link is not None:
                        companions.add(component)
                if components[component] is None:
                    per_name.add(component)
            if mixed:  # a companion's weight may differ by layer (weight / weight_packed)
                here = {c: scheme.weight_of(c, present.__contains__)  # type: ignore[union-attr]
                        for c in present}
                at = [i for i, c in enumerate(comps) if here[c] is not None]
                weight_comps = [here[comps[i]][0] for i in at]  # type: ignore[index]
            else:
                at = [i for i, c in enumerate(comps) if c in companions]
                weight_comps = [weight_of[comps[i]] for i in at]  # type: ignore[misc]
            keep = None if per_name.isdisjoint(comps) else \
                [components[c] is not None for c in comps]
            known = by_comps[comps] = (at, weight_comps, keep)
        at, weight_comps, keep = known
        if at and keep is None:  # companions link to their weight when the checkpoint holds
            unlinked[layer] = (prefix, at, weight_comps)  # it: on the layer's first use
        elif at:
            _link(links, names, prefix, at, weight_comps, wmap)
        if keep is not None:  # a global pattern matched too: those names are classified apart
            off_layer.extend(compress(names, [not k for k in keep]))
            names = list(compress(names, keep))
        layers[layer] = names
    if scheme is not None:
        for name in off_layer:
            link = scheme.weight_of(name, wmap.__contains__)
            if link is not None and link[0] in wmap:
                links[name] = link[0]
    for name in off_layer:
        weight = links.get(name, name)
        role = fam.classify(weight, n, m)
        if role is not None and weight != name:
            role = role._replace(component=(naming if scheme is None else scheme.naming_of(
                weight)).companion_component(
                role.component, weight, name))
        if role is None:
            unknown.append(name)
        elif role.placement in ("layer", "mtp") and role.layer is not None and name in links:
            layers[role.layer] = layers.get(role.layer, []) + [name]
        else:
            others[name] = role
    if unknown:
        raise PlanError(f"{len(unknown)} checkpoint tensor(s) the {fam.name} family does "
                        f"not know (num_hidden_layers={n}, mtp layers={m}): "
                        f"{', '.join(unknown[:8])}" + (" ..." if len(unknown) > 8 else ""),
                        tensor=unknown[0])
    layered = fam.layer_template(spec) if fam.layer_template is not None else None
    template = fam.template(spec) if fam.template is not None and layered is None else None
    only = {} if template is None else {
        t: fam.classify(t, n, m) for t in template.keys() - index.weight_map.keys()}
    return CheckpointRoles(spec, {k: tuple(v) for k, v in layers.items()}, components, others,
                           links, template, only, layered, _index_names=index.weight_map.keys(),
                           _unlinked=unlinked, naming=naming, scheme=scheme)


def _link(links: dict[str, str], names: Sequence[str], prefix: str, at: list[int],
          weight_comps: list[str], index_names: Collection[str]) -> None:
    """Link a layer's companions (``names[i]`` for ``i`` in ``at``) to their weights
    (``prefix`` + the weight's component), those whose weight the checkpoint holds."""
    weights = list(map(prefix.__add__, weight_comps))
    linked = map(names.__getitem__, at)
    if all(map(index_names.__contains__, weights)):
        links.update(zip(linked, weights))
    else:
        links.update((x, w) for x, w in zip(linked, weights) if w in index_names)


def _bucket_by_prefix(names: list[str], pattern: str, off_layer: list[str]
                      ) -> dict[str, list[str]]:
    """Names grouped by the layer prefix they start with (``model.layers.7.``); the others
    are appended to ``off_layer``. In sorted order the names starting with one prefix are one
    contiguous range, so the regex runs once per range (bisect finds its end), not per name."""
    match = re.compile(pattern).match
    ordered = names if names == sorted(names) else sorted(names)
    by_prefix: dict[str, list[str]] = {}
    cursor, end = 0, len(ordered)
    while cursor < end:
        found = match(ordered[cursor])
        if found is None:
            off_layer.append(ordered[cursor])
            cursor += 1
            continue
        prefix = found.group(0)
        # every name in [cursor, hi) starts with prefix (sorted, below prefix's successor)
        hi = bisect.bisect_left(ordered, prefix[:-1] + chr(ord(prefix[-1]) + 1), cursor)
        by_prefix.setdefault(prefix, []).extend(ordered[cursor:hi])
        cursor = hi
    return by_prefix


def wanted(role: TensorRole, window: StageWindow, experts: Optional[tuple[int, int]]) -> bool:
    if role.placement == "first":
        return window.has_embed
    if role.placement == "last":
        return window.has_head
    if role.placement != "layer" or not window.owns(role.layer):  # type: ignore[arg-type]
        return False
    if role.expert is not None and experts is not None:
        return experts[0] <= role.expert < experts[1]
    return True
