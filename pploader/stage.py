"""The public load path for one rank: plan its stage, stream it, keep it.

These functions take an explicit Topology and never touch process groups themselves; pass a
``Comm`` to get fail-together semantics, aggregated progress and cancellation.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from .planning.checkpoint import open_checkpoint
from .planning.dtypes import cast_stream
from .planning.plan import DEFAULT_EXCHANGE_COST, Partition, RankPlan, plan_mtp
from .planning.shard import DEFAULT_RANGE_COST_BYTES
from .planning.spec import load_spec
from .planning.stage import StagePlan, plan_stage
from .planning.topology import Topology
from .io.backend import ReadOptions, ReadStats
from .io.registry import open_backend
from .io.transfer import open_transfer
from .errors import ArgumentError
from .report import RankReport, current_rss_bytes, peak_rss_bytes, reset_peak_rss

if TYPE_CHECKING:  # pragma: no cover
    from .distributed.comm import Comm
    from .io.device import PinnedRing

logger = logging.getLogger(__name__)

__all__ = ["StagePlan", "plan_stage", "iter_stage_weights", "load_stage", "StageResult",
           "iter_mtp_weights"]


def iter_stage_weights(model: "StagePlan | os.PathLike | str",
                       topology: Optional[Topology] = None, *,
                       partition: Partition = "even", window_bytes: Optional[int] = None,
                       threads: Optional[int] = None, mode: str = "owned",
                       cancel: Optional[threading.Event] = None,
                       on_progress: Optional[Callable[[int], None]] = None,
                       comm: Optional["Comm"] = None, read_once: bool = False,
                       range_cost_bytes: int = DEFAULT_RANGE_COST_BYTES,
                       exchange_cost: Optional[float] = DEFAULT_EXCHANGE_COST,
                       device: "str | torch.device" = "cpu",
                       io_backend: Optional[str] = None,
                       device_window_bytes: Optional[int] = None,
                       ring: Optional["PinnedRing"] = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of this rank's stage, lazily, with bounded memory, on ``device``.

    On a GPU (``device="cuda:N"``) the tensors arrive already on the device, read through
    the pinned ring under a bounded device budget (``device_window_bytes``, default 2 GiB:
    about that much of the stream's tensors exist at once), each handed over as soon as it
    has landed and released once the consumer moves on, so an engine's
    ``param.copy_(tensor)`` is a device-to-device copy that overlaps the reads. ``ring``: staging made ahead (``io.registry.prepare_staging``, page-locked while
    the engine builds its model), stopped before the first read.

    ``model`` is a ``StagePlan`` (from :func:`plan_stage`: an engine that needed the window
    first, to build its stage, streams that same plan; nothing is planned twice) or a model
    directory with ``topology`` (and ``partition``, ``read_once``). Feed it to a serving
    stack's ``load_weights(weights)`` unchanged. The plan's transfer runs here
    (io/transfer/): with ``comm``, the read-once kinds and the TP exchange move bytes between
    ranks (every rank of the group must iterate); without one, exchanged slices are read
    directly.
    """
    from .arguments import check_type
    check_type("topology", topology, Topology, "a Topology")
    if ring is not None:
        from .io.pinned_ring import PinnedRing
        check_type("ring", ring, PinnedRing, "a PinnedRing (pploader.start_staging)")
    if comm is not None:
        from .distributed.comm import Comm
        check_type("comm", comm, Comm, "a pploader.Comm")
    if isinstance(model, StagePlan):
        if topology is not None and topology != model.plan.topology:
            raise ArgumentError(f"iter_stage_weights: topology {topology.describe()} differs "
                                f"from the StagePlan's {model.plan.topology.describe()}",
                                argument="topology")
        if read_once and model.kind != "stage_read_once":
            raise ArgumentError("read_once is planned: pass plan_stage(..., read_once=True)'s "
                                "plan", argument="read_once")
        staged = model
    elif topology is None:
        raise ArgumentError("iter_stage_weights(model_dir, topology): topology missing "
                            "(or pass a StagePlan from plan_stage)", argument="topology")
    else:
        staged = plan_stage(model, topology, partition=partition, read_once=read_once,
                            range_cost_bytes=range_cost_bytes, exchange_cost=exchange_cost)
    if ring is not None:
        ring.stop_preparing()  # never page-lock beside the load's own reads
    stream = open_transfer(staged, device, ReadOptions(
        window_bytes=window_bytes, threads=threads, mode=mode, cancel=cancel,
        on_progress=on_progress, ring=ring, device_window_bytes=device_window_bytes),
        comm, io_backend)
    yield from cast_stream(iter(stream), staged.casts)


def iter_mtp_weights(model_dir: os.PathLike | str, mtp_layer: int, *,
                     topology: Optional[Topology] = None, window_bytes: Optional[int] = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """A draft model's weights: MTP layer ``mtp_layer`` renamed to layer 0, streamed."""
    spec = load_spec(model_dir)
    plan = plan_mtp(spec, open_checkpoint(model_dir), mtp_layer, topology)
    yield from open_backend(plan, "cpu", ReadOptions(window_bytes=window_bytes))


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
               io_backend: Optional[str] = None) -> StageResult:
    """Read a planned stage into owned tensors on ``device`` and measure it.

    The plan's transfer (``plan_stage(read_once=..., node_ranks=...)``, or the TP exchange
    the plan chose) runs here through ``comm`` (every rank of its group calls this): gloo on
    CPU, NCCL on CUDA. Without a Comm, exchanged slices are read directly.

    ``memory_budget_bytes`` (CPU reader) caps what may be allocated: exceeding it raises a
    MemoryBudgetError naming the tensor and bytes (how tests simulate running out of memory).

    ``io_backend`` (io/registry.py; None = ``auto``): the read backend of every read of the
    transfer: on CUDA by default ``pinned`` (a pinned staging ring straight into device
    tensors; ``ring`` may be passed in to reuse one across loads), on CPU ``threaded`` (the
    windowed Reader); ``buffered`` is the plain-``read()`` reference.
    """
    from .arguments import check_type
    check_type("staged", staged, StagePlan, "a StagePlan (from plan_stage)", optional=False)
    plan = staged.plan
    rss_before = current_rss_bytes()
    reset_peak_rss()
    reader = open_transfer(staged, device, ReadOptions(
        window_bytes=window_bytes, threads=threads, cancel=cancel, on_progress=on_progress,
        memory_budget_bytes=memory_budget_bytes, ring=ring), comm, io_backend)
    state = dict(cast_stream(reader.load().items(), staged.casts))  # planning/dtypes.py
    t = plan.topology
    report = RankReport(
        rank=t.rank, pp_rank=t.pp_rank, tp_rank=t.tp_rank, ep_rank=t.ep_rank,
        start_layer=plan.window.start_layer, end_layer=plan.window.end_layer,
        tensors=len(state), ideal_bytes=plan.ideal_bytes, read_bytes=reader.stats.read_bytes,
        header_bytes=plan.header_bytes, seconds=reader.stats.seconds,
        peak_rss_bytes=peak_rss_bytes(), rss_growth_bytes=peak_rss_bytes() - rss_before,
        files=len(plan.files))
    report.extra.update(reader.report())
    logger.info("%s: loaded %d tensors, %d bytes read in %.3f s (%.2f GB/s) to %s (%s)",
                t.describe(), len(state), reader.stats.read_bytes, reader.stats.seconds,
                report.gbps, device, reader.kind)
    return StageResult(state, plan, reader.stats, report)
