"""vLLM load format ``pploader``: each worker reads only its pipeline stage's bytes.

Registered in every vLLM process through the ``vllm.general_plugins`` entry point
(:func:`register`), so ``LLM(model=DIR, load_format="pploader", pipeline_parallel_size=2)`` and
``vllm serve DIR --load-format pploader -pp 2`` work. The worker's topology and layer window
come from the engine (its parallel state, ``get_pp_indices`` and ``VLLM_PP_LAYER_PARTITION`` as
vLLM parses it); pploader is given that partition explicitly and its plan is checked against
the model's ``start_layer/end_layer``. The tensors go through the model's own ``load_weights``
(vLLM's weight loaders, q/k/v and gate/up stacking, quantization hooks).

TP modes (``model_loader_extra_config={"tp_mode": ...}``), see docs/integration.md:

* ``placed`` (default): read only this TP rank's byte ranges, placed at their offsets inside a
  full-shaped buffer whose other elements are NaN; vLLM's loaders narrow to the rank's part
  as they always do. Bytes read = the rank's ideal bytes. A NaN in any floating parameter after
  ``load_weights`` means the engine narrowed elsewhere than pploader read: a clear error.
* ``full``: hand the stage's whole tensors (TP x the ideal bytes); loaders narrow.
* ``sliced``: hand pploader's slices and set ``param.is_sharded_weight`` on the stage's
  parameters; only vLLM's v1 linear loaders honour that flag (not ``ModelWeightParameter``,
  which unquantized linears use, nor the vocab embedding or fused MoE), so TP>1 fails there.

``io_backend`` (default ``mapped``): views of the page cache for resident tensors (the
engine's copy is the only one), positional reads for cold ones (integrations/placed.py). The
stage is the engine's view of it (integrations/engine_plan.py): checkpoint names (the tied head
of a last stage as ``model.embed_tokens.weight`` too) and, under ``enable_expert_parallel``, the
local experts vLLM's MoE layers hold, read whole.

Reloads (integrations/vllm_reload.py): vLLM's own ``collective_rpc("reload_weights",
kwargs={"weights_path": D})`` through :meth:`PPLoaderModelLoader.get_all_weights`, and, in an
engine built with ``worker_extension_cls=WORKER_EXTENSION``, ``reload(llm, D)``. Both read and
agree on every worker before writing; a refused checkpoint leaves the engine serving.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

import torch
from torch import nn

# vllm is not installed where mypy runs: its names are Any there
from vllm.config import ModelConfig  # type: ignore[import-not-found, unused-ignore]
from vllm.model_executor.model_loader import (  # type: ignore[import-not-found, unused-ignore]
    register_model_loader)
from vllm.model_executor.model_loader import (  # type: ignore[import-not-found, unused-ignore]
    base_loader as _base_loader)

BaseModelLoader = _base_loader.BaseModelLoader

from ..errors import PlanError
from ..planning.topology import Topology

if TYPE_CHECKING:  # pragma: no cover
    from ..planning.stage import StagePlan
# the engine-neutral core (integrations/engine_core.py); re-exported for callers of this module
from .engine_core import (TP_MODES, EarlyPlan, LoadState,  # noqa: F401
                          check_no_unread, early_staging, load_engine_stage, load_summary,
                          loader_options, plan_engine_stage, read_topology,
                          share_engine_logging)
from .engine_core import check_all_loaded as _check_all_loaded
from .engine_core import start_early_plan as _start_early_plan
from .vllm_reload import LAST as _LAST
from .vllm_reload import WorkerExtension, engine_reload_weights, reload, reload_stage

logger = logging.getLogger(__name__)

__all__ = ["LOAD_FORMAT", "TP_MODES", "WORKER_EXTENSION", "PPLoaderModelLoader", "register",
           "EarlyPlan", "start_early_plan",
           "engine_topology", "engine_partition", "engine_local_experts", "load_report",
           "reload_stage", "reload", "WorkerExtension"]

LOAD_FORMAT = "pploader"
WORKER_EXTENSION = "pploader.integrations.vllm.WorkerExtension"


# ---- the engine's view ----------------------------------------------------------------
def engine_topology() -> Topology:
    """This worker's (pp, tp) place from vLLM's parallel state (TP innermost, as pploader)."""
    from vllm.distributed.parallel_state import (  # type: ignore[import-not-found, unused-ignore]
        get_pp_group, get_tp_group)
    pp, tp = get_pp_group(), get_tp_group()
    return Topology(pp.world_size, tp.world_size, 1,
                    pp.rank_in_group * tp.world_size + tp.rank_in_group)


def engine_partition(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """Layers per stage exactly as vLLM splits them (``get_pp_indices``, which reads
    ``VLLM_PP_LAYER_PARTITION`` itself)."""
    from vllm.distributed import utils  # type: ignore[import-not-found, unused-ignore]
    get_pp_indices = utils.get_pp_indices
    bounds = [get_pp_indices(num_layers, r, pp_size) for r in range(pp_size)]
    return tuple(end - start for start, end in bounds)


def engine_local_experts(model: nn.Module, num_experts: int) -> Optional[frozenset[int]]:
    """The experts vLLM placed on this rank under expert parallelism (its MoE layers'
    ``expert_map_manager``: the ``linear`` or ``round_robin`` placement as the layers really
    applied it, fallbacks included), all of them with EPLB (redundant slots may take any
    expert), or None without EP (experts split over TP like any tensor)."""
    found: Optional[frozenset[int]] = None
    eplb = False
    for module in model.modules():
        manager = getattr(module, "expert_map_manager", None)
        if manager is None or not getattr(manager, "use_ep", False):
            continue
        eplb = eplb or bool(getattr(module, "eplb_state", None))
        ids = frozenset(int(e) for e in manager.get_local_expert_ids() if int(e) < num_experts)
        if found is not None and ids != found:
            raise PlanError(f"vLLM's MoE layers place different experts on this rank "
                            f"({sorted(found)} vs {sorted(ids)}): cannot plan one stage")
        found = ids
    if found is not None and eplb:
        return frozenset(range(num_experts))
    return found


def _place(num_layers: int) -> tuple[Topology, tuple[int, ...]]:
    topology = engine_topology()
    return topology, engine_partition(num_layers, topology.pp_size)


def start_early_plan(model_dir: str, tp_mode: str, range_cost_bytes: int
                     ) -> Optional[EarlyPlan]:
    """An :class:`EarlyPlan` of this worker's stage from vLLM's parallel state, or None where
    it cannot be made before the model exists (integrations/engine_core.py)."""
    return _start_early_plan(model_dir, tp_mode, range_cost_bytes, _place)


def _mark_sharded(model: nn.Module) -> None:
    for param in model.parameters():
        param.is_sharded_weight = True  # type: ignore[attr-defined]


# ---- the loader -------------------------------------------------------------------------
#: attention parameters vLLM builds for a quantized model (``BaseKVCacheMethod``: KV-cache and
#: attention scales, zero points), set to its defaults after loading when the checkpoint
#: stores none (compressed-tensors checkpoints without a ``kv_cache_scheme``)
ENGINE_DEFAULTED = frozenset({"k_scale", "v_scale", "q_scale", "prob_scale", "k_zero_point",
                              "v_zero_point", "q_zero_point"})


def check_all_loaded(model: nn.Module, loaded: Optional[Iterable[str]], staged: "StagePlan"
                     ) -> tuple[str, ...]:
    """engine_core's strict check with vLLM's defaulted attention scales (ENGINE_DEFAULTED)."""
    return _check_all_loaded(model, loaded, staged, defaulted=ENGINE_DEFAULTED)


class PPLoaderModelLoader(BaseModelLoader):  # type: ignore[misc, valid-type]
    """vLLM model loader that reads only this worker's stage (and TP part) of the checkpoint."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.tp_mode, self.range_cost_bytes, self.io_backend = loader_options(
            getattr(load_config, "model_loader_extra_config", None))
        self.staging: Any = None  # GPU workers: page-locked while load_model builds the model
        self.early_plan: Optional[EarlyPlan] = None  # set by load_model

    def download_model(self, model_config: ModelConfig) -> None:
        """pploader reads a local directory only (no hub downloads)."""
        if not os.path.isdir(model_config.model):
            raise ValueError(f"load_format 'pploader' needs a local checkpoint directory, got "
                             f"{model_config.model!r}")

    def load_model(self, vllm_config: Any, model_config: ModelConfig, prefix: str = ""
                   ) -> nn.Module:
        """vLLM's load_model, with this worker's stage planned in the background while the
        engine builds the model (:class:`EarlyPlan`), and on a GPU worker the pinned staging
        page-locked meanwhile. Started here, not when the loader is made: vLLM's
        ``reload_weights`` makes a loader only to call :meth:`get_all_weights`."""
        self.staging = early_staging()
        self.early_plan = start_early_plan(model_config.model, self.tp_mode,
                                           self.range_cost_bytes)
        try:
            return super().load_model(vllm_config, model_config, prefix=prefix)
        finally:
            self.early_plan = None

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        model_dir = model_config.model
        self.download_model(model_config)
        topology = engine_topology()
        from ..planning.spec import load_spec
        spec = load_spec(model_dir)
        partition = engine_partition(spec.num_layers, topology.pp_size)
        experts = engine_local_experts(model, spec.num_experts) if spec.num_experts else None
        early = getattr(self, "early_plan", None)
        planned = early.result() if early is not None and early.key == (
            model_dir, topology, tuple(partition), self.tp_mode, self.range_cost_bytes) \
            and experts is None else None

        def load(weights: Any) -> Any:
            if self.tp_mode != "sliced" or topology.tp_size == 1:
                return model.load_weights(weights)  # type: ignore[operator]
            _mark_sharded(model)
            try:
                return model.load_weights(weights)  # type: ignore[operator]
            except (AssertionError, RuntimeError, ValueError) as exc:
                raise PlanError(f"vLLM's weight loader refused a pre-sliced tensor "
                                f"({type(exc).__name__}: {exc}); its embedding and "
                                "ModelWeightParameter loaders ignore is_sharded_weight: use "
                                "tp_mode 'placed' (the default)", rank=topology.rank) from exc
        load_engine_stage(model, model_dir, topology, partition, load, tp_mode=self.tp_mode,
                          io_backend=self.io_backend, range_cost_bytes=self.range_cost_bytes,
                          local_experts=experts, planned=planned, staging=self.staging,
                          defaulted=ENGINE_DEFAULTED)

    def get_all_weights(self, model_config: ModelConfig, model: nn.Module
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """vLLM's ``reload_weights(weights_path=D)``: this worker's stage of ``D``, read and
        agreed on every worker first (integrations/vllm_reload.py); a refused checkpoint
        leaves the engine serving the old weights."""
        from vllm.distributed.parallel_state import (  # type: ignore[import-not-found, unused-ignore]
            get_world_group)
        world = get_world_group()
        return engine_reload_weights(model, model_config,
                                     last_worker=world.rank_in_group == world.world_size - 1)


def register() -> None:
    """Entry point (``vllm.general_plugins``): register load format ``pploader`` in this
    process, and let pploader's log records out through vLLM's handlers (vLLM configures only
    its own logger, so pploader's per-worker byte counts would otherwise be dropped)."""
    from vllm.model_executor.model_loader import (  # type: ignore[import-not-found, unused-ignore]
        _LOAD_FORMAT_TO_MODEL_LOADER)
    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not PPLoaderModelLoader:
        register_model_loader(LOAD_FORMAT)(PPLoaderModelLoader)
    share_engine_logging("vllm")


# ---- worker-side functions (collective_rpc); reloads: integrations/vllm_reload.py --------
def load_report(worker: Any) -> dict[str, Any]:
    """The last load's and reload's byte accounting on this worker (``collective_rpc``)."""
    return dict(_LAST)


