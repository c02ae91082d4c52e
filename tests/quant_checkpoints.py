"""Tiny quantized llama checkpoints with reference numerics written here (independent of
pploader): FP8 block-scaled, FP8 per-channel / per-tensor and NVFP4 (ModelOpt). Shared by
tests/planning/test_quant.py and tests/io/test_tp_redistribute.py."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Optional

import torch

from helpers import tiny_config
from pploader.planning.spec import spec_from_config
from pploader.tiny import write_checkpoint

F8 = torch.float8_e4m3fn
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---- reference numerics ----------------------------------------------------------------------
def fp8_block(w: torch.Tensor, bn: int, bk: int) -> dict[str, torch.Tensor]:
    n, k = w.shape
    scale = torch.empty(-(-n // bn), -(-k // bk))
    q = torch.empty(n, k, dtype=F8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / 448
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / scale[i, j]).to(F8)
    return {"weight": q, "weight_scale_inv": scale}


def fp8_block_dequant(t: dict[str, torch.Tensor], bn: int, bk: int) -> torch.Tensor:
    n, k = t["weight"].shape
    s = t["weight_scale_inv"].repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return t["weight"].float() * s


def nvfp4(w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    n, k = w.shape
    gs = w.abs().max() / (448 * 6)
    g = w.reshape(n, k // group, group)
    scale = (g.abs().amax(-1) / 6 / gs).clamp(min=2 ** -6).to(F8)
    x = g / (scale.float() * gs).unsqueeze(-1)
    codes = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1) | ((x < 0).long() << 3)
    codes = codes.reshape(n, k).to(torch.uint8)
    return {"weight": codes[:, 0::2] | (codes[:, 1::2] << 4), "weight_scale": scale,
            "weight_scale_2": gs.reshape(()), "input_scale": torch.tensor(0.5)}


def nvfp4_dequant(t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    p = t["weight"]
    codes = torch.stack([p & 0xF, p >> 4], -1).reshape(p.shape[0], -1).long()
    vals = E2M1[codes & 7] * (1 - 2 * (codes >> 3)).float()
    return vals * t["weight_scale"].float().repeat_interleave(group, 1) * t["weight_scale_2"]


def fp8_channel(w: torch.Tensor) -> dict[str, torch.Tensor]:
    s = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448
    return {"weight": (w / s).to(F8), "weight_scale": s, "input_scale": torch.ones(1)}


def fp8_channel_dequant(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return t["weight"].float() * t["weight_scale"]


def fp8_tensor(w: torch.Tensor) -> dict[str, torch.Tensor]:
    s = w.abs().max().clamp(min=1e-12) / 448
    return {"weight": (w / s).to(F8), "weight_scale": s.reshape(()),
            "input_scale": torch.tensor(1.0)}


def fp8_tensor_dequant(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return t["weight"].float() * t["weight_scale"]


SCHEMES: dict[str, tuple[dict, Callable, Callable]] = {
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [16, 16]},
                  lambda w: fp8_block(w, 16, 16), lambda t: fp8_block_dequant(t, 16, 16)),
    "nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
              lambda w: nvfp4(w, 16), lambda t: nvfp4_dequant(t, 16)),
    "fp8-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                     "config_groups": {"group_0": {
                         "targets": ["Linear"],
                         "weights": {"type": "float", "num_bits": 8, "strategy": "channel"},
                         "input_activations": {"type": "float", "num_bits": 8,
                                               "strategy": "tensor", "dynamic": False}}},
                     "ignore": ["lm_head"]}, fp8_channel, fp8_channel_dequant),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static"},
                   fp8_tensor, fp8_tensor_dequant),
}


def _quantized_weights(spec, names) -> list[str]:  # type: ignore[no-untyped-def]
    """Linear weights of the decoder layers (what the test quantizes)."""
    return [n for n in names if re.fullmatch(r"model\.layers\.\d+\..*_proj\.weight", n)]


def write_quantized(out: Path, scheme: str, *, drop: Optional[str] = None,
                    quant_config: Optional[dict] = None, seed: int = 0,
                    quantize: Optional[Callable] = None) -> tuple[Path, dict]:
    """A tiny llama quantized with ``scheme`` (``drop``: a tensor left out on purpose)."""
    qc, default_quantize, _ = SCHEMES[scheme]
    quantize = quantize or default_quantize
    cfg = tiny_config(quantization_config=quant_config or qc)
    spec = spec_from_config(cfg)
    template = spec.family.template(spec)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    quantized = set(_quantized_weights(spec, template))
    for name, shape in template.items():
        w = torch.randn(tuple(shape), generator=gen) * 0.02 + 1e-3
        if name not in quantized:
            tensors[name] = w.to(torch.bfloat16)
            continue
        stem = name[:-len("weight")]
        for suffix, t in quantize(w).items():
            tensors[stem + suffix] = t
    if drop is not None:
        del tensors[drop]
    write_checkpoint(out, tensors, cfg, shard_bytes=60_000)
    return out, cfg
