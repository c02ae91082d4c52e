"""Registry of model families: architecture name -> Family data."""
from __future__ import annotations

from typing import Mapping

from ..errors import ConfigError
from .base import CheckpointFormat, Family, GlobalRule, Layout, ShardRule, TensorRole
from . import deepseek, granite, llama, mamba, moe, nemotron_h, qwen_hybrid

__all__ = ["CheckpointFormat", "Family", "GlobalRule", "Layout", "ShardRule", "TensorRole",
           "FAMILIES", "find_family", "supported_architectures"]

#: Every family pploader supports. Add yours here (see docs/families.md).
FAMILIES: tuple[Family, ...] = (
    llama.FAMILY, llama.QWEN3, llama.QWEN2,
    moe.QWEN3_MOE, moe.MIXTRAL, deepseek.DEEPSEEK_V3,
    qwen_hybrid.QWEN3_NEXT, qwen_hybrid.QWEN3_5, qwen_hybrid.QWEN3_5_MOE,
    qwen_hybrid.QWEN3_5_VL, qwen_hybrid.QWEN3_5_MOE_VL,
    mamba.JAMBA, mamba.BAMBA, mamba.FALCON_H1, nemotron_h.NEMOTRON_H, granite.GRANITE_MOE_HYBRID,
)


def supported_architectures() -> list[str]:
    return sorted(a for f in FAMILIES for a in f.architectures)


def find_family(config: Mapping) -> tuple[Family, str]:
    """The family of a config.json, by its ``architectures`` list: a hand-written family
    when one names it, else the generic family built from transformers' meta model."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ConfigError("config.json has no `architectures` list; supported: "
                          + ", ".join(supported_architectures()), file="config.json")
    for arch in archs:
        for fam in FAMILIES:
            if arch in fam.architectures:
                return fam, arch
    return _generic(config, archs[0])


def _generic(config: Mapping, arch: object) -> tuple[Family, str]:
    """The generic family (transformers' meta model), or a ConfigError saying why not."""
    try:
        from . import generic  # imports transformers lazily, only for unknown architectures
        return generic.family_for(config), str(arch)
    except ImportError as exc:
        reason = f"the generic family needs transformers ({exc})"
    except ConfigError as exc:
        reason = f"the generic family cannot derive it: {exc.detail}"
    raise ConfigError(f"unsupported architecture {arch!r}: {reason}; hand-written families: "
                      + ", ".join(supported_architectures())
                      + " (docs/families.md explains how to add a family)", file="config.json")
