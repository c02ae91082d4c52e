"""pploader: pipeline-parallel distributed checkpoint loading. The public API.

Names are imported on first use (PEP 562), so ``pploader --help`` and the CLI's argument
checks never import torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the submodule defining it (docs/integration.md, "Public API", lists the
#: same names; tests/cli/test_public_api.py checks both). Everything else stays reachable
#: through its subpackage (pploader.planning.plan.plan_rank, ...).
_EXPORTS: dict[str, str] = {
    # who: the ranks, the process group, fail-together steps
    "Topology": "planning.topology",
    "init_distributed": "distributed.bootstrap",
    "Comm": "distributed.comm",
    "run_guarded": "distributed.comm",
    # the job: the agreed sequence every rank runs; the job's plan
    "load_pipeline_stage": "job",
    "StageLoadOptions": "job",
    "StageLoad": "job",
    "plan_job": "job",
    "JobPlan": "job",
    "measure_exchange_cost": "job",
    # one stage: plan it, stream it, load it
    "plan_stage": "planning.stage",
    "StagePlan": "planning.stage",
    "StageWindow": "planning.partition",
    "iter_stage_weights": "stage",
    "load_stage": "stage",
    "StageResult": "stage",
    "iter_mtp_weights": "stage",
    "owned": "io.read",
    "is_borrowed": "io.read",
    "start_staging": "io.staging",
    "release_staging": "io.staging",
    # engines: their windows; placeholders for other stages' layers
    "EngineSplit": "planning.partition",
    "get_pp_indices": "planning.partition",
    "check_engine_window": "planning.partition",
    "use_structure_cache": "families.meta_store",
    "make_stage_layers": "bind.stage_layers",
    "MissingLayer": "bind.stage_layers",
    # into a module: bind, post-process, reload, layerwise
    "load_stage_into": "bind.place",
    "BindResult": "bind.place",
    "LoadRecord": "bind.place",
    "NameMap": "bind.names",
    "NameRule": "bind.names",
    "bind_derived": "bind.postprocess",
    "reload_from_disk": "bind.reload",
    "ReloadResult": "bind.reload",
    "load_layerwise": "bind.layerwise",
    "LayerwiseReport": "bind.layerwise",
    "LayerTracker": "bind.layerwise",
    "LayerOrderWarning": "bind.layerwise",
    "is_ready": "bind.postprocess",
    "ensure_ready": "bind.postprocess",
    # cache pools
    "PoolOptions": "cache.sizing",
    "CacheDtypes": "cache.geometry",
    "CachePools": "cache.pools",
    "build_rank_pools": "cache.pools",
    # torch-native: dcp.load's storage reader; DeviceMesh / pipelining stage -> pploader
    "PPLoaderStorageReader": "integrations.dcp",
    "mesh_topology": "planning.mesh",
    "pipeline_window": "planning.mesh",
    # errors (pploader.errors has them all)
    "PPLoaderError": "errors",
    "ConfigError": "errors",
    "CheckpointError": "errors",
    "PlanError": "errors",
    "ReadError": "errors",
    "MemoryBudgetError": "errors",
    "TopologyError": "errors",
    "ArgumentError": "errors",
    "NotReadyError": "errors",
    "RankFailure": "errors",
}

__all__ = [
    "__version__", "Topology", "init_distributed", "Comm", "run_guarded", "load_pipeline_stage",
    "StageLoadOptions", "StageLoad", "plan_job", "JobPlan", "measure_exchange_cost",
    "plan_stage", "StagePlan", "StageWindow", "iter_stage_weights", "load_stage", "StageResult", "iter_mtp_weights",
    "owned", "is_borrowed", "start_staging", "release_staging", "EngineSplit", "get_pp_indices",
    "check_engine_window", "use_structure_cache",
    "make_stage_layers", "MissingLayer", "load_stage_into", "BindResult", "LoadRecord",
    "NameMap", "NameRule", "bind_derived", "reload_from_disk", "ReloadResult", "load_layerwise",
    "LayerwiseReport", "LayerTracker", "LayerOrderWarning", "is_ready", "ensure_ready",
    "PoolOptions", "CacheDtypes", "CachePools", "build_rank_pools", "PPLoaderStorageReader",
    "mesh_topology", "pipeline_window", "PPLoaderError",
    "ConfigError", "CheckpointError", "PlanError", "ReadError", "MemoryBudgetError",
    "TopologyError", "ArgumentError", "NotReadyError", "RankFailure",
]  # == ["__version__", *_EXPORTS] (tests/cli/test_public_api.py checks)


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
    from .planning.topology import Topology
    from .distributed.bootstrap import init_distributed
    from .distributed.comm import Comm, run_guarded
    from .job import (JobPlan, StageLoad, StageLoadOptions, load_pipeline_stage,
                      measure_exchange_cost, plan_job)
    from .planning.stage import StagePlan, plan_stage
    from .stage import (StageResult, iter_mtp_weights, iter_stage_weights,
                        load_stage)
    from .planning.partition import EngineSplit, StageWindow, check_engine_window, get_pp_indices
    from .families.meta_store import use_structure_cache
    from .io.read import is_borrowed, owned
    from .bind.stage_layers import MissingLayer, make_stage_layers
    from .bind.place import BindResult, LoadRecord, load_stage_into
    from .bind.names import NameMap, NameRule
    from .bind.postprocess import bind_derived, ensure_ready, is_ready
    from .bind.reload import ReloadResult, reload_from_disk
    from .bind.layerwise import LayerOrderWarning, LayerTracker, LayerwiseReport, load_layerwise
    from .cache.sizing import PoolOptions
    from .cache.geometry import CacheDtypes
    from .cache.pools import CachePools, build_rank_pools
    from .integrations.dcp import PPLoaderStorageReader
    from .planning.mesh import mesh_topology, pipeline_window
    from .errors import (CheckpointError, ConfigError, MemoryBudgetError, NotReadyError,
                         PlanError, PPLoaderError, RankFailure, ReadError, TopologyError,
                         ArgumentError)
