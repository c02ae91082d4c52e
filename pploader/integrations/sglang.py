"""SGLang load format ``pploader``: each scheduler process reads only its pipeline stage.

Two ways in, one loader class (:class:`PPLoaderModelLoader`, a ``DefaultModelLoader``):

* ``sglang.Engine(model_path=D, load_format=PPLoaderModelLoader, pp_size=2)``: SGLang's
  ``get_model_loader`` instantiates a class given as the load format.
* ``--load-format pploader`` (``python -m sglang.launch_server``, ``sglang.Engine(...,
  load_format="pploader")``, ``update_weights_from_disk(D, load_format="pploader")``): the
  ``sglang.srt.plugins`` entry point :func:`register`, which SGLang runs in the launcher, the
  engine and every scheduler process before it parses arguments, adds ``pploader`` to the
  ``--load-format`` choices and hooks ``LoadConfig._verify_load_format`` so that the name
  resolves to the class (SGLang's files are not patched).

Each rank plans its window from the model SGLang built (``model.start_layer / end_layer``,
its ``pp_group`` / ``tp_group``, ``get_pp_indices`` which reads ``SGLANG_PP_LAYER_PARTITION``
itself), reads only its stage (integrations/engine_core.py, shared with vLLM) and hands the
tensors to the model's own ``load_weights`` (SGLang's weight loaders narrow TP, stack q/k/v and
gate/up, place experts), then runs SGLang's ``process_weights_after_loading``. Every
parameter must have been written during ``load_weights`` (integrations/written.py: through
its weight loader, or in place into its storage). ``model_loader_extra_config``:
``tp_mode``, ``io_backend``, ``range_cost_bytes`` (as vLLM's), ``report_dir`` (each rank
writes its load / reload accounting there as ``rank<N>.json``).

Reload: SGLang's ``update_weights_from_disk`` asks the loader for ``_get_weights_iterator``
(:meth:`PPLoaderModelLoader._get_weights_iterator`: the new checkpoint checked and this stage
read whole before anything is written) and then writes in place with
:meth:`PPLoaderModelLoader.load_weights_and_postprocess`. SGLang runs that request one stage
after another (a stage relays a request to the next only after handling it), so the ranks
cannot wait for each other; instead every rank checks *every* stage's plan of the new
checkpoint (headers, sizes, shapes: the same files give every rank the same verdict) before
it writes. A refused checkpoint is refused on every rank, nothing is written, the engine keeps
serving the old weights and ``model_path`` points back at them.

An MTP / NextN draft model (SGLang's draft worker, its own ``load_model`` call: the model
config's ``is_draft_model``, ``load_config.draft_model_idx`` for multi-layer EAGLE) reads only
its MTP layer (integrations/engine_plan.py ``engine_draft``: the family's MTP knowledge,
families/generic_mtp.py), lazily, under the checkpoint's names, into the draft model's own
``load_weights``; the MTP layer's own embedding and head copies are not read, since SGLang's
draft takes the target's (``set_embed_and_head``; under PP its embedding from the checkpoint,
pp_draft_embedding.py). A draft is reloaded as SGLang's ``DefaultModelLoader`` does.
"""
from __future__ import annotations

import json
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

# sglang is not installed where mypy runs: its names are Any there
from sglang.srt.model_loader import loader as _sgl_loader  # type: ignore[import-not-found, unused-ignore]
from sglang.srt.model_loader.weight_utils import (  # type: ignore[import-not-found, unused-ignore]
    default_weight_loader)

from ..errors import PlanError
from ..families.generic_mtp import TARGET_SHARED
from ..planning.topology import Topology
from ..stage import StagePlan
from .engine_core import (LAST, EarlyPlan, LoadState, check_all_loaded, early_staging,
                          load_engine_draft, load_engine_stage, loader_options,
                          plan_engine_stage, share_engine_logging, start_early_plan)
from .engine_reload import record_served, same_layout, served_state
from .placed import rchar_bytes, read_stage
from .written import tracking_writes

DefaultModelLoader = _sgl_loader.DefaultModelLoader

logger = logging.getLogger(__name__)

__all__ = ["LOAD_FORMAT", "PPLoaderModelLoader", "register", "engine_topology",
           "engine_partition", "load_report"]

LOAD_FORMAT = "pploader"
ENGINE = "SGLang"
SPLIT = "get_pp_indices (SGLANG_PP_LAYER_PARTITION)"
#: where this process writes its reports (``report_dir``), kept for reloads
_REPORT_DIR: dict[str, str] = {}
#: SGLang's NextN draft parameters that its speculative worker replaces with the target's
#: (``set_embed_and_head``) after the load: never written by the draft's ``load_weights``
DRAFT_SHARED_PARAMS = frozenset({"model.embed_tokens.weight", "lm_head.weight"})
#: the model this process serves, loaded by pploader: SGLang's reload hands the loader only
#: ``Source.init_new(config, model)``, which does not keep the model
_SERVED: dict[str, "weakref.ref[nn.Module]"] = {}


# ---- the engine's view ----------------------------------------------------------------
def engine_topology() -> Topology:
    """This rank's (pp, tp) place from SGLang's parallel state (its world rank is
    ``tp_size * pp_rank + tp_rank``: TP innermost, as pploader)."""
    from sglang.srt.runtime_context import get_parallel  # type: ignore[import-not-found, unused-ignore]
    parallel = get_parallel()
    pp, tp = parallel.pp_group, parallel.tp_group
    return Topology(pp.world_size, tp.world_size, 1,
                    pp.rank_in_group * tp.world_size + tp.rank_in_group)


def engine_partition(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """Layers per stage exactly as SGLang splits them (its ``get_pp_indices``, which reads
    ``SGLANG_PP_LAYER_PARTITION`` itself)."""
    from sglang.srt.distributed.utils import get_pp_indices  # type: ignore[import-not-found, unused-ignore]
    bounds = [get_pp_indices(num_layers, r, pp_size) for r in range(pp_size)]
    return tuple(end - start for start, end in bounds)


def _place(num_layers: int) -> tuple[Topology, tuple[int, ...]]:
    topology = engine_topology()
    return topology, engine_partition(num_layers, topology.pp_size)


def _mtp_checkpoint(model_dir: str) -> bool:
    """A local checkpoint whose config declares MTP layers (``num_nextn_predict_layers``):
    its draft model is one of them."""
    if not os.path.isdir(model_dir):
        return False
    from ..planning.spec import load_spec
    try:
        return load_spec(model_dir).num_mtp_layers > 0
    except Exception as exc:  # noqa: BLE001 - not pploader's to plan: SGLang's loader reads it
        logger.debug("draft %s not planned: %s", model_dir, exc)
        return False


def _load_tracked(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                  target_device: torch.device) -> set[str]:
    """SGLang's ``load_weights_only`` (its quantization renames, then ``model.load_weights``)
    with the parameters it wrote recorded."""
    with tracking_writes(model, default_weight_loader) as written:
        DefaultModelLoader.load_weights_only(model, weights, target_device)
    return written


def _write_report(rank: int) -> None:
    where = _REPORT_DIR.get("dir")
    if where:
        path = Path(where) / f"rank{rank}.json"
        path.write_text(json.dumps(LAST, default=str, indent=1))


# ---- the loader -------------------------------------------------------------------------
class PPLoaderModelLoader(DefaultModelLoader):  # type: ignore[misc, valid-type]
    """SGLang model loader that reads only this rank's stage (and TP part) of the checkpoint.
    A ``DefaultModelLoader``, so that SGLang's ``update_weights_from_disk`` accepts it."""

    def __init__(self, load_config: Any) -> None:
        _sgl_loader.BaseModelLoader.__init__(self, load_config)  # not the default's checks
        extra = dict(getattr(load_config, "model_loader_extra_config", None) or {})
        report_dir = extra.pop("report_dir", None)
        self.tp_mode, self.range_cost_bytes, self.io_backend = loader_options(extra)
        if report_dir:
            _REPORT_DIR["dir"] = str(report_dir)
        # GPU ranks: the pinned ring page-locked while SGLang builds the model
        self.staging: Any = early_staging()
        self._pending: Optional[tuple[Any, ...]] = None   # a reload read, not yet written
        self._draft = False   # a draft model: SGLang's default loading

    def download_model(self, model_config: Any) -> None:
        """pploader reads a local directory only (no hub downloads)."""
        if not os.path.isdir(model_config.model_path):
            raise ValueError(f"load_format 'pploader' needs a local checkpoint directory, got "
                             f"{model_config.model_path!r}")

    def load_model(self, *, model_config: Any, device_config: Any) -> nn.Module:
        """SGLang's ``DefaultModelLoader.load_model``, with this rank's stage planned in the
        background while the model is built and only that stage read."""
        model_dir = model_config.model_path
        draft = getattr(model_config, "is_draft_model", False) or \
            getattr(self.load_config, "draft_model_idx", None) is not None
        if draft and not _mtp_checkpoint(model_dir):
            # a draft checkpoint of its own (EAGLE, a hub id): it is the whole draft model
            logger.info("pploader: draft %s has no MTP layers; SGLang's default loader loads "
                        "it", model_dir)
            self._draft = True
            return super().load_model(model_config=model_config, device_config=device_config)
        self.download_model(model_config)
        early = None if draft else start_early_plan(model_dir, self.tp_mode,
                                                    self.range_cost_bytes, _place)
        target_device = torch.device(device_config.device)
        quant_config = _sgl_loader._get_quantization_config(model_config, self.load_config)
        with _sgl_loader.set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = _sgl_loader._initialize_model(model_config, self.load_config,
                                                      quant_config)
            if draft:
                self._draft = True
                self._load_draft(model, model_dir, target_device)
            else:
                self._load_stage(model, model_dir, target_device, early)
        self.counter_after_loading_weights = time.perf_counter()
        return model.eval()

    def _load_draft(self, model: nn.Module, model_dir: str, target_device: torch.device
                    ) -> None:
        """The draft worker's load: its MTP layer only (``draft_model_idx``, else the first),
        then SGLang's post-processing."""
        rank = engine_topology().rank
        load_engine_draft(
            model, model_dir, int(getattr(self.load_config, "draft_model_idx", None) or 0),
            lambda weights: _load_tracked(model, weights, target_device), rank=rank,
            shared=TARGET_SHARED, io_backend=self.io_backend, staging=self.staging,
            engine=ENGINE, ignore=DRAFT_SHARED_PARAMS.__contains__)
        DefaultModelLoader.postprocess_weights(model, target_device)
        _write_report(rank)

    def _load_stage(self, model: nn.Module, model_dir: str, target_device: torch.device,
                    early: Optional[EarlyPlan]) -> LoadState:
        topology = engine_topology()
        from ..planning.spec import load_spec
        spec = load_spec(model_dir)
        partition = engine_partition(spec.num_layers, topology.pp_size)
        if spec.num_experts:
            experts = engine_local_experts(model, spec.num_experts)
        else:
            experts = None
        planned = early.result() if early is not None and early.key == (
            model_dir, topology, partition, self.tp_mode, self.range_cost_bytes) \
            and experts is None else None
        state = load_engine_stage(
            model, model_dir, topology, partition,
            lambda weights: _load_tracked(model, weights, target_device),
            tp_mode=self.tp_mode, io_backend=self.io_backend,
            range_cost_bytes=self.range_cost_bytes, local_experts=experts, planned=planned,
            staging=self.staging, engine=ENGINE, split=SPLIT)
        DefaultModelLoader.postprocess_weights(model, target_device)
        _SERVED["model"] = weakref.ref(model)
        _write_report(topology.rank)
        return state

    # ---- reload: SGLang's update_weights_from_disk ----------------------------------------
    def _get_weights_iterator(self, source: Any, **_: Any
                              ) -> Iterator[tuple[str, torch.Tensor]]:
        """The new checkpoint (``source.model_or_path``) checked for every stage and this
        stage read whole; raised on refusal (SGLang then writes nothing), with the served
        ``model_path`` put back."""
        model_config = getattr(source, "model_config", None)
        if self._draft or getattr(model_config, "is_draft_model", False):
            return super()._get_weights_iterator(source, **_)   # a draft: SGLang's default
        ref = _SERVED.get("model")
        model = ref() if ref is not None else None
        state = served_state(model) if model is not None else None
        if model is None or state is None:
            raise PlanError("this engine's model was not loaded with load_format 'pploader'")
        checkpoint_dir = str(source.model_or_path)
        rchar0, start = rchar_bytes(), time.perf_counter()
        try:
            staged = check_every_stage(model, state, checkpoint_dir)
            reader, replay = read_stage(staged, state.tp_mode, state.io_backend)
        except Exception as exc:
            failed = {"ok": False, "rank": state.topology.rank, "written": False,
                      "error": f"{type(exc).__name__}: {exc}"}
            LAST["reload_error"] = failed
            _write_report(state.topology.rank)
            if model_config is not None:
                model_config.model_path = state.model_dir   # keep serving the old one
            logger.error("pploader reload of %s refused on %s: %s", checkpoint_dir,
                         state.topology.describe(), exc)
            raise PlanError(f"pploader refused the reload of {checkpoint_dir}; nothing was "
                            f"written, the served weights stay: {exc}",
                            rank=state.topology.rank) from exc
        self._pending = (model, state, staged, reader, checkpoint_dir, start, rchar0,
                         rchar_bytes())
        return replay()

    def load_weights_and_postprocess(self, model: nn.Module,  # type: ignore[override]
                                     weights: Iterable[tuple[str, torch.Tensor]],
                                     target_device: torch.device) -> None:
        """The reload's write: in place through SGLang's weight loaders (every stage
        parameter written, data pointers kept), then its ``process_weights_after_loading``
        (the derived parameters rebuilt)."""
        pending, self._pending = self._pending, None
        if pending is None:   # not a reload this loader read: SGLang's own path
            DefaultModelLoader.load_weights_and_postprocess(model, weights, target_device)
            return
        _, state, staged, reader, checkpoint_dir, start, rchar0, rchar1 = pending
        before = {n: p.data_ptr() for n, p in model.named_parameters()}
        written = _load_tracked(model, weights, target_device)
        check_all_loaded(model, written, staged)
        DefaultModelLoader.postprocess_weights(model, target_device)
        report = record_served(model, state, staged, reader, checkpoint_dir, start, rchar0,
                               rchar1)
        report["data_ptrs_kept"] = before == {n: p.data_ptr()
                                              for n, p in model.named_parameters()}
        _write_report(state.topology.rank)


def check_every_stage(model: nn.Module, state: LoadState, checkpoint_dir: str) -> StagePlan:
    """Plan every PP stage of ``checkpoint_dir`` for this rank's TP place (headers, sizes,
    the family's strict accounting: the same verdict on every rank, as they read the same
    files) and this stage against the served one; returns this stage's plan."""
    topology = state.topology
    own: Optional[StagePlan] = None
    for pp_rank in range(topology.pp_size):
        place = Topology(topology.pp_size, topology.tp_size, 1,
                         pp_rank * topology.tp_size + topology.tp_rank)
        mine = pp_rank == topology.pp_rank
        staged = plan_engine_stage(
            checkpoint_dir, place, state.partition, state.tp_mode,
            model if mine else None, range_cost_bytes=state.range_cost_bytes,
            local_experts=state.local_experts, engine=ENGINE, split=SPLIT)
        if mine:
            own = staged
    assert own is not None
    same_layout(state.staged, own, topology.rank)
    return own


def engine_local_experts(model: nn.Module, num_experts: int) -> Optional[frozenset[int]]:
    """The experts SGLang placed on this rank under expert parallelism (its MoE layers'
    ``moe_ep_size`` / ``moe_ep_rank``: contiguous blocks of ``num_experts / ep``), or None
    without EP (experts split over TP like any tensor)."""
    found: Optional[frozenset[int]] = None
    for module in model.modules():
        ep_size = getattr(module, "moe_ep_size", None)
        ep_rank = getattr(module, "moe_ep_rank", None)
        if not isinstance(ep_size, int) or not isinstance(ep_rank, int) or ep_size <= 1:
            continue
        per = num_experts // ep_size
        ids = frozenset(range(ep_rank * per, (ep_rank + 1) * per))
        if found is not None and ids != found:
            raise PlanError(f"SGLang's MoE layers place different experts on this rank "
                            f"({sorted(found)} vs {sorted(ids)}): cannot plan one stage")
        found = ids
    return found


# ---- the plugin -------------------------------------------------------------------------
def _resolve_format(original: Callable[..., Any], config: Any, *args: Any, **kwargs: Any
                    ) -> Any:
    """``LoadConfig._verify_load_format``, with ``"pploader"`` resolved to the class."""
    fmt = config.load_format
    if isinstance(fmt, str) and fmt.lower() == LOAD_FORMAT:
        config.load_format = PPLoaderModelLoader
        return None
    return original(config, *args, **kwargs)


def register() -> None:
    """Entry point (``sglang.srt.plugins``): ``--load-format pploader`` accepted by SGLang's
    argument parser and resolved to :class:`PPLoaderModelLoader` in every process; pploader's
    log records let out through SGLang's handlers."""
    from sglang.srt.arg_groups.choices import (  # type: ignore[import-not-found, unused-ignore]
        LOAD_FORMAT_CHOICES, add_load_format_choices)
    from sglang.srt.plugins.hook_registry import (  # type: ignore[import-not-found, unused-ignore]
        HookRegistry, HookType)
    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    HookRegistry.register("sglang.srt.configs.load_config.LoadConfig._verify_load_format",
                          _resolve_format, HookType.AROUND)
    share_engine_logging("sglang")


def load_report() -> dict[str, Any]:
    """This process's last load / reload / refused reload (also in ``report_dir``)."""
    return dict(LAST)
