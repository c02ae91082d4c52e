"""The shape of model knowledge: a Family is data (patterns, rules, config readers).

The planner never looks at tensor names itself; it asks the family to classify them.
Adding an architecture = adding one module under ``families/`` with a ``FAMILY`` value and
registering it in ``families/__init__.py`` (see docs/families.md, "Adding a family").
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Union

from ..errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from ..planning.spec import ModelSpec

logger = logging.getLogger(__name__)

__all__ = ["Family", "GlobalRule", "ShardRule", "Layout", "TensorRole", "Template",
           "CheckpointFormat", "LAYER_KINDS", "cfg", "cfg_opt"]

#: The layer kinds pploader knows (cache geometry and shard rules key on these). ``mlp`` is a
#: block with no sequence mixer (NemotronH's MLP / MoE layers): no cache. ``sliding_attention``
#: is GQA attention over a window (``layer_types``); ``unknown`` is a layer the generic family
#: could not classify (its cache geometry is refused, naming the layer).
LAYER_KINDS = ("full_attention", "mla", "gdn", "mamba1", "mamba2", "hybrid_attention_mamba2",
               "mlp", "sliding_attention", "unknown")

#: Non-parameter buffers some old exporters saved (rotary tables): known, never read (logged).
STRAY_BUFFERS = r"(.+\.)?rotary_emb\.inv_freq"

#: name -> shape of every tensor a checkpoint of this config holds (the strict expected set).
Template = Callable[["ModelSpec"], Mapping[str, tuple[int, ...]]]


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


@dataclass(frozen=True)
class ShardRule:
    """How a tensor splits over the TP ranks of a stage.

    ``dim`` None = replicated. ``segments(spec)`` gives the sizes of independent parts along
    ``dim`` (e.g. Mamba2 in_proj = [z, x, B, C, dt]); each part is split on its own and the
    rank's pieces are concatenated in order. ``units(spec)`` gives the number of indivisible
    units (e.g. kv heads) of every segment, or a tuple with one count per segment (Mamba2
    in_proj: heads for z/x/dt, groups for B/C): with fewer units than TP ranks, units are
    replicated (rank r takes unit r * units // tp). ``pad`` pads dim 0 to a multiple of tp.
    ``block`` is the quantization block along ``dim`` a split must not cut.
    """

    pattern: str
    dim: Optional[int]
    segments: Optional[Callable[["ModelSpec"], tuple[int, ...]]] = None
    units: Optional[Callable[["ModelSpec"], Union[int, tuple[int, ...]]]] = None
    pad: bool = False


@dataclass(frozen=True)
class TensorRole:
    """What a checkpoint tensor is, as far as placement is concerned."""

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


#: marker syntax that could match a newline or anchor the whole text (\s, \W, \D, [^...],
#: \A, \Z, the s flag): such a marker is searched name by name
_SPANS_NAMES = re.compile(r"\\[sWDAZ]|\[\^|\(\?[a-zA-Z]*s")


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
    text_config_key: Optional[str] = None        # VL configs nest the LM config here
    fused_targets: tuple = ()                    # bind/place.py: checkpoint pieces -> fused params
    formats: tuple[CheckpointFormat, ...] = ()   # other namings, detected from the checkpoint
    mtp_pattern: Optional[str] = None            # MTP tensors outside the layer numbering
    format: str = "original"                     # which naming this Family value describes
    ignore_pattern: Optional[str] = STRAY_BUFFERS  # known non-parameters, never read (logged)
    config_defaults: Mapping[str, object] = field(default_factory=dict)  # for keys config.json
    #   lacks under the standard name (generic: transformers' aliases, e.g. n_head)
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
                return replace(self, formats=(), format=fmt.name, _compiled={},
                               **dict(fmt.changes))  # type: ignore[arg-type]
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
        """The first TP rule whose pattern fully matches ``component`` (None = replicated)."""
        for rule in self.shard_rules:
            if self._re(rule.pattern).fullmatch(component):
                return rule
        return None

    def layer_name(self, layer: int, component: str) -> str:
        """Checkpoint name of ``component`` in ``layer`` (inverse of the layer prefix)."""
        prefix = re.sub(r"\(\\d\+\)", str(layer), self.layer_prefix).replace("\\.", ".")
        return prefix + component


def cfg(config: Mapping, *keys: str) -> Any:  # JSON: the caller converts
    """The first present key of ``config``; a clear error naming all keys when none is."""
    for key in keys:
        if key in config and config[key] is not None:
            return config[key]
    raise ConfigError(f"config.json lacks {' / '.join(keys)}")


def cfg_opt(config: Mapping, key: str, default: Any) -> Any:
    value = config.get(key)
    return default if value is None else value
