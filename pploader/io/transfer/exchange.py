"""Transfer ``exchange`` (planning/redistribute.py plans it): row shares read, pieces swapped
with one all-to-all per batch over the TP group, each rank's slices assembled in place.

No torch.distributed here: the collective is ``comm.Comm.all_to_all_bytes``. CPU tensors go
over gloo; on CUDA the row shares are loaded by the DeviceLoader and swapped over NCCL on the
device.

Fail-together without hanging: a rank whose reads fail (or that sees another rank fail) keeps
taking part in the remaining all-to-alls with zero-filled shares, then raises; so no peer is
left waiting inside a collective, and the caller's ``comm.agree`` reports the failure.
A rank that dies mid-collective is detected by the process group (gloo at once, NCCL at its
timeout), as for read-once broadcasts.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Optional

import torch

from ...planning.checkpoint import DTYPES
from ...planning.rank_plan import RankPlan
from ...planning.redistribute import ExchangeItem, Redistribute, piece_selection
from ..backend import ReadBackend, ReadOptions, ReadStats, collect, sum_stats
from ..registry import indexed_device, open_backend, shared_staging
from .auto_cost import AUTO_EXCHANGE_COSTS, auto_exchange_cost  # noqa: F401 (re-exported)

if TYPE_CHECKING:  # pragma: no cover
    from ...distributed.comm import Comm
    from ...planning.stage import StagePlan

__all__ = ["ExchangeTransfer", "split_plan", "DEFAULT_DEVICE_GROUP_BYTES",
           "AUTO_EXCHANGE_COSTS", "auto_exchange_cost", "bytes_view"]

#: Row-share bytes per all-to-all on CUDA (consecutive planned batches merged): large
#: all-to-alls run near link speed over NVLink and few DeviceLoader runs amortise their setup.
DEFAULT_DEVICE_GROUP_BYTES = 1 << 30


def split_plan(plan: RankPlan) -> tuple[RankPlan, RankPlan, Redistribute]:
    """(direct items not exchanged, the row-share reads in exchange order, the exchange)."""
    ex = plan.redistribute
    if ex is None:
        raise ValueError("plan has no redistribution (planned with exchange_cost=None or tp=1)")
    skip = ex.targets
    own = replace(plan, items=tuple(i for i in plan.items if i.target not in skip),
                  redistribute=None)
    shares = replace(plan, items=tuple(i.share for i in ex.items), redistribute=None)
    return own, shares, ex


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as uint8 with the last dim widened by the itemsize."""
    if t.dim() == 0:
        return t.reshape(1).view(torch.uint8)
    return t.view(torch.uint8)


class ExchangeTransfer:
    """Yields ``(target, tensor)`` of a plan with a Redistribute: first every exchanged tensor
    (row shares read, all-to-alls over the TP group), then the rest (direct reads).

    Pipelined: a background thread reads the row shares group by group (a group = consecutive
    planned batches up to ``group_bytes`` of share bytes; then the direct items) while this
    thread exchanges the previous group in one all-to-all; so the exchange hides behind the
    reads. On CUDA each group goes through the device backend (pinned ring -> device) and the
    all-to-all runs on the device over NCCL, the pack/scatter copies too (no host copy);
    default group 1 GiB of shares. On CPU the groups are the planned batches (gloo).

    Every rank of the TP group must iterate it to the end. ``stats.read_bytes`` counts storage
    bytes; ``sent_bytes`` / ``received_bytes`` the bytes exchanged with other ranks;
    ``exchange_seconds`` this thread's time in pack + all-to-all + scatter (peers' skew
    included), ``wait_seconds`` its time waiting for the reads (the exposed read time),
    ``link_setup_seconds`` the first tiny all-to-all (NCCL's communicator setup, overlapped
    with the first group's reads).

    Every read goes through the read-backend registry (``io_backend``: a name from
    io/registry.py, None = the device's default), so a new backend serves this path too.
    ``options.threads`` None: 16 on CUDA, 1 on CPU.
    """

    kind = "exchange"

    def __init__(self, staged: "StagePlan | RankPlan", device: torch.device,
                 options: ReadOptions, comm: Optional["Comm"],
                 io_backend: Optional[str] = None, *, group_bytes: Optional[int] = None) -> None:
        self.plan = staged if isinstance(staged, RankPlan) else staged.plan
        self.own, self.shares, self.exchange = split_plan(self.plan)
        if comm is None:
            raise ValueError("the TP exchange needs a Comm (its all-to-alls go through it)")
        if comm.topology.tp_group() != self.exchange.group:
            raise ValueError(f"plan's TP group {self.exchange.group} is not the comm's "
                             f"{comm.topology.tp_group()}")
        self.comm, self.cancel, self.on_progress = comm, options.cancel, options.on_progress
        self.device = indexed_device(device)
        cuda = self.device.type == "cuda"
        self.group_bytes = group_bytes if group_bytes is not None else (
            DEFAULT_DEVICE_GROUP_BYTES if cuda else 0)
        self.io_backend = io_backend
        options = replace(options, threads=options.threads or (16 if cuda else 1))
        # CPU: one backend streams the shares, one the direct items (opened now: a bad backend
        # name fails before any collective); CUDA: one backend run per group (_load_groups),
        # all on one staging (a CUDA backend's pinned ring), made here
        self._share_reader: Optional[ReadBackend] = None
        self._own_reader: Optional[ReadBackend] = None
        if cuda:
            options = shared_staging(self.plan, self.device, options, io_backend)
        else:
            self._share_reader = open_backend(self.shares, self.device,
                                              replace(options, mode="owned"), io_backend)
            self._own_reader = open_backend(self.own, self.device, options, io_backend)
        self.options = replace(options, mode="owned")
        self._device_stats: list[ReadStats] = []
        self.stats = ReadStats()
        self.sent_bytes = self.received_bytes = 0
        self.exchange_seconds = self.wait_seconds = self.link_setup_seconds = 0.0
        self.all_to_alls = 0
        self.error: Optional[BaseException] = None

    def load(self, destinations: Optional[Mapping[str, torch.Tensor]] = None
             ) -> dict[str, torch.Tensor]:
        """Every target (``destinations``: copied into the caller's tensors)."""
        return collect(self, destinations)

    def report(self) -> dict[str, Any]:
        """The exchange's counters (``RankReport.extra["redistribute"]``)."""
        return {"redistribute": {
            "tensors": len(self.exchange.targets),
            "sent_bytes": self.sent_bytes, "received_bytes": self.received_bytes,
            "exchange_seconds": round(self.exchange_seconds, 4),
            "wait_seconds": round(self.wait_seconds, 4), "all_to_alls": self.all_to_alls,
            "link_setup_seconds": round(self.link_setup_seconds, 4)}}

    def groups(self) -> list[list[ExchangeItem]]:
        """The planned batches, consecutive ones merged up to ``group_bytes`` of share bytes
        (0: one all-to-all per planned batch).

        Every rank of the group must run the same all-to-alls, so the merge is decided from
        the plan alone, identically on every rank: a batch weighs its largest share (the
        same number on every rank), never this rank's own share bytes (those differ by a row
        between ranks, and are 0 on a rank that reads no row of a one-row chunk)."""
        out: list[list[ExchangeItem]] = []
        used = 0
        for batch in self.exchange.batches():
            size = sum(max(n for _, n in i.rows) * i.row_bytes for i in batch)
            if out and self.group_bytes and used + size <= self.group_bytes:
                out[-1] += batch
                used += size
            else:
                out.append(list(batch))
                used = size
        return out

    # ---- the reads (background thread) --------------------------------------------------
    def _load_groups(self, groups: list[list[ExchangeItem]], ready: "queue.Queue[Any]",
                     stop: threading.Event) -> None:
        """Reads each group's shares, then the direct items; puts each result (None after a
        failure: the exchange goes on with zeros) on ``ready``."""
        def put(value: Any) -> None:
            while not stop.is_set():
                try:
                    ready.put(value, timeout=0.1)
                    return
                except queue.Full:
                    continue

        if self._share_reader is None:
            def load(plan: RankPlan) -> dict[str, torch.Tensor]:
                # inside the try: a failure to open the backend is reported; every group runs
                # on the staging made in __init__ (a CUDA backend's pinned ring)
                backend = open_backend(plan, self.device, self.options, self.io_backend)
                self._device_stats.append(backend.stats)
                return backend.load()
        else:
            stream = iter(self._share_reader)

            def load(plan: RankPlan) -> dict[str, torch.Tensor]:
                return dict(next(stream) for _ in plan.items)  # the reader keeps plan order
        for group in groups:
            if stop.is_set():
                return
            loaded = None
            if self.error is None:
                try:
                    loaded = load(replace(self.shares, items=tuple(i.share for i in group)))
                except Exception as exc:  # noqa: BLE001 - raised after the exchange
                    self.error = exc
            put(loaded)
        if self.error is None:
            try:
                if self._share_reader is None:
                    put(load(self.own))
                    return
                next(stream, None)  # lets the share reader finish (identity checks, close)
            except Exception as exc:  # noqa: BLE001
                self.error = exc
        put(None)

    def _dummy(self, item: ExchangeItem) -> torch.Tensor:
        return torch.zeros(item.share.shape, dtype=DTYPES[item.dtype][0], device=self.device)

    def _open_link(self) -> None:
        """One tiny all-to-all: NCCL creates the TP group's communicator on its first
        collective (seconds on a fresh process group), so this runs it while the background
        thread reads the first group instead of after it."""
        tp = len(self.exchange.group)
        buf = torch.zeros(tp, dtype=torch.uint8, device=self.device)
        self.comm.all_to_all_bytes(torch.empty_like(buf), [1] * tp, buf, [1] * tp)

    # ---- the exchange -------------------------------------------------------------------
    def _exchange(self, batch: list[ExchangeItem], shares: list[torch.Tensor],
                  outputs: dict[str, torch.Tensor]) -> None:
        ex = self.exchange
        me, tp = ex.tp_rank, len(ex.group)
        send_splits = [sum(i.piece_bytes(me, q) for i in batch) for q in range(tp)]
        recv_splits = [sum(i.piece_bytes(p, me) for i in batch) for p in range(tp)]
        send = torch.empty(sum(send_splits), dtype=torch.uint8, device=self.device)
        pos = 0
        for q in range(tp):
            for item, share in zip(batch, shares):
                a, n = item.rows[me]
                piece = _gather_rows(share, item, a, n, q)  # a strided view: one copy
                send[pos:pos + piece.numel()].view(piece.shape).copy_(piece)
                pos += piece.numel()
        for item in batch:
            if item.first:
                outputs[item.target] = torch.empty(item.out_shape(me),
                                                   dtype=DTYPES[item.dtype][0],
                                                   device=self.device)
        total = sum(recv_splits)
        if len(batch) == 1:  # one chunk: its pieces arrive in order, straight into the output
            at = batch[0].out_offset(me)
            recv = bytes_view(outputs[batch[0].target]).reshape(-1)[at:at + total]
        else:
            recv = torch.empty(total, dtype=torch.uint8, device=self.device)
        self.comm.all_to_all_bytes(recv, recv_splits, send, send_splits)
        self.all_to_alls += 1
        self.sent_bytes += sum(send_splits) - send_splits[me]
        self.received_bytes += sum(recv_splits) - recv_splits[me]
        pos = 0
        for p in range(tp) if len(batch) > 1 else ():  # several: scatter into the outputs
            for item in batch:
                n = item.piece_bytes(p, me)
                if n:
                    at = item.out_offset(me) + sum(item.piece_bytes(s, me) for s in range(p))
                    flat = bytes_view(outputs[item.target]).reshape(-1)
                    flat[at:at + n].copy_(recv[pos:pos + n])
                pos += n
        if self.device.type == "cuda":
            # outputs complete before they are handed out, and ``send`` / ``recv`` / the shares
            # freed only after this stream (which waits for NCCL) is done: the reads thread's
            # DeviceLoader may get a freed block at once and write it from its own streams
            torch.cuda.current_stream(self.device).synchronize()
        del send, recv

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        start = time.perf_counter()
        groups = self.groups()
        ready: "queue.Queue[Any]" = queue.Queue(maxsize=1)
        stop = threading.Event()
        reads = threading.Thread(target=self._load_groups, args=(groups, ready, stop),
                                 name="pploader-exchange-reads", daemon=True)
        reads.start()
        try:
            t0 = time.perf_counter()
            self._open_link()  # while the first group is read
            self.link_setup_seconds = time.perf_counter() - t0
            outputs: dict[str, torch.Tensor] = {}
            for group in groups:
                t0 = time.perf_counter()
                loaded = ready.get()
                t1 = time.perf_counter()
                self.wait_seconds += t1 - t0
                if self.error is None and self.cancel is not None and self.cancel.is_set():
                    self.error = RuntimeError("cancelled: another rank failed")
                shares = [loaded[i.share.target] if loaded is not None else self._dummy(i)
                          for i in group]
                del loaded
                self._exchange(group, shares, outputs)
                del shares
                self.exchange_seconds += time.perf_counter() - t1
                if self.error is None:
                    for item in group:
                        if item.last:
                            yield item.target, outputs.pop(item.target)
            t0 = time.perf_counter()
            own = ready.get()  # CUDA: the direct items (read while the last group was swapped)
            self.wait_seconds += time.perf_counter() - t0
            reads.join()
            if self.error is not None:
                raise self.error
            if own is not None:
                yield from own.items()
            elif self._own_reader is not None:
                yield from self._own_reader
        finally:
            stop.set()
            reads.join()
            self.stats = sum_stats([*(r.stats for r in (self._share_reader, self._own_reader)
                                      if r is not None), *self._device_stats],
                                   time.perf_counter() - start)


def _gather_rows(share: torch.Tensor, item: ExchangeItem, first: int, rows: int,
                 dst: int) -> torch.Tensor:
    """Rank ``dst``'s slice inside rows ``[first, first + rows)`` (this share), as uint8 with
    the last dim in bytes; a view when the slice is one interval per dim."""
    sel = piece_selection(item.selections[dst], first, first + rows)
    if not rows:
        return torch.empty(0, dtype=torch.uint8, device=share.device)
    t = bytes_view(share)
    size, last = share.element_size(), share.dim() - 1
    for dim, intervals in sel.dims:
        scale = size if dim == last else 1
        parts = [t.narrow(dim, s * scale, k * scale) for s, k in intervals]
        if not parts:
            return torch.empty(0, dtype=torch.uint8, device=share.device)
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    return t
