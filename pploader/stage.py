"""The public load path for one rank: plan its stage, stream it, keep it.

These functions take an explicit Topology and never touch process groups themselves; pass a
``Comm`` to get fail-together semantics, aggregated progress and cancellation.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Optional, Sequence

import torch

from .checkpoint import CheckpointIndex, open_checkpoint
from .dtypes import cast_stream, dtype_casts
from .errors import PPLoaderError
from .plan import Partition, RankPlan, make_windows, plan_mtp, plan_rank
from .read import Reader, ReadStats
from .report import RankReport, current_rss_bytes, peak_rss_bytes, reset_peak_rss
from .spec import ModelSpec, load_spec
from .topology import Topology

__all__ = ["StagePlan", "plan_stage", "iter_stage_weights", "load_stage", "StageResult",
           "iter_mtp_weights"]


@dataclass(frozen=True)
class StagePlan:
    """A rank's plan together with what it was made from."""

    spec: ModelSpec
    index: CheckpointIndex
    plan: RankPlan
    casts: Mapping[str, torch.dtype] = field(default_factory=dict)  # see dtypes.py


def plan_stage(model_dir: os.PathLike | str, topology: Topology, *,
               partition: Partition = "even", strict: bool = True,
               allowed_roots: Sequence[str] = ()) -> StagePlan:
    """Plan this rank's stage from config.json and the needed shards' headers.

    Every check (headers, shapes, dtype policy) happens here, before anything is allocated;
    errors name this rank."""
    try:
        spec = load_spec(model_dir)
        index = open_checkpoint(model_dir, allowed_roots=allowed_roots)
        windows = make_windows(spec, index, topology.pp_size, partition)
        plan = plan_rank(spec, index, topology, windows[topology.pp_rank], strict=strict)
        return StagePlan(spec, index, plan, dtype_casts(spec, plan))
    except PPLoaderError as exc:
        raise exc.on_rank(topology.rank)


def iter_stage_weights(model_dir: os.PathLike | str, topology: Topology, *,
                       partition: Partition = "even", window_bytes: Optional[int] = None,
                       threads: int = 1, mode: str = "owned",
                       cancel: Optional[threading.Event] = None,
                       on_progress: Optional[Callable[[int], None]] = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of this rank's stage, lazily, with bounded host memory.

    Feed it to a serving stack's ``load_weights(weights)`` unchanged.
    """
    staged = plan_stage(model_dir, topology, partition=partition)
    yield from cast_stream(Reader(staged.plan, window_bytes=window_bytes, threads=threads,
                                  mode=mode, cancel=cancel, on_progress=on_progress),
                           staged.casts)


def iter_mtp_weights(model_dir: os.PathLike | str, mtp_layer: int, *,
                     topology: Optional[Topology] = None, window_bytes: Optional[int] = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """A draft model's weights: MTP layer ``mtp_layer`` renamed to layer 0, streamed."""
    spec = load_spec(model_dir)
    plan = plan_mtp(spec, open_checkpoint(model_dir), mtp_layer, topology)
    yield from Reader(plan, window_bytes=window_bytes)


@dataclass
class StageResult:
    """A loaded stage: tensors by target name, the plan, the reader's stats, the report."""

    state_dict: dict[str, torch.Tensor]
    plan: RankPlan
    stats: ReadStats
    report: RankReport


def load_stage(staged: StagePlan, *, window_bytes: Optional[int] = None, threads: int = 1,
               cancel: Optional[threading.Event] = None,
               on_progress: Optional[Callable[[int], None]] = None,
               memory_budget_bytes: Optional[int] = None) -> StageResult:
    """Read a planned stage into owned tensors and measure it.

    ``memory_budget_bytes`` caps what the reader may allocate: exceeding it raises a
    MemoryBudgetError naming the tensor and bytes (how tests simulate running out of memory).
    """
    plan = staged.plan
    rss_before = current_rss_bytes()
    reset_peak_rss()
    reader = Reader(plan, window_bytes=window_bytes, threads=threads, cancel=cancel,
                    on_progress=on_progress, memory_budget_bytes=memory_budget_bytes)
    state = dict(cast_stream(reader, staged.casts))  # dtype policy (dtypes.py)
    t = plan.topology
    report = RankReport(
        rank=t.rank, pp_rank=t.pp_rank, tp_rank=t.tp_rank, ep_rank=t.ep_rank,
        start_layer=plan.window.start_layer, end_layer=plan.window.end_layer,
        tensors=len(state), ideal_bytes=plan.ideal_bytes, read_bytes=reader.stats.read_bytes,
        header_bytes=plan.header_bytes, seconds=reader.stats.seconds,
        peak_rss_bytes=peak_rss_bytes(), rss_growth_bytes=peak_rss_bytes() - rss_before,
        files=len(plan.files))
    return StageResult(state, plan, reader.stats, report)
