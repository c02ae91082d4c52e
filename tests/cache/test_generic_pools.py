"""Cache pools of the generic family's newer layer kinds, against two independent references.

Each case is a tiny transformers model (the sweep's shrink, tests/sweep_shrink.py) whose layers
were kind ``unknown`` (or mis-sized) before: BERT-style and other odd-named attention, LFM2's
short convolutions, OLMo-hybrid's gated delta net, Kimi / Bailing delta attention, MiniMax's
lightning attention, Zamba's multi-head Mamba beside its shared attention, RecurrentGemma's
recurrent block (its own test: the state lives on the modules), RWKV's time mixing (its own
test: the state is a model output). For every case:

- transformers' own cache after a forward (``use_cache=True``) has, per layer, exactly the K /
  V heads x head dim, conv channels (pploader keeps ``kernel - 1`` of its ``kernel`` columns)
  and recurrent state shapes pploader's geometry gives;
- ``plan_job`` at PP=2 gives each stage the pools of its own layers only, with KV bytes per
  token and state bytes per request equal to sums computed here from the config by hand
  (``Hand``: config keys and arithmetic only, no pploader code), and each stage's
  ``build_rank_pools`` on the CPU allocates those shapes for its own layers, bytes measured
  from the tensors.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import generic_sweep

F32 = 4  # the tiny models are saved in float32; ssm / temporal state is float32 by default

#: BERT-style ``attention.self.{query,key,value}`` decoders (``is_decoder`` set: they cache)
BERT_LIKE = ("bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra",
             "ernie", "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert",
             "roformer", "xlm-roberta", "xlm-roberta-xl", "xmod", "git")

#: Per-layer (kv bytes per token, state bytes per request, state shapes) at ``tp`` ranks,
#: computed from the config dict by hand.
Hand = list[tuple[int, int, dict[str, tuple[int, ...]]]]


def _mha(c: dict, tp: int, heads_key: str = "num_attention_heads",
         hidden_key: str = "hidden_size") -> tuple[int, int, dict]:
    heads = c[heads_key]
    return (2 * (heads // tp) * (c[hidden_key] // heads) * F32, 0, {})


def _cpmant(c: dict, tp: int) -> Hand:  # project_k: num_attention_heads x dim_head
    return [(2 * (c["num_attention_heads"] // tp) * c["dim_head"] * F32, 0, {})] * 4


def _jetmoe(c: dict, tp: int) -> Hand:  # kv_proj: K and V of num_key_value_heads x kv_channels
    return [(2 * (c["num_key_value_heads"] // tp) * c["kv_channels"] * F32, 0, {})] * 4


def _lfm2(c: dict, tp: int) -> Hand:
    out: Hand = []
    for t in c["layer_types"]:
        if t == "conv":  # the last L_cache - 1 inputs of the hidden-wide depthwise conv
            shape = (c["hidden_size"] // tp, c["conv_L_cache"] - 1)
            out.append((0, math.prod(shape) * F32, {"conv": shape}))
        else:
            head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
            out.append((2 * (c["num_key_value_heads"] // tp) * head_dim * F32, 0, {}))
    return out


def _olmo_hybrid(c: dict, tp: int) -> Hand:
    out: Hand = []
    hk, hv = c["linear_num_key_heads"] // tp, c["linear_num_value_heads"] // tp
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    for t in c["layer_types"]:
        if t == "linear_attention":  # q, k, v each convolved; delta-rule state per value head
            conv = (2 * hk * dk + hv * dv, c["linear_conv_kernel_dim"] - 1)
            temporal = (hv, dv, dk)
            out.append((0, (math.prod(conv) + math.prod(temporal)) * F32,
                        {"conv": conv, "temporal": temporal}))
        else:
            head_dim = c["hidden_size"] // c["num_attention_heads"]
            out.append((2 * (c["num_key_value_heads"] // tp) * head_dim * F32, 0, {}))
    return out


def _delta_attention(c: dict, tp: int) -> Hand:
    """Kimi / Bailing delta attention (K and V heads the same), MLA on the other layers."""
    out: Hand = []
    heads, d = c["linear_num_heads"] // tp, c["linear_head_dim"]
    for t in c["layer_types"]:
        if t == "linear_attention":  # conv over q, k, v; one [d, d] state per head
            conv, temporal = (3 * heads * d, c["linear_conv_kernel_dim"] - 1), (heads, d, d)
            out.append((0, (math.prod(conv) + math.prod(temporal)) * F32,
                        {"conv": conv, "temporal": temporal}))
        else:  # MLA: the latent, the same on every TP rank
            out.append(((c["kv_lora_rank"] + c["qk_rope_head_dim"]) * F32, 0, {}))
    return out


def _minimax(c: dict, tp: int) -> Hand:
    out: Hand = []
    heads, d = c["num_attention_heads"] // tp, c["head_dim"]
    for t in c["layer_types"]:
        if t == "linear_attention":  # lightning attention: one [d, d] KV sum per head
            out.append((0, heads * d * d * F32, {"temporal": (heads, d, d)}))
        else:
            out.append((2 * (c["num_key_value_heads"] // tp) * d * F32, 0, {}))
    return out


def _zamba(c: dict, tp: int) -> Hand:
    out: Hand = []
    d_inner = c["mamba_expand"] * c["hidden_size"]
    heads = c["n_mamba_heads"]
    conv = (d_inner // tp, c["mamba_d_conv"] - 1)  # Mamba over d_inner, no B / C groups
    ssm = (heads // tp, d_inner // heads, c["mamba_d_state"])
    state = (math.prod(conv) + math.prod(ssm)) * F32
    for t in c["layers_block_type"]:
        kv = 0
        if t == "hybrid":  # the shared attention block: attention_head_dim over 2 x hidden
            kv = 2 * (c["num_key_value_heads"] // tp) * c["attention_head_dim"] * F32
        out.append((kv, state, {"conv": conv, "ssm": ssm}))
    return out


CASES: dict[str, tuple[dict[str, Any], Callable[[dict, int], Hand]]] = {
    **{t: ({"is_decoder": True}, lambda c, tp: [_mha(c, tp)] * 4) for t in BERT_LIKE},
    # X-MOD runs only with a language adapter chosen
    "xmod": ({"is_decoder": True, "default_language": "en_XX"}, lambda c, tp: [_mha(c, tp)] * 4),
    "ctrl": ({}, lambda c, tp: [_mha(c, tp, "n_head", "n_embd")] * 4),
    "moshi": ({}, lambda c, tp: [_mha(c, tp)] * 4),
    "cpmant": ({}, _cpmant),
    "jetmoe": ({}, _jetmoe),
    "lfm2": ({"layer_types": ["conv", "full_attention", "conv", "conv"]}, _lfm2),
    "lfm2_moe": ({}, _lfm2),
    "lfm3": ({}, _lfm2),
    "olmo_hybrid": ({}, _olmo_hybrid),
    # Zamba's attention runs over 2 x hidden, head dim 2 x hidden / heads (its class default,
    # Zamba-7B: 224 = 7168 / 32); the shrink's 16 would equal hidden / heads and hide a mix-up
    "zamba": ({"attention_head_dim": 32}, _zamba),
    # the shrink's top-k (8 of 4 experts) does not run; 2 does
    "kimi_linear": ({"num_experts_per_token": 2}, _delta_attention),
    "bailing_hybrid": ({"num_experts_per_token": 2, "num_expert_group": 1}, _delta_attention),
    "minimax": ({}, _minimax),
}
#: run in the default suite; the other BERT-style ones are marked slow (same code path)
DEFAULT = {"bert", "git", "ctrl", "moshi", "cpmant", "jetmoe", "lfm2", "lfm2_moe", "lfm3",
           "olmo_hybrid", "zamba", "kimi_linear", "bailing_hybrid", "minimax"}


@pytest.fixture(scope="module")
def quiet() -> None:
    import logging
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _model(model_type: str) -> tuple[Any, dict]:
    import transformers
    arch = generic_sweep.causal_lm_types()[model_type]
    cls = getattr(transformers, arch)
    config = generic_sweep.model_config(generic_sweep.tiny_config(model_type), cls)
    for key, value in CASES[model_type][0].items():
        setattr(config, key, value)
    config.architectures = [arch]
    torch.manual_seed(0)
    return cls._from_config(config, dtype=torch.float32).eval(), json.loads(
        config.to_json_string())


def _their_layers(model: Any) -> list[tuple[Any, Any]]:
    """(cache layer, its recurrent state or None) per decoder layer of transformers' own cache
    after a forward (MiniMax keeps its lightning states beside the layers: ``linear_cache``)."""
    with torch.no_grad():
        out = model(input_ids=torch.arange(5).unsqueeze(0), use_cache=True)
    cache = out.past_key_values
    layers = list(getattr(cache, "self_attention_cache", cache).layers)
    linear = list(getattr(cache, "linear_cache", []))
    linear += [[]] * (len(layers) - len(linear))
    return [(layer, dict(getattr(layer, "recurrent_states", None) or {}).get(0)
             if not torch.is_tensor(lin) else lin) for layer, lin in zip(layers, linear)]


def _check_pp2(model: Any, hand: Hand, tmp_path: Path) -> None:
    """PP=2 through plan_job: each stage sizes its own layers only, the hand sums; then each
    stage allocates them (CPU): 3 request slots of the hand shapes, bytes measured."""
    from pploader.cache.pools import PoolOptions, build_rank_pools
    from pploader.job import plan_job
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    generic_sweep.as_released(model.config.model_type, tmp_path, model.config.to_dict())
    job = plan_job(tmp_path, 2)
    assert "unavailable" not in job.pipeline_pools, job.pipeline_pools
    seen = []
    for summary in job.summaries:
        pools, lo, hi = summary["pools"], summary["start_layer"], summary["end_layer"]
        own = hand[lo:hi]
        assert pools["kv_bytes_per_token"] == sum(h[0] for h in own)
        assert pools["state_bytes_per_request"] == sum(h[1] for h in own)
        assert pools["attention_layers"] == [i for i in range(lo, hi) if hand[i][0]]
        assert pools["state_layers"] == [i for i in range(lo, hi) if hand[i][1]]
        for entry in pools["layers"]:
            assert lo <= entry["layer"] < hi
            shapes = {n: tuple(s["shape"]) for n, s in entry["states"].items()}
            assert shapes == hand[entry["layer"]][2]
        seen += range(lo, hi)
    assert seen == list(range(4))
    for plan in job.plans:
        pools = build_rank_pools(job.spec, plan, PoolOptions(tokens=64, requests=3),
                                 device="cpu")
        w = plan.window
        for layer in range(w.start_layer, w.end_layer):
            kv_bytes, state_bytes, shapes = hand[layer]
            got_states = pools.states.get(layer, {})
            assert {n: tuple(t.shape) for n, t in got_states.items()} == \
                {n: (3, *shape) for n, shape in shapes.items()}
            assert sum(t.nbytes for t in got_states.values()) == 3 * state_bytes
            kv = pools.kv.get(layer, ())
            assert sum(t[0, 0].nbytes for t in kv) == kv_bytes  # one token, every part
        assert pools.state_allocated_bytes == 3 * sum(
            hand[i][1] for i in range(w.start_layer, w.end_layer))


def _case(t: str) -> object:
    return pytest.param(t, marks=[] if t in DEFAULT else [pytest.mark.slow])


@pytest.mark.parametrize("model_type", [_case(t) for t in sorted(CASES)])
def test_pools_equal_transformers_cache_and_hand_sums_at_pp2(model_type: str, tmp_path: Path,
                                                             quiet: None) -> None:
    from pploader.cache.geometry import model_cache
    from pploader.planning.spec import spec_from_config
    model, config = _model(model_type)
    spec = spec_from_config({**config, "dtype": "float32"})
    ours = model_cache(spec, 1)
    hand = CASES[model_type][1](config, 1)
    assert len(ours) == len(hand) == spec.num_layers == 4
    # transformers' own cache after a forward: the strongest reference for the shapes
    for layer, (mine, (theirs, rec)) in enumerate(zip(ours, _their_layers(model))):
        keys = getattr(theirs, "keys", None)
        assert (mine.kv is None) == (keys is None), (layer, mine.kind)
        if keys is not None and mine.kind == "mla":  # keys: the compressed kv, values: rope
            assert (mine.kv.heads, mine.kv.head_dim) == (
                keys.shape[1], keys.shape[3] + theirs.values.shape[3]), layer
        elif keys is not None:
            assert (mine.kv.heads, mine.kv.head_dim) == (keys.shape[1], keys.shape[3]), layer
        conv = dict(getattr(theirs, "conv_states", None) or {}).get(0)
        got = {s.name: s.shape for s in mine.states}
        assert ("conv" in got) == (conv is not None), (layer, got)
        if conv is not None:
            assert got["conv"] == (conv.shape[1], conv.shape[2] - 1), (layer, got, conv.shape)
        if rec is not None:
            rec_name = next(n for n in got if n != "conv")
            assert got[rec_name] == tuple(rec.shape[1:]), (layer, got, rec.shape)
        else:
            assert set(got) <= {"conv"}, (layer, got)
        assert (mine.kv_bytes_per_token, mine.state_bytes_per_request, got) == hand[layer]
    _check_pp2(model, hand, tmp_path)


@pytest.mark.parametrize("model_type", ["zamba", "lfm2_moe", "olmo_hybrid", "cpmant", "jetmoe",
                                        "kimi_linear", "minimax"])
def test_tp2_geometry_equals_hand_numbers(model_type: str, quiet: None) -> None:
    """At TP=2 heads, conv channels and value heads are split as the hand formulas split them
    (every count in these configs divides by 2)."""
    from pploader.cache.geometry import model_cache
    from pploader.planning.spec import spec_from_config
    _, config = _model(model_type)
    spec = spec_from_config({**config, "dtype": "float32"})
    got = [(c.kv_bytes_per_token, c.state_bytes_per_request, {s.name: s.shape for s in c.states})
           for c in model_cache(spec, 2)]
    assert got == CASES[model_type][1](config, 2)


@pytest.mark.parametrize("model_type,why", [
    ("deepseek_v4", "kind 'unknown'"), ("xlstm", "kind 'unknown'"),
    ("xlnet", "kind 'unknown'"), ("reformer", "kind 'unknown'")])
def test_layers_without_a_known_cache_are_still_refused(model_type: str, why: str,
                                                        quiet: None) -> None:
    """Where the layer's cache is not one of the sized kinds (DeepSeek-V4's compressed sparse
    attention, xLSTM's mLSTM, XLNet's memory, Reformer's LSH), the geometry is refused naming the layer, as before; a BERT
    decoder with cross-attention too (the encoder's KV)."""
    from pploader import ConfigError
    from pploader.cache.geometry import model_cache
    from pploader.planning.spec import spec_from_config
    import transformers
    arch = generic_sweep.causal_lm_types()[model_type]
    config = generic_sweep.model_config(generic_sweep.tiny_config(model_type),
                                        getattr(transformers, arch))
    spec = spec_from_config({**json.loads(config.to_json_string()), "architectures": [arch],
                             "dtype": "float32"})
    with pytest.raises(ConfigError, match=why):
        model_cache(spec, 1)
    if model_type == "reformer":
        bert = generic_sweep.model_config(generic_sweep.tiny_config("bert"),
                                          transformers.BertLMHeadModel)
        bert.is_decoder = bert.add_cross_attention = True
        spec = spec_from_config({**json.loads(bert.to_json_string()),
                                 "architectures": ["BertLMHeadModel"], "dtype": "float32"})
        with pytest.raises(ConfigError, match="kind 'unknown'"):
            model_cache(spec, 1)


def _recurrent_gemma(c: dict, tp: int) -> Hand:
    out: Hand = []
    width, k = c["lru_width"] // tp, c["conv1d_width"]
    for t in c["block_types"] * 2:  # the class's pattern repeats over the layers
        if t == "recurrent":  # conv's last K - 1 inputs, one float32 recurrence value a channel
            out.append((0, width * (k - 1) * F32 + width * F32,
                        {"conv": (width, k - 1), "recurrent": (width,)}))
        else:
            out.append((2 * (c["num_key_value_heads"] // tp) * c["head_dim"] * F32, 0, {}))
    return out[:c["num_hidden_layers"]]


def test_recurrent_gemma_pools_equal_its_modules_state_and_hand_sums(tmp_path: Path,
                                                                     quiet: None) -> None:
    """RecurrentGemma keeps its recurrent state on the modules, not in a returned cache: after
    a forward each recurrent block's ``conv1d_state`` / ``rg_lru.recurrent_states`` has the
    shapes pploader gives (conv: K - 1 columns); attention layers get K / V pages by hand;
    PP=2 stages and their CPU allocation as the other cases."""
    import transformers
    from pploader.cache.geometry import model_cache
    from pploader.planning.spec import spec_from_config
    cls = transformers.RecurrentGemmaForCausalLM
    config = generic_sweep.model_config(generic_sweep.tiny_config("recurrent_gemma"), cls)
    config.architectures = ["RecurrentGemmaForCausalLM"]
    torch.manual_seed(0)
    model = cls._from_config(config, dtype=torch.float32).eval()
    raw = json.loads(config.to_json_string())
    hand = _recurrent_gemma(raw, 1)
    with torch.no_grad():
        model(input_ids=torch.arange(5).unsqueeze(0), use_cache=True)
    ours = model_cache(spec_from_config({**raw, "dtype": "float32"}), 1)
    recurrent = 0
    for layer, (mine, block) in enumerate(zip(ours, model.model.layers)):
        got = {s.name: s.shape for s in mine.states}
        conv = getattr(block.temporal_block, "conv1d_state", None)
        assert (conv is not None) == bool(got), (layer, got)
        if conv is not None:
            rec = block.temporal_block.rg_lru.recurrent_states
            assert got == {"conv": tuple(conv.shape[1:]), "recurrent": tuple(rec.shape[1:])}
            assert mine.states[1].dtype == "float32" and rec.dtype == torch.float32  # geometry keeps names
            recurrent += 1
        assert (mine.kv_bytes_per_token, mine.state_bytes_per_request, got) == hand[layer]
    assert recurrent == 3
    assert [(c.kv_bytes_per_token, c.state_bytes_per_request,
             {s.name: s.shape for s in c.states})
            for c in model_cache(spec_from_config({**raw, "dtype": "float32"}), 2)] == \
        _recurrent_gemma(raw, 2)
    _check_pp2(model, hand, tmp_path)


def test_rwkv_pools_equal_its_state_output_and_hand_sums(tmp_path: Path, quiet: None) -> None:
    """RWKV returns its state as ``out.state``: five ``[batch, hidden, layers]`` tensors (the
    channel- and time-mixing token shifts in the model dtype, then the WKV numerator,
    denominator and max in float32). pploader's per-layer shift ``[2, hidden]`` and wkv
    ``[3, attention_hidden]`` hold the same numbers; PP=2 as the other cases; TP refused."""
    import transformers
    from pploader import PlanError
    from pploader.cache.geometry import model_cache
    from pploader.planning.spec import spec_from_config
    cls = transformers.RwkvForCausalLM
    config = generic_sweep.model_config(generic_sweep.tiny_config("rwkv"), cls)
    config.architectures = ["RwkvForCausalLM"]
    torch.manual_seed(0)
    model = cls._from_config(config, dtype=torch.float32).eval()
    raw = json.loads(config.to_json_string())
    hidden, att = raw["hidden_size"], raw["attention_hidden_size"] or raw["hidden_size"]
    hand: Hand = [(0, (2 * hidden + 3 * att) * F32,
                   {"shift": (2, hidden), "wkv": (3, att)})] * raw["num_hidden_layers"]
    with torch.no_grad():
        state = model(input_ids=torch.arange(5).unsqueeze(0), use_cache=True).state
    spec = spec_from_config({**raw, "dtype": "float32"})
    ours = model_cache(spec, 1)
    for layer, mine in enumerate(ours):
        got = {s.name: (s.shape, s.dtype) for s in mine.states}
        theirs = [s[0, :, layer] for s in state]
        name = str  # the geometry keeps dtypes by name (planning/dtype_table.py)
        assert got == {"shift": ((len(theirs[:2]), theirs[0].shape[0]),
                                 name(theirs[0].dtype).removeprefix("torch.")),
                       "wkv": ((len(theirs[2:]), theirs[2].shape[0]),
                               name(theirs[2].dtype).removeprefix("torch."))}
        assert (mine.kv_bytes_per_token, mine.state_bytes_per_request,
                {n: shape for n, (shape, _) in got.items()}) == hand[layer]
    with pytest.raises(PlanError, match="rwkv cache geometry at tp=2"):
        model_cache(spec, 2)
    _check_pp2(model, hand, tmp_path)
