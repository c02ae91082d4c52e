"""pploader: pipeline-parallel distributed checkpoint loading. The public API.

Names are imported on first use (PEP 562), so ``pploader --help`` and the CLI's argument
checks never import torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the submodule defining it
_EXPORTS: dict[str, str] = {
    "CheckpointIndex": "planning.checkpoint", "TensorEntry": "planning.checkpoint",
    "open_checkpoint": "planning.checkpoint", "parse_header": "planning.checkpoint",
    "CheckpointError": "errors", "ConfigError": "errors", "NotReadyError": "errors",
    "PlanError": "errors", "PPLoaderError": "errors", "RankFailure": "errors",
    "ReadError": "errors", "TopologyError": "errors",
    "StageWindow": "planning.partition", "balanced_windows": "planning.partition", "even_windows": "planning.partition",
    "explicit_windows": "planning.partition",
    "RankPlan": "planning.plan", "ReadItem": "planning.plan", "make_windows": "planning.plan", "plan_all": "planning.plan",
    "plan_mtp": "planning.plan", "plan_rank": "planning.plan",
    "Reader": "io.read", "ReadStats": "io.read", "is_borrowed": "io.read", "owned": "io.read",
    "ModelSpec": "planning.spec", "load_spec": "planning.spec", "spec_from_config": "planning.spec",
    "StagePlan": "stage", "StageResult": "stage", "iter_mtp_weights": "stage",
    "iter_stage_weights": "stage", "load_stage": "stage", "plan_stage": "stage",
    "Topology": "planning.topology",
    "FusedTarget": "families.fused",
    "LayerOrderWarning": "bind.layerwise", "LayerTracker": "bind.layerwise",
    "LayerwiseReport": "bind.layerwise", "load_layerwise": "bind.layerwise",
    "BindResult": "bind.place", "NameMap": "bind.place", "load_stage_into": "bind.place",
    "bind_derived": "bind.postprocess", "ensure_ready": "bind.postprocess", "is_ready": "bind.postprocess",
    "run_post_processing": "bind.postprocess",
    "ReloadResult": "bind.reload", "reload_from_disk": "bind.reload",
    "EngineSplit": "planning.partition", "check_engine_window": "planning.partition",
    "engine_layer_counts": "planning.partition", "engine_windows": "planning.partition",
    "get_pp_indices": "planning.partition", "NameRule": "bind.names", "MissingLayer": "bind.stage_layers",
    "is_placeholder": "bind.stage_layers", "make_stage_layers": "bind.stage_layers",
    "ReadBackend": "io.backend", "ReadOptions": "io.backend", "open_backend": "io.registry",
}

__all__ = [
    "__version__", "CheckpointIndex", "TensorEntry", "open_checkpoint", "parse_header",
    "CheckpointError", "ConfigError", "NotReadyError", "PlanError", "PPLoaderError", "RankFailure",
    "ReadError", "TopologyError", "StageWindow", "balanced_windows", "even_windows",
    "explicit_windows", "RankPlan", "ReadItem", "make_windows", "plan_all", "plan_mtp",
    "plan_rank", "Reader", "ReadStats", "is_borrowed", "owned", "ModelSpec", "load_spec",
    "spec_from_config", "StagePlan", "StageResult", "iter_mtp_weights", "iter_stage_weights",
    "load_stage", "plan_stage", "Topology", "FusedTarget", "LayerOrderWarning", "LayerTracker",
    "LayerwiseReport", "load_layerwise", "BindResult", "NameMap", "load_stage_into",
    "bind_derived", "ensure_ready", "is_ready", "run_post_processing", "ReloadResult",
    "reload_from_disk", "EngineSplit", "check_engine_window", "engine_layer_counts",
    "engine_windows", "get_pp_indices", "NameRule", "MissingLayer", "is_placeholder",
    "make_stage_layers", "ReadBackend", "ReadOptions", "open_backend",
]  # == _EXPORTS (tests/test_cli_mistakes.py checks)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pploader' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from .planning.checkpoint import CheckpointIndex, TensorEntry, open_checkpoint, parse_header
    from .errors import (CheckpointError, ConfigError, NotReadyError, PlanError,
                         PPLoaderError, RankFailure, ReadError, TopologyError)
    from .families.fused import FusedTarget
    from .bind.layerwise import LayerOrderWarning, LayerTracker, LayerwiseReport, load_layerwise
    from .planning.partition import StageWindow, balanced_windows, even_windows, explicit_windows
    from .bind.place import BindResult, NameMap, load_stage_into
    from .planning.plan import RankPlan, ReadItem, make_windows, plan_all, plan_mtp, plan_rank
    from .bind.postprocess import bind_derived, ensure_ready, is_ready, run_post_processing
    from .io.read import Reader, ReadStats, is_borrowed, owned
    from .io.backend import ReadBackend, ReadOptions
    from .io.registry import open_backend
    from .bind.reload import ReloadResult, reload_from_disk
    from .planning.spec import ModelSpec, load_spec, spec_from_config
    from .stage import (StagePlan, StageResult, iter_mtp_weights, iter_stage_weights,
                        load_stage, plan_stage)
    from .planning.topology import Topology
    from .planning.partition import (EngineSplit, check_engine_window, engine_layer_counts,
                                     engine_windows, get_pp_indices)
    from .bind.names import NameRule
    from .bind.stage_layers import MissingLayer, is_placeholder, make_stage_layers
