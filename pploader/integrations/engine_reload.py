"""Reload agreement for every engine format (vLLM: integrations/vllm_reload.py, SGLang:
integrations/sglang.py): read and agree before anything is written.

Each worker plans its stage of the new directory (headers and sizes, same family / window /
tensor shapes as served; a checkpoint of exactly the served layout keeps the served plan,
planning/rebase.py), takes all of its bytes (views of resident pages, the rest read into
memory), then all workers agree (:func:`read_agreed`, one ``run_guarded`` step over the
engine's store). Only then does the engine write, through its own in-place path; a refused
checkpoint never leaves the engine broken: nothing is written. :func:`record_served` makes the
new checkpoint the served one.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ..bind.module_state import find_module_state, module_state
# imported with the plugin, not inside the first reload (its import is seconds on a busy box)
from ..distributed.comm import Comm, run_guarded
from ..errors import PlanError, PPLoaderError
from ..io.backend import ReadBackend
from ..planning.rebase import rebase_stage
from ..stage import StagePlan
from .engine_core import LAST, LoadState, load_summary, plan_engine_stage
from .placed import read_stage

logger = logging.getLogger(__name__)

__all__ = ["Read", "served_state", "same_layout", "read_agreed", "record_served"]

Read = tuple[StagePlan, ReadBackend, Callable[[], Iterator[tuple[str, torch.Tensor]]]]


def served_state(model: nn.Module) -> Optional[LoadState]:
    """The :class:`LoadState` of a model an engine format loaded, or None."""
    found = find_module_state(model)
    return found.engine_load if found is not None else None


def same_layout(old: StagePlan, new: StagePlan, rank: int) -> None:
    """A reload must fill exactly the tensors the engine holds: same family, window, items."""
    if old.spec.family.name != new.spec.family.name:
        raise PlanError(f"new checkpoint is family {new.spec.family.name}, the engine serves "
                        f"{old.spec.family.name}", rank=rank)
    if old.plan.window != new.plan.window:
        raise PlanError(f"new checkpoint gives window {new.plan.window}, the engine serves "
                        f"{old.plan.window}", rank=rank)
    before = {i.target: (i.source_shape, i.shape) for i in old.plan.items}
    after = {i.target: (i.source_shape, i.shape) for i in new.plan.items}
    if before != after:
        diff = sorted(set(before.items()) ^ set(after.items()))
        name = diff[0][0] if diff else None
        raise PlanError(f"new checkpoint's stage tensors differ from the served ones "
                        f"({len(diff)} differences, e.g. {diff[:3]})", tensor=name, rank=rank)


def read_agreed(model: nn.Module, state: LoadState, checkpoint_dir: str, timeout_s: float
                ) -> tuple[Optional[Read], Optional[dict[str, Any]]]:
    """Phase 1 on every worker: plan, check and take the whole stage of ``checkpoint_dir``,
    then agree. ((staged, reader, replay), None) on success; (None, the agreed failure)."""
    topology = state.topology

    def read_all() -> Read:
        # a checkpoint of the served layout (a weight update) keeps the served plan
        staged = rebase_stage(state.staged, checkpoint_dir) or plan_engine_stage(
            checkpoint_dir, topology, state.partition, state.tp_mode, model,
            range_cost_bytes=state.range_cost_bytes, local_experts=state.local_experts,
            engine=state.engine)
        same_layout(state.staged, staged, topology.rank)
        return (staged, *read_stage(staged, state.tp_mode, state.io_backend))

    # polls at most 10 ms apart: a worker that read first starts writing right after the last
    # (agreement only: no process subgroups, whose creation is a collective per reload)
    comm = Comm(topology, timeout_s=timeout_s, max_poll_s=0.01, groups=False,
                namespace=f"pploader-{state.engine.lower()}-reload")
    try:
        return run_guarded(comm, read_all), None
    except PPLoaderError as exc:   # every worker gets the same RankFailure if any failed
        failures = getattr(exc, "failures", None) or {topology.rank: str(exc)}
        own = exc.__cause__
        failed = {"ok": False, "rank": topology.rank, "error": str(exc), "written": False,
                  "failures": {str(r): m for r, m in failures.items()},
                  "own_error": None if own is None else f"{type(own).__name__}: {own}"}
        LAST["reload_error"] = failed
        logger.error("pploader reload of %s refused on %s: %s", checkpoint_dir,
                     topology.describe(), exc)
        return None, failed
    finally:  # the engine's store outlives this call: no rank needs to wait for the others
        comm.close(linger=False)


def record_served(model: nn.Module, state: LoadState, staged: StagePlan, reader: ReadBackend,
                  checkpoint_dir: str, start: float, rchar0: Optional[int],
                  rchar1: Optional[int]) -> dict[str, Any]:
    """Record the reloaded checkpoint as the one served (its state and report)."""
    new = LoadState(checkpoint_dir, state.topology, state.partition, state.tp_mode, staged,
                    range_cost_bytes=state.range_cost_bytes, io_backend=state.io_backend,
                    local_experts=state.local_experts, engine=state.engine)
    new.report = load_summary(new, reader, time.perf_counter() - start, rchar0, rchar1)
    new.report.update(ok=True, total_seconds=time.perf_counter() - start)
    module_state(model).engine_load = new
    LAST["reload"] = new.report
    LAST.pop("reload_error", None)
    logger.info("pploader reload %s: read %d bytes (ideal %d) from %s",
                state.topology.describe(), reader.stats.read_bytes, new.report["ideal_bytes"],
                checkpoint_dir)
    return new.report
