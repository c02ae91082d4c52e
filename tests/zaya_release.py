"""A tiny ZAYA1 release checkpoint (what SGLang's ``zaya`` loads), its names and shapes spelled
out from SGLang's module definitions (``CCA``, ``ZayaRouter``, ``FusedMoE`` experts,
``ResidualScaling``), not from pploader's template: for the family's plan tests
(tests/families/test_zaya.py) and the SGLang engine runs (tests/sglang)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

H, V, NQ, NK, D, FFN, E, X = 32, 256, 4, 2, 8, 32, 4, 16
LAYERS = ["a", E, "a", E, "a", E, "a"]

CONFIG: dict[str, Any] = {
    "architectures": ["ZayaForCausalLM"], "model_type": "zaya", "dtype": "bfloat16",
    "vocab_size": V, "hidden_size": H, "num_hidden_layers": 80, "zaya_layers": LAYERS,
    "num_attention_heads": NQ, "num_query_groups": NK, "num_key_value_heads": NK,
    "head_dim": D, "kv_channels": D, "cca_num_q_heads": [NQ if t == "a" else 0 for t in LAYERS],
    "num_query_groups_list": [NK if t == "a" else 0 for t in LAYERS], "ffn_hidden_size": FFN,
    "ffn_hidden_size_list": [0 if t == "a" else FFN for t in LAYERS], "num_experts": E,
    "zaya_mlp_expansion": [0 if t == "a" else X for t in LAYERS], "moe_router_topk": 1,
    "zaya_use_mod": True, "zaya_use_eda": True, "scale_residual_merge": True,
    "normalization": "RMSNorm", "norm_epsilon": 1e-5, "cca": True, "cca_time0": 2,
    "cca_time1": 2, "tie_word_embeddings": False, "attention_bias": False,
    "activation_func": "swiglu", "gated_linear_unit": True, "partial_rotary_factor": 0.5}


#: the other branch of every option SGLang's modules read: LayerNorm (weight and bias),
#: biased attention linears, no residual scaling, no MOD skip expert, no EDA, a tied head
VARIANT: dict[str, Any] = {**CONFIG, "normalization": "LayerNorm", "attention_bias": True,
                           "scale_residual_merge": False, "zaya_use_mod": False,
                           "zaya_use_eda": False, "tie_word_embeddings": True}


def release_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of a release checkpoint, from SGLang's modules (not pploader's template)."""
    ch = (NQ + NK) * D
    norms = ("weight", "bias") if config["normalization"] == "LayerNorm" else ("weight",)
    bias = config["attention_bias"]
    slots = E + 1 if config["zaya_use_mod"] else E
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    out.update({f"model.final_norm.{n}": (H,) for n in norms})
    if not config["tie_word_embeddings"]:
        out["lm_head.weight"] = (V, H)
    if config["scale_residual_merge"]:
        for n in ("hidden_states_scale", "hidden_states_bias", "residual_scale",
                  "residual_bias"):
            out[f"model.res_scale.{n}"] = (H,)
    for i, kind in enumerate(config["zaya_layers"]):
        p = f"model.layers.{i}."
        out.update({f"{p}input_norm.{n}": (H,) for n in norms})
        if config["scale_residual_merge"]:
            out[p + "res_scale.hidden_states_scale"] = (H,)
            out[p + "res_scale.hidden_states_bias"] = (H,)
            if i:  # layer 0 has no incoming residual stream
                out[p + "res_scale.residual_scale"] = out[p + "res_scale.residual_bias"] = (H,)
        if kind == "a":
            q = p + "self_attn.qkv."
            out.update({q + "linear_q.weight": (NQ * D, H), q + "linear_k.weight": (NK * D, H),
                        q + "val_proj1.weight": (NK * D // 2, H),
                        q + "val_proj2.weight": (NK * D // 2, H),
                        q + "conv_qk.0.weight": (ch, 1, 2), q + "conv_qk.0.bias": (ch,),
                        q + "conv_qk.1.weight": (ch, D, 2), q + "conv_qk.1.bias": (ch,),
                        q + "temp": (NK,), p + "self_attn.o_proj.weight": (H, NQ * D)})
            if bias:
                out.update({q + "linear_q.bias": (NQ * D,), q + "linear_k.bias": (NK * D,),
                            q + "val_proj1.bias": (NK * D // 2,),
                            q + "val_proj2.bias": (NK * D // 2,),
                            p + "self_attn.o_proj.bias": (H,)})
        else:
            r = p + "zaya_block.router."
            out.update({r + "down_proj.weight": (X, H), r + "down_proj.bias": (X,),
                        r + "rmsnorm_eda.weight": (X,),
                        r + "router_mlp.0.weight": (X, X), r + "router_mlp.0.bias": (X,),
                        r + "router_mlp.2.weight": (X, X), r + "router_mlp.2.bias": (X,),
                        r + "router_mlp.4.weight": (slots, X), r + "balancing_biases": (slots,)})
            if config["zaya_use_eda"]:
                out[r + "router_states_scale"] = (X,)
            for e in range(E):
                x = f"{p}zaya_block.experts.local_experts.{e}."
                out[x + "linear_fc1.weight"] = (FFN, H)
                out[x + "linear_fc2.weight"] = (H, FFN // 2)
    return out


#: what a trained model's parameters of that kind start as (an engine run's values)
_ONES = ("norm.weight", "norm_eda.weight", "_scale", ".temp")
_ZEROS = ("_bias", "balancing_biases", "proj.bias", "linear_q.bias", "linear_k.bias",
          "router_mlp.0.bias", "router_mlp.2.bias", "down_proj.bias")


def _model_value(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith(_ONES):
        return torch.ones(shape)
    if name.endswith(_ZEROS):
        return torch.zeros(shape)
    return torch.randn(shape, generator=gen) * 0.05


def write_release(path: Path, config: dict[str, Any], *, model_values: bool = False) -> Path:
    """The release checkpoint of ``config`` in two shards. Values: unit normal (every byte
    distinct, for bitwise plan checks), or with ``model_values`` what an engine can run
    (small weights, unit norms and scales, zero biases: finite, varied tokens)."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {n: (_model_value(n, s, gen) if model_values else torch.randn(s, generator=gen)
                   ).to(torch.bfloat16) for n, s in release_tensors(config).items()}
    tensors = {n: t.float() if n.endswith("balancing_biases") else t  # an fp32 buffer
               for n, t in tensors.items()}
    names = sorted(tensors)
    half = len(names) // 2  # two shards, so a stage reads from both
    save_file({n: tensors[n] for n in names[:half]}, str(path / "model-1.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(path / "model-2.safetensors"))
    weight_map = {n: "model-1.safetensors" if i < half else "model-2.safetensors"
                  for i, n in enumerate(names)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return path
