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
    "CheckpointIndex": "checkpoint", "TensorEntry": "checkpoint",
    "open_checkpoint": "checkpoint", "parse_header": "checkpoint",
    "CheckpointError": "errors", "ConfigError": "errors", "NotReadyError": "errors",
    "PlanError": "errors", "PPLoaderError": "errors", "RankFailure": "errors",
    "ReadError": "errors", "TopologyError": "errors",
    "StageWindow": "partition", "balanced_windows": "partition", "even_windows": "partition",
    "explicit_windows": "partition",
    "RankPlan": "plan", "ReadItem": "plan", "make_windows": "plan", "plan_all": "plan",
    "plan_mtp": "plan", "plan_rank": "plan",
    "Reader": "read", "ReadStats": "read", "is_borrowed": "read", "owned": "read",
    "ModelSpec": "spec", "load_spec": "spec", "spec_from_config": "spec",
    "StagePlan": "stage", "StageResult": "stage", "iter_mtp_weights": "stage",
    "iter_stage_weights": "stage", "load_stage": "stage", "plan_stage": "stage",
    "Topology": "topology",
    "FusedTarget": "families.fused",
    "LayerOrderWarning": "layerwise", "LayerTracker": "layerwise",
    "LayerwiseReport": "layerwise", "load_layerwise": "layerwise",
    "BindResult": "place", "NameMap": "place", "load_stage_into": "place",
    "bind_derived": "postprocess", "ensure_ready": "postprocess", "is_ready": "postprocess",
    "run_post_processing": "postprocess",
    "ReloadResult": "reload", "reload_from_disk": "reload",
    "EngineSplit": "partition", "check_engine_window": "partition",
    "engine_layer_counts": "partition", "engine_windows": "partition",
    "get_pp_indices": "partition", "NameRule": "names", "MissingLayer": "stage_layers",
    "is_placeholder": "stage_layers", "make_stage_layers": "stage_layers",
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
    "make_stage_layers",
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
    from .checkpoint import CheckpointIndex, TensorEntry, open_checkpoint, parse_header
    from .errors import (CheckpointError, ConfigError, NotReadyError, PlanError,
                         PPLoaderError, RankFailure, ReadError, TopologyError)
    from .families.fused import FusedTarget
    from .layerwise import LayerOrderWarning, LayerTracker, LayerwiseReport, load_layerwise
    from .partition import StageWindow, balanced_windows, even_windows, explicit_windows
    from .place import BindResult, NameMap, load_stage_into
    from .plan import RankPlan, ReadItem, make_windows, plan_all, plan_mtp, plan_rank
    from .postprocess import bind_derived, ensure_ready, is_ready, run_post_processing
    from .read import Reader, ReadStats, is_borrowed, owned
    from .reload import ReloadResult, reload_from_disk
    from .spec import ModelSpec, load_spec, spec_from_config
    from .stage import (StagePlan, StageResult, iter_mtp_weights, iter_stage_weights,
                        load_stage, plan_stage)
    from .topology import Topology
    from .partition import (EngineSplit, check_engine_window, engine_layer_counts,
                            engine_windows, get_pp_indices)
    from .names import NameRule
    from .stage_layers import MissingLayer, is_placeholder, make_stage_layers
