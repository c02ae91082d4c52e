"""The sweep's shrink: any transformers config made tiny (tests/generic_sweep.py builds and
checks the result). Generic rules first (sizes by name and suffix, nested configs recursively,
the kept layers chosen by pattern and renumbered everywhere); ``FIXUPS`` is the short table of
per-model overrides, each with its reason."""
from __future__ import annotations

import json
import re
from typing import Any, Optional

LAYERS = 4
#: config key -> tiny value (applied when the config class has the key)
SIZES: dict[str, Any] = {
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "n_layers": LAYERS, "num_layers": LAYERS,
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "embed_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "ffn_hidden_size": 128,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2, "head_dim": 16,
    "vocab_size": 128, "max_position_embeddings": 128, "n_positions": 128,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "qk_head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 4, "mamba_num_heads": 4, "mamba_d_head": 32, "mamba_head_dim": 32,
    "mamba_d_state": 8, "ssm_state_size": 8, "state_size": 8, "mamba_n_groups": 2,
    "n_groups": 2, "mamba_expand": 2, "expand": 2, "mamba_d_conv": 4, "conv_kernel": 4,
    "mamba_chunk_size": 8, "chunk_size": 8, "mamba_dt_rank": 4, "time_step_rank": 4,
    "sliding_window": 16, "attention_chunk_size": 16,
    "decoder_layers": LAYERS, "encoder_layers": 2, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
    "decoder_attention_heads": 4, "encoder_attention_heads": 4, "num_decoder_layers": LAYERS,
}
#: model type -> extra overrides for configs whose constraints the generic shrink breaks
#: (nested configs by their own model_type; dicts are merged into the shrunk dict)
FIXUPS: dict[str, dict[str, Any]] = {
    # heads x head_dim must equal expand x hidden (its own key names)
    "mamba2": {"num_heads": 4, "head_dim": 32},
    # the default config does not build (the attention reads attn_config.rope_theta) nor run
    # (clamp to clip_qkv=None); DBRX itself uses 8
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # the rotary part is head_dim wide and must equal qk_rope_head_dim
    "longcat_flash": {"head_dim": 8},
    # the default config does not build: rope_parameters must be keyed by layer type
    "cohere_compass_text": {"rope_parameters": {"full_attention": {
        "rope_type": "default", "rope_theta": 10000.0}}},
    # the default config does not build: its layers index layer_types (None by default)
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # the default config does not build: the QSA indexer sizes default to None (one kv head)
    "qwen4_exp_text": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                       "indexer_budget": 16, "indexer_compress_ratio": 4},
    # validator: the loop bounds must be multiples of the attention-residual block
    "inkling2_loop_text": {"n_layers_per_attn_res_block": 1, "loop_layer_index_start": 1,
                           "loop_layer_index_end": 3},
    # validator: the shared-KV tail must use every cache kind the earlier layers produce
    "gemma3n_text": {"layer_types": ["sliding_attention", "full_attention"] * 2,
                     "num_kv_shared_layers": 2},
    # validator: an assistant has no per-layer inputs and shares the KV of every layer
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0,
                                         "vocab_size_per_layer_input": 0}},
    "gemma4_unified_assistant": {"text_config": {"hidden_size_per_layer_input": 0,
                                                 "vocab_size_per_layer_input": 0}},
    # validator: ZAYA routes to exactly one expert
    "zaya": {"num_experts_per_tok": 1},
    # the LM-head class asserts is_decoder; axial positions must factor max_position_embeddings
    # and their dims sum to the hidden size
    "reformer": {"is_decoder": True, "axial_pos_shape": [8, 16], "axial_pos_embds_dim": [16, 48]},
}
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id",
             "decoder_start_token_id", "mask_token_id", "unk_token_id")


def _layer_selection(defaults: dict[str, Any], n_default: int) -> list[int]:
    """Which original layers the tiny model keeps: every distinct per-layer pattern (the values
    of the per-layer lists, ``per_layer_config`` entries, layer-index lists) by first occurrence,
    then the earliest layers, in order. Truncating to the first layers would lose e.g. gemma's
    full-attention layer or a MoE model's sparse layers."""
    signature: list[tuple] = [() for _ in range(n_default)]
    for key, value in defaults.items():
        if key in ("architectures", "id2label", "label2id"):
            continue
        if isinstance(value, list) and len(value) == n_default:
            for i in range(n_default):
                signature[i] += (key, json.dumps(value[i], sort_keys=True))
        elif _is_index_list(key, value, n_default):
            for i in range(n_default):
                signature[i] += (key, i in value)
        elif _is_per_layer_dict(value, n_default):
            for i in range(n_default):
                entry = value.get(str(i), value.get(f"{i:02d}"))
                signature[i] += (key, json.dumps(entry, sort_keys=True))
    chosen: list[int] = []
    for repeat in (1, 2):  # each pattern once, then a second time (tied/shared blocks need two)
        seen: dict[tuple, int] = {}
        for i, sig in enumerate(signature):
            seen[sig] = seen.get(sig, 0) + 1
            if seen[sig] == repeat and len(chosen) < LAYERS:
                chosen.append(i)
    chosen += [i for i in range(n_default) if i not in chosen][:LAYERS - len(chosen)]
    return sorted(chosen)


def _is_index_list(key: str, value: Any, n_default: int) -> bool:
    """A list of layer ids (``attn_layer_indices``, ``mlp_only_layers``...)."""
    return ("layer" in key and isinstance(value, list) and bool(value) and len(value) < n_default
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n_default
                    for v in value))


def _is_per_layer_dict(value: Any, n_default: int) -> bool:
    """A dict keyed by layer id (``per_layer_config``: {"05": {...}})."""
    return isinstance(value, dict) and bool(value) and all(
        isinstance(k, (str, int)) and str(k).isdigit() and int(k) < n_default for k in value)


WIDTH_KEYS = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "emb_dim")
#: name suffix -> tiny value, for sizes SIZES does not name (``hidden_size_global``,
#: ``expert_ffn_hidden_size``, ``index_n_heads``, ``encoder_hash_byte_group_vocab``...)
SUFFIXES: tuple[tuple[str, int], ...] = (
    (r"vocab(_size)?(_\w+)?$", 128), (r"head_dim$", 16), (r"(kv_heads|key_value_heads)$", 2),
    (r"(n_heads|num_heads|attention_heads)$", 4),
    (r"(moe|expert)\w*(intermediate_size|ffn_hidden_size|ffn_dim)$", 32),
    (r"(intermediate_size|ffn_hidden_size|ffn_dim)$", 128),
    (r"(^|_)(hidden_size|emb_dim|embed_dim|d_model)(_\w+)?$", 64),
    (r"(^|_)(n_routed_experts|num_experts|zero_expert_num)$", 4),
)


def _by_suffix(key: str) -> Optional[int]:
    return next((tiny for rx, tiny in SUFFIXES if re.search(rx, key)), None)


def _sub_config_keys(cls: Any, defaults: dict[str, Any]) -> list[str]:
    """Keys holding nested configs (text / vision / audio / attn / decoder...)."""
    subs = set(getattr(cls, "sub_configs", None) or {}) if cls is not None else set()
    return [k for k, v in defaults.items()
            if isinstance(v, dict) and (k in subs or "model_type" in v)]


def _sub_config_class(cls: Any, key: str, value: dict) -> Any:
    from transformers import CONFIG_MAPPING, AutoConfig
    sub = (getattr(cls, "sub_configs", None) or {}).get(key) if cls is not None else None
    if (sub is None or sub is AutoConfig) and value.get("model_type") in CONFIG_MAPPING:
        sub = CONFIG_MAPPING[value["model_type"]]
    return None if sub is AutoConfig else sub


def _shrink(values: dict[str, Any], defaults: dict[str, Any], cls: Any = None,
            widths: frozenset[int] = frozenset(), ratio: bool = True) -> dict[str, Any]:
    """Tiny overrides of one config dict (``defaults``: its ``to_dict()``), recursing into
    every nested config with the same sizes; ``values`` win (per-model FIXUPS)."""
    over = {k: v for k, v in SIZES.items() if k in defaults}
    for key, value in defaults.items():  # sizes under other names: by suffix, never grown
        if key in SIZES or not isinstance(value, int) or isinstance(value, bool):
            continue
        tiny = _by_suffix(key)
        times = next((m for m in (1, 2, 3, 4) for w in widths if value == m * w), None)
        if times is not None and re.search(r"(dim|size)$", key):
            over[key] = 64 * times  # a hidden width (or a multiple: Zamba's 2 x hidden attention)
        elif tiny is not None and value > tiny:
            over[key] = tiny
    if defaults.get("num_key_value_heads") is not None and \
            defaults.get("num_key_value_heads") == defaults.get("num_attention_heads"):
        over["num_key_value_heads"] = over.get("num_attention_heads", 4)  # MHA stays MHA
    n_default = next((defaults[k] for k in ("num_hidden_layers", "n_layer", "num_layers",
                                             "n_layers", "decoder_layers")
                      if isinstance(defaults.get(k), int)), None)
    keep = _layer_selection(defaults, n_default) if n_default and n_default > LAYERS else \
        list(range(n_default or 0))
    for key, value in defaults.items():
        if not n_default or key in ("architectures", "id2label", "label2id"):
            pass
        elif isinstance(value, list) and len(value) == n_default:  # per-layer lists
            over[key] = [SIZES[key] if key in SIZES and isinstance(value[i], int) else value[i]
                         for i in keep]
        elif _is_index_list(key, value, n_default):  # layer ids: renumbered
            over[key] = [j for j, i in enumerate(keep) if i in value]
        elif _is_per_layer_dict(value, n_default):  # {layer id: overrides}: renumbered
            new: dict[str, Any] = {}
            for j, i in enumerate(keep):
                for k in (str(i), f"{i:02d}", i):
                    if k in value:
                        entry = value[k]
                        new[f"{j:02d}" if len(str(k)) == 2 else str(j)] = (
                            _layer_overrides(entry, defaults, over, ratio)
                            if isinstance(entry, dict) else entry)
                        break
            over[key] = new
        elif (isinstance(value, int) and not isinstance(value, bool) and "layers" in key
              and key not in SIZES and value == n_default):  # "all layers" counts
            over[key] = LAYERS
        if key in TOKEN_IDS and isinstance(value, int) and value >= 128:
            over[key] = 1
        if key in TOKEN_IDS and isinstance(value, list):
            over[key] = [v if v < 128 else 1 for v in value if isinstance(v, int)]
    for key in _sub_config_keys(cls, defaults):  # nested configs: the same tiny sizes
        value = defaults[key]
        sub_cls = _sub_config_class(cls, key, value)
        over[key] = {**value, **_shrink(FIXUPS.get(str(value.get("model_type")), {}), value,
                                        sub_cls, widths, ratio)}
    _mamba_heads(over, defaults)
    for key, value in values.items():
        over[key] = {**over[key], **value} if isinstance(value, dict) and isinstance(
            over.get(key), dict) and key != "rope_parameters" else value
    return over


def _layer_overrides(entry: dict[str, Any], defaults: dict[str, Any],
                     over: dict[str, Any], ratio: bool) -> dict[str, Any]:
    """One layer's overrides at the tiny scale: in the same ratio to the global value (gemma 4's
    global layers: head_dim 512 vs 256 -> 32 vs 16, so the layer stays different), or without
    ``ratio`` the plain tiny sizes (where a validator ties them to other sizes: dots3)."""
    out = {**entry, **_shrink({}, entry)}
    for key, value in entry.items() if ratio else ():
        base, tiny = defaults.get(key), over.get(key)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (value, base, tiny)) \
                and base and value != base:
            out[key] = max(1, round(tiny * value / base))
    return out


def _mamba_heads(over: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Mamba head dims consistent with the shrunk width: heads x head dim = expand x hidden."""
    for heads, dim in (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim")):
        if heads in over and dim in over:
            expand = over.get("mamba_expand", over.get("expand", 2))
            hidden = over.get("hidden_size", 64)
            over[dim] = expand * hidden // over[heads]
            if "mamba_d_ssm" in defaults:
                over["mamba_d_ssm"] = expand * hidden


def _defaults(cls: Any) -> dict[str, Any]:
    """``cls().to_dict()``; where the default config itself fails validation (an assistant
    config whose default text config breaks its rules), its sub-configs' own defaults."""
    from transformers import CONFIG_MAPPING
    try:
        return cls().to_dict()
    except Exception:  # noqa: BLE001 - rebuilt from the sub-configs below
        specs = getattr(cls, "sub_configs_defaults", None) or {}
        out = {k: CONFIG_MAPPING[spec.model_type]().to_dict() for k, spec in specs.items()
               if getattr(spec, "model_type", None) in CONFIG_MAPPING}
        if not out:
            raise
        return out


def _widths(defaults: dict[str, Any]) -> set[int]:
    """Every hidden width in the config tree (text, vision, audio...): a size equal to one of
    them elsewhere (``adapter_in_dim``, ``out_hidden_size``) is that width, so it shrinks too."""
    out = {v for k, v in defaults.items() if k in WIDTH_KEYS and isinstance(v, int) and v > 64}
    for value in defaults.values():
        if isinstance(value, dict):
            out |= _widths(value)
    return out


def tiny_config(model_type: str) -> Any:
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    defaults = _defaults(cls)
    widths = frozenset(_widths(defaults))
    try:
        return cls(**_shrink(FIXUPS.get(model_type, {}), defaults, cls, widths))
    except Exception:  # noqa: BLE001 - per-layer ratios broke a validator: plain tiny sizes
        return cls(**_shrink(FIXUPS.get(model_type, {}), defaults, cls, widths, ratio=False))


def model_config(config: Any, model_cls: Any) -> Any:
    """The config ``model_cls`` is built from: a composite config's sub-config when the class
    takes that (``Qwen3_5ForCausalLM`` takes ``text_config``, ``MusicgenForCausalLM`` the
    ``decoder``), as a real checkpoint of that class stores it."""
    want = getattr(model_cls, "config_class", None)
    if want is None or isinstance(config, want):
        return config
    subs = [getattr(config, k, None) for k in (getattr(config, "sub_configs", None) or {})]
    return next((sub for sub in subs if isinstance(sub, want)), config)
