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

Under TP, gpt-oss's MXFP4 experts split as vLLM's gpt-oss loader splits them
(``models/gpt_oss.py``, ``_load_weights_mxfp4``; :func:`engine_tp_rules`): the intermediate
dim in whole 32-value blocks, ``ceil(blocks / tp)`` a rank, the last rank fewer
(``heads.ceil_share``). gate_up's rows interleave gate and up (``gate_up[..., ::2]`` is the
gate in transformers), so the rows ``[2 s, 2 e)`` hold both halves of intermediate
``[s, e)``: blocks, scales and bias split on dim 1 in units of 64 rows. down_proj's input dim
is the intermediate dim: blocks and scales split on dim 2 in whole blocks. down_proj's bias
is read whole on every rank (the engine zeroes it off TP rank 0 itself). gpt-oss's
unquantized experts (bf16, ``[E, H, 2I]`` / ``[E, I, H]``) split as that loader's
``_load_weights_other`` does: the intermediate dim in elements, ``cdiv(I, tp)`` a rank, the
last fewer; gate_up's columns ``[2 s, 2 e)`` (dim 2) and bias, down's rows ``[s, e)`` (dim 1).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import replace
from functools import partial
from typing import Any, Callable, Mapping, Optional

from ..errors import ConfigError, PlanError
from .base import ShardRule, SpecView
from .hf_meta import Naming

__all__ = ["is_mxfp4", "mxfp4_naming", "engine_tp_rules", "BLOCK", "SUFFIXES",
           "ENGINE_TP_ARCHITECTURES"]

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


#: architectures whose serving engine defines the TP split of the stacked experts (vLLM's
#: gpt-oss loader: ``_load_weights_mxfp4`` for MXFP4, ``_load_weights_other`` for bf16)
ENGINE_TP_ARCHITECTURES = frozenset({"GptOssForCausalLM"})

#: stacked expert tensor -> the dim vLLM's gpt-oss loader splits (None: read whole); MXFP4
#: splits the intermediate dim in whole blocks, the unquantized layout in elements
_MXFP4_DIMS: dict[str, Optional[int]] = {
    "gate_up_proj_blocks": 1, "gate_up_proj_scales": 1, "gate_up_proj_bias": 1,
    "down_proj_blocks": 2, "down_proj_scales": 2, "down_proj_bias": None}
_PLAIN_DIMS: dict[str, Optional[int]] = {  # [E, H, 2I] / [E, 2I] / [E, I, H] / [E, H]
    "gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1, "down_proj_bias": None}


def _intermediate(spec: SpecView) -> int:
    """``intermediate_size``: the units of the engine's split of unquantized experts."""
    size = spec.config.get("intermediate_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise PlanError(f"gpt-oss experts under TP: intermediate_size {size!r} is not a "
                        "positive integer", file="config.json")
    return size


def _intermediate_blocks(spec: SpecView) -> int:
    """The intermediate dim in whole MXFP4 blocks (the units of the engine's split)."""
    size = _intermediate(spec)
    if size % BLOCK:
        raise PlanError(f"mxfp4 experts under TP: intermediate_size {size} is not a multiple "
                        f"of the {BLOCK}-value block", file="config.json")
    return size // BLOCK


def engine_tp_rules(architecture: str, naming: Naming) -> dict[str, Callable[[str], ShardRule]]:
    """``{component: pattern -> ShardRule}`` for the stacked expert tensors of ``naming``
    whose TP split an engine defines (see the module docstring): gpt-oss's MXFP4 blocks,
    scales and biases in whole blocks, its unquantized experts and biases in elements (vLLM:
    ``cdiv(intermediate_size, tp)`` a rank, the last fewer); empty for any other
    architecture, whose rules stay the generic family's."""
    if architecture not in ENGINE_TP_ARCHITECTURES:
        return {}
    quantized = any(c.endswith(SUFFIXES[0]) for c in naming.fused_components)
    dims, units = (_MXFP4_DIMS, _intermediate_blocks) if quantized else \
        (_PLAIN_DIMS, _intermediate)
    out: dict[str, Callable[[str], ShardRule]] = {}
    for comp in naming.fused_components:
        tokens = comp.split(".")
        if len(tokens) < 2 or tokens[-2] != "experts" or tokens[-1] not in dims:
            continue
        out[comp] = partial(_engine_rule, dim=dims[tokens[-1]], units=units)
    return out


def _engine_rule(pattern: str, dim: Optional[int], units: Callable[[SpecView], int]
                 ) -> ShardRule:
    if dim is None:
        return ShardRule(pattern, None)
    return ShardRule(pattern, dim, units=units, ceil=True)
