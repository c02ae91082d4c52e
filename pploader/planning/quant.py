"""Quantized checkpoints: the scheme from config.json and the companion tensors of weights.

A quantized weight ``<module>.weight`` travels with companions: ``weight_scale_inv`` (FP8
block-scaled, DeepSeek-V3 style), ``weight_scale`` (FP8 per-tensor / per-channel, NVFP4 group
scales), ``weight_scale_2`` and ``input_scale`` (scalars). The scheme gives the companions'
suffixes, dtypes and blocks; how they are *named* next to a weight is the family's
(``Family.quant_naming``, families/base.py: by default the final ``weight`` replaced by the
suffix), so this module never cuts or glues a tensor name itself.

Families' templates give the *logical* weight shape ``[..., N, K]``; this module derives the
stored weight shape (NVFP4 packs two values per byte: ``[N, K/2]``) and every companion's
shape. Which weights are quantized is read from the
checkpoint's headers (a weight stored in the scheme's dtype is quantized and *must* have its
companions; one stored in the model dtype, e.g. a router gate, is not), or, without headers,
from the config's ignore list.

Sharding follows the weight: the TP selection is computed on the logical shape, then mapped
to the packed weight (intervals / pack) and to each companion (block rows/cols follow the
weight's slice; scalars are replicated; leading expert dims pass through). A split that cuts a
quantization block or a packed byte is a PlanError naming tensor, shape, dim, tp and block.
"""
from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from ..errors import ConfigError, PlanError
from ..families.base import QuantNaming
from .shard import Interval, Selection

if TYPE_CHECKING:  # pragma: no cover
    from .spec import ModelSpec

__all__ = ["Companion", "QuantScheme", "scheme_from_config", "quant_scheme", "expand_template",
           "expected_tensors", "same_shape", "QUANT_CONFIG_KEYS"]

QUANT_CONFIG_KEYS = ("quantization_config", "compression_config")
Block = Optional[int]  # elements per scale entry along a dim; None = one entry for the dim


@dataclass(frozen=True)
class Companion:
    """A tensor stored next to a quantized weight. ``block`` = (rows, cols) of the weight's
    last two dims covered by one entry (None = the whole dim); ``block`` None = a scalar per
    weight (per expert for stacked [E, N, K] weights)."""

    suffix: str
    dtype: str
    block: Optional[tuple[Block, Block]] = None

    def shape(self, logical: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of this companion for a weight of logical shape ``[..., N, K]``."""
        if self.block is None:
            return tuple(logical[:-2])
        return tuple(logical[:-2]) + tuple(1 if b is None else -(-x // b)
                                           for x, b in zip(logical[-2:], self.block))


@dataclass(frozen=True)
class QuantScheme:
    """One quantization method as data: the stored weight dtype, packing and companions."""

    name: str                          # "fp8-block" | "fp8-tensor" | "fp8-channel" | "nvfp4"
    weight_dtype: str                  # safetensors dtype of a quantized weight
    companions: tuple[Companion, ...]
    pack: int = 1                      # logical values per stored element along the last dim
    ignore: tuple[str, ...] = ()       # config's modules kept unquantized (names, globs, re:)
    naming: QuantNaming = QuantNaming()  # the family's companion naming (quant_scheme(spec))

    # ---- names ---------------------------------------------------------------------------
    def companion_names(self, weight: str) -> dict[str, Companion]:
        """``{name: companion}`` of a quantized weight named ``weight``."""
        return {self.naming.companion(weight, c.suffix): c for c in self.companions}

    def weight_of(self, name: str) -> Optional[tuple[str, Companion]]:
        """``(weight name, companion)`` when ``name`` is a companion's name, else None."""
        found = self.naming.weight_of(name, [c.suffix for c in self.companions])
        if found is None:
            return None
        return found[0], next(c for c in self.companions if c.suffix == found[1])

    def is_quantized(self, name: str, dtype: Optional[str], ndim: int) -> bool:
        """A weight (name ends in ``weight``, >= 2 dims) stored in the scheme's dtype."""
        return dtype == self.weight_dtype and ndim >= 2 and self.naming.is_weight(name)

    def ignored(self, name: str) -> bool:
        """True when the config's ignore list names the module of weight ``name``."""
        module = self.naming.module_of(name)
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.fullmatch(pat[3:], module) or re.fullmatch(pat[3:], name):
                    return True
            elif any(ch in pat for ch in "*?["):
                if fnmatch.fnmatchcase(module, pat) or fnmatch.fnmatchcase(name, pat):
                    return True
            elif module == pat or module.endswith("." + pat) or name == pat:
                return True
        return False

    # ---- shapes --------------------------------------------------------------------------
    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(stored[:-1]) + (stored[-1] * self.pack,)

    def stored_shape(self, logical: tuple[int, ...], name: str = "") -> tuple[int, ...]:
        if logical[-1] % self.pack:
            raise PlanError(f"{self.name}: last dim {logical[-1]} of {list(logical)} is not a "
                            f"multiple of the packing ({self.pack} values per byte)", tensor=name)
        return tuple(logical[:-1]) + (logical[-1] // self.pack,)

    # ---- selections ----------------------------------------------------------------------
    def weight_selection(self, sel: Selection, logical: tuple[int, ...], name: str,
                         tp_size: int) -> Selection:
        """The stored weight's selection for a logical selection (checks every block)."""
        for c in self.companions:
            self.companion_selection(c, sel, logical, name, tp_size)
        last = len(logical) - 1
        dims = []
        for d, intervals in sel.dims:
            if d == last and self.pack > 1:
                packed = f"a byte packing {self.pack} values"
                intervals = tuple(_blockwise(intervals, logical[d], self.pack, self, name,
                                             logical, d, tp_size, packed))
            dims.append((d, intervals))
        return Selection(tuple(dims), sel.pad_rows)

    def companion_selection(self, c: Companion, sel: Selection, logical: tuple[int, ...],
                            name: str, tp_size: int) -> Selection:
        """The companion's selection that matches the weight's logical selection ``sel``."""
        lead = len(logical) - 2
        dims = []
        pad = sel.pad_rows if lead > 0 else 0  # padded leading dim passes through
        for d, intervals in sel.dims:
            if d < lead:
                dims.append((d, intervals))
                continue
            block = None if c.block is None else c.block[d - lead]
            if block is None:
                continue  # scalar / whole-dim scale: replicated along this dim
            what = f"the {block}-element blocks of {c.suffix} {list(c.shape(logical))}"
            dims.append((d, tuple(_blockwise(intervals, logical[d], block, self, name, logical,
                                             d, tp_size, what))))
            if d == 0 and sel.pad_rows:  # padded rows of a 2-d weight: whole padded blocks
                rows = sum(n for _, n in intervals)
                pad = -(-(rows + sel.pad_rows) // block) - -(-rows // block)
        return Selection(tuple(dims), pad)


def _blockwise(intervals: tuple[Interval, ...], size: int, block: int, scheme: QuantScheme,
               name: str, logical: tuple[int, ...], dim: int, tp_size: int,
               what: str) -> list[Interval]:
    """Intervals in units of ``block``; an interval must start on a block boundary and end on
    one (or at the end of the dim, where the last block may be partial)."""
    out = []
    for start, n in intervals:
        if start % block or (n % block and start + n != size):
            raise PlanError(
                f"TP split cuts a quantization block: shape {list(logical)} split on dim {dim} "
                f"over tp={tp_size} gives a rank the slice [{start}, {start + n}), which cuts "
                f"{what} (block {block}, {scheme.name}); use a tp whose slices are multiples "
                f"of {block}", tensor=name)
        out.append((start // block, -(-n // block)))
    return out


# ---- config.json --------------------------------------------------------------------------
def _fp8(qc: Mapping) -> QuantScheme:
    static = str(qc.get("activation_scheme", "dynamic")).lower() == "static"
    inputs = (Companion("input_scale", "F32"),) if static else ()
    ignore = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
    block = qc.get("weight_block_size")
    if block:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ConfigError(f"quantization_config.weight_block_size must be two positive "
                              f"integers, got {block!r}", file="config.json")
        return QuantScheme("fp8-block", "F8_E4M3",
                           (Companion("weight_scale_inv", "F32", (block[0], block[1])),) + inputs,
                           ignore=ignore)
    return QuantScheme("fp8-tensor", "F8_E4M3", (Companion("weight_scale", "F32"),) + inputs,
                       ignore=ignore)


def _modelopt(qc: Mapping) -> QuantScheme:
    inner: Any = qc.get("quantization") if isinstance(qc.get("quantization"), Mapping) else qc
    algo = str(inner.get("quant_algo") or qc.get("quant_algo") or "").upper()
    ignore = tuple(inner.get("exclude_modules") or qc.get("ignore") or ())
    if algo == "FP8":
        return QuantScheme("fp8-tensor", "F8_E4M3", (Companion("weight_scale", "F32"),
                                                     Companion("input_scale", "F32")),
                           ignore=ignore)
    if algo == "NVFP4":
        group = int(inner.get("group_size") or qc.get("group_size") or 16)
        return QuantScheme("nvfp4", "U8", (Companion("weight_scale", "F8_E4M3", (1, group)),
                                           Companion("weight_scale_2", "F32"),
                                           Companion("input_scale", "F32")),
                           pack=2, ignore=ignore)
    raise ConfigError(f"modelopt quant_algo {algo or None!r} is not supported (FP8, NVFP4)",
                      file="config.json")


def _compressed(qc: Mapping) -> QuantScheme:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups or any(g != groups[0] for g in groups):
        raise ConfigError("compressed-tensors: exactly one kind of config group is supported",
                          file="config.json")
    w, a = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ConfigError(f"compressed-tensors weights {w.get('type')}/{w.get('num_bits')} bits "
                          "are not supported (fp8 float/8 only)", file="config.json")
    inputs = (Companion("input_scale", "F32"),) if a and not a.get("dynamic", False) else ()
    strategy = w.get("strategy")
    ignore = tuple(qc.get("ignore") or ())
    if strategy == "tensor":
        scale = Companion("weight_scale", "F32")
    elif strategy == "channel":
        scale = Companion("weight_scale", "F32", (1, None))
    elif strategy == "block":
        b = w.get("block_structure") or [128, 128]
        scale = Companion("weight_scale", "F32", (int(b[0]), int(b[1])))
    else:
        raise ConfigError(f"compressed-tensors strategy {strategy!r} is not supported "
                          "(tensor, channel, block)", file="config.json")
    return QuantScheme(f"fp8-{strategy}", "F8_E4M3", (scale,) + inputs, ignore=ignore)


def _fbgemm(qc: Mapping) -> QuantScheme:
    return QuantScheme("fp8-channel", "F8_E4M3", (Companion("weight_scale", "F32", (1, None)),),
                       ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _mxfp4(qc: Mapping) -> QuantScheme:
    """MXFP4 (gpt-oss): the quantized tensors are their own names (``<w>_blocks`` and
    ``<w>_scales``, uint8, stacked experts), which the family's template spells out
    (families/mxfp4.py); no ``weight`` has companions, so nothing is expanded here."""
    return QuantScheme("mxfp4", "U8", (), ignore=tuple(qc.get("modules_to_not_convert") or ()))


_METHODS: Mapping[str, Callable[[Mapping], QuantScheme]] = {
    "fp8": _fp8, "modelopt": _modelopt, "compressed-tensors": _compressed,
    "fbgemm_fp8": _fbgemm, "mxfp4": _mxfp4}


def scheme_from_config(config: Mapping) -> Optional[QuantScheme]:
    """The QuantScheme of a config.json (None when it declares no quantization)."""
    qc = None
    for key in QUANT_CONFIG_KEYS:
        if isinstance(config.get(key), Mapping):
            qc = config[key]
            break
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in _METHODS:
        raise ConfigError(f"quant_method {method or None!r} is not supported; supported: "
                          + ", ".join(sorted(_METHODS)), file="config.json")
    return _METHODS[method](qc)


def quant_scheme(spec: "ModelSpec") -> Optional[QuantScheme]:
    """The scheme of a ModelSpec (config.json top level first, then the text config), naming
    companions as the spec's family does."""
    scheme = scheme_from_config(spec.full_config) or scheme_from_config(spec.config)
    if scheme is None or scheme.naming == spec.family.quant_naming:
        return scheme
    return replace(scheme, naming=spec.family.quant_naming)


# ---- templates ----------------------------------------------------------------------------
def expand_template(scheme: QuantScheme, template: Mapping[str, tuple[int, ...]], *,
                    dtype_of: Optional[Callable[[str], Optional[str]]] = None,
                    layer_names: Optional[Callable[[str], bool]] = None
                    ) -> dict[str, tuple[int, ...]]:
    """``template`` (logical shapes) as a quantized checkpoint stores it: quantized weights
    get their stored shape and their companions are added (scalars have shape ``()``).

    With ``dtype_of`` (the checkpoint's stored dtype per name, None if absent) a weight is
    quantized iff stored in the scheme's dtype. Without it, every >= 2-d weight for which
    ``layer_names`` is true (default: all) and that the config does not ignore is.
    """
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in template.items():
        shape = tuple(shape)
        if dtype_of is not None:
            quantized = scheme.is_quantized(name, dtype_of(name), len(shape))
        else:
            quantized = (scheme.is_quantized(name, scheme.weight_dtype, len(shape))
                         and not scheme.ignored(name)
                         and (layer_names is None or layer_names(name)))
        if not quantized:
            out[name] = shape
            continue
        out[name] = scheme.stored_shape(shape, name)
        for cname, c in scheme.companion_names(name).items():
            out[cname] = c.shape(shape)
    return out


def expected_tensors(spec: "ModelSpec", dtype_of: Optional[Callable[[str], Optional[str]]] = None
                     ) -> dict[str, tuple[int, ...]]:
    """The family template with quantization applied (what a checkpoint of ``spec`` holds).

    Without ``dtype_of`` only decoder/MTP-layer weights count as quantized (embeddings and
    heads stay in the model dtype unless the checkpoint says otherwise)."""
    if spec.family.template is None:
        raise ConfigError(f"family {spec.family.name} has no tensor template")
    template = spec.family.template(spec)
    scheme = quant_scheme(spec)
    if scheme is None:
        return dict(template)

    def in_layer(name: str) -> bool:
        role = spec.family.classify(name, spec.num_layers, spec.num_mtp_layers)
        return role is not None and role.placement in ("layer", "mtp")
    return expand_template(scheme, template, dtype_of=dtype_of, layer_names=in_layer)


def same_shape(expected: tuple[int, ...], stored: tuple[int, ...]) -> bool:
    """Shapes agree; an expected scalar ``()`` also accepts any one-element shape (``[1]``)."""
    if tuple(expected) == tuple(stored):
        return True
    return tuple(expected) == () and math.prod(stored) == 1
