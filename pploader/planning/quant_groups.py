"""compressed-tensors config groups with different schemes: each weight's scheme, resolved
from its module name as compressed-tensors resolves it.

A ``quantization_config`` of llm-compressor may give several ``config_groups``, each a scheme
(``weights``, ``input_activations``, ``format``) and ``targets``; ``ignore`` lists modules left
unquantized. A module's scheme (compressed-tensors ``apply_quantization_config`` /
``match_targets``, vLLM ``get_scheme_dict`` / ``find_matched_target``):

- a module matched by an ``ignore`` entry is not quantized;
- a target or ignore entry is ``re:<regex>`` (``re.match`` on the module name, anchored at
  its start only), else an exact module name, else a class name: only ``Linear`` is
  understood here, matching every quantizable weight's module (another class name is a
  ConfigError, pploader sees names, not classes);
- a target named by two groups belongs to the later one;
- of several matching targets, compressed-tensors takes exact names before regexes (each
  sorted alphabetically), then class names; vLLM takes the first name match in config order,
  then the first class match. Where the two pick different schemes the module is refused
  as a conflicting match (the engines would load it differently);
- a module matched by no target is not quantized.

A weight stored quantized (under a scheme's suffix and dtype) whose module resolves to no
scheme, or to a scheme stored another way, is a PlanError naming the tensor. A weight stored
plain is plain whatever its group says (as for one scheme: the headers decide).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from ..errors import ConfigError, PlanError
from ..families.base import QuantNaming, TensorRole
from .quant_layout import Companion, QuantScheme

__all__ = ["Group", "MixedScheme", "mixed_scheme", "mixed_columns"]

#: class-name targets understood: every quantizable weight's module is a linear layer
_LINEAR = ("Linear", "LinearBase")
_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Group:
    """One config group: its name, targets (config order) and scheme."""

    name: str
    targets: tuple[str, ...]
    scheme: QuantScheme


#: ``re:`` targets compiled (``re.match``: anchored at the start of the module name only)
_REGEX: dict[str, Callable[[str], Any]] = {}


def _name_match(module: str, target: str) -> bool:
    if target.startswith("re:"):
        found = _REGEX.get(target)
        return (found(module) if found is not None else re.match(target[3:], module)) \
            is not None
    return target == module


def _check_target(target: Any, where: str) -> str:
    if not isinstance(target, str) or not target:
        raise ConfigError(f"compressed-tensors {where}: target {target!r} is not a string",
                          file="config.json")
    if target.startswith("re:"):
        try:
            re.compile(target[3:])
        except re.error as exc:
            raise ConfigError(f"compressed-tensors {where}: target {target!r} is not a valid "
                              f"regex ({exc})", file="config.json") from None
    elif _CLASS_NAME.fullmatch(target) and target not in _LINEAR:
        raise ConfigError(f"compressed-tensors {where}: class target {target!r} is not "
                          "supported (pploader matches module names, re: regexes and the "
                          "Linear class)", file="config.json")
    return target


def mixed_scheme(groups: Sequence[Group], ignore: Iterable[str]) -> "MixedScheme":
    """The per-weight scheme of config groups with different schemes."""
    ignore = tuple(_check_target(t, "ignore") for t in ignore)
    for g in groups:
        if not g.targets:
            raise ConfigError(f"compressed-tensors config group {g.name} has no targets",
                              file="config.json")
        for t in g.targets:
            _check_target(t, f"config group {g.name}")
    first = groups[0].scheme
    name = first.name if all(g.scheme == first for g in groups) else "mixed"
    return MixedScheme(name, first.weight, first.companions, ignore=ignore,
                       groups=tuple(groups))


@dataclass(frozen=True)
class MixedScheme(QuantScheme):
    """Several schemes, one per config group; each weight's is its module's (``resolve``).
    The geometry (shapes, selections) is the resolved scheme's: call sites resolve first."""

    groups: tuple[Group, ...] = ()
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    #: the distinct schemes in config order (each group holds one of these very objects)
    schemes: tuple[QuantScheme, ...] = field(default=(), init=False, compare=False,
                                             repr=False)
    weight_dtypes: frozenset[str] = field(default=frozenset(), init=False, compare=False,  # type: ignore[assignment]
                                          repr=False)

    mixed = True

    def __post_init__(self) -> None:
        for t in self.ignore + tuple(t for g in self.groups for t in g.targets):
            if t.startswith("re:") and t not in _REGEX:
                _REGEX[t] = re.compile(t[3:]).match
        canon = {s: s for s in reversed([g.scheme for g in self.groups])}  # the first of equals
        groups = tuple(replace(g, scheme=canon[g.scheme]) for g in self.groups)
        schemes = tuple({id(g.scheme): g.scheme for g in groups}.values())
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "schemes", schemes)
        object.__setattr__(self, "weight_dtypes", frozenset(s.weight.dtype for s in schemes))

    def scheme_index(self, scheme: Optional[QuantScheme]) -> int:
        """The position of one of ``schemes`` (by identity; -1 for None)."""
        if scheme is None:
            return -1
        return next(i for i, s in enumerate(self.schemes) if s is scheme)

    def with_naming(self, family: QuantNaming) -> "QuantScheme":
        groups = tuple(replace(g, scheme=g.scheme.with_naming(family)) for g in self.groups)
        return replace(self, groups=groups, naming=family)

    # ---- matching ------------------------------------------------------------------------
    def match(self, module: str) -> tuple[Optional[Group], str]:
        """``(group, why)`` of ``module`` (group None: not quantized; ``why`` says why, for
        messages). PlanError when compressed-tensors and vLLM would pick different schemes."""
        found = self._memo.get(module)
        if found is None:
            found = self._memo[module] = self._match(module)
        if isinstance(found, PlanError):
            raise found
        return found  # type: ignore[no-any-return]

    def _match(self, module: str) -> "tuple[Optional[Group], str] | PlanError":
        for pat in self.ignore:
            if _name_match(module, pat) or pat in _LINEAR:
                return None, f"the config's ignore list names it ({pat!r})"
        owner: dict[str, Group] = {}
        for g in self.groups:  # a target named twice belongs to the later group (keeping
            for t in g.targets:  # its first place in the order, as a dict does in vLLM)
                owner[t] = g
        by_name = [t for t in owner if _name_match(module, t)]
        by_class = [t for t in owner if t in _LINEAR]
        if not by_name and not by_class:
            return None, "no config group targets it (" + "; ".join(
                f"{g.name}: {', '.join(g.targets)}" for g in self.groups) + ")"
        ct = (sorted(by_name, key=lambda t: (t.startswith("re:"), t)) or by_class)[0]
        vllm = (by_name or by_class)[0]
        if owner[ct].scheme != owner[vllm].scheme:
            return PlanError(
                f"module {module} is matched by config group {owner[ct].name} (target {ct!r}, "
                f"{owner[ct].scheme.name}) and by {owner[vllm].name} (target {vllm!r}, "
                f"{owner[vllm].scheme.name}): compressed-tensors picks the first (exact names, "
                "then regexes, alphabetically), vLLM the second (config order); make one "
                "target match it", tensor=module)
        return owner[ct], f"config group {owner[ct].name} (target {ct!r})"

    def resolve(self, name: str) -> Optional[QuantScheme]:
        """The scheme of weight or companion ``name`` (``<module>.<suffix>``): its module's."""
        try:
            group, _ = self.match(name.rsplit(".", 1)[0])
        except PlanError as exc:
            raise PlanError(exc.detail, tensor=name) from None
        return None if group is None else group.scheme

    def ignored(self, name: str) -> bool:
        return self.resolve(name) is None

    # ---- names ---------------------------------------------------------------------------
    def naming_of(self, weight: str) -> QuantNaming:
        last = weight.rsplit(".", 1)[-1]
        for s in self.schemes:
            if s.naming.weight == last:
                return s.naming
        return self.naming

    def companion_names(self, weight: str) -> dict[str, Companion]:
        s = self.resolve(weight)
        return {} if s is None else s.companion_names(weight)

    def weight_of(self, name: str, exists: Optional[Callable[[str], bool]] = None
                  ) -> Optional[tuple[str, Companion]]:
        """A companion's ``(stored weight, companion)``: of the schemes naming such a
        companion, the one whose stored weight ``exists`` (else the first)."""
        found = [link for link in (s.weight_of(name) for s in self.schemes) if link is not None]
        if exists is not None:
            for link in found:
                if exists(link[0]):
                    return link
        return found[0] if found else None

    def _form(self, name: str, dtype: Optional[str], ndim: int) -> Optional[QuantScheme]:
        """A scheme whose stored weight ``name`` (stored name, dtype) looks like."""
        return next((s for s in self.schemes if s.is_quantized(name, dtype, ndim)), None)

    def _check(self, name: str, stored: str, dtype: Optional[str],
               form: QuantScheme) -> QuantScheme:
        """The scheme of ``name``, stored as ``stored`` in ``form``'s way, or a PlanError."""
        module = name.rsplit(".", 1)[0]
        group, why = self.match(module)
        if group is None:
            raise PlanError(f"stored quantized ({form.weight.suffix} {dtype}, like "
                            f"{form.name}) but module {module} is not quantized by the "
                            f"config: {why}", tensor=stored)
        s = group.scheme
        if (s.weight.suffix, s.weight.dtype) != (form.weight.suffix, form.weight.dtype):
            raise PlanError(f"stored as {form.weight.suffix} {dtype} (like {form.name}) but "
                            f"{why} gives module {module} {s.name}, stored as "
                            f"{s.weight.suffix} {s.weight.dtype}", tensor=stored)
        return s

    def is_quantized(self, name: str, dtype: Optional[str], ndim: int) -> bool:
        form = self._form(name, dtype, ndim)
        if form is None:
            return False
        self._check(name, name, dtype, form)
        return True

    def stored_scheme(self, name: str, ndim: int,
                      dtype_of: Callable[[str], Optional[str]]) -> Optional[QuantScheme]:
        for s in self.schemes:
            stored = s.naming.stored(name)
            dtype = dtype_of(stored)
            if s.is_quantized(stored, dtype, ndim):
                return self._check(name, stored, dtype, s)
        return None

    # ---- geometry: the resolved scheme's ---------------------------------------------------
    def _unresolved(self, *_: Any, **__: Any) -> Any:
        raise TypeError("a mixed compressed-tensors scheme: resolve the weight's scheme first")

    logical_shape = stored_shape = weight_selection = companion_selection = _unresolved


def mixed_columns(scheme: QuantScheme, names: Sequence[str], roles: Sequence[TensorRole],
                  entries: Sequence[Any], weights: Sequence[Optional[str]],
                  layer_roles: Callable[[int], Mapping[str, TensorRole]],
                  once: Callable[[tuple, Callable[[], Any]], Any],
                  fusions: tuple = ()) -> list[int]:
    """Per tensor of a stage: the index of its scheme in ``scheme.schemes`` (a companion's:
    its weight's; -1: plain), part of the planning key. Checks every stored weight against
    its module's scheme, and that the experts of each of the stage's MoE layers (all of
    them, whatever the EP rank: ``layer_roles``) resolve to one scheme: vLLM and SGLang
    build one fused-MoE method per layer from its first expert's scheme; and that the pieces
    of one fused linear (``fusions``: the family's q/k/v, gate/up) share one (vLLM: "Found
    different quantization schemes for the shards"). Each layer is checked ``once``
    (``CheckpointRoles.stage_value``)."""
    at = {id(s): i for i, s in enumerate(scheme.schemes)}  # type: ignore[attr-defined]
    at[id(None)] = -1
    out: list[int] = []
    layers: set[Optional[int]] = set()
    for name, role, entry, weight in zip(names, roles, entries, weights):
        if weight is not None:  # a companion: its weight's scheme
            out.append(at[id(scheme.resolve(weight))])
            continue
        s = scheme.resolve(name) if scheme.is_quantized(name, entry.dtype,
                                                        len(entry.shape)) else None
        out.append(at[id(s)])
        layers.add(role.layer)
    for layer in sorted(layers, key=lambda x: -1 if x is None else x):
        if layer is not None:
            once(("linear schemes", layer), partial(_check_layer, scheme, layer,
                                                    layer_roles, fusions))
    return out


def _check_layer(scheme: QuantScheme, layer: int,
                 layer_roles: Callable[[int], Mapping[str, TensorRole]],
                 fusions: tuple) -> bool:
    """``layer``'s experts, and the pieces of each fused linear, resolve to one scheme each."""
    from ..families.fused import match_fused
    roles = layer_roles(layer)
    _check_experts(scheme, layer, roles)
    pieces: dict[tuple, tuple[str, Optional[QuantScheme]]] = {}
    for name, role in sorted(roles.items()):
        naming = scheme.naming_of(name)
        if role.expert is not None or role.fused_experts or not naming.is_weight(name):
            continue
        found = match_fused(fusions, naming.logical_of(role.component)) if fusions else None
        if found is None or found.fusion.stacked:
            continue
        s = scheme.resolve(name)
        first = pieces.setdefault(found.group, (name, s))
        if first[1] is not s:
            raise PlanError(
                f"the pieces of fused {found.target} in layer {layer} have different "
                f"quantization schemes: {first[0]} is "
                f"{first[1].name if first[1] else 'not quantized'}, this one "
                f"{s.name if s else 'not quantized'} (vLLM loads them as one layer of one "
                "scheme)", tensor=name)
    return True


def _check_experts(scheme: QuantScheme, layer: int, roles: Mapping[str, TensorRole]) -> None:
    """The experts' weights of ``layer`` (all of them) resolve to one scheme, or PlanError."""
    first: Optional[tuple[str, Optional[QuantScheme]]] = None
    for name, role in sorted(roles.items()):
        if not (role.expert is not None or role.fused_experts) \
                or not scheme.naming_of(name).is_weight(name):
            continue
        s = scheme.resolve(name)  # the config's scheme of the module
        first = first or (name, s)
        if first[1] is not s:
            raise PlanError(
                f"the experts of layer {layer} mix quantization schemes: {first[0]} is "
                f"{first[1].name if first[1] else 'not quantized'}, this one "
                f"{s.name if s else 'not quantized'} (vLLM and SGLang load one MoE layer "
                "with one scheme)", tensor=name)
