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


#: The transformers ``model_type`` values each hand-written family was written for. A config
#: naming a family's architecture with another ``model_type`` (transformers reuses classes:
#: ``exaone`` saves through ``LlamaForCausalLM`` with its own names) goes to the generic family.
MODEL_TYPES: Mapping[str, frozenset[str]] = {
    "llama": frozenset({"llama", "mistral"}), "qwen2": frozenset({"qwen2"}),
    "qwen3": frozenset({"qwen3"}), "qwen3_moe": frozenset({"qwen3_moe"}),
    "mixtral": frozenset({"mixtral"}), "deepseek_v3": frozenset({"deepseek_v3"}),
    "qwen3_next": frozenset({"qwen3_next"}), "qwen3_5": frozenset({"qwen3_5_text", "qwen3_5"}),
    "qwen3_5_moe": frozenset({"qwen3_5_moe_text", "qwen3_5_moe"}),
    "qwen3_5_vl": frozenset({"qwen3_5"}), "qwen3_5_moe_vl": frozenset({"qwen3_5_moe"}),
    "jamba": frozenset({"jamba"}), "bamba": frozenset({"bamba"}),
    "falcon_h1": frozenset({"falcon_h1"}), "nemotron_h": frozenset({"nemotron_h"}),
    "granitemoehybrid": frozenset({"granitemoehybrid"}),
}


def supported_architectures() -> list[str]:
    return sorted(a for f in FAMILIES for a in f.architectures)


def find_family(config: Mapping) -> tuple[Family, str]:
    """The family of a config.json, by its ``architectures`` list: a hand-written family
    when one names it, else the generic family built from transformers' meta model."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ConfigError("config.json has no `architectures` list; supported: "
                          + ", ".join(supported_architectures()), file="config.json")
    model_type = config.get("model_type")
    for arch in archs:
        for fam in FAMILIES:
            if arch in fam.architectures and (
                    model_type is None or model_type in MODEL_TYPES.get(fam.name, (model_type,))):
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
