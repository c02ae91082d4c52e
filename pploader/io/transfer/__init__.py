"""Transfer executors: how a planned stage's bytes arrive, one executor per transfer kind
(planning/transfer.py decides the kind; this package runs it).

``open_transfer(staged, device, options, comm, io_backend)`` is the twin of
``io.registry.open_backend``: it opens the executor of ``staged.transfer`` on any read
backend and device. Every executor implements the read protocol (``io/backend.ReadBackend``:
``plan``, ``stats``, ``load()``, iteration) plus ``kind`` and ``report()`` (the transfer's own
counters for the rank's report), and reads only through ``open_backend``. Collectives go
through ``distributed.comm.Comm``; nothing here plans.

| kind              | executor                          | moves bytes with           |
|-------------------|-----------------------------------|----------------------------|
| direct            | direct.DirectTransfer             | nothing (reads only)       |
| exchange          | exchange.ExchangeTransfer         | all-to-all over TP group   |
| stage_read_once   | read_once.StageReadOnce           | broadcasts in stage groups |
| node_read_once    | read_once.NodeReadOnce            | send / recv inside a node  |
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ...distributed.comm import Comm
    from ...planning.rank_plan import RankPlan
    from ...planning.stage import StagePlan
    from ..backend import ReadOptions, ReadStats

__all__ = ["TransferReader", "EXECUTORS", "open_transfer"]

#: transfer kind -> ``module:class`` of its executor (constructed as
#: ``cls(staged, device, options, comm, io_backend)``)
EXECUTORS: dict[str, str] = {
    "direct": "pploader.io.transfer.direct:DirectTransfer",
    "exchange": "pploader.io.transfer.exchange:ExchangeTransfer",
    "stage_read_once": "pploader.io.transfer.read_once:StageReadOnce",
    "node_read_once": "pploader.io.transfer.read_once:NodeReadOnce",
}


@runtime_checkable
class TransferReader(Protocol):
    """The read protocol (``ReadBackend``) plus the transfer's kind and counters."""

    plan: "RankPlan"
    stats: "ReadStats"
    kind: str

    def load(self, destinations: Optional[Mapping[str, "torch.Tensor"]] = None
             ) -> dict[str, "torch.Tensor"]: ...

    def __iter__(self) -> Iterator[tuple[str, "torch.Tensor"]]: ...

    def report(self) -> dict[str, Any]: ...


def open_transfer(staged: "StagePlan", device: "str | torch.device" = "cpu",
                  options: Optional["ReadOptions"] = None, comm: Optional["Comm"] = None,
                  io_backend: Optional[str] = None) -> TransferReader:
    """The executor of ``staged``'s planned transfer, reading ``staged.plan`` onto ``device``
    through ``io_backend`` (a name of io/registry.py; None = the device's default).

    Without a ``comm`` an ``exchange`` plan is read directly (its items hold the direct reads
    of every target); the read-once kinds need one. Nothing is read until ``load()`` or
    iteration; every rank of the transfer's group must then run it to the end."""
    from ...arguments import check_device, check_type
    from ...planning.stage import StagePlan
    from ..backend import ReadOptions
    check_type("staged", staged, StagePlan, "a StagePlan (from plan_stage)", optional=False)
    device = check_device("device", device, required=True)
    kind = staged.kind
    if kind == "exchange" and comm is None:
        kind = "direct"
    if kind != "direct" and comm is None:
        raise ValueError(f"transfer {kind!r} needs a Comm (its collectives go through it)")
    module, _, attr = EXECUTORS[kind].partition(":")
    cls = getattr(importlib.import_module(module), attr)
    return cls(staged, device, options or ReadOptions(),  # type: ignore[no-any-return]
               comm, io_backend)
