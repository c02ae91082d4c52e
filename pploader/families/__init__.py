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
    """The family of a config.json, by its ``architectures`` list."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ConfigError("config.json has no `architectures` list; supported: "
                          + ", ".join(supported_architectures()), file="config.json")
    for arch in archs:
        for fam in FAMILIES:
            if arch in fam.architectures:
                return fam, arch
    raise ConfigError(f"unsupported architecture {archs[0]!r}; supported: "
                      + ", ".join(supported_architectures())
                      + " (docs/families.md explains how to add a family)", file="config.json")
