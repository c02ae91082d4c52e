"""Tiny compressed-tensors checkpoints whose config groups give different schemes to different
weights, with an ignore list, and which scheme each module has, read here from the config
by hand (independent of pploader's resolver, planning/quant_groups.py).

``MIXED`` (as llm-compressor writes a mixed-precision recipe):

- ``int4``: every Linear (class target), int4 pack-quantized, group ``GROUP``;
- ``attn``: ``re:.*self_attn\\.[qkvo]_proj$``, int8 W8A8 per channel, static input scale;
- ``fp8``: ``re:model\\.layers\\.1\\.mlp\\..*``, FP8 per channel (layer 1's MLP, its experts);
- ignore: ``lm_head``, the MoE router ``re:.*mlp\\.gate$``, the exact module
  ``model.layers.2.mlp.down_proj`` (a dense down_proj; a MoE layer's experts are named
  ``mlp.experts.<e>.down_proj``, which it does not name) and layer 4's experts.

compressed-tensors takes a name match (exact, then regex) before a class match, so the
attention and layer 1's MLP are not int4 although "Linear" matches them too.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from helpers import tiny_config
from pploader.planning.spec import spec_from_config
from pploader.tiny import write_checkpoint
from quant_int4 import GROUP, quantize, quantized_linear

INT4 = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": GROUP,
        "symmetric": True, "actorder": None}
MIXED: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "mixed-precision",
    "quantization_status": "compressed",
    "config_groups": {
        "int4": {"targets": ["Linear"], "format": "pack-quantized", "weights": INT4,
                 "input_activations": None},
        "attn": {"targets": [r"re:.*self_attn\.[qkvo]_proj$"], "format": "int-quantized",
                 "weights": {"type": "int", "num_bits": 8, "strategy": "channel",
                             "symmetric": True},
                 "input_activations": {"type": "int", "num_bits": 8, "strategy": "tensor",
                                       "symmetric": True, "dynamic": False}},
        "fp8": {"targets": [r"re:model\.layers\.1\.mlp\..*"], "format": "float-quantized",
                "weights": {"type": "float", "num_bits": 8, "strategy": "channel",
                            "symmetric": True},
                "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                      "dynamic": True}}},
    "ignore": ["lm_head", r"re:.*mlp\.gate$", "model.layers.2.mlp.down_proj",
               r"re:model\.layers\.4\.mlp\.experts\."],
}


def mixed_method(name: str) -> Optional[str]:
    """The method a tiny MIXED checkpoint stores ``name``'s module with (None: plain), by the
    rules above."""
    if not quantized_linear(name):
        return None  # embeddings, norms, the router, lm_head
    module = name.rsplit(".", 1)[0]
    if module == "model.layers.2.mlp.down_proj" or \
            module.startswith("model.layers.4.mlp.experts."):
        return None
    if ".self_attn." in module:
        return "w8a8"
    if module.startswith("model.layers.1.mlp."):
        return "fp8-channel"
    return "w4a16"


def write_mixed(out: Path, model: str = "tiny-llama", qc: Optional[dict] = None,
                method_of: Callable[[str], Optional[str]] = mixed_method, seed: int = 0
                ) -> tuple[Path, dict]:
    """A tiny ``model`` checkpoint stored as ``method_of`` says per weight, with config
    ``qc`` (default MIXED)."""
    cfg = tiny_config(model, quantization_config=json.loads(json.dumps(qc or MIXED)))
    spec = spec_from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in spec.family.template(spec).items():  # type: ignore[misc]
        method = method_of(name) if re.search(r"\.weight$", name) else None
        if method is None:
            tensors[name] = (torch.randn(tuple(shape), generator=gen) * 0.02).to(torch.bfloat16)
            continue
        stem = name[:-len("weight")]
        for suffix, t in quantize(method, shape[0], shape[1], gen).items():
            tensors[stem + suffix] = t
    write_checkpoint(out, tensors, cfg, shard_bytes=50_000)
    return out, cfg
