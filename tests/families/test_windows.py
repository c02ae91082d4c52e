"""Attention windows per layer (families/windows.py, ``CacheDims.windows``) against transformers'
own config classes: for every convention (``layer_types``, ``sliding_window_pattern`` defaults,
Qwen's ``use_sliding_window`` + ``max_window_layers``, Mistral / Mixtral / Qwen3-MoE windows on
every layer, Llama-4's chunked attention) the windows pploader reads from ``config.json`` equal
what the transformers class (and the model built from it) uses."""
from __future__ import annotations

from typing import Any, Optional

import pytest
import transformers

from helpers import tiny_config
from pploader import ConfigError
from pploader.cache.geometry import model_cache
from pploader.families.windows import (CHUNKED_TYPES, SLIDING_TYPES, layout_windows,
                                       typed_windows)
from pploader.planning.spec import spec_from_config

#: hand-written families: (config class, architecture, model_type, overrides); transformers
#: applies ``sliding_window`` per ``layer_types`` (Qwen2/3) or on every layer (the others)
HAND: list[tuple[str, str, str, dict[str, Any]]] = [
    ("Qwen2Config", "Qwen2ForCausalLM", "qwen2",
     {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 3}),
    ("Qwen2Config", "Qwen2ForCausalLM", "qwen2",  # defaults: window 4096 from layer 28
     {"use_sliding_window": True, "num_hidden_layers": 30}),
    ("Qwen2Config", "Qwen2ForCausalLM", "qwen2",
     {"use_sliding_window": False, "sliding_window": 24, "max_window_layers": 3}),
    ("Qwen2Config", "Qwen2ForCausalLM", "qwen2",
     {"use_sliding_window": True, "sliding_window": 24,
      "layer_types": ["full_attention", "sliding_attention"] * 4}),
    ("Qwen3Config", "Qwen3ForCausalLM", "qwen3",
     {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 5}),
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3_moe",
     {"use_sliding_window": True, "sliding_window": 40, "max_window_layers": 5}),
    ("MistralConfig", "MistralForCausalLM", "mistral", {"sliding_window": 24}),
    ("MistralConfig", "MistralForCausalLM", "mistral", {"sliding_window": None}),
    ("MistralConfig", "MistralForCausalLM", "mistral", {}),  # class default 4096
    ("MixtralConfig", "MixtralForCausalLM", "mixtral", {"sliding_window": 24}),
    ("MixtralConfig", "MixtralForCausalLM", "mixtral", {}),  # class default: none
]

_BASES = {"qwen2": "tiny-llama", "qwen3": "tiny-qwen3", "qwen3_moe": "tiny-qwen3_moe",
          "mistral": "tiny-llama", "mixtral": "tiny-mixtral"}


def _class_windows(cls_name: str, config: dict) -> tuple[Optional[int], ...]:
    """The windows transformers' class gives each layer (as its models read them)."""
    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "dtype")}
    cfg = getattr(transformers, cls_name)(**kwargs)
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is None:  # Mistral, Mixtral, Qwen3-MoE: every layer uses config.sliding_window
        return (cfg.sliding_window,) * n
    return tuple(cfg.sliding_window if t == "sliding_attention" else
                 getattr(cfg, "attention_chunk_size", None) if t == "chunked_attention" else None
                 for t in types)


@pytest.mark.parametrize("cls_name,arch,model_type,over", HAND)
def test_hand_written_family_windows_equal_transformers(cls_name: str, arch: str,
                                                        model_type: str, over: dict) -> None:
    config = tiny_config(_BASES[model_type], architectures=[arch], model_type=model_type, **over)
    spec = spec_from_config(config)
    expected = _class_windows(cls_name, config)
    assert spec.family.cache_dims.windows_of(spec) == expected
    caches = model_cache(spec)
    assert tuple(c.window for c in caches) == expected
    assert [c.kind for c in caches] == ["full_attention" if w is None else "sliding_attention"
                                        for w in expected]


def test_llama_never_slides() -> None:
    """LlamaForCausalLM ignores ``sliding_window`` (LlamaConfig has none): no window."""
    spec = spec_from_config(tiny_config("tiny-llama", sliding_window=16))
    assert all(c.window is None and c.kind == "full_attention" for c in model_cache(spec))


#: generic family (the model built on the meta device): class-normalised ``layer_types``
GENERIC: list[tuple[str, str, str, dict[str, Any]]] = [
    ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3_text",
     {"sliding_window": 32, "sliding_window_pattern": 3}),
    ("Gemma3TextConfig", "Gemma3ForCausalLM", "gemma3_text", {"sliding_window": 32}),
    ("Gemma2Config", "Gemma2ForCausalLM", "gemma2", {"sliding_window": 32}),
    ("GptOssConfig", "GptOssForCausalLM", "gpt_oss",
     {"sliding_window": 32, "num_local_experts": 4, "num_experts_per_tok": 2}),
    ("Cohere2Config", "Cohere2ForCausalLM", "cohere2", {"sliding_window": 32}),
]


@pytest.mark.parametrize("cls_name,arch,model_type,over", GENERIC)
def test_generic_family_windows_equal_transformers(cls_name: str, arch: str, model_type: str,
                                                   over: dict) -> None:
    config = {"architectures": [arch], "model_type": model_type, "num_hidden_layers": 7,
              "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "dtype": "bfloat16",
              **over}
    spec = spec_from_config(config)
    assert spec.family.name.startswith("generic:")
    expected = _class_windows(cls_name, config)
    assert any(w is not None for w in expected) and any(w is None for w in expected)
    caches = model_cache(spec)
    assert tuple(c.window for c in caches) == expected
    assert all((c.kind == "sliding_attention") == (c.window is not None) for c in caches)


def test_chunked_attention_window_is_the_chunk() -> None:
    """Llama-4's ``chunked_attention`` layers keep one chunk (``attention_chunk_size``)."""
    cfg = transformers.Llama4TextConfig(num_hidden_layers=8, attention_chunk_size=64)
    text = cfg.to_dict()
    kinds = ["sliding_attention" if t in SLIDING_TYPES | CHUNKED_TYPES else "full_attention"
             for t in text["layer_types"]]
    got = layout_windows(text, kinds)
    assert got == _class_windows("Llama4TextConfig", text)
    assert got.count(64) == 6 and got.count(None) == 2


def test_unused_zero_window_is_no_window() -> None:
    """Qwen2-MoE as transformers saves it: ``sliding_window: 0``, ``use_sliding_window``
    false, every layer ``full_attention``: pools with no window, not a refusal."""
    text = transformers.Qwen2MoeConfig(
        num_hidden_layers=3, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, vocab_size=128).to_dict()
    assert text["sliding_window"] == 0 and set(text["layer_types"]) == {"full_attention"}
    spec = spec_from_config({**text, "architectures": ["Qwen2MoeForCausalLM"],
                             "dtype": "bfloat16"})
    caches = model_cache(spec)
    assert len(caches) == 3 and all(c.window is None and c.kind == "full_attention"
                                    for c in caches)
    with pytest.raises(ConfigError, match="sliding_window = 0"):
        typed_windows(["full_attention", "sliding_attention"], 0)


def test_bad_window_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="sliding_window = 0"):
        typed_windows(["sliding_attention"], 0)
    spec = spec_from_config(tiny_config("tiny-llama", architectures=["MistralForCausalLM"],
                                        model_type="mistral", sliding_window=-4))
    with pytest.raises(ConfigError, match="sliding_window = -4"):
        model_cache(spec)


def test_tp_head_check_covers_sliding_only_models() -> None:
    """A model whose attention layers are all sliding still gets the TP head check (engines
    give every TP rank whole heads): 4 query heads do not split over 3 ranks."""
    from pploader.errors import PlanError
    from pploader.families.heads import check_tp_heads
    spec = spec_from_config({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                             "num_hidden_layers": 5, "hidden_size": 64, "intermediate_size": 64,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                             "vocab_size": 128, "sliding_window": 32, "dtype": "bfloat16"})
    assert set(spec.layer_kinds) == {"sliding_attention"}
    check_tp_heads(spec, 2)
    with pytest.raises(PlanError, match="does not divide the 4 query heads"):
        check_tp_heads(spec, 3)
