"""Reloading a running vLLM engine that was loaded with load format ``pploader``.

Two entry points, one protocol (read and agree before anything is written):

* vLLM's own API, ``llm.collective_rpc("reload_weights", kwargs={"weights_path": D})``: vLLM
  points ``model_config.model`` at ``D`` and asks the loader for ``get_all_weights``
  (:func:`engine_reload_weights`), then writes them through its layerwise in-place reload.
* pploader's, ``reload(llm, D)`` (engine built with ``worker_extension_cls=WORKER_EXTENSION``):
  ``collective_rpc("pploader_reload")`` (:func:`reload_stage`), which returns rather than
  raises and :func:`reload` raises ``RankFailure`` on the driver.

Each worker plans its stage of ``D``, takes all of its bytes, then all workers agree
(integrations/engine_reload.py, shared with SGLang). Only then is anything written. A refused
checkpoint never leaves the engine broken: nothing is written, ``model_config.model`` points back at the served checkpoint, and
on vLLM's path only the executor's *last* worker raises (vLLM's multiprocess executor reads the
replies in rank order and stops at the first failure: any earlier failure would leave the later
replies queued and desynchronise every later call); the others load nothing (vLLM's layerwise
reload puts the served tensors back).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import PlanError, RankFailure
from .engine_core import LAST, check_no_unread
from .engine_reload import read_agreed, record_served, served_state
from .placed import rchar_bytes

logger = logging.getLogger(__name__)

__all__ = ["reload_stage", "reload", "engine_reload_weights", "WorkerExtension", "LAST",
           "REFUSED"]

#: what a refused reload on vLLM's path raises on the executor's last worker
REFUSED = "pploader refused the reload; nothing was written, the served weights stay"


def _model_of(worker: Any) -> nn.Module:
    runner = getattr(worker, "model_runner", None)
    return runner.get_model() if runner is not None else worker.get_model()


def engine_reload_weights(model: nn.Module, model_config: Any, *, last_worker: bool,
                          timeout_s: float = 300.0) -> Iterator[tuple[str, torch.Tensor]]:
    """``get_all_weights`` for vLLM's ``reload_weights``: the stage of ``model_config.model``
    (already pointed at the new directory by vLLM), read and agreed on every worker before
    this returns (module docstring). Refused: ``model_config.model`` is set back; the last
    worker raises, the others return nothing to load."""
    state = served_state(model)
    if state is None:
        raise PlanError("this engine's model was not loaded with load_format='pploader'")
    checkpoint_dir = str(model_config.model)
    rchar0, start = rchar_bytes(), time.perf_counter()
    done, failed = read_agreed(model, state, checkpoint_dir, timeout_s)
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
        record_served(model, state, staged, reader, checkpoint_dir, start, rchar0, rchar1)
    return stream()


def reload_stage(worker: Any, checkpoint_dir: str, *, timeout_s: float = 300.0
                 ) -> dict[str, Any]:
    """Reload this worker's stage from ``checkpoint_dir`` in place; run on every worker
    (``llm.collective_rpc("pploader_reload", args=(DIR,))``, or :func:`reload` which raises).
    Returns rather than raises (module docstring); on a refusal every worker returns
    ``ok: False`` with the same agreed error and the served weights are untouched."""
    model = _model_of(worker)
    state = served_state(model)
    if state is None:
        return {"ok": False, "rank": None, "error": "this engine was not loaded with "
                "load_format='pploader'", "written": False}
    rchar0, start = rchar_bytes(), time.perf_counter()
    done, failed = read_agreed(model, state, str(checkpoint_dir), timeout_s)
    if done is None:
        assert failed is not None
        return failed
    staged, reader, replay = done
    rchar1 = rchar_bytes()
    topology = state.topology
    try:  # phase 2: every worker validated and read its stage; write in place
        worker.model_runner.reload_weights(weights_iterator=replay(), is_checkpoint_format=True)
        del replay  # the held bytes go now
        check_no_unread(model, staged, state.tp_mode, reader)
    except Exception as exc:  # noqa: BLE001
        failed = {"ok": False, "rank": topology.rank, "written": True,
                  "error": f"writing failed after agreement, weights may be partly updated: "
                           f"{type(exc).__name__}: {exc}"}
        LAST["reload_error"] = failed
        logger.exception("pploader reload write failed on %s", topology.describe())
        return failed
    return record_served(model, state, staged, reader, str(checkpoint_dir), start, rchar0,
                         rchar1)


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
