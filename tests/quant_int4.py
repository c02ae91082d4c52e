"""Tiny int4 / int8 / NVFP4 checkpoints in the real on-disk layouts, and what each TP rank of a
serving engine holds of every tensor, both written here independently of pploader's planner.

Layouts (the tensors each library's ``save`` writes; shapes for a linear of N outputs and K
inputs, group g):

- AutoAWQ GEMM (``awq/modules/linear/gemm.py``): ``qweight`` int32 [K, N/8] (8 int4 per word
  along the outputs, AWQ's order 0 2 4 6 1 3 5 7), ``qzeros`` int32 [K/g, N/8], ``scales``
  fp16 [K/g, N].
- AutoGPTQ / GPTQModel (``gptq`` format): ``qweight`` int32 [K/8, N] (packed along the
  inputs), ``qzeros`` int32 [K/g, N/8], ``scales`` fp16 [K/g, N], ``g_idx`` int32 [K]
  (``desc_act``: a permutation's groups, else ``k // g``).
- compressed-tensors ``pack-quantized`` (``pack_to_int32``): ``weight_packed`` int32
  [N, K/8], ``weight_scale`` bf16 [N, K/g] ([N, 1] per channel), ``weight_zero_point`` int32
  [N/8, K/g] (asymmetric), ``weight_g_idx`` int32 [K] (actorder "group"), ``weight_shape``
  int64 [2]; ``int-quantized`` W8A8: int8 ``weight`` [N, K], ``weight_scale`` f32 [N, 1],
  ``input_scale`` [1] (static); ``float-quantized`` FP8 per channel: fp8 ``weight`` [N, K],
  ``weight_scale`` f32 [N, 1]; ``nvfp4-pack-quantized``: ``weight_packed`` uint8 [N, K/2],
  fp8 ``weight_scale`` [N, K/16], ``weight_global_scale`` / ``input_global_scale`` f32 [1].

The engine's rule (``engine_slices``) is spelled from vLLM's parameter attributes of each
method (``input_dim`` / ``output_dim`` / ``packed_dim`` with its ``pack_factor``, group dims,
``marlin_repeat_scales_on_all_ranks``: act-order scales whole on row-parallel layers) and its
linear layers (q by heads, k / v by kv heads, replicated when fewer than tp; o / down split
on the inputs; the router and norms whole; vocab rows ``ceil(V / tp)`` with padding).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from helpers import tiny_config
from pploader.planning.spec import spec_from_config
from pploader.tiny import write_checkpoint

GROUP = 16
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

CONFIGS: dict[str, dict] = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
            "zero_point": True, "modules_to_not_convert": None},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
             "sym": True, "checkpoint_format": "gptq", "lm_head": False},
    "gptq-desc-act": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True,
                      "sym": False, "checkpoint_format": "gptq", "lm_head": False},
    "w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized",
              "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                            "weights": {"type": "int", "num_bits": 4,
                                                        "strategy": "group",
                                                        "group_size": GROUP, "symmetric": True,
                                                        "actorder": None}}},
              "ignore": ["lm_head", "re:.*mlp.gate$"], "quantization_status": "compressed"},
    "w4a16-asym-actorder": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {
            "group_0": {"targets": ["re:.*self_attn.*"], "weights": {
                "type": "int", "num_bits": 4, "strategy": "group", "group_size": GROUP,
                "symmetric": False, "actorder": "group"}},
            "group_1": {"targets": ["re:.*mlp.*"], "weights": {
                "type": "int", "num_bits": 4, "strategy": "group", "group_size": GROUP,
                "symmetric": False, "actorder": "group"}}},
        "ignore": ["lm_head", "re:.*mlp.gate$"]},
    "w8a8": {"quant_method": "compressed-tensors", "format": "int-quantized",
             "config_groups": {"group_0": {
                 "targets": ["Linear"],
                 "weights": {"type": "int", "num_bits": 8, "strategy": "channel",
                             "symmetric": True},
                 "input_activations": {"type": "int", "num_bits": 8, "strategy": "tensor",
                                       "symmetric": True, "dynamic": False}}},
             "ignore": ["lm_head", "re:.*mlp.gate$"]},
    "nvfp4": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
              "config_groups": {"group_0": {
                  "targets": ["Linear"],
                  "weights": {"type": "float", "num_bits": 4, "strategy": "tensor_group",
                              "group_size": 16, "symmetric": True},
                  "input_activations": {"type": "float", "num_bits": 4,
                                        "strategy": "tensor_group", "group_size": 16,
                                        "dynamic": "local"}}},
              "ignore": ["lm_head", "re:.*mlp.gate$"]},
}

#: per method and stored suffix: each dim as (logical dim "out" / "in", entries per value:
#: the pack or group; None = one entry)
def layouts(method: str, group: int = GROUP) -> dict[str, tuple[tuple[str, Optional[int]], ...]]:
    if method == "awq":
        return {"qweight": (("in", 1), ("out", 8)), "qzeros": (("in", group), ("out", 8)),
                "scales": (("in", group), ("out", 1))}
    if method.startswith("gptq"):
        return {"qweight": (("in", 8), ("out", 1)), "qzeros": (("in", group), ("out", 8)),
                "scales": (("in", group), ("out", 1)), "g_idx": (("in", 1),)}
    if method.startswith("w4a16"):
        return {"weight_packed": (("out", 1), ("in", 8)),
                "weight_scale": (("out", 1), ("in", group)),
                "weight_zero_point": (("out", 8), ("in", group)), "weight_g_idx": (("in", 1),),
                "weight_shape": ()}
    if method == "w8a8":
        return {"weight": (("out", 1), ("in", 1)), "weight_scale": (("out", 1), ("in", None)),
                "input_scale": ()}
    if method == "fp8-channel":
        return {"weight": (("out", 1), ("in", 1)), "weight_scale": (("out", 1), ("in", None))}
    if method == "nvfp4":
        return {"weight_packed": (("out", 1), ("in", 2)),
                "weight_scale": (("out", 1), ("in", 16)),
                "weight_global_scale": (), "input_global_scale": ()}
    raise ValueError(method)


#: methods whose group scales (and zeros) every rank of a row-parallel layer holds whole
ACT_ORDER = {"gptq-desc-act": ("qzeros", "scales"),
             "w4a16-asym-actorder": ("weight_scale", "weight_zero_point")}


# ---- packing (each library's bit order) ------------------------------------------------------
def pack_int32(codes: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))
               ) -> torch.Tensor:
    """Pack int4 ``codes`` 8 per int32 along ``dim`` (value ``order[i]`` in nibble i)."""
    c = codes.movedim(dim, -1).to(torch.int64)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // 8, 8)[..., list(order)]
    word = sum(c[..., i] << (4 * i) for i in range(8))
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word)
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))
                 ) -> torch.Tensor:
    w = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], -1)
    inverse = [order.index(j) for j in range(8)]
    nib = nib[..., inverse]
    return nib.reshape(*nib.shape[:-2], -1).movedim(-1, dim)


# ---- writing ---------------------------------------------------------------------------------
def quantized_linear(name: str) -> bool:
    """The linears the tiny checkpoints quantize: every decoder projection but the router."""
    return re.fullmatch(r"model\.layers\.\d+\..*_proj\.weight", name) is not None


def quantize(method: str, n: int, k: int, gen: torch.Generator, group: int = GROUP,
             scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Random stored tensors of ``method`` for an [n, k] linear (real dtypes and shapes; the
    scales about ``scale``)."""
    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 16, shape, generator=gen)

    def half(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return ((torch.rand(shape, generator=gen) + 0.5) * scale).to(dtype)
    groups = k // group
    if method == "awq":
        return {"qweight": pack_int32(codes(k, n), 1, AWQ_ORDER),
                "qzeros": pack_int32(codes(groups, n), 1, AWQ_ORDER), "scales": half(groups, n)}
    if method.startswith("gptq"):
        g_idx = torch.arange(k) // group
        if method == "gptq-desc-act":
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        return {"qweight": pack_int32(codes(k, n), 0), "qzeros": pack_int32(codes(groups, n), 1),
                "scales": half(groups, n), "g_idx": g_idx.to(torch.int32)}
    if method.startswith("w4a16"):
        out = {"weight_packed": pack_int32(codes(n, k), 1),
               "weight_scale": half(n, groups, dtype=torch.bfloat16),
               "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        if method == "w4a16-asym-actorder":
            out["weight_zero_point"] = pack_int32(codes(n, groups), 0)
            out["weight_g_idx"] = (torch.arange(k) // group)[torch.randperm(k, generator=gen)
                                                             ].to(torch.int32)
        return out
    if method == "w8a8":
        return {"weight": torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8),
                "weight_scale": torch.rand(n, 1, generator=gen), "input_scale": torch.rand(1)}
    if method == "fp8-channel":  # compressed-tensors float-quantized, dynamic activations
        return {"weight": torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn),
                "weight_scale": torch.rand(n, 1, generator=gen)}
    if method == "nvfp4":
        return {"weight_packed": torch.randint(0, 256, (n, k // 2), generator=gen
                                               ).to(torch.uint8),
                "weight_scale": half(n, k // 16).float().to(torch.float8_e4m3fn),
                "weight_global_scale": torch.rand(1), "input_global_scale": torch.rand(1)}
    raise ValueError(method)


def write_int4(out: Path, method: str, model: "str | Mapping[str, Any]" = "tiny-llama",
               seed: int = 0, group: int = GROUP, scale: float = 1.0,
               shard_bytes: int = 50_000) -> tuple[Path, dict]:
    """A tiny ``model`` checkpoint (a bundled tiny config's name, or a config) whose decoder
    linears are stored as ``method`` does, with group size ``group``."""
    qc = json.loads(json.dumps(CONFIGS[method]))  # a deep copy
    if "group_size" in qc:
        qc["group_size"] = group
    for g in (qc.get("config_groups") or {}).values():  # compressed-tensors' groups
        if g["weights"].get("strategy") == "group":
            g["weights"]["group_size"] = group
    cfg = dict(model, quantization_config=qc) if not isinstance(model, str) else \
        tiny_config(model, quantization_config=qc)
    spec = spec_from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    plain = getattr(torch, str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"))
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in spec.family.template(spec).items():  # type: ignore[misc]
        if not quantized_linear(name):
            tensors[name] = (torch.randn(tuple(shape), generator=gen) * 0.02).to(plain)
            continue
        stem = name[:-len("weight")]
        for suffix, t in quantize(method, shape[0], shape[1], gen, group, scale).items():
            tensors[stem + suffix] = t
    write_checkpoint(out, tensors, cfg, shard_bytes=shard_bytes)
    return out, cfg


# ---- the engine's rule -----------------------------------------------------------------------
def _linear(module: str, cfg: Mapping[str, Any]) -> tuple[Optional[str], Optional[int], int]:
    """(split logical dim "out" / "in" or None, units it splits in (heads) or None, its size)."""
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    leaf = module.rsplit(".", 1)[-1]
    inter = cfg["moe_intermediate_size"] if ".experts." in module else cfg["intermediate_size"]
    if leaf == "q_proj":
        return "out", heads, heads * hd
    if leaf in ("k_proj", "v_proj"):
        return "out", kv, kv * hd
    if leaf == "o_proj":
        return "in", heads, heads * hd
    if leaf in ("gate_proj", "up_proj"):
        return "out", None, inter
    if leaf == "down_proj":
        return "in", None, inter
    return None, None, 0


def _interval(units: Optional[int], size: int, tp: int, rank: int) -> tuple[int, int]:
    """The rank's [start, end) of a dim of ``size`` split in ``units`` (None: elements)."""
    if units is not None and units < tp:  # fewer heads than ranks: one head, replicated
        per_unit = size // units
        head = rank * units // tp
        return head * per_unit, (head + 1) * per_unit
    per = size // tp
    return rank * per, (rank + 1) * per


def engine_slices(name: str, shape: tuple[int, ...], cfg: Mapping[str, Any], method: str,
                  tp: int, rank: int, group: int = GROUP) -> tuple[tuple[slice, ...], int]:
    """``(slices of the stored tensor, zero rows padded)`` that TP rank ``rank`` holds."""
    whole = tuple(slice(0, n) for n in shape)
    if tp == 1:
        return whole, 0
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        per = -(-shape[0] // tp)
        start = min(rank * per, shape[0])
        stop = min(start + per, shape[0])
        return (slice(start, stop),) + whole[1:], per - (stop - start)
    module, suffix = name.rsplit(".", 1)
    split, units, size = _linear(module, cfg)
    if split is None:
        return whole, 0  # norms, router
    layout = layouts(method, group)
    if suffix == "bias" or suffix not in layout and suffix == "weight":
        dims: tuple = (("out", 1), ("in", 1))  # an unquantized linear
    else:
        dims = layout[suffix]
    start, stop = _interval(units, size, tp, rank)
    out = list(whole)
    for at, (logical, per) in enumerate(dims):
        if logical != split or per is None:
            continue
        if logical == "in" and suffix in ACT_ORDER.get(method, ()):
            continue  # act-order: every rank of a row-parallel layer holds all groups
        assert start % per == 0 and stop % per == 0, (name, start, stop, per)
        out[at] = slice(start // per, stop // per)
    return tuple(out), 0
