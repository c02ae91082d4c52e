"""Hot reload in place: validate and agree everywhere first, then overwrite the same storage.

``reload_from_disk(model, checkpoint_dir, record=...)`` is called on every rank of a job whose
stage modules were loaded by ``load_stage_into`` (``record``: its ``BindResult.record``, or the
``ReloadResult.record`` of the previous reload). A stage module loaded some other way (a
``torch.distributed.pipelining`` stage of plain tensors) passes ``mesh=`` (its
``DeviceMesh``) and/or ``window=`` (``pipeline_window(stage, layers)``) instead: the stage
is planned from them and its tensors, as they are now, are the destinations. Order (nothing
is written before step 3):

1. every rank plans its stage from the new checkpoint (headers, names, shapes, dtypes and
   quantization companions through the family template), binds it to the module and checks
   each destination is still the tensor ``load_stage_into`` filled (same data_ptr, shape,
   strides, dtype): a post-process that deleted, replaced or reshaped a source fails here;
2. the ranks agree (steps 1 and 3 are each one ``run_guarded`` step): any failure anywhere ->
   every rank raises the combined error and the weights are untouched;
3. bytes are written in place (every parameter keeps its ``data_ptr``, so captured CUDA
   graphs stay valid), streamed with the reader's bounded window, then post-processing
   re-runs. A fault in this step leaves the model marked not ready (``forward`` raises
   NotReadyError) on every rank; restore it by reloading a good checkpoint.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from torch import nn

from ..bind.names import NameMap

from ..planning.checkpoint import open_checkpoint
from ..errors import ConfigError, PlanError
from .place import (Binding, LoadRecord, TensorSnapshot, bind_stage, commit_writes,
                    module_tensors)
from ..planning.plan import RankPlan, plan_rank
from ..planning.rebase import rebase_stage
from ..io.read import ReadStats
from ..planning.spec import read_config, spec_from_config
from ..planning.stage import StagePlan
from ..distributed.comm import run_guarded

if TYPE_CHECKING:  # pragma: no cover
    from ..distributed.comm import Comm
    from ..planning.partition import StageWindow

__all__ = ["ReloadResult", "reload_from_disk", "plan_reload", "check_destinations",
           "record_stage"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReloadResult:
    """What a reload wrote: the plan, the reader's stats, the modules post-processed, and the
    record to pass to the next reload (the new checkpoint's binding, the same destinations)."""

    plan: RankPlan
    stats: ReadStats
    processed: tuple[str, ...]
    record: LoadRecord


def plan_reload(record: LoadRecord, checkpoint_dir: os.PathLike | str, *,
                allowed_roots: Sequence[str] = ()) -> StagePlan:
    """Plan the recorded stage (same family, topology and window) from a new checkpoint; a
    checkpoint of the recorded plan's layout keeps that plan (planning/rebase.py)."""
    if record.staged is not None:
        rebased = rebase_stage(record.staged, checkpoint_dir, allowed_roots=allowed_roots)
        if rebased is not None:
            return rebased
    config = read_config(checkpoint_dir, allowed_roots=allowed_roots)
    path = Path(checkpoint_dir) / "config.json"
    archs = config.get("architectures") if isinstance(config, dict) else None
    if isinstance(archs, list) and archs and not set(archs) & set(record.family.architectures):
        raise ConfigError(f"architecture {archs[0]!r} but the model was loaded as "
                          f"{record.family.name} ({', '.join(record.family.architectures)})",
                          file=str(path))
    spec = spec_from_config(config, family=record.family)  # type: ignore[arg-type]
    if spec.num_layers != record.num_layers:
        raise ConfigError(f"{spec.num_layers} layers but the loaded model has "
                          f"{record.num_layers}", file=str(path))
    index = open_checkpoint(checkpoint_dir, allowed_roots=allowed_roots)
    plan = plan_rank(spec, index, record.topology, record.window, strict=record.strict)
    return StagePlan(spec, index, plan)


def check_destinations(model: nn.Module, record: LoadRecord) -> None:
    """Every tensor load_stage_into filled must still be there, unchanged in layout."""
    tensors = module_tensors(model)
    problems = []
    for name, snap in record.snapshots.items():
        t = tensors.get(name)
        change = "deleted after loading" if t is None else snap.change(t)
        if change is not None:
            problems.append(f"{name}: {change}")
    if problems:
        raise PlanError(
            f"cannot reload in place, nothing was written: {len(problems)} loaded tensor(s) "
            "changed since loading (a process_weights_after_loading() that deletes, replaces "
            "or reshapes its source parameters breaks reload; derive with pploader.bind_derived "
            "and keep the sources): " + "; ".join(problems[:8]),
            tensor=problems[0].split(":")[0], rank=record.topology.rank)


def record_stage(model: nn.Module, checkpoint_dir: os.PathLike | str, *, mesh: Any = None,
                 window: Optional["StageWindow"] = None, names: Optional[NameMap] = None,
                 strict: bool = True, allowed_roots: Sequence[str] = ()) -> LoadRecord:
    """The ``LoadRecord`` of ``model``'s stage as it is now (no load_stage_into before): the
    stage from ``mesh`` / ``window`` (``planning.mesh.resolve_stage``), planned from
    ``checkpoint_dir`` and bound to ``model``; its tensors now are the destinations."""
    from ..planning.mesh import resolve_stage
    from ..planning.stage import open_model
    opened = open_model(checkpoint_dir, allowed_roots=allowed_roots)
    spec, index = opened.spec, opened.index
    topo, win = resolve_stage(spec.num_layers, mesh=mesh, window=window)
    staged = StagePlan(spec, index, plan_rank(spec, index, topo, win, strict=strict))
    names = names if names is not None else NameMap()
    binding = bind_stage(model, staged, names=names)
    binding.check(strict, topo.rank)
    tensors = module_tensors(model)
    bad = [n for n in binding.params if tensors[n].is_meta or _is_dtensor(tensors[n])]
    if bad:
        raise PlanError("reload writes in place into materialised plain tensors: "
                        f"{', '.join(bad[:8])} {'are' if len(bad) > 1 else 'is'} "
                        + ("a DTensor (reload a DTensor stage with dcp.load(state_dict, "
                           "storage_reader=PPLoaderStorageReader(...)), in place)"
                           if _is_dtensor(tensors[bad[0]]) else "on the meta device"),
                        tensor=bad[0], rank=topo.rank)
    bound = set(binding.params)
    outside = sorted({m for m in map(names.to_module, index.weight_map) if m is not None and
                      m in tensors and not tensors[m].is_meta and m not in bound})
    if outside:  # the module holds another window's layers: not this stage
        raise PlanError(f"the module holds checkpoint tensors outside stage {win.pp_rank}'s "
                        f"layers [{win.start_layer}, {win.end_layer}): "
                        f"{', '.join(outside[:8])}: give the stage's own window "
                        "(window=pipeline_window(stage, layers))", tensor=outside[0],
                        rank=topo.rank)
    return LoadRecord(spec.family, spec.num_layers, topo, win, staged.plan.experts, names, (),
                      False, strict, binding,
                      {n: TensorSnapshot.of(tensors[n]) for n in binding.params}, staged)


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor")


def reload_from_disk(model: nn.Module, checkpoint_dir: os.PathLike | str, *,
                     record: Optional[LoadRecord] = None, comm: Optional["Comm"] = None,
                     process: bool = True, window_bytes: Optional[int] = None,
                     threads: int = 1, allowed_roots: Sequence[str] = (),
                     on_progress: Optional[Callable[[int], None]] = None, mesh: Any = None,
                     window: Optional["StageWindow"] = None,
                     names: Optional[NameMap] = None) -> ReloadResult:
    """Reload ``model``'s stage from ``checkpoint_dir`` in place (called on every rank).

    ``record``: what loaded ``model`` (``BindResult.record`` of ``load_stage_into``, or the
    previous ``ReloadResult.record``); a ``mesh`` / ``window`` given with it must be its
    stage. Without a record, ``mesh`` (a ``DeviceMesh``, dims pp / tp [/ ep]) and/or
    ``window`` (``pipeline_window(stage, layers)``) name the stage (:func:`record_stage`;
    ``names``: module name -> checkpoint name map). Raises before any write when any rank's
    validation fails (RankFailure with a ``comm``, else the PlanError / CheckpointError /
    TopologyError itself); raises NotReadyError, and leaves the model marked not ready, when
    writing fails midway on any rank.
    """
    from ..arguments import check_paths, check_type
    from ..distributed.comm import Comm
    check_type("comm", comm, Comm, "a pploader.Comm")
    check_type("model", model, nn.Module, "a torch.nn.Module", optional=False)
    allowed_roots = check_paths("allowed_roots", allowed_roots)
    rank = comm.rank if comm is not None else (
        record.topology.rank if isinstance(record, LoadRecord) else None)
    base: list[LoadRecord] = []

    def validate() -> tuple[StagePlan, Binding]:
        from ..planning.mesh import check_stage
        rec = record
        if rec is None and (mesh is not None or window is not None):
            rec = record_stage(model, checkpoint_dir, mesh=mesh, window=window, names=names,
                               allowed_roots=allowed_roots)
        elif not isinstance(rec, LoadRecord):
            raise PlanError("reload_from_disk needs the LoadRecord of the load "
                            "(record=load_stage_into(...).record): it names the stage, the "
                            "names and the destinations; or mesh= / window= for a stage "
                            f"loaded another way; got {type(rec).__name__}")
        elif mesh is not None or window is not None:
            check_stage(rec.topology, rec.window, mesh=mesh, stage_window=window,
                        what="the load record")
        base.append(rec)
        check_destinations(model, rec)
        staged = plan_reload(rec, checkpoint_dir, allowed_roots=allowed_roots)
        binding = bind_stage(model, staged, names=rec.names, ignore=rec.ignore,
                             allow_cast=rec.allow_cast)
        binding.check(rec.strict, rank)
        unknown = [n for n in binding.params if n not in rec.snapshots]
        if unknown:
            raise PlanError("the new checkpoint fills tensors the first load did not: "
                            + ", ".join(unknown[:8]) + "; reload writes only in place",
                            tensor=unknown[0], rank=rank)
        return staged, binding

    staged, binding = run_guarded(comm, validate, rank=rank)  # before any write
    logger.info("rank %s: reloading %d tensor(s) in place from %s", rank,
                len(binding.params), checkpoint_dir)
    stats, processed = commit_writes(
        model, binding, staged.plan, action="reload_from_disk", comm=comm, process=process,
        window_bytes=window_bytes, threads=threads, on_progress=on_progress)
    logger.info("rank %s: reloaded %d bytes in %.3f s", rank, stats.read_bytes, stats.seconds)
    return ReloadResult(staged.plan, stats, processed,
                        replace(base[0], binding=binding, staged=staged))
