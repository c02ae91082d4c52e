"""Reloading a running vLLM engine that was loaded with load format ``pploader``.

Two entry points, one protocol (read and agree before anything is written):

* vLLM's own API, ``llm.collective_rpc("reload_weights", kwargs={"weights_path": D})``: vLLM
  points ``model_config.model`` at ``D`` and asks the loader for ``get_all_weights``
  (:func:`engine_reload_weights`), then writes them through its layerwise in-place reload.
* pploader's, ``reload(llm, D)`` (engine built with ``worker_extension_cls=WORKER_EXTENSION``):
  ``collective_rpc("pploader_reload")`` (:func:`reload_stage`), which returns rather than
  raises and :func:`reload` raises ``RankFailure`` on the driver.

Each worker plans its stage of ``D`` (headers and sizes, same family / window / tensor shapes as
served; a checkpoint of exactly the served layout keeps the served plan, planning/rebase.py),
takes all of its bytes (views of resident pages, the rest read into memory), then all
workers agree. Only then is anything written. A refused checkpoint never leaves the engine
broken: nothing is written, ``model_config.model`` points back at the served checkpoint, and
on vLLM's path only the executor's *last* worker raises (vLLM's multiprocess executor reads the
replies in rank order and stops at the first failure: any earlier failure would leave the later
replies queued and desynchronise every later call); the others load nothing (vLLM's layerwise
reload puts the served tensors back).
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
from ..errors import PlanError, PPLoaderError, RankFailure
from ..io.backend import ReadBackend
from ..planning.rebase import rebase_stage
from ..stage import StagePlan
from .placed import rchar_bytes, read_stage

logger = logging.getLogger(__name__)

__all__ = ["reload_stage", "reload", "engine_reload_weights", "WorkerExtension", "LAST",
           "REFUSED"]

#: this process's last load / reload / refused reload (``load_report``)
LAST: dict[str, dict[str, Any]] = {}
#: what a refused reload on vLLM's path raises on the executor's last worker
REFUSED = "pploader refused the reload; nothing was written, the served weights stay"


def _model_of(worker: Any) -> nn.Module:
    runner = getattr(worker, "model_runner", None)
    return runner.get_model() if runner is not None else worker.get_model()


def _state(model: nn.Module) -> Any:
    found = find_module_state(model)
    return found.engine_load if found is not None else None


def _same_layout(old: StagePlan, new: StagePlan, rank: int) -> None:
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


Read = tuple[StagePlan, ReadBackend, Callable[[], Iterator[tuple[str, torch.Tensor]]]]


def _read_agreed(model: nn.Module, state: Any, checkpoint_dir: str, timeout_s: float
                 ) -> tuple[Optional[Read], Optional[dict[str, Any]]]:
    """Phase 1 on every worker: plan, check and take the whole stage of ``checkpoint_dir``,
    then agree. ((staged, reader, replay), None) on success; (None, the agreed failure)."""
    from .vllm import plan_engine_stage
    topology = state.topology

    def read_all() -> Read:
        # a checkpoint of the served layout (a weight update) keeps the served plan
        staged = rebase_stage(state.staged, checkpoint_dir) or plan_engine_stage(
            checkpoint_dir, topology, state.partition, state.tp_mode, model,
            range_cost_bytes=state.range_cost_bytes, local_experts=state.local_experts)
        _same_layout(state.staged, staged, topology.rank)
        return (staged, *read_stage(staged, state.tp_mode, state.io_backend))

    # polls at most 10 ms apart: a worker that read first starts writing right after the last
    # (agreement only: no process subgroups, whose creation is a collective per reload)
    comm = Comm(topology, timeout_s=timeout_s, namespace="pploader-vllm-reload",
                max_poll_s=0.01, groups=False)
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


def _served(model: nn.Module, state: Any, staged: StagePlan, reader: ReadBackend,
            checkpoint_dir: str, start: float, rchar0: Optional[int],
            rchar1: Optional[int]) -> dict[str, Any]:
    """Record the reloaded checkpoint as the one served (its state and report)."""
    from .vllm import LoadState, load_summary
    new = LoadState(checkpoint_dir, state.topology, state.partition, state.tp_mode, staged,
                    range_cost_bytes=state.range_cost_bytes, io_backend=state.io_backend,
                    local_experts=state.local_experts)
    new.report = load_summary(new, reader, time.perf_counter() - start, rchar0, rchar1)
    new.report.update(ok=True, total_seconds=time.perf_counter() - start)
    module_state(model).engine_load = new
    LAST["reload"] = new.report
    LAST.pop("reload_error", None)
    logger.info("pploader reload %s: read %d bytes (ideal %d) from %s",
                state.topology.describe(), reader.stats.read_bytes, new.report["ideal_bytes"],
                checkpoint_dir)
    return new.report


def engine_reload_weights(model: nn.Module, model_config: Any, *, last_worker: bool,
                          timeout_s: float = 300.0) -> Iterator[tuple[str, torch.Tensor]]:
    """``get_all_weights`` for vLLM's ``reload_weights``: the stage of ``model_config.model``
    (already pointed at the new directory by vLLM), read and agreed on every worker before
    this returns (module docstring). Refused: ``model_config.model`` is set back; the last
    worker raises, the others return nothing to load."""
    state = _state(model)
    if state is None:
        raise PlanError("this engine's model was not loaded with load_format='pploader'")
    checkpoint_dir = str(model_config.model)
    rchar0, start = rchar_bytes(), time.perf_counter()
    done, failed = _read_agreed(model, state, checkpoint_dir, timeout_s)
    if done is None:
        model_config.model = state.model_dir   # keep serving (and reloading) the old one
        if last_worker:
            assert failed is not None
            raise PlanError(f"{REFUSED}: {failed['error']}", rank=state.topology.rank)
        return iter(())
    staged, reader, replay = done
    rchar1 = rchar_bytes()

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        yield from replay()
        _served(model, state, staged, reader, checkpoint_dir, start, rchar0, rchar1)
    return stream()


def reload_stage(worker: Any, checkpoint_dir: str, *, timeout_s: float = 300.0
                 ) -> dict[str, Any]:
    """Reload this worker's stage from ``checkpoint_dir`` in place; run on every worker
    (``llm.collective_rpc("pploader_reload", args=(DIR,))``, or :func:`reload` which raises).
    Returns rather than raises (module docstring); on a refusal every worker returns
    ``ok: False`` with the same agreed error and the served weights are untouched."""
    model = _model_of(worker)
    state = _state(model)
    if state is None:
        return {"ok": False, "rank": None, "error": "this engine was not loaded with "
                "load_format='pploader'", "written": False}
    rchar0, start = rchar_bytes(), time.perf_counter()
    done, failed = _read_agreed(model, state, str(checkpoint_dir), timeout_s)
    if done is None:
        assert failed is not None
        return failed
    staged, reader, replay = done
    rchar1 = rchar_bytes()
    topology = state.topology
    try:  # phase 2: every worker validated and read its stage; write in place
        worker.model_runner.reload_weights(weights_iterator=replay(), is_checkpoint_format=True)
        del replay  # the held bytes go now
        from .vllm import check_no_unread
        check_no_unread(model, staged, state.tp_mode, reader)
    except Exception as exc:  # noqa: BLE001
        failed = {"ok": False, "rank": topology.rank, "written": True,
                  "error": f"writing failed after agreement, weights may be partly updated: "
                           f"{type(exc).__name__}: {exc}"}
        LAST["reload_error"] = failed
        logger.exception("pploader reload write failed on %s", topology.describe())
        return failed
    return _served(model, state, staged, reader, str(checkpoint_dir), start, rchar0, rchar1)


def reload(llm: Any, checkpoint_dir: str, *, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """Driver side: reload every worker of ``llm`` (built with
    ``worker_extension_cls=WORKER_EXTENSION``) from ``checkpoint_dir``; raises RankFailure
    naming each worker's error if the new checkpoint was refused (old weights keep serving)."""
    results = llm.collective_rpc("pploader_reload", args=(str(checkpoint_dir),),
                                 kwargs={"timeout_s": timeout_s})
    failures: dict[int, str] = {}
    for i, result in enumerate(results):
        if not result.get("ok"):   # the agreed failures, the same on every worker
            rank = result.get("rank")
            own = {str(i if rank is None else rank): result["error"]}
            failures.update({int(r): m for r, m in (result.get("failures") or own).items()})
    if failures:
        raise RankFailure(failures)
    return list(results)


class WorkerExtension:
    """``worker_extension_cls="pploader.integrations.vllm.WorkerExtension"``: call by name,
    ``llm.collective_rpc("pploader_reload", args=(DIR,))`` (no pickled callables needed)."""

    def pploader_reload(self, checkpoint_dir: str, timeout_s: float = 300.0) -> dict[str, Any]:
        return reload_stage(self, checkpoint_dir, timeout_s=timeout_s)

    def pploader_report(self) -> dict[str, Any]:
        return dict(LAST)

    def pploader_data_ptrs(self) -> dict[str, int]:
        """Parameter name -> data_ptr (to check that a reload wrote in place)."""
        return {n: p.data_ptr() for n, p in _model_of(self).named_parameters()}
