"""MXFP4 checkpoints (gpt-oss): how stacked expert weights are stored, for the generic family.

transformers builds the model unquantized on ``meta`` (``_from_config`` applies no quantizer),
so the template holds each stacked expert weight in its logical layout ``[E, K, N]`` (``x @
w``: gate_up_proj ``[E, hidden, 2 x intermediate]``, down_proj ``[E, intermediate, hidden]``).
An MXFP4 checkpoint stores such a weight ``<w>`` as ``<w>_blocks`` ``[E, N, K / 32, 16]``
(uint8, two 4-bit values a byte, 32 values a block) and ``<w>_scales`` ``[E, N, K / 32]``
(uint8 exponents): the layout transformers' ``Mxfp4Dequantize`` reads (it transposes back to
``[E, K, N]``) and the one OpenAI published. Only 3-d stacked experts are quantized (what
transformers' ``replace_with_mxfp4_linear`` converts); biases, routers, attention and the
embedding stay in the model dtype. Blocks and scales stack experts on dim 0, like the
weight: EP slices them as it slices any stacked expert tensor.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import replace
from typing import Any, Mapping

from ..errors import ConfigError
from .hf_meta import Naming

__all__ = ["is_mxfp4", "mxfp4_naming", "BLOCK", "SUFFIXES"]

BLOCK = 32                     # values per scale (one uint8 exponent)
SUFFIXES = ("_blocks", "_scales")


def is_mxfp4(config: Mapping[str, Any]) -> bool:
    qc = config.get("quantization_config")
    return isinstance(qc, Mapping) and str(qc.get("quant_method", "")).lower() == "mxfp4"


def _kept(name: str, config: Mapping[str, Any]) -> bool:
    """True when ``modules_to_not_convert`` keeps the module of ``name`` unquantized."""
    qc = config.get("quantization_config") or {}
    module = name.rsplit(".", 1)[0]
    for pat in qc.get("modules_to_not_convert") or ():
        if fnmatch.fnmatchcase(module, pat) or fnmatch.fnmatchcase(name, pat) \
                or module == pat or module.startswith(pat + "."):
            return True
    return False


def mxfp4_naming(naming: Naming, config: Mapping[str, Any]) -> Naming:
    """``naming`` as an MXFP4 checkpoint stores it (see the module docstring)."""
    fused = set(naming.fused_components)
    prefix = re.compile(naming.layer_prefix)
    template: dict[str, tuple[int, ...]] = {}
    quantized: set[str] = set()
    for name, shape in naming.template.items():
        m = prefix.match(name)
        comp = name[m.end():] if m else None
        if comp is None or comp not in fused or len(shape) != 3 or _kept(name, config):
            template[name] = shape
            continue
        experts, k, n = shape
        if k % BLOCK:
            raise ConfigError(f"mxfp4: {name} {list(shape)}: the input dim {k} is not a "
                              f"multiple of the {BLOCK}-value block", file="config.json")
        template[name + "_blocks"] = (experts, n, k // BLOCK, BLOCK // 2)
        template[name + "_scales"] = (experts, n, k // BLOCK)
        quantized.add(comp)
    if not quantized:
        raise ConfigError("quant_method 'mxfp4' but the model has no stacked expert weights "
                          "to quantize (MXFP4 is supported for stacked 3-d experts, gpt-oss)",
                          file="config.json")
    components = tuple(sorted((fused - quantized) | {c + s for c in quantized
                                                     for s in SUFFIXES}))
    return replace(naming, template=template, fused_components=components)
