"""Transfers ``stage_read_once`` and ``node_read_once``: bytes several ranks need are read by
one of them and moved to the others (broadcasts in the stage's groups; send / recv inside a
node). Who reads what was decided at planning time (planning/share.py via
planning/transfer.py); these executors only read (through ``open_backend``) and move bytes
(through ``Comm``), on any backend and device (gloo on CPU, NCCL on CUDA).

Fail-together without hanging: a rank whose read fails keeps taking part in the remaining
transfers with zero-filled tensors, then raises, so no peer waits forever inside a
collective; the caller's ``comm.agree`` reports the failure.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import torch

from ...planning.checkpoint import DTYPES
from ...planning.items import ReadItem
from ..backend import ReadBackend, ReadOptions, ReadStats, collect, sum_stats
from ..registry import open_backend, shared_staging
from .exchange import ExchangeTransfer, bytes_view

if TYPE_CHECKING:  # pragma: no cover
    from ...distributed.comm import Comm
    from ...planning.share import NodePlan, SharedPlan
    from ...planning.stage import StagePlan

__all__ = ["StageReadOnce", "NodeReadOnce"]


def _empty(item: ReadItem, device: torch.device) -> torch.Tensor:
    return torch.empty(item.shape, dtype=DTYPES[item.dtype][0], device=device)


class StageReadOnce:
    """Read once for replicas: items that several ranks of the stage plan identically
    (replicated tensors; with EP > 1 every non-expert slice) are read from storage by one rank
    of their group and broadcast through ``comm``.

    Yields ``(target, tensor)``: the shared items first, in the global broadcast order, then
    this rank's own items. Every rank of the stage must iterate it to the end.
    ``stats.read_bytes`` counts storage bytes only (``received_bytes``: the broadcast ones).

    It pays when storage is slower than the interconnect (network file systems, a cold cache
    shared by many ranks); on local NVMe or a warm page cache it only adds synchronisation,
    so it is off by default.
    """

    kind = "stage_read_once"

    def __init__(self, staged: "StagePlan", device: torch.device, options: ReadOptions,
                 comm: Optional["Comm"], io_backend: Optional[str] = None) -> None:
        if comm is None:
            raise ValueError("read once per stage needs a Comm (the broadcasts go through it)")
        if options.mode != "owned":
            raise ValueError("read once per stage yields owned tensors only")
        assert staged.transfer is not None and staged.transfer.shared is not None
        self.shared: "SharedPlan" = staged.transfer.shared
        self.plan, self.comm, self.device = staged.plan, comm, device
        self._on_progress = options.on_progress
        # this rank's shared reads, then its own items: two backends of one load on one staging
        options = shared_staging(staged.plan, device, options, io_backend)
        self._readers: tuple[ReadBackend, ReadBackend] = (
            open_backend(self.shared.reads, device, options, io_backend),
            open_backend(self.shared.own, device, options, io_backend))
        self.stats, self.received_bytes = ReadStats(), 0

    def load(self, destinations: Optional[Mapping[str, torch.Tensor]] = None
             ) -> dict[str, torch.Tensor]:
        return collect(self, destinations)

    def report(self) -> dict[str, Any]:
        return {"read_once": {"broadcasts": len(self.shared.shared),
                              "received_bytes": self.received_bytes}}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        rank = self.shared.rank
        start = time.perf_counter()
        try:
            reads, own = iter(self._readers[0]), iter(self._readers[1])
            for s in self.shared.shared:
                if s.reader == rank:
                    target, tensor = next(reads)
                else:
                    target, tensor = s.item.target, _empty(s.item, self.device)
                    self.received_bytes += s.item.nbytes
                self.comm.broadcast_bytes(tensor, s.reader, s.group)
                if s.reader != rank and self._on_progress is not None:
                    self._on_progress(s.item.read_bytes)  # counts as loaded, as planned
                yield target, tensor
            next(reads, None)  # lets the reader finish (identity checks, close)
            yield from own
        finally:
            self.stats = sum_stats([r.stats for r in self._readers],
                                   time.perf_counter() - start)


class NodeReadOnce:
    """Read once per node: bytes that several ranks of this rank's node need (replicated
    tensors, the tied head = the embedding, identical vocab slices of different stages) are
    read by one of them and sent point to point to the others. Every rank of the node must
    iterate it to the end; bytes read per node = the union of its ranks' plans.

    Yields ``(target, tensor)``: the transfers in the node's order, then this rank's own items
    (through the TP exchange when the plan chose it for its strided slices). A rank whose read
    fails sends zeros for the rest (no receiver waits forever) and raises. CPU tensors go over
    gloo, CUDA tensors over NCCL.
    """

    kind = "node_read_once"

    def __init__(self, staged: "StagePlan", device: torch.device, options: ReadOptions,
                 comm: Optional["Comm"], io_backend: Optional[str] = None) -> None:
        if comm is None:
            raise ValueError("read once per node needs a Comm (the sends go through it)")
        transfer = staged.transfer
        assert transfer is not None and transfer.node is not None
        self.node: "NodePlan" = transfer.node
        self.plan, self.comm, self.device = staged.plan, comm, device
        me = self.node.rank
        first: dict[int, ReadItem] = {}
        for i, item in self.node.mine:
            if self.node.transfers[i].reader == me:
                first.setdefault(i, item)
        options = shared_staging(staged.plan, device, replace(options, mode="owned"), io_backend)
        self._reads = open_backend(replace(self.node.own, items=tuple(first.values()),
                                           redistribute=None), device, options, io_backend)
        # strided TP slices are never node-shared (each rank's differ): when the plan chose
        # read-and-redistribute for them, this rank's own items go through the exchange
        self._own: "ReadBackend | ExchangeTransfer" = (
            ExchangeTransfer(self.node.own, device, options, comm, io_backend)
            if transfer.node_exchange else
            open_backend(replace(self.node.own, redistribute=None), device, options,
                         io_backend))
        self._on_progress = options.on_progress
        self.stats, self.received_bytes = ReadStats(), 0
        self.error: Optional[BaseException] = None

    def load(self, destinations: Optional[Mapping[str, torch.Tensor]] = None
             ) -> dict[str, torch.Tensor]:
        return collect(self, destinations)

    def report(self) -> dict[str, Any]:
        own = self._own.report() if isinstance(self._own, ExchangeTransfer) else {}
        return {"node_read_once": {"transfers": len(self.node.transfers),
                                   "received_bytes": self.received_bytes}, **own}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        me, start = self.node.rank, time.perf_counter()
        reads = iter(self._reads)
        try:
            for index, transfer in enumerate(self.node.transfers):
                items = [item for i, item in self.node.mine if i == index]
                if not items:
                    continue
                if transfer.reader == me:
                    tensor = None
                    if self.error is None:
                        try:
                            tensor = next(reads)[1]
                        except Exception as exc:  # noqa: BLE001 - raised after the sends
                            self.error = exc
                    if tensor is None:
                        tensor = torch.zeros_like(_empty(items[0], self.device))
                    for dst in transfer.receivers:
                        self.comm.send(bytes_view(tensor).reshape(-1), dst)
                else:
                    tensor = _empty(items[0], self.device)
                    self.comm.recv(bytes_view(tensor).reshape(-1), transfer.reader)
                    self.received_bytes += tensor.numel() * tensor.element_size()
                    if self._on_progress is not None:
                        self._on_progress(transfer.nbytes)
                if self.error is None:
                    for k, item in enumerate(items):
                        yield item.target, tensor if k == 0 else tensor.clone()
            if self.error is not None:
                raise self.error
            next(reads, None)  # the reader's end (identity checks, close)
            yield from self._own
        finally:
            self.stats = sum_stats([self._reads.stats, self._own.stats],
                                   time.perf_counter() - start)
