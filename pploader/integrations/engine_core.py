"""The engine-neutral core of pploader's serving-engine load formats (vLLM: integrations/vllm.py,
SGLang: integrations/sglang.py). No engine import: each engine file hands it what the engine
says (its topology, layer split, model, expert placement) and the model's ``load_weights``.

One load, the same in every engine (:func:`load_engine_stage`): plan this worker's stage as the
engine holds it (integrations/engine_plan.py), check the plan's window against the one the
engine built, stream only the stage's bytes (integrations/placed.py; on a GPU worker the
device stream with the pinned ring the loader started early, :func:`early_staging`) into the
engine's own ``load_weights``, then check that every parameter of the stage was written
(:func:`check_all_loaded`, :func:`check_no_unread`) and record what was read
(:class:`LoadState` on the model, :data:`LAST` in the process). Reloads agree through
integrations/engine_reload.py. A draft worker's load (:func:`load_engine_draft`) streams one
MTP layer the same way.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from ..bind.module_state import module_state
from ..errors import PlanError
from ..io.backend import ReadBackend
from ..planning.topology import Topology
from ..stage import StagePlan, plan_stage
from .engine_plan import engine_draft, engine_stage
from .placed import DEFAULT_BACKEND, NAN_DTYPES, rchar_bytes, stage_weights

logger = logging.getLogger(__name__)

__all__ = ["TP_MODES", "LAST", "LoadState", "EarlyPlan", "start_early_plan",
           "plan_engine_stage", "read_topology", "model_window", "check_all_loaded",
           "check_no_unread", "early_staging", "model_device", "load_summary",
           "load_engine_stage", "loader_options", "load_engine_draft", "share_engine_logging"]

TP_MODES = ("placed", "full", "sliced")

#: this process's last load / reload / refused reload (the engines' ``load_report``)
LAST: dict[str, dict[str, Any]] = {}

#: (topology, layers per stage) of this worker, as the engine says
Place = tuple[Topology, tuple[int, ...]]
#: the model's own ``load_weights``: (name, tensor) stream -> names of the parameters written
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]


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
    engine: str = "vLLM"        # whose model (error messages, the reload's namespace)


def loader_options(extra: Optional[dict[str, Any]]) -> tuple[str, int, str]:
    """(tp_mode, range_cost_bytes, io_backend) from an engine's ``model_loader_extra_config``;
    unknown keys or values: ValueError (the engine shows it when the loader is made)."""
    extra = dict(extra or {})
    tp_mode = str(extra.pop("tp_mode", "placed"))
    # exact byte ranges by default: strided TP slices row by row, never a covering box
    range_cost_bytes = int(extra.pop("range_cost_bytes", 0))
    # the read backend (io/registry.py): views of resident pages, positional reads else
    io_backend = str(extra.pop("io_backend", DEFAULT_BACKEND))
    from ..io.registry import select_backend
    select_backend("cpu", io_backend)   # unknown or not a host backend: ValueError
    if tp_mode not in TP_MODES:
        raise ValueError(f"pploader tp_mode must be one of {TP_MODES}, got {tp_mode!r}")
    if extra:
        raise ValueError(f"unknown pploader model_loader_extra_config keys: {sorted(extra)}")
    return tp_mode, range_cost_bytes, io_backend


# ---- planning from the engine's model ---------------------------------------------------
def model_window(model: nn.Module) -> Optional[tuple[int, int]]:
    """The ``[start_layer, end_layer)`` the engine built (``model.model.start_layer``)."""
    inner = getattr(model, "model", None)
    start, end = getattr(inner, "start_layer", None), getattr(inner, "end_layer", None)
    return (int(start), int(end)) if isinstance(start, int) and isinstance(end, int) else None


def read_topology(topology: Topology, tp_mode: str) -> Topology:
    """The topology pploader plans with: ``full`` reads whole tensors (tp 1)."""
    if tp_mode == "full":
        return Topology(topology.pp_size, 1, 1, topology.pp_rank)
    return topology


def plan_engine_stage(model_dir: str, topology: Topology, partition: Sequence[int],
                      tp_mode: str, model: Optional[nn.Module] = None, *,
                      range_cost_bytes: int = 0,
                      local_experts: Optional[frozenset[int]] = None,
                      planned: Optional[StagePlan] = None, engine: str = "vLLM",
                      split: str = "get_pp_indices") -> StagePlan:
    """Plan this worker's stage as the engine holds it (integrations/engine_plan.py: its
    expert placement, its names) with the engine's partition; the window must be the model's.
    ``planned``: that plan made already (:class:`EarlyPlan`), only checked here; ``engine``,
    ``split``: the engine and its split function, named in errors."""
    staged = planned if planned is not None else engine_stage(
        model_dir, read_topology(topology, tp_mode), partition,
        local_experts=local_experts, range_cost_bytes=range_cost_bytes)
    window = staged.plan.window
    start = sum(partition[:topology.pp_rank])
    expected = (start, start + partition[topology.pp_rank])
    built = model_window(model) if model is not None else None
    if built is not None and built != expected:
        raise PlanError(f"{engine}'s model holds layers {built} but {split} gives {expected}: "
                        "cannot tell which window to load", rank=topology.rank)
    if (window.start_layer, window.end_layer) != expected or \
            window.has_embed != (topology.pp_rank == 0) or \
            window.has_head != (topology.pp_rank == topology.pp_size - 1):
        raise PlanError(f"pploader planned layers [{window.start_layer}, {window.end_layer}) "
                        f"(embed {window.has_embed}, head {window.has_head}) but {engine}'s "
                        f"stage {topology.pp_rank}/{topology.pp_size} holds [{expected[0]}, "
                        f"{expected[1]})", rank=topology.rank)
    return staged


class EarlyPlan:
    """The stage planned in a background thread while the engine builds the model (planning
    needs only the directory and the engine's parallel state; it reads config and headers, no
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
            self._staged = engine_stage(model_dir, read_topology(topology, tp_mode),
                                        partition, range_cost_bytes=cost)
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self._error = exc

    def result(self) -> StagePlan:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._staged is not None
        return self._staged


def start_early_plan(model_dir: str, tp_mode: str, range_cost_bytes: int,
                     place: Callable[[int], Place]) -> Optional[EarlyPlan]:
    """An :class:`EarlyPlan` of this worker's stage, or None where it cannot be made before
    the model exists (not a local directory, experts, an unreadable config: the load plans
    then, and reports any error itself). ``place(num_layers)``: the engine's (topology,
    partition) for this worker."""
    try:
        if not os.path.isdir(model_dir):
            return None
        from ..planning.spec import load_spec
        spec = load_spec(model_dir)
        if spec.num_experts:
            return None
        topology, partition = place(spec.num_layers)
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


def check_all_loaded(model: nn.Module, loaded: Optional[Iterable[str]], staged: StagePlan,
                     *, ignore: Callable[[str], bool] = lambda name: False,
                     defaulted: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """Strict: every parameter of the stage was written by ``load_weights``. Parameters the
    engine builds for tensors another stage owns are zeroed (never read on this rank) and
    returned; parameters whose last name part is in ``defaulted`` (the engine sets them to
    defaults after loading, e.g. vLLM's attention scales) pass when the checkpoint stores no
    tensor of that kind; anything else missing (and not ``ignore``d: parameters the engine
    fills itself) is an error listing it."""
    rank = staged.plan.topology.rank
    if loaded is None:
        raise PlanError(f"{type(model).__name__}.load_weights returned no set of loaded "
                        "parameters: cannot check that the stage is complete", rank=rank)
    params = dict(model.named_parameters())
    unloaded = sorted(n for n in set(params) - set(loaded) if not ignore(n))
    elsewhere = tuple(n for n in unloaded if _other_stage(n, staged))
    stored = {t.rpartition(".")[2] for t in staged.plan.tensors} if defaulted else set()
    missing = [n for n in unloaded if n not in elsewhere and not (
        n.rpartition(".")[2] in defaulted and n.rpartition(".")[2] not in stored)]
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


def check_no_unread(model: nn.Module, staged: StagePlan, tp_mode: str, reader: ReadBackend,
                    engine: str = "vLLM") -> None:
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
                        f"tp_mode='placed': {engine}'s loader took elements outside this "
                        "rank's pploader slice (or the checkpoint holds NaN); use "
                        "model_loader_extra_config={'tp_mode': 'full'}", rank=rank)


# ---- the device and the load ------------------------------------------------------------
def early_staging() -> Any:
    """On a GPU worker, the device backend's staging (the pinned ring) started now, when the
    loader is created or the engine starts ``load_model``, so its page-locking overlaps the
    engine building the model (the engine has set the worker's device by then); None on CPU
    workers or when it cannot start (the load then makes its own)."""
    try:
        if not torch.cuda.is_available():
            return None
        from ..io.registry import prepare_staging
        return prepare_staging(torch.device("cuda", torch.cuda.current_device()))
    except Exception as exc:  # noqa: BLE001 - the load makes its own staging
        logger.debug("no early staging: %s", exc)
        return None


def model_device(model: nn.Module) -> torch.device:
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
            "io_backend": state.io_backend, "engine": state.engine,
            "local_experts": None if state.local_experts is None else sorted(state.local_experts),
            "header_bytes": state.staged.plan.header_bytes, "seconds": seconds,
            "items": len(state.staged.plan.items),
            "rchar_bytes": None if rchar0 is None or rchar1 is None else rchar1 - rchar0,
            "model_dir": state.model_dir}


def _device_options(device: torch.device, staging: Any) -> Any:
    """The read options of a load onto ``device``: None on CPU; on a GPU the device stream
    through the pinned ring the loader started (``staging``), its page-locking stopped."""
    if device.type == "cpu":
        return None
    from ..io.backend import ReadOptions
    if staging is not None:
        staging.stop_preparing()  # never page-lock beside the load's own reads
    return ReadOptions(ring=staging)


def load_engine_draft(model: nn.Module, model_dir: str, mtp_layer: int,
                      load_weights: LoadWeights, *, rank: int = 0,
                      shared: frozenset[str] = frozenset(),
                      io_backend: str = DEFAULT_BACKEND, staging: Any = None,
                      engine: str = "vLLM",
                      ignore: Callable[[str], bool] = lambda name: False) -> dict[str, Any]:
    """A draft worker's load: only MTP layer ``mtp_layer`` of the checkpoint
    (integrations/engine_plan.py :func:`engine_draft`, less the ``shared`` components the
    engine takes from the target), streamed lazily into the draft model's ``load_weights``;
    every parameter not ``ignore``d (the ones the engine shares in later) must be written.
    Returns the report, also ``LAST["draft"]``."""
    rchar0, start = rchar_bytes(), time.perf_counter()
    staged = engine_draft(model_dir, mtp_layer, shared=shared)
    device = model_device(model)
    reader, weights = stage_weights(staged, "full", io_backend,
                                    _device_options(device, staging), device)
    loaded = load_weights(weights)
    rchar1, seconds = rchar_bytes(), time.perf_counter() - start
    try:
        check_all_loaded(model, loaded, staged, ignore=ignore)
    except PlanError as exc:
        raise PlanError(f"{engine}'s draft model (MTP layer {mtp_layer} of {model_dir}): {exc}",
                        rank=rank) from exc
    plan = staged.plan
    report = {"rank": rank, "engine": engine, "mtp_layer": mtp_layer,
              "layer": staged.spec.num_layers + mtp_layer, "model_dir": model_dir,
              "tensors": list(plan.tensors), "read_bytes": reader.stats.read_bytes,
              "ideal_bytes": plan.ideal_bytes, "header_bytes": plan.header_bytes,
              "mapped_bytes": int(getattr(reader, "mapped_bytes", 0)),
              "rchar_bytes": None if rchar0 is None or rchar1 is None else rchar1 - rchar0,
              "seconds": seconds, "io_backend": io_backend}
    LAST["draft"] = report
    logger.info("pploader %s rank %d: draft model from MTP layer %d (checkpoint layer %d): "
                "read %d bytes of %d tensor(s) in %.2f s", engine, rank, mtp_layer,
                report["layer"], reader.stats.read_bytes, len(plan.tensors), seconds)
    return report


def share_engine_logging(engine_logger: str) -> None:
    """Let pploader's log records out through the engine's handlers (the engine configures
    its own logger, not the root's): pploader's logger takes the engine logger's handlers and
    level, once, when it has none of its own."""
    ours, theirs = logging.getLogger("pploader"), logging.getLogger(engine_logger)
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.getEffectiveLevel())
        ours.propagate = False


def load_engine_stage(model: nn.Module, model_dir: str, topology: Topology,
                      partition: Sequence[int], load_weights: LoadWeights, *,
                      tp_mode: str = "placed", io_backend: str = DEFAULT_BACKEND,
                      range_cost_bytes: int = 0,
                      local_experts: Optional[frozenset[int]] = None,
                      planned: Optional[StagePlan] = None, staging: Any = None,
                      engine: str = "vLLM", split: str = "get_pp_indices",
                      ignore: Callable[[str], bool] = lambda name: False,
                      defaulted: frozenset[str] = frozenset()) -> LoadState:
    """One worker's load (module docstring): plan (or take ``planned``) and check the stage,
    stream it into ``load_weights``, check and record it. ``staging``: the pinned ring started
    by the loader (GPU workers). Returns the :class:`LoadState`, also kept on the model."""
    rchar0, start = rchar_bytes(), time.perf_counter()
    partition = tuple(partition)
    staged = plan_engine_stage(model_dir, topology, partition, tp_mode, model,
                               range_cost_bytes=range_cost_bytes, local_experts=local_experts,
                               planned=planned, engine=engine, split=split)
    device = model_device(model)
    # on a GPU the device stream: pinned ring -> the GPU, D2D copy_
    reader, weights = stage_weights(staged, tp_mode, io_backend,
                                    _device_options(device, staging), device)
    loaded = load_weights(weights)
    rchar1, seconds = rchar_bytes(), time.perf_counter() - start
    check_all_loaded(model, loaded, staged, ignore=ignore, defaulted=defaulted)
    check_no_unread(model, staged, tp_mode, reader, engine)
    state = LoadState(model_dir, topology, partition, tp_mode, staged,
                      range_cost_bytes=range_cost_bytes, io_backend=io_backend,
                      local_experts=local_experts, engine=engine)
    state.report = load_summary(state, reader, seconds, rchar0, rchar1)
    module_state(model).engine_load = state  # travels with the model (bind/module_state.py)
    LAST["load"] = state.report
    logger.info("pploader %s %s: layers [%d, %d) read %d bytes (%d of them mapped from the "
                "page cache; ideal %d, headers %d) in %.2f s, tp_mode=%s%s", engine,
                topology.describe(), staged.plan.window.start_layer,
                staged.plan.window.end_layer, reader.stats.read_bytes,
                getattr(reader, "mapped_bytes", 0), staged.plan.ideal_bytes,
                staged.plan.header_bytes, seconds, tp_mode,
                "" if local_experts is None else f", {len(local_experts)} local expert(s)")
    return state

