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
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional, Sequence

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
from ..io.backend import ReadBackend
from ..bind.module_state import module_state
from ..stage import StagePlan, plan_stage
from ..planning.topology import Topology
from .engine_plan import engine_stage
from .placed import DEFAULT_BACKEND, NAN_DTYPES, rchar_bytes, stage_weights
from .vllm_reload import LAST as _LAST
from .vllm_reload import WorkerExtension, engine_reload_weights, reload, reload_stage

logger = logging.getLogger(__name__)

__all__ = ["LOAD_FORMAT", "TP_MODES", "WORKER_EXTENSION", "PPLoaderModelLoader", "register",
           "EarlyPlan", "start_early_plan",
           "engine_topology", "engine_partition", "engine_local_experts", "load_report",
           "reload_stage", "reload", "WorkerExtension"]

LOAD_FORMAT = "pploader"
TP_MODES = ("placed", "full", "sliced")
WORKER_EXTENSION = "pploader.integrations.vllm.WorkerExtension"


@dataclass
class LoadState:
    """What one worker loaded (kept on the model for reloads and reports)."""

    model_dir: str
    topology: Topology          # the engine's (pp, tp) grid and this worker's place in it
    partition: tuple[int, ...]  # layers per stage, as the engine split them
    tp_mode: str
    staged: StagePlan
    range_cost_bytes: int = 0
    io_backend: str = DEFAULT_BACKEND
    local_experts: Optional[frozenset[int]] = None  # the engine's EP placement on this rank
    report: dict[str, Any] = field(default_factory=dict)


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


def _model_window(model: nn.Module) -> Optional[tuple[int, int]]:
    inner = getattr(model, "model", None)
    start, end = getattr(inner, "start_layer", None), getattr(inner, "end_layer", None)
    return (int(start), int(end)) if isinstance(start, int) and isinstance(end, int) else None


def _read_topology(topology: Topology, tp_mode: str) -> Topology:
    """The topology pploader plans with: ``full`` reads whole tensors (tp 1)."""
    if tp_mode == "full":
        return Topology(topology.pp_size, 1, 1, topology.pp_rank)
    return topology


def plan_engine_stage(model_dir: str, topology: Topology, partition: Sequence[int],
                      tp_mode: str, model: Optional[nn.Module] = None, *,
                      range_cost_bytes: int = 0,
                      local_experts: Optional[frozenset[int]] = None,
                      planned: Optional[StagePlan] = None) -> StagePlan:
    """Plan this worker's stage as the engine holds it (integrations/engine_plan.py: its
    expert placement, its names) with the engine's partition; the window must be the model's.
    ``planned``: that plan made already (:class:`EarlyPlan`), only checked here."""
    staged = planned if planned is not None else engine_stage(
        model_dir, _read_topology(topology, tp_mode), partition,
        local_experts=local_experts, range_cost_bytes=range_cost_bytes)
    window = staged.plan.window
    start = sum(partition[:topology.pp_rank])
    expected = (start, start + partition[topology.pp_rank])
    engine = _model_window(model) if model is not None else None
    if engine is not None and engine != expected:
        raise PlanError(f"vLLM's model holds layers {engine} but get_pp_indices gives {expected}: "
                        "cannot tell which window to load", rank=topology.rank)
    if (window.start_layer, window.end_layer) != expected or \
            window.has_embed != (topology.pp_rank == 0) or \
            window.has_head != (topology.pp_rank == topology.pp_size - 1):
        raise PlanError(f"pploader planned layers [{window.start_layer}, {window.end_layer}) "
                        f"(embed {window.has_embed}, head {window.has_head}) but vLLM's stage "
                        f"{topology.pp_rank}/{topology.pp_size} holds [{expected[0]}, "
                        f"{expected[1]})", rank=topology.rank)
    return staged


class EarlyPlan:
    """The stage planned in a background thread while vLLM builds the model (planning needs
    only the directory and the engine's parallel state; it reads config and headers, no
    tensor data), so ``load_weights`` starts reading at once. Not for MoE checkpoints (the
    expert placement is read off the built model). ``result()`` joins and re-raises the
    planning error, if any, in the caller."""

    def __init__(self, model_dir: str, topology: Topology, partition: Sequence[int],
                 tp_mode: str, range_cost_bytes: int) -> None:
        self.key = (model_dir, topology, tuple(partition), tp_mode, range_cost_bytes)
        self._staged: Optional[StagePlan] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="pploader-plan", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        model_dir, topology, partition, tp_mode, cost = self.key
        try:
            self._staged = engine_stage(model_dir, _read_topology(topology, tp_mode),
                                        partition, range_cost_bytes=cost)
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self._error = exc

    def result(self) -> StagePlan:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._staged is not None
        return self._staged


def start_early_plan(model_dir: str, tp_mode: str, range_cost_bytes: int
                     ) -> Optional[EarlyPlan]:
    """An :class:`EarlyPlan` of this worker's stage, or None where it cannot be made before
    the model exists (not a local directory, experts, an unreadable config: the load plans
    then, and reports any error itself)."""
    try:
        if not os.path.isdir(model_dir):
            return None
        from ..planning.spec import load_spec
        spec = load_spec(model_dir)
        if spec.num_experts:
            return None
        topology = engine_topology()
        partition = engine_partition(spec.num_layers, topology.pp_size)
    except Exception as exc:  # noqa: BLE001 - load_weights plans and raises as usual
        logger.debug("no early plan: %s", exc)
        return None
    return EarlyPlan(model_dir, topology, partition, tp_mode, range_cost_bytes)


# ---- checks after load_weights ----------------------------------------------------------
def _other_stage(name: str, staged: StagePlan) -> bool:
    """A parameter named like a checkpoint tensor this stage does not own (vLLM's Mixtral,
    for one, builds the embedding, final norm and head on every PP rank)."""
    spec, window = staged.spec, staged.plan.window
    role = spec.family.classify(name, spec.num_layers, spec.num_mtp_layers)
    if role is None:
        return False
    if role.placement == "first":
        return not window.has_embed
    if role.placement == "last":
        return not window.has_head
    return role.placement == "layer" and not window.owns(role.layer)  # type: ignore[arg-type]


#: attention parameters vLLM builds for a quantized model (``BaseKVCacheMethod``: KV-cache and
#: attention scales, zero points), set to its defaults after loading when the checkpoint
#: stores none (compressed-tensors checkpoints without a ``kv_cache_scheme``)
ENGINE_DEFAULTED = frozenset({"k_scale", "v_scale", "q_scale", "prob_scale", "k_zero_point",
                              "v_zero_point", "q_zero_point"})


def check_all_loaded(model: nn.Module, loaded: Optional[Iterable[str]], staged: StagePlan
                     ) -> tuple[str, ...]:
    """Strict: every parameter of the stage was written by ``load_weights``. Parameters the
    engine builds for tensors another stage owns are zeroed (never read on this rank) and
    returned; attention scales the engine defaults (ENGINE_DEFAULTED) pass when the
    checkpoint stores no tensor of that kind; anything else missing is an error listing it."""
    rank = staged.plan.topology.rank
    if loaded is None:
        raise PlanError(f"{type(model).__name__}.load_weights returned no set of loaded "
                        "parameters: cannot check that the stage is complete", rank=rank)
    params = dict(model.named_parameters())
    unloaded = sorted(set(params) - set(loaded))
    elsewhere = tuple(n for n in unloaded if _other_stage(n, staged))
    stored = {t.rpartition(".")[2] for t in staged.plan.tensors}
    missing = [n for n in unloaded if n not in elsewhere and not (
        n.rpartition(".")[2] in ENGINE_DEFAULTED and n.rpartition(".")[2] not in stored)]
    if missing:
        raise PlanError(f"{len(missing)} parameter(s) of this stage were not loaded from the "
                        f"checkpoint: {', '.join(missing[:12])}" + (" ..." if len(missing) > 12
                                                                    else ""), rank=rank)
    with torch.no_grad():
        for name in elsewhere:
            params[name].data.zero_()
    if elsewhere:
        logger.info("pploader rank %d: zeroed %s (the engine builds them here, another stage "
                    "owns them)", rank, ", ".join(elsewhere))
    return elsewhere


def check_no_unread(model: nn.Module, staged: StagePlan, tp_mode: str, reader: ReadBackend
                    ) -> None:
    """``placed`` at TP>1 with some tensors placed in NaN (not every item handed as a view):
    a NaN in a parameter means the engine narrowed bytes pploader did not read (its TP split
    differs from pploader's), or the checkpoint itself holds NaN."""
    topology = staged.plan.topology
    if tp_mode != "placed" or topology.tp_size == 1 or \
            getattr(reader, "mapped_items", 0) >= len(staged.plan.items):
        return
    rank = topology.rank
    bad = [name for name, p in model.named_parameters()
           if p.dtype in NAN_DTYPES and p.numel() and bool(torch.isnan(p.data).any())]
    if bad:
        raise PlanError(f"parameter(s) {', '.join(bad[:8])} hold NaN after loading with "
                        "tp_mode='placed': vLLM's loader took elements outside this rank's "
                        "pploader slice (or the checkpoint holds NaN); use "
                        "model_loader_extra_config={'tp_mode': 'full'}", rank=rank)


def _mark_sharded(model: nn.Module) -> None:
    for param in model.parameters():
        param.is_sharded_weight = True  # type: ignore[attr-defined]


# ---- the loader -------------------------------------------------------------------------
class PPLoaderModelLoader(BaseModelLoader):  # type: ignore[misc, valid-type]
    """vLLM model loader that reads only this worker's stage (and TP part) of the checkpoint."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        extra = dict(getattr(load_config, "model_loader_extra_config", None) or {})
        self.tp_mode = str(extra.pop("tp_mode", "placed"))
        # exact byte ranges by default: strided TP slices row by row, never a covering box
        self.range_cost_bytes = int(extra.pop("range_cost_bytes", 0))
        # the read backend (io/registry.py): views of resident pages, positional reads else
        self.io_backend = str(extra.pop("io_backend", DEFAULT_BACKEND))
        from ..io.registry import select_backend
        select_backend("cpu", self.io_backend)   # unknown or not a host backend: ValueError
        if self.tp_mode not in TP_MODES:
            raise ValueError(f"pploader tp_mode must be one of {TP_MODES}, got {self.tp_mode!r}")
        if extra:
            raise ValueError(f"unknown pploader model_loader_extra_config keys: {sorted(extra)}")
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
        self.staging = _early_staging()
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
        rchar0, start = rchar_bytes(), time.perf_counter()
        from ..planning.spec import load_spec
        spec = load_spec(model_dir)
        partition = engine_partition(spec.num_layers, topology.pp_size)
        experts = engine_local_experts(model, spec.num_experts) if spec.num_experts else None
        early = getattr(self, "early_plan", None)
        planned = early.result() if early is not None and early.key == (
            model_dir, topology, tuple(partition), self.tp_mode, self.range_cost_bytes) \
            and experts is None else None
        staged = plan_engine_stage(model_dir, topology, partition, self.tp_mode, model,
                                   range_cost_bytes=self.range_cost_bytes,
                                   local_experts=experts, planned=planned)
        device = _model_device(model)
        options = None
        if device.type != "cpu":  # the device stream: pinned ring -> the GPU, D2D copy_
            from ..io.backend import ReadOptions
            if self.staging is not None:
                self.staging.stop_preparing()  # never page-lock beside the load's own reads
            options = ReadOptions(ring=self.staging)
        reader, weights = stage_weights(staged, self.tp_mode, self.io_backend, options, device)
        if self.tp_mode == "sliced" and topology.tp_size > 1:
            _mark_sharded(model)
            try:
                loaded = model.load_weights(weights)  # type: ignore[operator]
            except (AssertionError, RuntimeError, ValueError) as exc:
                raise PlanError(f"vLLM's weight loader refused a pre-sliced tensor "
                                f"({type(exc).__name__}: {exc}); its embedding and "
                                "ModelWeightParameter loaders ignore is_sharded_weight: use "
                                "tp_mode 'placed' (the default)", rank=topology.rank) from exc
        else:
            loaded = model.load_weights(weights)  # type: ignore[operator]
        rchar1, seconds = rchar_bytes(), time.perf_counter() - start
        check_all_loaded(model, loaded, staged)
        check_no_unread(model, staged, self.tp_mode, reader)
        state = LoadState(model_dir, topology, partition, self.tp_mode, staged,
                          range_cost_bytes=self.range_cost_bytes, io_backend=self.io_backend,
                          local_experts=experts)
        state.report = load_summary(state, reader, seconds, rchar0, rchar1)
        module_state(model).engine_load = state  # travels with the model (bind/module_state.py)
        _LAST["load"] = state.report
        logger.info("pploader %s: layers [%d, %d) read %d bytes (%d of them mapped from the "
                    "page cache; ideal %d, headers %d) in %.2f s, tp_mode=%s%s",
                    topology.describe(), staged.plan.window.start_layer,
                    staged.plan.window.end_layer, reader.stats.read_bytes,
                    getattr(reader, "mapped_bytes", 0), staged.plan.ideal_bytes,
                    staged.plan.header_bytes, seconds, self.tp_mode,
                    "" if experts is None else f", {len(experts)} local expert(s)")

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


def _early_staging() -> Any:
    """On a GPU worker, the device backend's staging (the pinned ring) started now, when vLLM
    starts ``load_model``, so its page-locking overlaps the engine building the model (vLLM
    has set the worker's device by then); None on CPU workers or when it cannot start (the load
    then makes its own)."""
    try:
        if not torch.cuda.is_available():
            return None
        from ..io.registry import prepare_staging
        return prepare_staging(torch.device("cuda", torch.cuda.current_device()))
    except Exception as exc:  # noqa: BLE001 - the load makes its own staging
        logger.debug("no early staging: %s", exc)
        return None


def _model_device(model: nn.Module) -> torch.device:
    """Where the engine's parameters live (the load format's target device)."""
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def load_summary(state: LoadState, reader: ReadBackend, seconds: float, rchar0: Optional[int],
                 rchar1: Optional[int]) -> dict[str, Any]:
    """What one worker read; ``ideal_bytes`` is its TP part of the stage (tp_mode aside);
    ``mapped_bytes``: the part of ``read_bytes`` taken as views of the page cache (no read
    syscall, so not in ``rchar_bytes``); ``readahead_bytes``: of those, the ones that were
    cold and faulted in ahead of the engine (kernel readahead)."""
    ideal = plan_stage(state.model_dir, state.topology, partition=list(state.partition)) \
        .plan.ideal_bytes if state.tp_mode == "full" and state.topology.tp_size > 1 \
        else state.staged.plan.ideal_bytes
    t, w = state.topology, state.staged.plan.window
    return {"rank": t.rank, "pp_rank": t.pp_rank, "tp_rank": t.tp_rank, "tp_mode": state.tp_mode,
            "start_layer": w.start_layer, "end_layer": w.end_layer,
            "read_bytes": reader.stats.read_bytes, "ideal_bytes": ideal,
            "mapped_bytes": int(getattr(reader, "mapped_bytes", 0)),
            "readahead_bytes": int(getattr(reader, "readahead_bytes", 0)),
            "io_backend": state.io_backend,
            "local_experts": None if state.local_experts is None else sorted(state.local_experts),
            "header_bytes": state.staged.plan.header_bytes, "seconds": seconds,
            "rchar_bytes": None if rchar0 is None or rchar1 is None else rchar1 - rchar0,
            "model_dir": state.model_dir}


def register() -> None:
    """Entry point (``vllm.general_plugins``): register load format ``pploader`` in this
    process, and let pploader's log records out through vLLM's handlers (vLLM configures only
    its own logger, so pploader's per-worker byte counts would otherwise be dropped)."""
    from vllm.model_executor.model_loader import (  # type: ignore[import-not-found, unused-ignore]
        _LOAD_FORMAT_TO_MODEL_LOADER)
    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not PPLoaderModelLoader:
        register_model_loader(LOAD_FORMAT)(PPLoaderModelLoader)
    ours, theirs = logging.getLogger("pploader"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.getEffectiveLevel())
        ours.propagate = False


# ---- worker-side functions (collective_rpc); reloads: integrations/vllm_reload.py --------
def load_report(worker: Any) -> dict[str, Any]:
    """The last load's and reload's byte accounting on this worker (``collective_rpc``)."""
    return dict(_LAST)


