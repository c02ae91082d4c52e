"""Limits on ``config.json``, checked before anything grows with what it says.

A config is a few kilobytes; a hostile or broken one must not cost gigabytes on every rank.
Three layers, each before the allocation it protects:

1. :func:`read_json_limited`: the file's size (``MAX_CONFIG_BYTES``, from ``fstat`` before
   reading) and its nesting depth (``MAX_CONFIG_DEPTH``, counted without recursion before
   ``json.loads``, so 100 000 nested brackets never reach the recursive parser);
2. :func:`check_config_counts`: every count a family turns into a loop (layers, experts,
   heads, MTP layers) and every dimension is an integer inside ``COUNT_LIMITS``, checked
   before the family or transformers' meta model reads the config;
3. :func:`check_counts_against_checkpoint`: the counts fit the checkpoint's tensor names
   (every layer holds at least one tensor, every routed expert of a per-expert checkpoint
   at least one per MoE layer), checked before the family template is built.

Every refusal is a ``ConfigError`` naming ``config.json`` and the key.
"""
from __future__ import annotations

import json
import math
import os
import re
from itertools import accumulate
from typing import TYPE_CHECKING, Collection, Mapping, Optional

from ..errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from .spec import ModelSpec

__all__ = ["MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH", "COUNT_LIMITS", "read_json_limited",
           "read_bytes_limited", "parse_json_limited", "check_config_types", "BOOL_KEYS",
           "OBJECT_KEYS",
           "check_config_counts", "check_counts_against_checkpoint", "too_deep"]

#: the largest config.json accepted (real ones are under 100 KB; VL configs a few hundred)
MAX_CONFIG_BYTES = 16 << 20

#: the deepest nesting of objects / arrays accepted (real configs: 4)
MAX_CONFIG_DEPTH = 64

_LAYERS = (1, 10_000)        # real models: up to ~200
_EXPERTS = (0, 1 << 16)      # real models: up to 512
_HEADS = (1, 1 << 16)        # real models: up to 128
_MTP = (0, 1_000)
_DIM = (1, 1 << 32)          # hidden / intermediate / vocab / head sizes

#: key -> (smallest, largest) accepted value; checked wherever the key appears (the top
#: level and one level down: text_config, language_config, ...)
COUNT_LIMITS: Mapping[str, tuple[int, int]] = {
    "num_hidden_layers": _LAYERS, "n_layer": _LAYERS, "num_layers": _LAYERS,
    "n_layers": _LAYERS,
    "num_experts": _EXPERTS, "num_local_experts": _EXPERTS, "n_routed_experts": _EXPERTS,
    "n_shared_experts": _EXPERTS, "num_experts_per_tok": _EXPERTS,
    "num_attention_heads": _HEADS, "num_key_value_heads": _HEADS, "n_head": _HEADS,
    "num_heads": _HEADS,
    "num_nextn_predict_layers": _MTP, "mtp_num_hidden_layers": _MTP,
    "hidden_size": _DIM, "intermediate_size": _DIM, "moe_intermediate_size": _DIM,
    "vocab_size": _DIM, "head_dim": _DIM, "d_model": _DIM,
}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def too_deep(text: str, max_depth: int) -> bool:
    """Whether ``text``'s objects and arrays nest deeper than ``max_depth`` (strings
    skipped): innermost pairs are peeled off ``max_depth`` times, each pass one C-speed
    scan, so any length and any depth costs at most ``max_depth`` passes and no recursion.
    Unbalanced or mismatched brackets stop the peeling; a running sum over what is left
    then gives the depth (those are invalid JSON, but must not reach the recursive parser)."""
    bare = _NOT_BRACKET.sub("", _STRING.sub("", text))
    for peeled_levels in range(max_depth):
        if not bare:
            return False
        peeled = bare.replace("[]", "").replace("{}", "")
        if peeled == bare:  # unbalanced or mismatched: one C-level running sum decides
            return max(accumulate(map(_STEP.__getitem__, bare))) > max_depth - peeled_levels
        bare = peeled
    return bool(bare) and ("[]" in bare or "{}" in bare)


def too_large(what: str, size: int, max_bytes: int, name: str) -> ConfigError:
    """The error for a config of ``size`` bytes over ``max_bytes`` (any storage)."""
    return ConfigError(f"{what} is {size} bytes, over the {max_bytes >> 20} MiB limit: not a "
                       "model config (a real one is a few KB)", file=name)


def read_bytes_limited(path: os.PathLike | str, max_bytes: int = MAX_CONFIG_BYTES, *,
                       what: str = "config.json") -> bytes:
    """A local file's bytes, its size checked (``fstat``) before reading and at most
    ``max_bytes + 1`` read (a FIFO or /proc file reports size 0)."""
    name = str(path)
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > max_bytes:
                raise too_large(what, size, max_bytes, name)
            return fh.read(max_bytes + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}", file=name) from None


def parse_json_limited(raw: bytes, name: str, *, what: str = "config.json",
                       max_bytes: int = MAX_CONFIG_BYTES,
                       max_depth: int = MAX_CONFIG_DEPTH) -> object:
    """The JSON value of ``raw`` (fetched from any storage, at most ``max_bytes + 1``
    bytes), strictly: size and nesting depth checked before parsing; a repeated key, NaN,
    an infinity (``Infinity``, ``1e999``; but ``INFINITY_OK``) refused naming the key. A ConfigError naming
    ``name`` otherwise. Every storage's config.json goes through here (spec.read_config)."""
    if len(raw) > max_bytes:
        raise ConfigError(f"{what} is over the {max_bytes >> 20} MiB limit: not a model "
                          "config (a real one is a few KB)", file=name)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not valid JSON: {exc}", file=name) from None
    if too_deep(text, max_depth):
        raise ConfigError(f"{what} nests objects / arrays more than {max_depth} levels deep: "
                          "not a model config", file=name)
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except _ValueRefused as exc:
        raise ConfigError(f"{what}: {exc}", file=name) from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"not valid JSON: {exc}", file=name) from None
    bad = _non_finite(value, "")
    if bad is not None:
        raise ConfigError(f"{what}: {bad[0]} is {bad[1]}: give a finite number", file=name)
    return value


def read_json_limited(path: os.PathLike | str, *, what: str = "config.json",
                      max_bytes: int = MAX_CONFIG_BYTES,
                      max_depth: int = MAX_CONFIG_DEPTH) -> object:
    """Parse the local JSON file ``path`` (:func:`read_bytes_limited`, then
    :func:`parse_json_limited`)."""
    return parse_json_limited(read_bytes_limited(path, max_bytes, what=what), str(path),
                              what=what, max_bytes=max_bytes, max_depth=max_depth)


class _ValueRefused(ValueError):
    """A JSON value pploader refuses (raised inside the parser's hooks)."""


def _unique_keys(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise _ValueRefused(f"key {key!r} appears twice in one object (JSON readers "
                                    "disagree on which value wins): keep one")
            seen.add(key)
    return obj


#: keys whose values may be infinite: transformers writes ``Infinity`` there for "no limit"
#: (Mamba2 / Bamba / Nemotron-H / FalconH1 / GraniteMoeHybrid ``time_step_limit``)
INFINITY_OK = frozenset({"time_step_limit"})


def _non_finite(value: object, path: str) -> Optional[tuple[str, float]]:
    """The first (key path, value) holding NaN (``NaN``) or an infinity (``Infinity``,
    ``1e999``) outside ``INFINITY_OK``; None when every number is finite. The nesting is
    already bounded (MAX_CONFIG_DEPTH), so the recursion is too."""
    if isinstance(value, float):
        if math.isnan(value) or (math.isinf(value) and path.rpartition(".")[2].split("[")[0]
                                 not in INFINITY_OK):
            return path or "the value", value
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, list) else ()
    for key, inner in items:
        found = _non_finite(inner, f"{path}[{key}]" if isinstance(key, int)
                            else f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


#: keys whose value must be a JSON boolean (``"false"`` as a string is true in Python)
BOOL_KEYS = frozenset({"tie_word_embeddings", "use_sliding_window", "attention_bias",
                       "mlp_bias", "use_qk_norm", "is_encoder_decoder", "use_mla",
                       "norm_topk_prob", "tie_encoder_decoder"})

#: keys whose value must be a JSON object (or null)
OBJECT_KEYS = frozenset({"quantization_config", "rope_scaling", "rope_parameters",
                         "text_config", "vision_config", "audio_config", "compression_config",
                         "pploader_tiny"})


def check_config_types(config: Mapping) -> None:
    """Well-known keys have their JSON type, at the top level and one level down (a string
    where a bool or an object belongs is refused naming the key; null means absent)."""
    def check(where: str, inner: Mapping) -> None:
        for key, value in inner.items():
            if isinstance(value, float) and (math.isnan(value) or (
                    math.isinf(value) and key not in INFINITY_OK)):
                raise ConfigError(f"{where}{key} is {value}: give a finite number",
                                  file="config.json")
        for key in BOOL_KEYS & inner.keys():
            if inner[key] is not None and not isinstance(inner[key], bool):
                raise ConfigError(f"{where}{key} is {_short(inner[key])}, not true / false: "
                                  f"fix {key}", file="config.json")
        for key in OBJECT_KEYS & inner.keys():
            if inner[key] is not None and not isinstance(inner[key], Mapping):
                raise ConfigError(f"{where}{key} is {_short(inner[key])}, not an object: "
                                  f"fix {key}", file="config.json")
    check("", config)
    for outer, inner in config.items():
        if isinstance(inner, Mapping):
            check(f"{outer}.", inner)


#: keys some configs give per layer (Gemma 3n's intermediate_size): a list of values in range
_PER_LAYER_OK = frozenset(k for k, v in COUNT_LIMITS.items() if v in (_DIM, _HEADS))


def _check_value(key: str, value: object, where: str) -> None:
    low, high = COUNT_LIMITS[key]
    if isinstance(value, list) and key in _PER_LAYER_OK and value:
        for item in value:
            _check_value(key, item, where)
        return
    if isinstance(value, float) and value.is_integer() and low <= value <= high:
        return  # 32.0: written by some exporters, read as 32
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}{key} is {_short(value)}, not an integer: fix {key}",
                          file="config.json")
    if not low <= value <= high:
        raise ConfigError(f"{where}{key}={_short(value)} is outside [{low}, {high}]: no real "
                          f"model has that; fix {key}", file="config.json")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_config_counts(config: Mapping) -> None:
    """Every key of ``COUNT_LIMITS`` present in ``config`` (or one level down) is an
    integer in its range (None means absent); a ConfigError naming the key otherwise."""
    for key in COUNT_LIMITS.keys() & config.keys():
        if config[key] is not None:
            _check_value(key, config[key], "")
    for outer, inner in config.items():
        if isinstance(inner, Mapping):
            for key in COUNT_LIMITS.keys() & inner.keys():
                if inner[key] is not None:
                    _check_value(key, inner[key], f"{outer}.")


def _key_of(config: Mapping[str, object], *keys: str) -> str:
    return next((k for k in keys if config.get(k) is not None), keys[0])


def check_counts_against_checkpoint(spec: "ModelSpec", names: Collection[str]) -> None:
    """The config's layer and expert counts can describe a checkpoint with ``names``:
    a ConfigError naming the key when the template built from them could not match it
    (so no template larger than the checkpoint is ever built). ``spec``'s family must be
    resolved to the checkpoint's naming (ModelSpec.for_checkpoint)."""
    total = len(names)
    if not total:
        return
    fam = spec.family
    layers = spec.num_layers
    if layers > total:
        key = _key_of(spec.config, "num_hidden_layers", "n_layer", "num_layers", "n_layers")
        seen = _layer_ids(fam.layer_prefix, names)
        have = f"layers {min(seen)}..{max(seen)}" if seen else "no numbered layers"
        raise ConfigError(f"{key}={layers} but the checkpoint holds only {total} tensors "
                          f"({have}); every layer has at least one: fix {key} or --model",
                          file="config.json")
    experts, moe = spec.num_experts, len(spec.moe_layers)
    if experts and moe and experts * moe > total and not _fused(fam, names):
        key = _key_of(spec.config, "num_experts", "num_local_experts", "n_routed_experts")
        raise ConfigError(f"{key}={experts} over {moe} MoE layers needs at least "
                          f"{experts * moe} expert tensors but the checkpoint holds {total} "
                          f"tensors in all: fix {key} or --model", file="config.json")


def _layer_ids(prefix: str, names: Collection[str]) -> set[int]:
    rx = re.compile(prefix)
    out = set()
    for name in names:
        m = rx.match(name)
        if m is not None and m.groups() and m.group(1) and m.group(1).isdigit():
            out.add(int(m.group(1)))
    return out


def _fused(fam: object, names: Collection[str]) -> bool:
    """Whether the checkpoint stacks experts in 3-D tensors (its template has one tensor per
    layer, whatever the expert count: the shape check compares the count)."""
    pattern: Optional[str] = getattr(fam, "fused_expert_pattern", None)
    if not pattern:
        return False
    rx = re.compile(f"(?:{getattr(fam, 'layer_prefix')})(?:{pattern})")
    return any(rx.fullmatch(n) for n in names)
