"""Quantized checkpoints: the scheme from config.json, and templates as quantized
checkpoints store them.

A quantized weight ``<module>.weight`` is stored as ``<module>.<suffix>`` (``weight`` for FP8
and int8, ``qweight`` for AWQ / GPTQ, ``weight_packed`` for compressed-tensors int4 and NVFP4)
with companions (scales, zero points, group indices, global scales). The scheme gives their
suffixes, dtypes and layouts (planning/quant_layout.py); how they are *named* next to a
weight is the family's (``Family.quant_naming``, families/base.py), so this module never cuts
or glues a tensor name itself.

Which weights are quantized is read from the checkpoint's headers (a weight stored under the
scheme's suffix and dtype is quantized and *must* have its companions; one stored in the
model dtype, e.g. a router gate, is not), or, without headers, from the config's ignore list.

Layouts, by source (each method's on-disk format as its library writes it and vLLM's loaders
read it: ``awq.py``, ``gptq.py`` / ``gptq_marlin.py``, ``compressed_tensors`` schemes):

- AWQ GEMM: ``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32 ``[K/g, N/8]``, ``scales``
  ``[K/g, N]``.
- GPTQ: ``qweight`` int32 ``[K*bits/32, N]``, ``qzeros`` ``[K/g, N*bits/32]``, ``scales``
  ``[K/g, N]``, ``g_idx`` ``[K]``; with ``desc_act`` the scales and zeros are held whole by
  every rank of a row-parallel layer (the group of an input is ``g_idx``'s, not its
  position), only ``qweight`` and ``g_idx`` are split.
- compressed-tensors ``pack-quantized`` (W4A16 / W8A16): ``weight_packed`` int32
  ``[N, K*bits/32]``, ``weight_scale`` ``[N, K/g]`` (``[N, 1]`` per channel),
  ``weight_zero_point`` ``[N*bits/32, K/g]`` (asymmetric), ``weight_g_idx`` ``[K]`` (actorder
  "group": scales held whole as above), ``weight_shape`` ``[2]``; ``int-quantized`` (W8A8):
  int8 ``weight``, ``weight_scale`` ``[N, 1]`` or a scalar, static ``input_scale``;
  ``nvfp4-pack-quantized``: ``weight_packed`` uint8 ``[N, K/2]``, FP8 ``weight_scale``
  ``[N, K/16]``, ``weight_global_scale`` and ``input_global_scale`` scalars.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from ..errors import ConfigError
from ..families.base import QuantNaming
from .quant_groups import Group, mixed_scheme
from .quant_layout import IN, OUT, PLAIN, Axis, Companion, QuantScheme, blocks

if TYPE_CHECKING:  # pragma: no cover
    from .spec import ModelSpec

__all__ = ["Axis", "Companion", "QuantScheme", "blocks", "scheme_from_config", "quant_scheme",
           "expand_template", "expected_tensors", "same_shape", "QUANT_CONFIG_KEYS"]

QUANT_CONFIG_KEYS = ("quantization_config", "compression_config")
FP8 = Companion("weight", "F8_E4M3", PLAIN)


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
        return QuantScheme("fp8-block",
                           FP8, (Companion("weight_scale_inv", "F32", blocks(block[0], block[1])),)
                           + inputs,
                           ignore=ignore)
    return QuantScheme("fp8-tensor", FP8, (Companion("weight_scale", "F32"),) + inputs,
                       ignore=ignore)


def _modelopt(qc: Mapping) -> QuantScheme:
    inner: Any = qc.get("quantization") if isinstance(qc.get("quantization"), Mapping) else qc
    algo = str(inner.get("quant_algo") or qc.get("quant_algo") or "").upper()
    ignore = tuple(inner.get("exclude_modules") or qc.get("ignore") or ())
    if algo == "FP8":
        return QuantScheme("fp8-tensor", FP8, (Companion("weight_scale", "F32"),
                                               Companion("input_scale", "F32")), ignore=ignore)
    if algo == "NVFP4":
        group = int(inner.get("group_size") or qc.get("group_size") or 16)
        return QuantScheme("nvfp4", Companion("weight", "U8", blocks(1, 2)),
                           (Companion("weight_scale", "F8_E4M3", blocks(1, group)),
                            Companion("weight_scale_2", "F32"), Companion("input_scale", "F32")),
                           ignore=ignore)
    raise ConfigError(f"modelopt quant_algo {algo or None!r} is not supported (FP8, NVFP4)",
                      file="config.json")


def _group(qc: Mapping, method: str, channel_ok: bool = True) -> Optional[int]:
    """A positive group size, or None for -1 (one group per output: per-channel scales)."""
    group = qc.get("group_size", qc.get("q_group_size"))
    if group == -1 and channel_ok:
        return None
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        raise ConfigError(f"{method} group_size must be a positive integer"
                          f"{' or -1' if channel_ok else ''}, got {group!r}", file="config.json")
    return group


def _bits(qc: Mapping, method: str, allowed: tuple[int, ...]) -> int:
    bits = qc.get("bits", qc.get("w_bit", qc.get("num_bits")))
    if bits not in allowed:
        raise ConfigError(f"{method} with {bits!r}-bit weights is not supported (bits "
                          f"{', '.join(map(str, allowed))}: whole values per int32)",
                          file="config.json")
    return int(bits)  # type: ignore[arg-type]


def _awq(qc: Mapping) -> QuantScheme:
    """AutoAWQ's GEMM layout: the int4 values packed 8 per int32 along the outputs."""
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ConfigError(f"awq version {version!r} is not supported (gemm: qweight [in, out/8])",
                          file="config.json")
    pack = 32 // _bits(qc, "awq", (4,))
    group = _group(qc, "awq", channel_ok=False)
    return QuantScheme("awq", Companion("qweight", "I32", (Axis(IN), Axis(OUT, pack))),
                       (Companion("qzeros", "I32", (Axis(IN, group), Axis(OUT, pack))),
                        Companion("scales", "F16", (Axis(IN, group), Axis(OUT)))),
                       ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _gptq(qc: Mapping) -> QuantScheme:
    """GPTQ (AutoGPTQ / GPTQModel ``gptq`` and ``gptq_v2`` formats): packed on the inputs."""
    fmt = str(qc.get("checkpoint_format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ConfigError(f"gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)",
                          file="config.json")
    if qc.get("lm_head"):
        raise ConfigError("gptq with a quantized lm_head (lm_head: true) is not supported",
                          file="config.json")
    if qc.get("dynamic"):
        raise ConfigError("gptq per-module overrides (dynamic) are not supported",
                          file="config.json")
    pack = 32 // _bits(qc, "gptq", (2, 4, 8))
    group = _group(qc, "gptq")
    split = not qc.get("desc_act")  # act-order: scales held whole on row-parallel layers
    return QuantScheme("gptq" if split else "gptq-desc-act",
                       Companion("qweight", "I32", (Axis(IN, pack), Axis(OUT))),
                       (Companion("qzeros", "I32", (Axis(IN, group, split), Axis(OUT, pack))),
                        Companion("scales", "F16", (Axis(IN, group, split), Axis(OUT))),
                        Companion("g_idx", "I32", (Axis(IN),))),
                       ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _compressed(qc: Mapping) -> QuantScheme:
    """compressed-tensors (llm-compressor): each weight's scheme resolved from the config
    groups' targets and the ignore list (planning/quant_groups.py), groups of one scheme or
    of several."""
    groups = dict(qc.get("config_groups") or {})
    if not groups:
        raise ConfigError("compressed-tensors config has no config_groups", file="config.json")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise ConfigError(f"compressed-tensors sparsity format {sparsity.get('format')!r} is "
                          "not supported", file="config.json")
    schemes = {name: _compressed_group(g, qc.get("format")) for name, g in groups.items()}
    ignore = tuple(qc.get("ignore") or ())
    targets = {name: g.get("targets") for name, g in groups.items()}
    for name, t in targets.items():
        if not isinstance(t, (list, tuple)):
            raise ConfigError(f"compressed-tensors config group {name}: targets must be a list, "
                              f"got {t!r}", file="config.json")
    return mixed_scheme([Group(name, tuple(targets[name]), s) for name, s in schemes.items()],
                        ignore)


def _compressed_group(group: Mapping, top_format: Optional[str]) -> QuantScheme:
    fmt = group.get("format") or top_format
    w, a = group.get("weights") or {}, group.get("input_activations")
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    static = bool(a) and not a.get("dynamic", False)  # type: ignore[union-attr]
    if kind == "float" and bits == 8:
        return _compressed_fp8(w, static)
    if kind == "float" and bits == 4:
        if fmt != "nvfp4-pack-quantized" or strategy != "tensor_group":
            raise ConfigError(f"compressed-tensors fp4 weights in format {fmt!r}, strategy "
                              f"{strategy!r} are not supported (nvfp4-pack-quantized, "
                              "tensor_group)", file="config.json")
        group_size = _group(w, "compressed-tensors nvfp4")
        inputs = (Companion("input_global_scale", "F32"),) if a else ()
        return QuantScheme("nvfp4", Companion("weight_packed", "U8", blocks(1, 2)),
                           (Companion("weight_scale", "F8_E4M3", blocks(1, group_size)),
                            Companion("weight_global_scale", "F32")) + inputs)
    if kind == "int" and fmt == "pack-quantized":
        return _compressed_wna16(w, static)
    if kind == "int" and bits == 8 and fmt in ("int-quantized", None):
        return _compressed_int8(w, a, static)
    raise ConfigError(f"compressed-tensors {kind}/{bits}-bit weights in format {fmt!r} are "
                      "not supported (float 8; int4 / int8 pack-quantized; int8 int-quantized; "
                      "nvfp4-pack-quantized)", file="config.json")


def _compressed_fp8(w: Mapping, static: bool) -> QuantScheme:
    inputs = (Companion("input_scale", "F32"),) if static else ()
    strategy = w.get("strategy")
    if strategy == "tensor":
        scale = Companion("weight_scale", "F32")
    elif strategy == "channel":
        scale = Companion("weight_scale", "F32", blocks(1, None))
    elif strategy == "block":
        b = w.get("block_structure") or [128, 128]
        scale = Companion("weight_scale", "F32", blocks(int(b[0]), int(b[1])))
    else:
        raise ConfigError(f"compressed-tensors fp8 strategy {strategy!r} is not supported "
                          "(tensor, channel, block)", file="config.json")
    return QuantScheme(f"fp8-{strategy}", FP8, (scale,) + inputs)


def _compressed_wna16(w: Mapping, static: bool) -> QuantScheme:
    """W4A16 / W8A16 ``pack-quantized``: vLLM's CompressedTensorsWNA16 parameters."""
    strategy = w.get("strategy")
    if strategy not in ("group", "channel") or static:
        raise ConfigError(f"compressed-tensors pack-quantized with strategy {strategy!r}"
                          f"{' and static input activations' if static else ''} is not "
                          "supported (group, channel; weight-only)", file="config.json")
    pack = 32 // _bits(w, "compressed-tensors pack-quantized", (4, 8))
    group = _group(w, "compressed-tensors") if strategy == "group" else None
    if w.get("actorder") not in (None, False, "group", "weight", "static"):
        raise ConfigError(f"compressed-tensors actorder {w.get('actorder')!r} is not supported "
                          "(group, weight / static, none)", file="config.json")
    g_idx = w.get("actorder") == "group" and group is not None
    split = not g_idx  # act-order by group: scales held whole on row-parallel layers
    comps = [Companion("weight_scale", "BF16", (Axis(OUT), Axis(IN, group, split))),
             Companion("weight_shape", "I64", tail=(2,))]
    if not w.get("symmetric", True):
        comps.append(Companion("weight_zero_point", "I32", (Axis(OUT, pack),
                                                            Axis(IN, group, split))))
    if g_idx:
        comps.append(Companion("weight_g_idx", "I32", (Axis(IN),)))
    name = f"w{32 // pack}a16-{strategy}" + ("-asym" if not w.get("symmetric", True) else "")
    return QuantScheme(name, Companion("weight_packed", "I32", (Axis(OUT), Axis(IN, pack))),
                       tuple(comps))


def _compressed_int8(w: Mapping, a: Optional[Mapping], static: bool) -> QuantScheme:
    """W8A8 int8 (``int-quantized``): vLLM's CompressedTensorsW8A8Int8 parameters."""
    strategy = w.get("strategy")
    if strategy not in ("channel", "tensor") or not w.get("symmetric", True):
        raise ConfigError(f"compressed-tensors int8 weights with strategy {strategy!r}"
                          f"{'' if w.get('symmetric', True) else ', asymmetric'} are not "
                          "supported (symmetric channel, tensor)", file="config.json")
    axes = blocks(1, None) if strategy == "channel" else None
    comps: tuple[Companion, ...] = (Companion("weight_scale", "F32", axes),)
    if static:
        comps += (Companion("input_scale", "F32"),)
        if not (a or {}).get("symmetric", True):
            comps += (Companion("input_zero_point", "I32"),)
    return QuantScheme(f"int8-{strategy}", Companion("weight", "I8", PLAIN), comps)


def _fbgemm(qc: Mapping) -> QuantScheme:
    return QuantScheme("fp8-channel", FP8, (Companion("weight_scale", "F32", blocks(1, None)),),
                       ignore=tuple(qc.get("modules_to_not_convert") or ()))


def _mxfp4(qc: Mapping) -> QuantScheme:
    """MXFP4 (gpt-oss): the quantized tensors are their own names (``<w>_blocks`` and
    ``<w>_scales``, uint8, stacked experts), which the family's template spells out
    (families/mxfp4.py); no ``weight`` has companions, so nothing is expanded here."""
    return QuantScheme("mxfp4", Companion("weight", "U8", PLAIN), (),
                       ignore=tuple(qc.get("modules_to_not_convert") or ()))


_METHODS: Mapping[str, Callable[[Mapping], QuantScheme]] = {
    "fp8": _fp8, "modelopt": _modelopt, "compressed-tensors": _compressed,
    "fbgemm_fp8": _fbgemm, "mxfp4": _mxfp4, "awq": _awq, "gptq": _gptq}


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
    companions as the spec's family does (its weight name stored under the scheme's).

    Kept per (quantization config, naming): the ranks of a plan share one scheme, and with it
    a per-weight scheme's module matches (planning/quant_groups.py)."""
    for config in (spec.full_config, spec.config):
        for key in QUANT_CONFIG_KEYS:
            if isinstance(config.get(key), Mapping):
                text = json.dumps({key: config[key]}, default=repr)  # in order: groups' order counts
                return _scheme_of(text, spec.family.quant_naming)
    return None


@lru_cache(maxsize=32)
def _scheme_of(text: str, naming: QuantNaming) -> Optional[QuantScheme]:
    scheme = scheme_from_config(json.loads(text))
    return None if scheme is None else scheme.with_naming(naming)


# ---- templates ----------------------------------------------------------------------------
def expand_template(scheme: QuantScheme, template: Mapping[str, tuple[int, ...]], *,
                    dtype_of: Optional[Callable[[str], Optional[str]]] = None,
                    layer_names: Optional[Callable[[str], bool]] = None
                    ) -> dict[str, tuple[int, ...]]:
    """``template`` (logical shapes) as a quantized checkpoint stores it: quantized weights
    get their stored shape and their companions are added (scalars have shape ``()``).

    With ``dtype_of`` (the checkpoint's stored dtype per name, None if absent) a weight is
    quantized iff stored (under the scheme's weight name) in the scheme's dtype (config
    groups: its module's scheme's, else a PlanError). Without it, every >= 2-d weight for
    which ``layer_names`` is true (default: all) and that the config does not ignore is.
    """
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in template.items():
        shape = tuple(shape)
        if dtype_of is not None:
            s = scheme.stored_scheme(name, len(shape), dtype_of)
        else:
            s = scheme.resolve(name)  # mixed groups: the module's scheme (None: ignored)
            if s is not None and not (
                    s.is_quantized(s.naming.stored(name), s.weight_dtype, len(shape))
                    and not scheme.ignored(name)
                    and (layer_names is None or layer_names(name))):
                s = None
        if s is None:
            out[name] = shape
            continue
        stored = s.naming.stored(name)  # x.weight -> x.qweight (AWQ / GPTQ), else itself
        out[stored] = s.stored_shape(shape, name)
        for cname, c in s.companion_names(stored).items():
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
