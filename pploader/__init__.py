"""pploader: pipeline-parallel distributed checkpoint loading. The public API."""
from __future__ import annotations

__version__ = "0.1.0"

from .checkpoint import CheckpointIndex, TensorEntry, open_checkpoint, parse_header
from .errors import (CheckpointError, ConfigError, NotReadyError, PlanError, PPLoaderError,
                     RankFailure, ReadError, TopologyError)
from .partition import StageWindow, balanced_windows, even_windows, explicit_windows
from .plan import RankPlan, ReadItem, make_windows, plan_all, plan_mtp, plan_rank
from .read import Reader, ReadStats, is_borrowed, owned
from .spec import ModelSpec, load_spec, spec_from_config
from .stage import (StagePlan, StageResult, iter_mtp_weights, iter_stage_weights, load_stage,
                    plan_stage)
from .topology import Topology
from .families.fused import FusedTarget
from .layerwise import LayerOrderWarning, LayerTracker, LayerwiseReport, load_layerwise
from .place import BindResult, NameMap, load_stage_into
from .postprocess import bind_derived, ensure_ready, is_ready, run_post_processing
from .reload import ReloadResult, reload_from_disk

__all__ = [
    "__version__", "CheckpointIndex", "TensorEntry", "open_checkpoint", "parse_header",
    "CheckpointError", "ConfigError", "NotReadyError", "PlanError", "PPLoaderError",
    "RankFailure", "ReadError", "TopologyError", "StageWindow", "balanced_windows",
    "even_windows", "explicit_windows", "RankPlan", "ReadItem", "make_windows", "plan_all",
    "plan_mtp", "plan_rank", "Reader", "ReadStats", "is_borrowed", "owned", "ModelSpec",
    "load_spec", "spec_from_config", "StagePlan", "StageResult", "iter_mtp_weights",
    "iter_stage_weights", "load_stage", "plan_stage", "Topology",
]
__all__ += [
    "FusedTarget", "LayerOrderWarning", "LayerTracker", "LayerwiseReport", "load_layerwise",
    "BindResult", "NameMap", "load_stage_into", "bind_derived", "ensure_ready", "is_ready",
    "run_post_processing", "ReloadResult", "reload_from_disk",
]

from .partition import (EngineSplit, check_engine_window, engine_layer_counts, engine_windows,
                        get_pp_indices)
from .names import NameRule
from .stage_layers import MissingLayer, is_placeholder, make_stage_layers

__all__ += [
    "EngineSplit", "check_engine_window", "engine_layer_counts", "engine_windows",
    "get_pp_indices", "NameRule", "MissingLayer", "is_placeholder", "make_stage_layers",
]
