"""The shape of model knowledge: a Family is data (patterns, rules, config readers).

The planner never looks at tensor names itself; it asks the family to classify them, to name
them (the head a tied embedding is read as, a quantized weight's scale companions) and to size
the cache of its mixers (``cache_dims``). Adding an architecture = adding one module under
``families/`` whose ``FAMILIES`` tuple lists its Family values; ``families/__init__.py`` finds
it (see docs/families.md, "Adding a family").

Families see the model through :class:`SpecView`, the part of ``planning.spec.ModelSpec`` they
read (a Protocol: no import of the planner, so no import cycle).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, NamedTuple, Optional

from ..errors import ConfigError
from .cache_dims import CONFIG_CACHE_DIMS, CacheDims
from .spec_view import ShardRule, SpecView, cfg, cfg_opt

if TYPE_CHECKING:  # pragma: no cover
    pass

logger = logging.getLogger(__name__)

__all__ = ["Family", "GlobalRule", "ShardRule", "Layout", "TensorRole", "Template", "LayerTemplate",
           "CheckpointFormat", "QuantNaming", "SpecView", "LAYER_KINDS", "cfg", "cfg_opt"]

#: The layer kinds pploader knows (cache geometry and shard rules key on these). ``mlp`` is a
#: block with no sequence mixer (NemotronH's MLP / MoE layers): no cache. ``sliding_attention``
#: is GQA attention over a window (``layer_types``); ``short_conv`` is LFM2's gated short
#: convolution (state: its last inputs), ``lightning_attention`` MiniMax's decayed linear
#: attention, ``rg_lru`` RecurrentGemma's recurrent block, ``rwkv`` RWKV's time mixing; ``unknown`` is a layer the generic family
#: could not classify (its cache geometry is refused, naming the layer). ``cca_attention`` is
#: ZAYA1's compressed convolutional attention: K / V pages plus a conv state per request.
LAYER_KINDS = ("full_attention", "mla", "gdn", "mamba1", "mamba2", "hybrid_attention_mamba2",
               "mlp", "sliding_attention", "short_conv", "lightning_attention", "rg_lru", "rwkv",
               "cca_attention", "unknown")

#: Non-parameter buffers some old exporters saved (rotary tables): known, never read (logged).
STRAY_BUFFERS = r"(.+\.)?rotary_emb\.inv_freq"


#: name -> shape of every tensor a checkpoint of this config holds (the strict expected set).
Template = Callable[[SpecView], Mapping[str, tuple[int, ...]]]

#: The same set split by layer: (the names outside the layers -> shape, a function giving
#: layer ``i``'s components -> shapes (its names are ``Family.layer_name(i, component)``; layers
#: of one kind may share one mapping, never mutated), the layer ids, MTP layers included), so a
#: planner builds only the layers a stage reads and compares layers by their components. Must
#: agree with ``Template`` (tests/families check every family that has one).
LayerTemplate = Callable[[SpecView], tuple[Mapping[str, tuple[int, ...]],
                                           Callable[[int], Mapping[str, tuple[int, ...]]], range]]


@dataclass(frozen=True)
class Layout:
    """Per-layer structure read from config.json by a family."""

    num_layers: int
    layer_kinds: tuple[str, ...]
    moe_layers: frozenset[int] = frozenset()
    num_experts: int = 0
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or len(self.layer_kinds) != self.num_layers:
            raise ConfigError(f"{len(self.layer_kinds)} layer kinds for {self.num_layers} layers")
        unknown = set(self.layer_kinds) - set(LAYER_KINDS)
        if unknown:
            raise ConfigError(f"unknown layer kinds {sorted(unknown)}; known: {LAYER_KINDS}")


@dataclass(frozen=True)
class GlobalRule:
    """A tensor outside the decoder layers; ``placement`` is the stage that holds it."""

    pattern: str                 # regex, full match on the checkpoint name
    placement: str               # "first" | "last"
    role: str = "other"          # "embed" | "head" | "final_norm" | "vision" | "other"
    name: Optional[str] = None   # the tensor's name when the rule matches exactly one

    def __post_init__(self) -> None:
        if self.name is None and not re.search(r"(?<!\\)[.*+?()\[\]{}|^$]", self.pattern):
            # a pattern without unescaped metacharacters matches exactly one name: that one
            object.__setattr__(self, "name", re.sub(r"\\(.)", r"\1", self.pattern))

    @classmethod
    def exact(cls, name: str, placement: str, role: str = "other") -> "GlobalRule":
        """A rule for the one tensor ``name`` (pattern and name both known)."""
        return cls(re.escape(name), placement, role, name)


class TensorRole(NamedTuple):
    """What a checkpoint tensor is, as far as placement is concerned (an immutable named
    tuple: a large MoE's ~100 k roles are built in C passes, planning/roles.py)."""

    placement: str               # "layer" | "first" | "last" | "mtp" | "ignored" (never read)
    component: str               # name inside the layer (or the full name for globals)
    layer: Optional[int] = None  # global layer id (MTP ids count on from num_layers)
    expert: Optional[int] = None  # expert id of a per-expert tensor
    fused_experts: bool = False  # a 3-D tensor stacking all experts on dim 0
    role: str = "layer"          # GlobalRule.role for globals


@dataclass(frozen=True)
class CheckpointFormat:
    """A second on-disk naming of one architecture, e.g. transformers' own layout
    (``save_pretrained(save_original_format=False)``: fused 3-D experts, sometimes another
    prefix). ``marker`` is a regex searched in the checkpoint's tensor names; any hit selects
    this format, whose ``changes`` replace Family fields (template, prefixes, globals...)."""

    name: str
    marker: str
    changes: tuple[tuple[str, object], ...]


#: rule syntax that reads differently inside an alternation of named groups: group
#: references (by number or name) and inline flags
_NOT_COMBINABLE = re.compile(r"\\[1-9]|\(\?P[=<]|\(\?[aiLmsux-]+[:)]|\\g")

#: marker syntax that could match a newline or anchor the whole text (\s, \W, \D, [^...],
#: \A, \Z, the s flag): such a marker is searched name by name
_SPANS_NAMES = re.compile(r"\\[sWDAZ]|\[\^|\(\?[a-zA-Z]*s")


@dataclass(frozen=True)
class QuantNaming:
    """How a quantized weight's companions are named: a weight ``<module>.<weight>`` travels
    with ``<module>.<suffix>`` for each companion suffix (``weight_scale_inv``, ``input_scale``...;
    the suffixes come from the quantization scheme, planning/quant.py). The planner asks the
    family's naming instead of cutting names itself. ``weight`` is the stored weight's last
    name part (``qweight`` for AWQ / GPTQ, ``weight_packed`` for compressed-tensors int4: the
    scheme sets it), ``logical`` the one templates and TP rules use.

    ``stacked``: last name parts of stacked 3-D expert parameters that are weights themselves
    (transformers' ``FP8Experts``: ``experts.gate_up_proj`` [E, 2I, H]). Their companions are
    the parameter's name followed by the suffix less its leading weight name
    (``experts.gate_up_proj_scale_inv``: transformers' ``_alloc_expert_proj`` and the
    ``weight_scale_inv`` -> ``_scale_inv`` rule of ``HfQuantizer.update_weight_conversions``).
    Only for schemes that store the weight itself (``weight``).

    ``external``: a regex searched in weight names whose companions are not stored next to
    them but as tensors of their own that the family's template names (transformers'
    default save of a fine-grained-FP8 MoE: per-expert weights, stacked ``_scale_inv``)."""

    weight: str = "weight"
    logical: str = "weight"
    stacked: tuple[str, ...] = ()
    external: str = ""

    def has_companions(self, weight: str) -> bool:
        """False for a weight whose companions are stored elsewhere (``external``)."""
        return not self.external or re.search(self.external, weight) is None

    def is_stacked(self, name: str) -> bool:
        """True for a stacked expert parameter named as a weight (see ``stacked``)."""
        return bool(self.stacked) and self.weight == self.logical == "weight" and \
            name.rpartition(".")[2] in self.stacked

    def _stem(self, weight: str) -> int:
        """Length of the part of weight name ``weight`` its companions' names share."""
        return len(weight) if self.is_stacked(weight) else len(weight) - len(self.weight)

    def stored(self, logical_name: str) -> str:
        """The stored weight's name (or component) for a logical one (``x.weight`` ->
        ``x.qweight``); names that are not weights unchanged."""
        if self.weight == self.logical or not (
                logical_name == self.logical or logical_name.endswith("." + self.logical)):
            return logical_name
        return logical_name[:len(logical_name) - len(self.logical)] + self.weight

    def logical_of(self, name: str) -> str:
        """The logical weight's name (or component) for a stored one (inverse of
        :meth:`stored`): what the family's TP rules and templates are written for."""
        if self.weight == self.logical or not self.is_weight(name):
            return name
        return name[:len(name) - len(self.weight)] + self.logical

    def is_weight(self, name: str) -> bool:
        return name == self.weight or name.endswith("." + self.weight) or self.is_stacked(name)

    def _stacked_tail(self, suffix: str) -> str:
        """What a stacked parameter's companion ``suffix`` appends to its name."""
        return suffix[len(self.weight):] if suffix.startswith(self.weight) else "_" + suffix

    def companion(self, weight: str, suffix: str) -> str:
        """The name of weight ``weight``'s companion ``suffix``."""
        if self.is_stacked(weight):
            return weight + self._stacked_tail(suffix)
        return weight[:len(weight) - len(self.weight)] + suffix

    def weight_of(self, name: str, suffixes: Iterable[str]) -> Optional[tuple[str, str]]:
        """``(weight name, suffix)`` when ``name`` is a companion (longest suffix first)."""
        suffixes = list(suffixes)
        for suffix in suffixes if len(suffixes) < 2 else sorted(suffixes, key=len, reverse=True):
            if name == suffix or name.endswith("." + suffix):
                return name[:len(name) - len(suffix)] + self.weight, suffix
            tail = self._stacked_tail(suffix)
            if self.stacked and name.endswith(tail) and self.is_stacked(name[:-len(tail)]):
                return name[:-len(tail)], suffix
        return None

    def companion_component(self, weight_component: str, weight: str, name: str) -> str:
        """The component of companion ``name`` of ``weight``, from the weight's component
        (``mlp.w.weight`` -> ``mlp.w.weight_scale_inv``)."""
        tail = name[self._stem(weight):]
        return weight_component[:len(weight_component) - (len(weight) - self._stem(weight))] \
            + tail

    def weight_component(self, companion_component: str, name: str, weight: str) -> str:
        """The component of ``weight``, from its companion ``name``'s component (inverse of
        :meth:`companion_component`)."""
        tail = name[self._stem(weight):]
        return companion_component[:len(companion_component) - len(tail)] \
            + weight[self._stem(weight):]

    def module_of(self, name: str) -> str:
        """The module of weight ``name`` (``a.b.weight`` / ``a.b.qweight`` -> ``a.b``; a
        stacked parameter ``a.experts.gate_up_proj`` -> ``a.experts``); other names
        unchanged."""
        if self.is_stacked(name):
            return name.rpartition(".")[0]
        for last in (self.weight, self.logical):
            if name.endswith("." + last):
                return name[:-len(last) - 1]
        return name


@dataclass(frozen=True)
class Family:
    """Everything pploader knows about one architecture family, as data."""

    name: str
    architectures: tuple[str, ...]
    layout: Callable[[Mapping], Layout]
    layer_prefix: str = r"model\.layers\.(\d+)\."
    globals: tuple[GlobalRule, ...] = ()
    expert_pattern: Optional[str] = None         # on the component; group 1 = expert id
    fused_expert_pattern: Optional[str] = None   # on the component; dim 0 = experts
    shard_rules: tuple[ShardRule, ...] = ()      # first full match on the component wins
    template: Optional[Template] = None
    layer_template: Optional[LayerTemplate] = None  # ``template`` by layer (optional, faster)
    text_config_key: Optional[str] = None        # VL configs nest the LM config here
    fused_targets: tuple = ()                    # bind/place.py: checkpoint pieces -> fused params
    formats: tuple[CheckpointFormat, ...] = ()   # other namings, detected from the checkpoint
    mtp_pattern: Optional[str] = None            # MTP tensors outside the layer numbering
    format: str = "original"                     # which naming this Family value describes
    ignore_pattern: Optional[str] = STRAY_BUFFERS  # known non-parameters, never read (logged)
    config_defaults: Mapping[str, object] = field(default_factory=dict)  # for keys config.json
    #   lacks under the standard name (generic: transformers' aliases, e.g. n_head)
    model_types: frozenset[str] = frozenset()    # config ``model_type``s it was written for
    #   (empty: any); another model_type naming the architecture goes to the generic family
    cache_dims: "CacheDims" = CONFIG_CACHE_DIMS  # mixer sizes for the
    #   cache geometry (default: read by the known config-key aliases, families/cache_dims.py)
    quant_naming: QuantNaming = QuantNaming()    # companion names of quantized weights
    #: parameters the model ties to a stored tensor (the output head's tie aside, which
    #: ``tie_word_embeddings`` declares): (target, stored source, where the target is used:
    #: "layer" (its name's layer) / "first" / "last" / "every" (target = source: stored
    #: outside the layers, run inside the loop over them)). A stage using a target whose
    #: source it does not hold reads the source under the target's name (Zamba's shared block)
    shared: tuple[tuple[str, str, str], ...] = ()
    #: layer tensors their own layer does not run: stored ones are read only as a ``shared``
    #: source by the stage whose layer runs the copy; tied copies' names are read by none
    #: (Zamba2's shared-block LoRA adapters: the block stored in its first hybrid layer holds
    #: every hybrid layer's adapter, each layer runs one; integrations leave the others empty)
    unrun: frozenset[str] = frozenset()
    native_dtypes: Mapping[str, str] = field(default_factory=dict)  # tensor name -> the
    #   safetensors dtype the model itself gives it whatever config.json's dtype (integer
    #   buffers such as a router's lookup table); stored so, it is loaded as stored
    #: for an architecture and model_type saved under two namings that need two families
    #: (ZAYA: its release naming here, transformers' own naming in the generic family): True
    #: when config.json is the one this family plans; None = every config naming the
    #: architecture (find_family asks it after ``accepts``)
    config_match: Optional[Callable[[Mapping], bool]] = None
    #: refuses the TP / EP sizes the model's engine refuses, or cuts in a way no shard rule
    #: states (``(spec, tp_size, ep_size)``, raising PlanError that names the tensor and the
    #: engine's reason), beyond the head checks every family gets; None = the rules alone
    #: decide (plan_rank calls it once per rank)
    check_parallel: Optional[Callable[[SpecView, int, int], None]] = None
    _compiled: dict = field(default_factory=dict, compare=False, repr=False)

    def for_checkpoint(self, names: Iterable[str]) -> "Family":
        """This family as the checkpoint with tensor ``names`` spells it (its ``formats`` are
        tried in order; none matching = the original naming). The result has no formats left,
        so resolving twice is free."""
        if not self.formats:
            return self
        names = list(names)
        joined = "\n".join(names)  # one C-speed search instead of one per name (92 k names)
        one_search = joined.count("\n") == len(names) - 1  # no name holds a newline
        for fmt in self.formats:
            if one_search and not _SPANS_NAMES.search(fmt.marker):
                # ^ and $ anchor each name (MULTILINE); nothing in the marker matches "\n"
                found = re.compile(fmt.marker, re.MULTILINE).search(joined) is not None
            else:
                rx = re.compile(fmt.marker)
                found = any(rx.search(n) for n in names)
            if found:
                changes = dict(fmt.changes)
                if "template" in changes:  # a by-layer template must describe the same set
                    changes.setdefault("layer_template", None)
                return replace(self, formats=(), format=fmt.name, _compiled={},
                               **changes)  # type: ignore[arg-type]
        return replace(self, formats=())

    def _re(self, pattern: str) -> "re.Pattern[str]":
        rx = self._compiled.get(pattern)
        if rx is None:
            rx = self._compiled[pattern] = re.compile(pattern)
        return rx

    def _matchers(self) -> tuple:
        """Compiled once: all globals as one alternation (named groups), then mtp, layer
        prefix, expert and fused-expert patterns (classify runs for every checkpoint name)."""
        found = self._compiled.get("__classify__")
        if found is None:
            globs = re.compile("|".join(f"(?P<g{i}>{r.pattern})"
                                        for i, r in enumerate(self.globals))) \
                if self.globals else None
            found = self._compiled["__classify__"] = tuple(
                [globs] + [self._re(p) if p else None for p in (
                    self.mtp_pattern, self.layer_prefix, self.expert_pattern,
                    self.fused_expert_pattern)])
        return found

    def classify(self, name: str, num_layers: int, num_mtp_layers: int) -> Optional[TensorRole]:
        """Role of a checkpoint tensor, or None when the family does not know the name."""
        globs, mtp, prefix, expert_rx, fused_rx = self._matchers()
        g = globs.fullmatch(name) if globs is not None else None
        if g is not None:
            rule = self.globals[int(next(k for k, v in g.groupdict().items()
                                         if v is not None)[1:])]
            return TensorRole(rule.placement, name, role=rule.role)
        if mtp is not None and mtp.fullmatch(name):
            return TensorRole("mtp", name, role="mtp")  # known, never read by a stage
        if self.ignore_pattern is not None and self._re(self.ignore_pattern).fullmatch(name):
            logger.info("%s: skipping %s, a buffer old exporters saved (not a parameter; the "
                        "model recomputes it)", self.name, name)
            return TensorRole("ignored", name, role="ignored")
        m = prefix.match(name)
        if m is None:
            return None
        layer, component = int(m.group(1)), name[m.end():]
        if layer >= num_layers + num_mtp_layers:
            return None
        placement = "layer" if layer < num_layers else "mtp"
        expert, fused = None, False
        if expert_rx is not None:
            em = expert_rx.fullmatch(component)
            if em is not None:
                expert = int(em.group(1))
        if expert is None and fused_rx is not None:
            fused = fused_rx.fullmatch(component) is not None
        return TensorRole(placement, component, layer, expert, fused)

    def shard_rule(self, component: str) -> Optional[ShardRule]:
        """The first TP rule whose pattern fully matches ``component`` (None = replicated).
        All rules are tried in one regex call (an alternation in rule order: fullmatch takes
        the first alternative that matches the whole name), the rule by its named group."""
        rules = self._rules_rx()
        if rules is not None:
            m = rules.fullmatch(component)
            return None if m is None else self.shard_rules[int(m.lastgroup[1:])]  # type: ignore[index]
        for rule in self.shard_rules:
            if self._re(rule.pattern).fullmatch(component):
                return rule
        return None

    def _rules_rx(self) -> "Optional[re.Pattern[str]]":
        """The rules as one alternation ``(?P<r0>...)|(?P<r1>...)``, compiled once; None when
        there are none or a pattern could read differently inside it (a backreference or
        inline flag), and then they are tried one by one."""
        if "__rules__" not in self._compiled:
            found = None
            pats = [r.pattern for r in self.shard_rules]
            if pats and not any(_NOT_COMBINABLE.search(p) for p in pats):
                try:
                    found = re.compile("|".join(f"(?P<r{i}>{p})" for i, p in enumerate(pats)))
                except re.error:  # pragma: no cover - each pattern alone still applies
                    found = None
            self._compiled["__rules__"] = found
        return self._compiled["__rules__"]  # type: ignore[no-any-return]

    def head_name(self) -> Optional[str]:
        """The name of the output head (the name a tied embedding is read as), or None."""
        return next((r.name for r in self.globals if r.role == "head"), None)

    def accepts(self, architecture: str, model_type: Optional[object]) -> bool:
        """True when this family was written for ``architecture`` under ``model_type``."""
        return architecture in self.architectures and (
            model_type is None or not self.model_types or model_type in self.model_types)

    def matches_config(self, config: Mapping) -> bool:
        """True when this family plans ``config`` (``config_match``; None: any config)."""
        return self.config_match is None or bool(self.config_match(config))

    def layer_name(self, layer: int, component: str) -> str:
        """Checkpoint name of ``component`` in ``layer`` (inverse of the layer prefix)."""
        prefix = re.sub(r"\(\\d\+\)", str(layer), self.layer_prefix).replace("\\.", ".")
        return prefix + component
