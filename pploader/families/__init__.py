"""Registry of model families: architecture name -> Family data.

Every module of this package that defines ``FAMILIES`` (a tuple of Family values) is a family
module; the registry is built from them at import, so adding a family is adding one module
(docs/families.md, "Adding a family"). The other modules are the shared building blocks.
"""
from __future__ import annotations

import importlib
import logging
import pkgutil
from typing import Mapping

from ..errors import ConfigError
from .base import CheckpointFormat, Family, GlobalRule, Layout, ShardRule, TensorRole

logger = logging.getLogger(__name__)

__all__ = ["CheckpointFormat", "Family", "GlobalRule", "Layout", "ShardRule", "TensorRole",
           "FAMILIES", "MODEL_TYPES", "find_family", "supported_architectures"]


def _discover() -> tuple[Family, ...]:
    """The ``FAMILIES`` of every module of this package, by module name (stable order)."""
    found: list[Family] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        found.extend(getattr(module, "FAMILIES", ()))
    names = [f.name for f in found]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise ImportError(f"pploader.families: family names declared twice: {doubled}")
    return tuple(found)


#: Every hand-written family pploader supports (one module each or a few per module).
FAMILIES: tuple[Family, ...] = _discover()

#: The transformers ``model_type`` values each hand-written family was written for
#: (``Family.model_types``). A config naming a family's architecture with another ``model_type``
#: (transformers reuses classes: ``exaone`` saves through ``LlamaForCausalLM`` with its own
#: names) goes to the generic family.
MODEL_TYPES: Mapping[str, frozenset[str]] = {f.name: f.model_types for f in FAMILIES}


def supported_architectures() -> list[str]:
    return sorted(a for f in FAMILIES for a in f.architectures)


def find_family(config: Mapping) -> tuple[Family, str]:
    """The family of a config.json, by its ``architectures`` list: a hand-written family
    when one names it (and, where an architecture has two namings, ``Family.config_match``
    says the config is its naming's), else the generic family built from transformers'
    meta model."""
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not archs:
        raise ConfigError("config.json has no `architectures` list; supported: "
                          + ", ".join(supported_architectures()), file="config.json")
    model_type = config.get("model_type")
    for arch in archs:
        for fam in FAMILIES:
            if fam.accepts(arch, model_type) and fam.matches_config(config):
                return fam, arch
    return _generic(config, archs)


def _generic(config: Mapping, archs: list) -> tuple[Family, str]:
    """The generic family (transformers' meta model); when it cannot be derived (a
    ``model_type`` the installed transformers does not know, no transformers at all), the
    hand-written family that names the architecture, as engines dispatch on
    ``architectures``; else a ConfigError saying why not."""
    arch = archs[0]
    try:
        from . import generic  # imports transformers lazily, only for unknown architectures
        return generic.family_for(config), str(arch)
    except ImportError as exc:
        reason = f"the generic family needs transformers ({exc})"
    except ConfigError as exc:
        reason = f"the generic family cannot derive it: {exc.detail}"
    for name in archs:
        for fam in FAMILIES:
            if fam.accepts(name, None) and fam.matches_config(config):
                logger.info("%s: model_type %r is not one %s was written for, and %s; planned "
                            "with the hand-written family %s by its architecture", name,
                            config.get("model_type"), fam.name, reason, fam.name)
                return fam, name
    raise ConfigError(f"unsupported architecture {arch!r}: {reason}; hand-written families: "
                      + ", ".join(supported_architectures())
                      + " (docs/families.md explains how to add a family)", file="config.json")
