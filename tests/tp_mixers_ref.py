"""What each TP rank holds of the SSM / short-convolution mixers and the stacked expert
layouts of families/tp_mixers.py and tp_experts3d.py, written independently of the planner
from the vLLM model files' loaders (config sizes only, never the planner's rules):

- Mamba / FalconMamba (``MambaMixer``): ``in_proj`` rows ``[r I/tp, (r+1) I/tp)`` of x and
  of z (``MergedColumnParallelLinear([I, I])``), ``conv1d`` / ``dt_proj`` / ``A_log`` / ``D``
  rows of I, ``x_proj`` / ``out_proj`` columns of I.
- Mamba2 (``MambaMixer2``): ``in_proj`` = [z | x | B | C | dt]: z, x, dt by heads, B and C by
  groups when ``n_groups % tp == 0``, the one group whole when ``n_groups == 1``
  (``mamba_v2_sharded_weight_loader``'s duplicated group); conv over [x | B | C] the same;
  ``A_log`` / ``D`` / ``dt_bias`` / gated ``norm`` by heads; ``out_proj`` columns.
- OLMo-hybrid (``OlmoHybridGatedDeltaNetAttention``): q / k (and their convs) rows of the
  key width, v / g rows of the value width, the fused conv [q | k | v] each part split,
  a / b / ``A_log`` / ``dt_bias`` rows of the value heads, ``o_proj`` columns, ``o_norm`` whole.
- LFM2 (``ShortConv``, ``Lfm2MLP``): ``conv.in_proj`` thirds [B | C | x] each split,
  ``conv.conv`` rows, ``conv.out_proj`` columns; ``feed_forward.w1`` / ``w3`` rows of the
  adjusted ``ff_dim`` (vLLM's ``block_auto_adjust_ff_dim`` arithmetic), ``w2`` columns.
- GraniteMoE (``input_linear`` -> ``experts.gate_up_proj`` [E, 2I, H], halves each split;
  ``output_linear`` [E, H, I] on I; shared MLP halves / columns of ``shared_intermediate_size``).
- Aria (``fc1`` [E, H, 2I] transposed to gate_up: halves on dim 2; ``fc2`` [E, I, H] rows).
- DBRX (``DbrxExperts.weight_loader``): ``w1`` / ``v1`` / ``w2`` [E x I, H] reshaped to
  [E, I, H], rows ``[r I/tp, (r+1) I/tp)`` of every expert.
- Attention by heads (k / v by KV heads, replicated when fewer than TP), ``o_proj`` /
  ``out_proj`` columns, the vocabulary in ``ceil(V / tp)`` rows padded after, everything else
  (norms, routers) whole.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

Slices = tuple[slice, ...]
#: a piece of dim ``d``: the rows ``[start, stop)`` of each listed interval, concatenated
Piece = tuple[int, tuple[tuple[int, int], ...]]


def _even(size: int, tp: int, rank: int, offset: int = 0) -> tuple[int, int]:
    assert size % tp == 0, f"{size} rows over tp={tp}"
    per = size // tp
    return offset + rank * per, offset + (rank + 1) * per


def _parts(sizes: Sequence[int], tp: int, rank: int, whole: Sequence[bool] = ()) -> tuple:
    """Intervals of concatenated parts, each split evenly (or kept whole where ``whole``)."""
    out, offset = [], 0
    for i, size in enumerate(sizes):
        out.append((offset, offset + size) if i < len(whole) and whole[i]
                   else _even(size, tp, rank, offset))
        offset += size
    return tuple(out)


def lfm2_ff_dim(config: Mapping[str, Any]) -> int:
    """vLLM's ``Lfm2MLP`` width: 2/3 of ``intermediate_size``, times the multiplier, rounded up
    to ``block_multiple_of`` when ``block_auto_adjust_ff_dim``."""
    ff = config["intermediate_size"]
    if config.get("block_auto_adjust_ff_dim"):
        ff = int(2 * ff / 3)
        if config.get("block_ffn_dim_multiplier") is not None:
            ff = int(config["block_ffn_dim_multiplier"] * ff)
        m = config["block_multiple_of"]
        ff = m * ((ff + m - 1) // m)
    return ff


def engine_piece(name: str, shape: Sequence[int], config: Mapping[str, Any], tp: int,
                 rank: int) -> tuple[Piece | None, int]:
    """``(piece, zero rows padded)``: the dim and intervals rank ``rank`` holds (None: whole)."""
    parts = name.split(".")
    module, leaf = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    hidden, mt = config.get("hidden_size") or config.get("d_model"), config["model_type"]
    heads = config.get("num_attention_heads") or config.get("n_heads")
    kv = config.get("num_key_value_heads") or heads
    if name.endswith(("embed_tokens.weight", "lm_head.weight", "embeddings.weight", "wte.weight")):
        per = -(-shape[0] // tp)
        start = min(rank * per, shape[0])
        stop = min(start + per, shape[0])
        return (0, ((start, stop),)), per - (stop - start)
    if mt in ("mamba", "falcon_mamba") and ".mixer." in name:
        inner = config["intermediate_size"]
        if module == "in_proj":
            return (0, _parts([inner, inner], tp, rank)), 0
        if module in ("conv1d", "dt_proj") or leaf in ("A_log", "D"):
            return (0, (_even(inner, tp, rank),)), 0
        if module in ("x_proj", "out_proj") and leaf == "weight":
            return (1, (_even(inner, tp, rank),)), 0
        return None, 0
    if mt == "mamba2" and ".mixer." in name or mt == "zamba2" and ".mamba." in name:
        if mt == "zamba2":
            nh, g, n = config["n_mamba_heads"], config["mamba_ngroups"], config["mamba_d_state"]
            hd = config["mamba_expand"] * hidden // nh
        else:
            nh, hd, g, n = config["num_heads"], config["head_dim"], config["n_groups"], \
                config["state_size"]
        inner, gs = nh * hd, g * n
        one = g == 1  # the single group duplicated on every rank
        assert one or g % tp == 0, "vLLM refuses n_groups % tp != 0 unless n_groups == 1"
        if module == "in_proj":
            return (0, _parts([inner, inner, gs, gs, nh], tp, rank,
                              (False, False, one, one, False))), 0
        if module == "conv1d":
            return (0, _parts([inner, gs, gs], tp, rank, (False, one, one))), 0
        if leaf in ("A_log", "D", "dt_bias"):
            return (0, (_even(nh, tp, rank),)), 0
        if module == "norm":
            return (0, (_even(inner, tp, rank),)), 0
        if module == "out_proj" and leaf == "weight":
            return (1, (_even(inner, tp, rank),)), 0
        return None, 0
    if mt == "zamba2":
        z = _zamba2(name, module, leaf, config, tp, rank)
        if z is not False:
            return z, 0  # type: ignore[return-value]
    if mt in ("lfm2", "lfm2_moe") and ".conv." in name:
        if module == "in_proj":
            return (0, _parts([hidden] * 3, tp, rank)), 0
        if module == "conv":
            return (0, (_even(hidden, tp, rank),)), 0
        if module == "out_proj" and leaf == "weight":
            return (1, (_even(hidden, tp, rank),)), 0
        return None, 0
    if mt in ("lfm2", "lfm2_moe") and ".feed_forward." in name and module in ("w1", "w2", "w3"):
        ff = lfm2_ff_dim(config) if mt == "lfm2" else config["intermediate_size"]
        if ".experts." in name:
            ff = config["moe_intermediate_size"]
        return ((1 if module == "w2" else 0), (_even(ff, tp, rank),)), 0
    if mt in ("lfm2_moe", "aria_text", "granitemoe", "granitemoeshared") and \
            ".experts." in name and leaf in ("gate_up_proj", "down_proj"):
        inter = config["moe_intermediate_size"] if mt == "lfm2_moe" else config["intermediate_size"]
        oriented = shape[1] == hidden  # [E, H, 2I] / [E, I, H] (Aria) vs [E, 2I, H] / [E, H, I]
        if leaf == "gate_up_proj":
            return (2 if oriented else 1, _parts([inter, inter], tp, rank)), 0
        return (1 if oriented else 2, (_even(inter, tp, rank),)), 0
    if mt.startswith("granitemoe") and module in ("input_linear", "output_linear"):
        if ".shared_mlp." in name:
            s = config["shared_intermediate_size"]
            return ((0, _parts([s, s], tp, rank)) if module == "input_linear"
                    else (1, (_even(s, tp, rank),))), 0
        inter = config["intermediate_size"]
        return ((1, _parts([inter, inter], tp, rank)) if module == "input_linear"
                else (2, (_even(inter, tp, rank),))), 0
    if mt == "aria_text" and module in ("fc1", "fc2") and ".experts." in name:
        inter = config["intermediate_size"]
        return ((2, _parts([inter, inter], tp, rank)) if module == "fc1"
                else (1, (_even(inter, tp, rank),))), 0
    if mt == "olmo_hybrid" and ".linear_attn." in name:
        key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
        vh = config["linear_num_value_heads"]
        if module in ("q_proj", "k_proj", "q_conv1d", "k_conv1d"):
            return (0, (_even(key, tp, rank),)), 0
        if module in ("v_proj", "g_proj", "v_conv1d"):
            return (0, (_even(value, tp, rank),)), 0
        if module == "conv1d":
            return (0, _parts([key, key, value], tp, rank)), 0
        if module in ("a_proj", "b_proj") or leaf in ("A_log", "dt_bias"):
            return (0, (_even(vh, tp, rank),)), 0
        if module == "o_proj":
            return (1, (_even(value, tp, rank),)), 0
        return None, 0                                # o_norm (head_v_dim)
    if mt == "kimi_linear":
        return _kimi(name, module, leaf, shape, config, tp, rank)
    if mt == "dbrx" and leaf in ("w1", "v1", "w2"):
        inter = config["ffn_config"]["ffn_hidden_size"]
        experts = config["ffn_config"]["moe_num_experts"]
        return (0, tuple(_even(inter, tp, rank, e * inter) for e in range(experts))), 0
    hd = config.get("head_dim") or (hidden // heads if heads else 0)
    if module == "q_proj":
        return (0, (_even(heads * hd, tp, rank),)), 0
    if module in ("k_proj", "v_proj"):
        if kv >= tp:
            return (0, (_even(kv * hd, tp, rank),)), 0
        head = rank * kv // tp
        return (0, ((head * hd, (head + 1) * hd),)), 0
    if module in ("o_proj", "out_proj") and leaf == "weight":
        return (1, (_even(heads * hd, tp, rank),)), 0
    if module in ("gate_proj", "up_proj"):  # shared experts (Aria): plain column-parallel
        return (0, (_even(shape[0], tp, rank),)), 0
    if module == "down_proj":
        return (1, (_even(shape[1], tp, rank),)), 0
    return None, 0                                    # norms, routers, expert bias


def _zamba2(name: str, module: str, leaf: str, config: Mapping[str, Any], tp: int,
            rank: int) -> Any:
    """Zamba2's shared block as vLLM's ``zamba2.py``; False: not one of its tensors."""
    if ".shared_transformer." not in name and not name.endswith(".linear.weight"):
        return False
    inter, rank_rows = config["intermediate_size"], config["adapter_rank"]
    attn = config["num_attention_heads"] * config["attention_head_dim"]
    parts = name.split(".")
    if "_adapter_list" in name:           # ...adapter_list.<k>.<0: A | 1: B>.weight
        if parts[-2] == "0":
            return (0, (_even(rank_rows, tp, rank),))
        if "gate_up_proj_adapter" in name:
            return (0, _parts([inter, inter], tp, rank))
        return (0, (_even(attn, tp, rank),))
    if module == "gate_up_proj":
        return (0, _parts([inter, inter], tp, rank))
    if module == "down_proj":
        return (1, (_even(inter, tp, rank),))
    if module in ("q_proj", "k_proj", "v_proj"):
        return (0, (_even(attn, tp, rank),))
    if module == "o_proj":
        return (1, (_even(attn, tp, rank),))
    return None                           # linear, norms


def _kimi(name: str, module: str, leaf: str, shape: Sequence[int], config: Mapping[str, Any],
          tp: int, rank: int) -> tuple[Piece | None, int]:
    """Kimi-Linear: KDA layers as SGLang's ``KimiDeltaAttention`` (q / k / v / f_b / g_b /
    b rows, per-channel convs and dt_bias by heads, ``A_log`` [1, 1, H, 1] on dim 2, f_a / g_a
    and the head-dim ``o_norm`` whole, ``o_proj`` columns), experts' w1 / w3 rows and w2
    columns, the MLA layers and the rest by tests/mla_ref.py."""
    from mla_ref import mla_slices
    parts = name.split(".")
    layer = int(parts[2]) if name.startswith("model.layers.") else None
    if layer is not None and config["layer_types"][layer] == "linear_attention" and \
            ".self_attn." in name:
        heads, hd = config["linear_num_heads"], config["linear_head_dim"]
        proj = heads * hd
        if module in ("f_a_proj", "g_a_proj", "o_norm"):
            return None, 0
        if leaf == "A_log":
            return (2, (_even(heads, tp, rank),)), 0
        if module == "b_proj":
            return (0, (_even(heads, tp, rank),)), 0
        if module == "o_proj":
            return (1, (_even(proj, tp, rank),)), 0
        if module == "conv1d":  # transformers' naming: [q | k | v] convs stacked
            return (0, _parts([proj] * 3, tp, rank)), 0
        assert module in ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj", "q_conv1d",
                          "k_conv1d", "v_conv1d") or leaf == "dt_bias", name
        return (0, (_even(proj, tp, rank),)), 0
    inter = config["moe_intermediate_size"]
    if ".experts." in name and module in ("w1", "w3", "w2"):
        return ((1 if module == "w2" else 0), (_even(inter, tp, rank),)), 0
    if ".experts." in name and leaf == "gate_up_proj":   # [E, 2I, H]: gate and up halves
        return (1, _parts([inter, inter], tp, rank)), 0
    if ".experts." in name and leaf == "down_proj":      # [E, H, I]
        return (2, (_even(inter, tp, rank),)), 0
    slices, pad = mla_slices(name, shape, config, tp, rank)
    cut = [(d, s) for d, s in enumerate(slices) if (s.start, s.stop) != (0, shape[d])]
    assert len(cut) <= 1, (name, slices)
    if not cut:
        return (None, 0) if not pad else ((0, ((0, shape[0]),)), pad)
    d, s = cut[0]
    return (d, ((s.start, s.stop),)), pad


def take(full: Any, piece: Piece | None, pad: int) -> Any:
    """The rank's tensor: ``full``'s intervals on the piece's dim concatenated, zero rows after."""
    import torch
    if piece is None:
        return full
    dim, intervals = piece
    out = torch.cat([full.narrow(dim, a, b - a) for a, b in intervals], dim)
    if pad:
        out = torch.cat([out, out.new_zeros((pad,) + tuple(out.shape[1:]))])
    return out
