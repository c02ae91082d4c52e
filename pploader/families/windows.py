"""Attention windows per decoder layer, for the cache geometry (``CacheDims.windows``).

A sliding-window layer attends to its last ``W`` tokens, a chunked-attention layer (Llama-4) to
the tokens of its own chunk of ``W``: either keeps at most ``W`` tokens of KV per sequence, not
the whole context. ``None`` = the whole context: full attention, or a layer whose window the
config does not give (pooled full-length: a safe bound, never a guess).

Read as transformers 5.24's config classes and models read them (tests/families/test_windows.py
checks these readers against the classes' own ``layer_types`` / ``sliding_window``):

- ``layer_types`` (Gemma-2/3, Cohere2, gpt-oss, Olmo3, Exaone4, Qwen2/3, Llama-4...): per layer,
  ``sliding_attention`` slides over ``sliding_window``, ``chunked_attention`` over
  ``attention_chunk_size``. The generic family reads the class-normalised config, where the
  class has already expanded ``sliding_window_pattern`` (or its default pattern) into the list.
- Qwen2 / Qwen3 without ``layer_types``: layers ``i >= max_window_layers`` (default 28) slide
  when ``use_sliding_window`` (default false) is true.
- Qwen3-MoE: every layer slides when ``use_sliding_window`` is true (its model ignores
  ``max_window_layers``).
- Mistral, Mixtral: every layer slides when ``sliding_window`` is set; Mistral's class default
  is 4096 (a ``config.json`` without the key slides), Mixtral's is none. Llama never slides.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from ..errors import ConfigError
from .spec_view import SpecView

__all__ = ["Windows", "SLIDING_TYPES", "CHUNKED_TYPES", "typed_windows", "config_windows",
           "layout_windows", "spec_layout_windows",
           "uniform_windows", "qwen_windows", "qwen_moe_windows", "mistral_windows"]

#: One entry per decoder layer: the tokens of KV it keeps per sequence, None = all of them.
Windows = tuple[Optional[int], ...]

#: ``layer_types`` names of sliding-window layers (transformers' and older exporters' spellings)
SLIDING_TYPES = frozenset({"sliding_attention", "sliding", "local", "local_attention"})
#: ``layer_types`` names of chunked-attention layers (Llama-4: window = ``attention_chunk_size``)
CHUNKED_TYPES = frozenset({"chunked_attention"})

#: Class defaults of transformers 5.24 (tested against the classes)
QWEN_DEFAULT_WINDOW = 4096          # Qwen2Config / Qwen3Config / Qwen3MoeConfig.sliding_window
QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28  # Qwen2Config / Qwen3Config.max_window_layers
MISTRAL_DEFAULT_WINDOW = 4096       # MistralConfig.sliding_window


def _size(value: Any, key: str) -> Optional[int]:
    """A window size from the config: a positive int, or None (no window)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key} = {value!r} is not a positive number of tokens",
                          file="config.json")
    return value


def typed_windows(types: Sequence[Any], sliding_window: Any,
                  chunk_size: Any = None) -> Windows:
    """Windows from a ``layer_types`` list: sliding layers get ``sliding_window``, chunked
    layers ``chunk_size``, every other layer None. A size is read only when some layer uses
    it (Qwen2-MoE's saved config carries ``sliding_window: 0`` with every layer full)."""
    names = {str(t) for t in types}
    sliding = _size(sliding_window, "sliding_window") if names & SLIDING_TYPES else None
    chunk = _size(chunk_size, "attention_chunk_size") if names & CHUNKED_TYPES else None
    return tuple(sliding if str(t) in SLIDING_TYPES else chunk if str(t) in CHUNKED_TYPES
                 else None for t in types)


def _layer_types(config: Mapping[str, Any], num_layers: int) -> Optional[Sequence[Any]]:
    types = config.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types) if isinstance(types, (list, tuple)) else 0}"
                          f" entries for {num_layers} layers", file="config.json")
    return types


def config_windows(config: Mapping[str, Any], num_layers: int) -> Windows:
    """Windows of a class-normalised config (every key present, ``layer_types`` expanded):
    ``layer_types`` with ``sliding_window`` / ``attention_chunk_size``; no list = no window."""
    types = _layer_types(config, num_layers)
    if types is None:
        return (None,) * num_layers
    return typed_windows(types, config.get("sliding_window"), config.get("attention_chunk_size"))


def layout_windows(config: Mapping[str, Any], kinds: Sequence[str]) -> Windows:
    """:func:`config_windows` for the layers a layout calls ``sliding_attention``, None for the
    rest (the generic family: its kinds come from the same ``layer_types``). A ``layer_types``
    list of the wrong length gives no window (the layout ignored it too)."""
    types = config.get("layer_types")
    if not isinstance(types, (list, tuple)) or len(types) != len(kinds):
        return (None,) * len(kinds)
    found = config_windows(config, len(kinds))
    return tuple(w if k == "sliding_attention" else None for w, k in zip(found, kinds))


def spec_layout_windows(spec: SpecView) -> Windows:
    """:func:`layout_windows` of a spec's own config (families without their own reader)."""
    return layout_windows(spec.config, spec.layer_kinds)


def uniform_windows(default: Optional[int]) -> Callable[[SpecView], Windows]:
    """Every layer slides over ``sliding_window`` (``default`` when the key is absent)."""
    def read(spec: SpecView) -> Windows:
        c = spec.config
        window = _size(c["sliding_window"] if "sliding_window" in c else default,
                       "sliding_window")
        return (window,) * spec.num_layers
    return read


def mistral_windows(spec: SpecView) -> Windows:
    """The llama family: MistralForCausalLM slides (class default 4096), Llama does not."""
    if spec.architecture != "MistralForCausalLM":
        return (None,) * spec.num_layers
    return uniform_windows(MISTRAL_DEFAULT_WINDOW)(spec)


def _qwen_window(config: Mapping[str, Any]) -> Optional[int]:
    if not config.get("use_sliding_window", False):
        return None
    return _size(config.get("sliding_window", QWEN_DEFAULT_WINDOW), "sliding_window")


def qwen_windows(spec: SpecView) -> Windows:
    """Qwen2 / Qwen3: ``layer_types`` if given, else layers ``>= max_window_layers``; the
    window only when ``use_sliding_window`` (transformers sets it None otherwise)."""
    c, n = spec.config, spec.num_layers
    window = _qwen_window(c)
    types = _layer_types(c, n)
    if types is not None:
        return typed_windows(types, window)
    first = c.get("max_window_layers", QWEN_DEFAULT_MAX_WINDOW_LAYERS)
    if not isinstance(first, int):
        raise ConfigError(f"max_window_layers = {first!r} is not a layer count",
                          file="config.json")
    return tuple(window if i >= first else None for i in range(n))


def qwen_moe_windows(spec: SpecView) -> Windows:
    """Qwen3-MoE: every layer slides when ``use_sliding_window``."""
    return (_qwen_window(spec.config),) * spec.num_layers
