"""The public load path for one rank: plan its stage, stream it, keep it.

These functions take an explicit Topology and never touch process groups themselves; pass a
``Comm`` to get fail-together semantics, aggregated progress and cancellation.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Optional, Sequence

import torch

from .planning.checkpoint import DTYPES, CheckpointIndex, open_checkpoint
from .planning.dtypes import cast_stream, dtype_casts
from .errors import PPLoaderError
from .planning.plan import (DEFAULT_EXCHANGE_COST, Partition, RankPlan, checkpoint_roles,
                            make_windows, plan_mtp, plan_rank)
from .io.backend import ReadBackend, ReadOptions, ReadStats
from .io.registry import open_backend
from .planning.share import share_reads
from .planning.shard import DEFAULT_RANGE_COST_BYTES
from .report import RankReport, current_rss_bytes, peak_rss_bytes, reset_peak_rss
from .planning.spec import ModelSpec, load_spec
from .planning.topology import Topology

if TYPE_CHECKING:  # pragma: no cover
    from .distributed.comm import Comm
    from .io.device import PinnedRing
    from .io.exchange import ExchangeReader, NodeReadOnceReader

logger = logging.getLogger(__name__)

__all__ = ["StagePlan", "plan_stage", "iter_stage_weights", "load_stage", "StageResult",
           "iter_mtp_weights", "ReadOnceReader"]


@dataclass(frozen=True)
class StagePlan:
    """A rank's plan together with what it was made from."""

    spec: ModelSpec
    index: CheckpointIndex
    plan: RankPlan
    casts: Mapping[str, torch.dtype] = field(default_factory=dict)  # see planning/dtypes.py


def plan_stage(model_dir: os.PathLike | str, topology: Topology, *,
               partition: Partition = "even", strict: bool = True,
               allowed_roots: Sequence[str] = (),
               range_cost_bytes: int = DEFAULT_RANGE_COST_BYTES,
               exchange_cost: Optional[float] = DEFAULT_EXCHANGE_COST,
               exchange_batch_bytes: Optional[int] = None) -> StagePlan:
    """Plan this rank's stage from config.json and the needed shards' headers.

    Every check (headers, shapes, dtype policy) happens here, before anything is allocated;
    errors name this rank. ``range_cost_bytes``: what one extra positional read costs in
    bytes of transfer; strided (dim-1) TP slices are read row by row when that is cheaper
    than reading the covering box (0 = always row by row, i.e. exactly the ideal bytes).
    ``exchange_cost`` (None = off): per tensor, strided slices may instead be read as row
    shares and redistributed over the TP group when loaded with a Comm (planning/redistribute.py)."""
    try:
        spec = load_spec(model_dir, allowed_roots=allowed_roots)
        index = open_checkpoint(model_dir, allowed_roots=allowed_roots)
        spec = spec.for_checkpoint(index.weight_map)  # the naming on disk (e.g. fused experts)
        windows = make_windows(spec, index, topology.pp_size, partition)
        plan = plan_rank(spec, index, topology, windows[topology.pp_rank], strict=strict,
                         range_cost_bytes=range_cost_bytes, exchange_cost=exchange_cost,
                         exchange_batch_bytes=exchange_batch_bytes)
        staged = StagePlan(spec, index, plan, dtype_casts(spec, plan))
        logger.info("%s: planned layers %d-%d%s%s: %d tensors, %d bytes to read (ideal %d) "
                    "from %d file(s)", topology.describe(), plan.window.start_layer,
                    plan.window.end_layer - 1, " + embedding" if plan.window.has_embed else "",
                    " + head" if plan.window.has_head else "", len(plan.items), plan.planned_read_bytes,
                    plan.ideal_bytes, len(plan.files))
        return staged
    except PPLoaderError as exc:
        raise exc.on_rank(topology.rank)


def iter_stage_weights(model: "StagePlan | os.PathLike | str",
                       topology: Optional[Topology] = None, *,
                       partition: Partition = "even", window_bytes: Optional[int] = None,
                       threads: int = 1, mode: str = "owned",
                       cancel: Optional[threading.Event] = None,
                       on_progress: Optional[Callable[[int], None]] = None,
                       comm: Optional["Comm"] = None, read_once: bool = False,
                       range_cost_bytes: int = DEFAULT_RANGE_COST_BYTES,
                       exchange_cost: Optional[float] = DEFAULT_EXCHANGE_COST
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of this rank's stage, lazily, with bounded host memory.

    ``model`` is a ``StagePlan`` (from :func:`plan_stage`: an engine that needed the window
    first, to build its stage, streams that same plan; nothing is planned twice) or a model
    directory with ``topology`` (and ``partition``). Feed it to a serving stack's
    ``load_weights(weights)`` unchanged. ``read_once`` (needs ``comm``; every rank of the stage
    must iterate) reads replicated tensors once per group and broadcasts them, see
    :class:`ReadOnceReader`. With ``comm`` (every rank of each TP group must iterate), strided
    TP slices planned for redistribution are read as row shares and exchanged (io/exchange.py);
    without one they are read directly.
    """
    if isinstance(model, StagePlan):
        if topology is not None and topology != model.plan.topology:
            raise ValueError(f"iter_stage_weights: topology {topology.describe()} differs from "
                             f"the StagePlan's {model.plan.topology.describe()}")
        staged = model
    elif topology is None:
        raise ValueError("iter_stage_weights(model_dir, topology): topology missing "
                         "(or pass a StagePlan from plan_stage)")
    else:
        staged = plan_stage(model, topology, partition=partition,
                            range_cost_bytes=range_cost_bytes, exchange_cost=exchange_cost)
    if comm is not None and not read_once and staged.plan.redistribute is not None:
        from .io.exchange import ExchangeReader
        stream: Iterator = iter(ExchangeReader(staged.plan, comm, window_bytes=window_bytes,
                                               threads=threads, mode=mode, cancel=cancel,
                                               on_progress=on_progress))
    elif read_once:
        if comm is None:
            raise ValueError("read_once needs a Comm (the broadcasts go through it)")
        if mode != "owned":
            raise ValueError("read_once yields owned tensors only")
        stream = iter(ReadOnceReader(staged, comm, window_bytes=window_bytes,
                                               threads=threads, cancel=cancel,
                                               on_progress=on_progress))
    else:
        stream = iter(open_backend(staged.plan, "cpu", ReadOptions(
            window_bytes=window_bytes, threads=threads, mode=mode, cancel=cancel,
            on_progress=on_progress)))
    yield from cast_stream(stream, staged.casts)


def iter_mtp_weights(model_dir: os.PathLike | str, mtp_layer: int, *,
                     topology: Optional[Topology] = None, window_bytes: Optional[int] = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """A draft model's weights: MTP layer ``mtp_layer`` renamed to layer 0, streamed."""
    spec = load_spec(model_dir)
    plan = plan_mtp(spec, open_checkpoint(model_dir), mtp_layer, topology)
    yield from open_backend(plan, "cpu", ReadOptions(window_bytes=window_bytes))


class ReadOnceReader:
    """Read once for replicas: items that several ranks of the stage plan identically
    (replicated tensors; with EP > 1 every non-expert slice) are read from storage by one rank
    of their group and broadcast through ``comm`` (planning/share.py decides who reads what).

    Yields ``(target, tensor)`` like a Reader: the shared items first, in the global broadcast
    order, then this rank's own items. Every rank of the stage must iterate it to the end.
    ``stats.read_bytes`` counts storage bytes only (received bytes are in ``received_bytes``).

    It pays when storage is slower than the interconnect (network file systems, a cold cache
    shared by many ranks); on local NVMe or a warm page cache it only adds synchronisation,
    so it is off by default (``load_stage(read_once=False)``).
    """

    def __init__(self, staged: StagePlan, comm: "Comm", *, window_bytes: Optional[int] = None,
                 threads: Optional[int] = None, cancel: Optional[threading.Event] = None,
                 on_progress: Optional[Callable[[int], None]] = None,
                 memory_budget_bytes: Optional[int] = None,
                 device: str | torch.device = "cpu", ring: Optional["PinnedRing"] = None,
                 io_backend: Optional[str] = None) -> None:
        plan, topo = staged.plan, staged.plan.topology
        self.device, self.ring, self.cancel = torch.device(device), ring, cancel
        roles = checkpoint_roles(staged.spec, staged.index)  # classified once for the group
        plans = [plan if r == topo.rank else plan_rank(staged.spec, staged.index,
                                                       topo.with_rank(r), plan.window,
                                                       strict=False,
                                                       range_cost_bytes=plan.range_cost_bytes,
                                                       exchange_cost=None, roles=roles)
                 for r in topo.stage_group()]
        self.shared = share_reads(plans)[topo.rank]
        self.comm, self.stats = comm, ReadStats()
        options = ReadOptions(window_bytes=window_bytes, threads=threads, cancel=cancel,
                              on_progress=on_progress, memory_budget_bytes=memory_budget_bytes,
                              ring=ring)
        # this rank's shared reads, then its own items: two backends of one load, the second
        # on the first's staging (a CUDA backend's pinned ring) when it has one
        first = open_backend(self.shared.reads, self.device, options, io_backend)
        options = replace(options, ring=getattr(first, "ring", ring))
        self._readers: tuple[ReadBackend, ReadBackend] = (
            first, open_backend(self.shared.own, self.device, options, io_backend))
        self.ring = options.ring
        self.received_bytes, self._on_progress = 0, on_progress

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        rank = self.shared.rank
        start = time.perf_counter()
        try:
            reads, own = iter(self._readers[0]), iter(self._readers[1])
            for s in self.shared.shared:
                if s.reader == rank:
                    target, tensor = next(reads)
                else:
                    target = s.item.target
                    tensor = torch.empty(s.item.shape, dtype=DTYPES[s.item.dtype][0],
                                         device=self.device)
                    self.received_bytes += s.item.nbytes
                self.comm.broadcast_bytes(tensor, s.reader, s.group)
                if s.reader != rank and self._on_progress is not None:
                    self._on_progress(s.item.read_bytes)  # counts as loaded, as planned
                yield target, tensor
            next(reads, None)  # lets the reader finish (identity checks, close)
            yield from own
        finally:
            for field_name in ("read_bytes", "items", "syscalls"):
                setattr(self.stats, field_name, sum(getattr(r.stats, field_name)
                                                    for r in self._readers))
            self.stats.seconds = time.perf_counter() - start  # reads + broadcasts
            self.stats.peak_inflight_bytes = max(r.stats.peak_inflight_bytes
                                                 for r in self._readers)


@dataclass
class StageResult:
    """A loaded stage: tensors by target name, the plan, the reader's stats, the report."""

    state_dict: dict[str, torch.Tensor]
    plan: RankPlan
    stats: ReadStats
    report: RankReport


def load_stage(staged: StagePlan, *, window_bytes: Optional[int] = None,
               threads: Optional[int] = None, device: str | torch.device = "cpu",
               ring: Optional["PinnedRing"] = None, cancel: Optional[threading.Event] = None,
               on_progress: Optional[Callable[[int], None]] = None,
               memory_budget_bytes: Optional[int] = None, comm: Optional["Comm"] = None,
               read_once: bool = False, redistribute: Optional[bool] = None,
               node_ranks: Optional[Sequence[int]] = None,
               partition: Partition = "even", io_backend: Optional[str] = None) -> StageResult:
    """Read a planned stage into owned tensors on ``device`` and measure it.

    ``read_once`` (needs ``comm``, all ranks of the stage call it): replicated tensors are
    read by one rank of their group and broadcast (:class:`ReadOnceReader`; default off), on
    CPU (gloo) or on CUDA (DeviceLoader + NCCL broadcasts).

    ``redistribute`` (default: whenever ``comm`` is given and the plan chose it for some
    tensor; every rank of each TP group must call it): strided TP slices are read as row
    shares and exchanged with all-to-alls over the TP group (io/exchange.py): gloo on CPU,
    NCCL on CUDA. Without a Comm, or with ``redistribute=False``, they are read directly.

    ``node_ranks`` (needs ``comm``; CPU; every rank of the node calls it): read once per node:
    bytes several ranks of this node need (replicated tensors, the tied head) are read by one
    and sent to the others (exchange.NodeReadOnceReader; ``partition`` = the plan's).

    ``memory_budget_bytes`` (CPU reader) caps what may be allocated: exceeding it raises a
    MemoryBudgetError naming the tensor and bytes (how tests simulate running out of memory).

    ``io_backend`` (io/registry.py; None = ``auto``): the read backend of every read (direct,
    ``read_once``, the TP exchange's row shares, read once per node): on CUDA by default
    ``pinned`` (a pinned staging ring straight into device tensors; ``ring`` may be passed in
    to reuse one across loads), on CPU ``threaded`` (the windowed Reader); ``buffered`` is the
    plain-``read()`` reference.
    """
    plan = staged.plan
    rss_before = current_rss_bytes()
    reset_peak_rss()
    reader: "ReadBackend | ReadOnceReader | ExchangeReader | NodeReadOnceReader"
    if (read_once or redistribute or node_ranks is not None) and comm is None:
        raise ValueError("read_once / redistribute / node_ranks need a Comm (the collectives "
                         "go through it)")
    if node_ranks is not None and (read_once or torch.device(device).type != "cpu"):
        raise ValueError("node_ranks (read once per node) is a CPU load of its own: not with "
                         "read_once, not on a device")
    exchange = (redistribute is not False and comm is not None and not read_once
                and node_ranks is None and plan.redistribute is not None)
    if node_ranks is not None:
        from .io.exchange import NodeReadOnceReader
        reader = NodeReadOnceReader(staged, comm, node_ranks,  # type: ignore[arg-type]
                                    partition=partition, window_bytes=window_bytes,
                                    threads=threads or 1, cancel=cancel, on_progress=on_progress,
                                    io_backend=io_backend)
        state = dict(reader)
    elif exchange:
        from .io.exchange import ExchangeReader
        cuda = torch.device(device).type == "cuda"
        reader = ExchangeReader(plan, comm, window_bytes=window_bytes,  # type: ignore[arg-type]
                                threads=threads or (16 if cuda else 1), cancel=cancel,
                                on_progress=on_progress, device=device, ring=ring,
                                memory_budget_bytes=memory_budget_bytes, io_backend=io_backend)
        state = dict(reader)
    elif read_once:
        reader = ReadOnceReader(staged, comm, window_bytes=window_bytes,  # type: ignore[arg-type]
                                threads=threads, cancel=cancel,
                                on_progress=on_progress, device=device, ring=ring,
                                memory_budget_bytes=memory_budget_bytes, io_backend=io_backend)
        state = dict(reader)
    else:
        reader = open_backend(plan, device, ReadOptions(
            window_bytes=window_bytes, threads=threads, cancel=cancel, on_progress=on_progress,
            memory_budget_bytes=memory_budget_bytes, ring=ring), io_backend)
        state = reader.load()
    state = dict(cast_stream(state.items(), staged.casts))  # dtype policy (planning/dtypes.py)
    t = plan.topology
    report = RankReport(
        rank=t.rank, pp_rank=t.pp_rank, tp_rank=t.tp_rank, ep_rank=t.ep_rank,
        start_layer=plan.window.start_layer, end_layer=plan.window.end_layer,
        tensors=len(state), ideal_bytes=plan.ideal_bytes, read_bytes=reader.stats.read_bytes,
        header_bytes=plan.header_bytes, seconds=reader.stats.seconds,
        peak_rss_bytes=peak_rss_bytes(), rss_growth_bytes=peak_rss_bytes() - rss_before,
        files=len(plan.files))
    logger.info("%s: loaded %d tensors, %d bytes read in %.3f s (%.2f GB/s) to %s",
                t.describe(), len(state), reader.stats.read_bytes, reader.stats.seconds,
                report.gbps, device)
    if exchange:
        report.extra["redistribute"] = {
            "tensors": len(plan.redistribute.targets),  # type: ignore[union-attr]
            "sent_bytes": reader.sent_bytes, "received_bytes": reader.received_bytes,  # type: ignore[union-attr]
            "exchange_seconds": round(reader.exchange_seconds, 4),  # type: ignore[union-attr]
            "wait_seconds": round(reader.wait_seconds, 4),  # type: ignore[union-attr]
            "all_to_alls": reader.all_to_alls,  # type: ignore[union-attr]
            "link_setup_seconds": round(reader.link_setup_seconds, 4)}  # type: ignore[union-attr]
    return StageResult(state, plan, reader.stats, report)
