"""Inkling's release naming under TP / EP, written from vLLM 0.32's ``models/inkling`` loaders
and independently of the planner: a tiny checkpoint's tensors (shapes from vLLM's module
definitions) and the slice of each tensor a (TP rank, EP rank) holds.

The rules, as the loaders cut (``nvidia/model.py``, ``attention.py``, ``short_conv.py``,
``mlp.py``, ``moe.py``):

- ``attn.wq_du`` / ``wr_du`` (stacked into ``qkvr`` parts 0 and 3): rows ``[r n / tp, (r + 1)
  n / tp)`` of their ``n`` rows (``MergedColumnParallelLinear`` per part); ``wk_dv`` /
  ``wv_dv`` the same (TP at most the KV heads); ``wo_ud`` the same columns;
- ``attn.k_sconv`` / ``v_sconv`` / ``attn_sconv`` / ``mlp_sconv``: ``weight.narrow(0, r *
  shard, shard)`` with ``shard`` the parameter's rows (KV heads x head dim / tp, hidden / tp);
- ``mlp.w13_dn`` (``ColumnParallelLinear``): rows ``[r 2I / tp, (r + 1) 2I / tp)``; ``w2_md``
  the same columns of ``I``;
- ``mlp.experts.w13_weight[g]``: ``narrow(0, r * 2 * half, 2 * half)``, ``half = I / tp``;
  ``w2_weight[g]``: ``narrow(1, r * I / tp, I / tp)``; under EP the rank's block of ``E / ep``
  experts whole of every expert it holds (``_local_expert_slots``);
- ``mlp.shared_experts.shared_w13_weight``: ``narrow(1, r * shard, shard)``, ``shard = 2I /
  tp``; ``shared_w2_weight`` ``narrow(2, ...)`` per expert; replicated over EP;
- ``model.llm.unembed`` (``ParallelLMHead``): ``ceil(V / tp)`` rows a rank, zero rows after;
- everything else whole (the embedding is ``InklingReplicatedEmbedding``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

Slices = tuple[slice, ...]

#: a tiny release config: 4 layers (layer 1 local with its own head counts), layer 0 dense
TINY: dict[str, Any] = {
    "architectures": ["InklingForCausalLM"], "model_type": "inkling_model",
    "torch_dtype": "bfloat16", "vocab_size": 250, "padded_vocab_size": 256,
    "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "d_rel": 8, "rel_extent": 32,
    "local_layer_ids": [1, 3], "sliding_window_size": 16, "swa_num_attention_heads": 8,
    "swa_num_key_value_heads": 4, "swa_head_dim": 8, "sconv_kernel_size": 4,
    "intermediate_size": 24, "dense_intermediate_size": 40, "dense_mlp_idx": 1,
    "n_routed_experts": 4, "n_shared_experts": 2, "num_experts_per_tok": 2,
    "use_gate_bias": True, "use_global_scale": True, "o_bias": True, "use_embed_norm": True,
    "shared_expert_sink": True, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
}


def tensors(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of a release checkpoint of ``config`` (random bf16; vLLM's shapes),
    with one MTP depth under ``model.mtp.``."""
    g = torch.Generator().manual_seed(seed)
    h, w = config["hidden_size"], config["sconv_kernel_size"]
    rows, d_rel = config["padded_vocab_size"], config["d_rel"]
    e, s, inter = config["n_routed_experts"], config["n_shared_experts"], \
        config["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.llm.embed.weight": (rows, h), "model.llm.embed_norm.weight": (h,),
        "model.llm.norm.weight": (h,), "model.llm.unembed.weight": (rows, h),
        "model.mtp.chain_norm.weight": (h,), "model.mtp.layers.0.input_proj.weight": (h, 2 * h)}
    for i in range(config["num_hidden_layers"]):
        local = i in config["local_layer_ids"]
        q = config["swa_num_attention_heads" if local else "num_attention_heads"]
        kv = config["swa_num_key_value_heads" if local else "num_key_value_heads"]
        hd = config["swa_head_dim" if local else "head_dim"]
        p = f"model.llm.layers.{i}."
        shapes.update({
            p + "attn_norm.weight": (h,), p + "mlp_norm.weight": (h,),
            p + "attn.wq_du.weight": (q * hd, h), p + "attn.wk_dv.weight": (kv * hd, h),
            p + "attn.wv_dv.weight": (kv * hd, h), p + "attn.wr_du.weight": (q * d_rel, h),
            p + "attn.wo_ud.weight": (h, q * hd), p + "attn.wo_ud.bias": (h,),
            p + "attn.q_norm.weight": (hd,), p + "attn.k_norm.weight": (hd,),
            p + "attn.rel_logits_proj.proj": (
                d_rel, config["sliding_window_size"] if local else config["rel_extent"]),
            p + "attn.k_sconv.weight": (kv * hd, 1, w), p + "attn.v_sconv.weight": (kv * hd, 1, w),
            p + "attn_sconv.weight": (h, 1, w), p + "mlp_sconv.weight": (h, 1, w)})
        if i < config["dense_mlp_idx"]:
            di = config["dense_intermediate_size"]
            shapes.update({p + "mlp.w13_dn.weight": (2 * di, h), p + "mlp.w2_md.weight": (h, di),
                           p + "mlp.global_scale": (1,)})
        else:
            shapes.update({
                p + "mlp.gate.weight": (e + s, h), p + "mlp.gate.bias": (e,),
                p + "mlp.gate.global_scale": (1,),
                p + "mlp.experts.w13_weight": (e, 2 * inter, h),
                p + "mlp.experts.w2_weight": (e, h, inter),
                p + "mlp.shared_experts.shared_w13_weight": (s, 2 * inter, h),
                p + "mlp.shared_experts.shared_w2_weight": (s, h, inter)})
    # the router's bias and the scales in float32, as vLLM's parameters hold them
    fp32 = (".gate.bias", ".global_scale")
    return {n: torch.randn(shape, generator=g).to(
        torch.float32 if n.endswith(fp32) else torch.bfloat16) for n, shape in shapes.items()}


def write(out: Path, config: Optional[dict[str, Any]] = None, shards: int = 3) -> Path:
    """A release checkpoint in ``out`` (``shards`` files + index), its config.json."""
    config = dict(TINY if config is None else config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    every = tensors(config)
    names = sorted(every)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: every[n].contiguous() for n in part}, str(out / fname))
        weight_map.update({n: fname for n in part})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def pp_layers(num_layers: int, pp: int, rank: int) -> range:
    """vLLM's ``get_pp_indices`` (no override): equal parts, the remainder on the ranks
    before the last."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    start = sum(parts[:rank])
    return range(start, start + parts[rank])


def stage_names(config: dict[str, Any], names: list[str], pp: int, pp_rank: int,
                ep: int = 1, ep_rank: int = 0) -> set[str]:
    """The tensors stage ``pp_rank`` loads (vLLM's ``make_layers`` + the first / last rank's
    embedding and head; ``model.mtp.*`` never), the routed experts' EP block aside."""
    layers = pp_layers(config["num_hidden_layers"], pp, pp_rank)
    out = set()
    for n in names:
        if n.startswith("model.mtp."):
            continue
        if n.startswith("model.llm.layers."):
            if int(n.split(".")[3]) in layers:
                out.add(n)
        elif n.startswith(("model.llm.embed", "model.visual.", "model.audio.")):
            if pp_rank == 0:
                out.add(n)
        elif pp_rank == pp - 1:
            out.add(n)
    return out


def engine_slices(name: str, shape: tuple[int, ...], config: dict[str, Any], tp: int,
                  rank: int, ep: int = 1, ep_rank: int = 0) -> tuple[Slices, int]:
    """``(slices of the full tensor, zero rows after dim 0)`` the rank holds of ``name``."""
    out = [slice(0, n) for n in shape]
    leaf = name.split("model.llm.layers.")[-1].split(".", 1)[-1]
    if leaf in ("mlp.experts.w13_weight", "mlp.experts.w2_weight") and ep > 1:
        per = config["n_routed_experts"] // ep
        out[0] = slice(ep_rank * per, (ep_rank + 1) * per)
    if tp == 1:
        return tuple(out), 0

    def rows(dim: int, n: int) -> tuple[Slices, int]:
        per = n // tp
        out[dim] = slice(rank * per, (rank + 1) * per)
        return tuple(out), 0

    if name == "model.llm.unembed.weight":
        per = -(-shape[0] // tp)
        start = min(rank * per, shape[0])
        out[0] = slice(start, min(start + per, shape[0]))
        return tuple(out), per - (out[0].stop - start)
    if leaf in ("attn.wq_du.weight", "attn.wk_dv.weight", "attn.wv_dv.weight",
                "attn.wr_du.weight", "attn.k_sconv.weight", "attn.v_sconv.weight",
                "attn_sconv.weight", "mlp_sconv.weight", "mlp.w13_dn.weight"):
        return rows(0, shape[0])
    if leaf in ("attn.wo_ud.weight", "mlp.w2_md.weight"):
        return rows(1, shape[1])
    if leaf in ("mlp.experts.w13_weight", "mlp.shared_experts.shared_w13_weight"):
        return rows(1, shape[1])
    if leaf in ("mlp.experts.w2_weight", "mlp.shared_experts.shared_w2_weight"):
        return rows(2, shape[2])
    return tuple(out), 0
