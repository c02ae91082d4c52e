"""Dtype policy: what happens when a checkpoint tensor's dtype is not config.json's dtype.

One small table decides, before anything is allocated or read:

- same dtype                                  -> loaded as stored
- the dtype the model itself gives that tensor (``Family.native_dtypes``: integer buffers
  such as a router's lookup table, whatever config.json's dtype) -> loaded as stored
- (stored, expected) in :data:`DTYPE_POLICY`  -> ``"cast"`` (exact widenings only) or
  ``"keep"`` (float32 tensors in a 16-bit model, e.g. norms, Mamba ``A_log``, router biases
  that checkpoints store in full precision on purpose: passed through, the consumer decides)
- a quantized model (config has ``quantization_config`` / ``compression_config``) and a stored
  dtype in :data:`QUANT_STORAGE` (fp8, integers, float32 scales) -> kept: the quantization
  method owns those dtypes; so are a quantization companion's 16-bit floats (GPTQ / AWQ
  ``scales`` are float16 in bfloat16 models too: the engine converts them)
- anything else (float16 in a bfloat16 model, integers in a plain model, float64 ...) ->
  :class:`PlanError` naming file, tensor, rank and both dtypes.

Pure: called by ``stage.plan_stage`` on every rank, so all ranks agree before reading.
"""
from __future__ import annotations

import logging
import os
from types import MappingProxyType
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Optional, Sequence

from .dtype_table import DTYPES, dtype_code
from .quant import quant_scheme
from ..errors import PlanError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .plan import RankPlan
    from .spec import ModelSpec

__all__ = ["DTYPE_POLICY", "QUANT_STORAGE", "dtype_action", "dtype_casts", "cast_codes",
           "cast_stream", "is_quantized", "stored_dtype"]

#: floating safetensors dtype codes a model dtype can be, and their config names
_MODEL_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}

#: (stored dtype, config dtype) -> "cast" | "keep". Pairs not listed are rejected.
DTYPE_POLICY: Mapping[tuple[str, str], str] = MappingProxyType({
    ("BF16", "F32"): "cast",   # exact widening
    ("F16", "F32"): "cast",    # exact widening
    ("BF16", "F64"): "cast",   # exact widening
    ("F16", "F64"): "cast",    # exact widening
    ("F32", "F64"): "cast",    # exact widening
    ("F32", "BF16"): "keep",   # full-precision-by-design tensors in a bf16 model
    ("F32", "F16"): "keep",    # same in an fp16 model (casting could overflow to inf)
})

#: Stored dtypes a quantized checkpoint may use for weights, scales and packed integers.
QUANT_STORAGE: frozenset[str] = frozenset({
    "F8_E4M3", "F8_E5M2", "F8_E8M0", "I8", "U8", "I16", "U16", "I32", "U32", "I64", "F32"})

_QUANT_KEYS = ("quantization_config", "compression_config")

logger = logging.getLogger(__name__)


def is_quantized(spec: "ModelSpec") -> bool:
    """True when config.json declares a quantization method."""
    return any(spec.config.get(k) or spec.full_config.get(k) for k in _QUANT_KEYS)


def dtype_action(stored: str, expected: str, *, quantized: bool = False,
                 native: Optional[str] = None) -> Optional[str]:
    """``"keep"``, ``"cast"`` or None (rejected) for a tensor stored as ``stored``
    (``native``: the dtype the model's own tensor of that name has, if fixed)."""
    if stored == expected or stored == native:
        return "keep"
    if quantized and stored in QUANT_STORAGE:
        return "keep"
    return DTYPE_POLICY.get((stored, expected))


def _allowed_text() -> str:
    return ", ".join(f"{a}->{b} ({act})" for (a, b), act in DTYPE_POLICY.items())


def dtype_casts(spec: "ModelSpec", plan: "RankPlan") -> "dict[str, torch.dtype]":
    """Targets of ``plan`` to cast (target -> torch dtype); raises PlanError for a rejected
    dtype. Imports torch only when there is a cast (:func:`cast_codes` never does)."""
    return {target: DTYPES[code][0] for target, code in cast_codes(spec, plan).items()}


def cast_codes(spec: "ModelSpec", plan: "RankPlan") -> dict[str, str]:
    """Targets of ``plan`` to cast (target -> safetensors dtype code); raises PlanError for a
    rejected dtype. Pure (no torch): ``pploader plan`` applies the policy with it.

    Every rejected tensor of the plan is counted in one error (the first one is named).
    """
    expected = dtype_code(spec.dtype_name)
    quantized = is_quantized(spec)
    native = spec.family.native_dtypes
    scheme = quant_scheme(spec) if quantized else None
    casts: dict[str, str] = {}
    rejected: list = []
    kept: list = []
    for item in plan.items:
        action = dtype_action(item.dtype, expected, quantized=quantized,
                              native=native.get(item.name))
        if action is None:
            if scheme is not None and item.dtype in _MODEL_DTYPES \
                    and scheme.weight_of(item.name) is not None:
                continue  # a quantization companion's own float dtype (scales): kept
            rejected.append(item)
        elif action == "cast":
            casts[item.target] = expected
        elif item.dtype != expected and item.dtype != native.get(item.name) \
                and not (quantized and item.dtype in QUANT_STORAGE):
            kept.append(item)
    if rejected:
        first = rejected[0]
        more = f" (and {len(rejected) - 1} more: " + ", ".join(
            f"{i.name} {i.dtype}" for i in rejected[1:6]) + ")" if len(rejected) > 1 else ""
        raise PlanError(f"dtype {first.dtype} in the checkpoint but config.json says {expected}"
                        f"{' (quantized)' if quantized else ''}; pploader converts only along "
                        f"its allowlist: {_allowed_text()}{more}. See docs/reliability.md.",
                        file=first.file, tensor=first.name, rank=plan.topology.rank)
    if kept:
        logger.warning("rank %d: %d tensor(s) stored as %s in a %s model are passed through as "
                       "stored, not cast: %s%s (load_stage_into refuses them unless the module "
                       "has that dtype or allow_cast=True)", plan.topology.rank, len(kept),
                       "/".join(sorted({i.dtype for i in kept})), expected,
                       ", ".join(i.name for i in kept[:8]), " ..." if len(kept) > 8 else "")
    return casts


def cast_stream(stream: "Iterable[tuple[str, torch.Tensor]]",
                casts: "Mapping[str, torch.dtype]") -> "Iterator[tuple[str, torch.Tensor]]":
    """Apply the planned casts to a ``(target, tensor)`` stream (others pass unchanged)."""
    for target, tensor in stream:
        dtype = casts.get(target)
        yield target, (tensor if dtype is None else tensor.to(dtype))


def stored_dtype(model_dir: "os.PathLike[str] | str", *,
                 allowed_roots: "Sequence[os.PathLike[str] | str]" = ()) -> str:
    """The model dtype of a checkpoint whose config.json names none: the floating dtype
    holding most of its parameters (headers only), as transformers' ``dtype="auto"`` and
    vLLM fall back to the checkpoint's own dtype. Quantized weights (fp8, packed integers)
    do not count. A PlanError when no tensor is stored in bfloat16 / float16 / float32."""
    import math
    from collections import Counter
    from .checkpoint import open_checkpoint
    index = open_checkpoint(model_dir, allowed_roots=allowed_roots)
    counts: Counter[str] = Counter()
    for file in sorted(set(index.weight_map.values()) - set(index.missing)):
        for entry in index.header(file).tensors.values():
            if entry.dtype in _MODEL_DTYPES:
                counts[entry.dtype] += math.prod(entry.shape)
    if not counts:
        raise PlanError("config.json names no dtype / torch_dtype and no tensor is stored in "
                        "bfloat16, float16 or float32 to take it from", file="config.json")
    code = counts.most_common(1)[0][0]
    logger.info("config.json names no dtype: using %s, the checkpoint's stored dtype",
                _MODEL_DTYPES[code])
    return _MODEL_DTYPES[code]
