"""A job's load, one rank's part: the agreed sequence every rank runs, and the job's plan.

:func:`load_pipeline_stage` is what ``pploader load`` runs on every rank, and what an embedder
with a process group calls instead of rebuilding it::

    plan this rank's stage ──► agree ──► load it (+ its cache pools) ──► agree

Each arrow is one :func:`pploader.distributed.comm.run_agreed` step: if any rank fails a step (bad
input, a bad file, an I/O error, a hang, a death), every rank raises the same
:class:`~pploader.errors.RankFailure`, naming each failing rank and its error, and no rank
goes on to the next step. Nothing here reads the environment: the caller resolves who it is
(``Comm`` / ``Topology``, ``StageLoadOptions.local_rank``) and which options apply.

:func:`plan_job` is the job's plan without launching it (``pploader plan``): every rank's
plan and cache pools from the headers, pure.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from .cache.sizing import PoolOptions, cache_costs, format_pools, pipeline_capacity, plan_pools
from .errors import ConfigError, PlanError, UsageError
from .planning.checkpoint import open_checkpoint
from .planning.dtypes import cast_codes
from .planning.stage import OpenedModel, open_model
from .planning.gcpause import without_gc
from .planning.plan import DEFAULT_EXCHANGE_COST, Partition, RankPlan, make_windows, plan_all
from .planning.shard import DEFAULT_RANGE_COST_BYTES
from .planning.spec import ModelSpec, load_spec
from .report import ProgressBar, format_table, plan_table

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from .planning.checkpoint import CheckpointIndex
    from .cache.pools import CachePools
    from .distributed.comm import Comm
    from .planning.stage import StagePlan
    from .stage import StageResult

logger = logging.getLogger(__name__)

__all__ = ["StageLoadOptions", "StageLoad", "load_pipeline_stage", "JobPlan", "plan_job"]

Device = Union[str, "torch.device", None]


@dataclass(frozen=True)
class StageLoadOptions:
    """How one rank loads its stage in :func:`load_pipeline_stage` (every field has the
    CLI's default; docs/usage.md lists the matching ``pploader load`` options).

    Planning: ``partition`` (even | balanced | vllm | sglang | an ``EngineSplit`` | layer
    counts; ``balanced`` with ``pools`` giving ``tokens``/``requests`` weighs each layer's
    cache too), ``allowed_roots``, ``range_cost_bytes``, ``exchange_cost``,
    ``exchange_batch_bytes`` (see :func:`pploader.plan_stage`); ``exchange_cost="auto"``:
    measured from the shards' page-cache residency and the device kind on every rank, rank
    0's value taken by all (:func:`measure_exchange_cost`, one agreed step before planning).

    Loading: ``device`` (None = ``cuda:<local_rank>`` when this process has a GPU, else cpu),
    ``local_rank`` (this rank's index on its node), ``window_bytes``, ``threads``,
    ``memory_budget_bytes``, ``read_once``, ``io_backend`` (see :func:`pploader.load_stage`),
    ``ranks_per_node`` (read once per node: consecutive ranks form a node, as torchrun, srun
    and mpiexec number them; None = off).

    Pools: ``pools`` (how to size them; None = no pools), ``build_pools`` (False: size
    nothing, allocate nothing; ``pools`` still sets a cache-aware ``balanced`` target),
    ``pool_device`` (None as for ``device``), ``pool_memory_from_device`` (size the pools
    from the pool device's total memory: ``PoolOptions.device_bytes`` = that memory).
    ``progress_bar``: rank 0 draws the job's bytes on stderr.
    """

    partition: Partition = "even"
    allowed_roots: Sequence[str] = ()
    range_cost_bytes: int = DEFAULT_RANGE_COST_BYTES
    exchange_cost: Union[float, str, None] = DEFAULT_EXCHANGE_COST  # or "auto"
    exchange_batch_bytes: Optional[int] = None
    device: Device = None
    local_rank: int = 0
    window_bytes: Optional[int] = None
    threads: Optional[int] = None
    memory_budget_bytes: Optional[int] = None
    read_once: bool = False
    ranks_per_node: Optional[int] = None
    io_backend: Optional[str] = None
    pools: Optional[PoolOptions] = None
    build_pools: bool = True
    pool_device: Device = None
    pool_memory_from_device: bool = False
    progress_bar: bool = False

    def __post_init__(self) -> None:
        """The CLI's ranges for every field (arguments.py): an ArgumentError naming it."""
        from .arguments import OPTIONS, check, check_paths
        object.__setattr__(self, "allowed_roots", check_paths("allowed_roots",
                                                              self.allowed_roots))
        check(range_cost_bytes=self.range_cost_bytes,
              exchange_batch_bytes=self.exchange_batch_bytes, window_bytes=self.window_bytes,
              threads=self.threads, memory_budget_bytes=self.memory_budget_bytes,
              io_backend=self.io_backend, ranks_per_node=self.ranks_per_node)
        if self.exchange_cost != "auto":
            check(exchange_cost=self.exchange_cost)
        OPTIONS["node"].check(self.local_rank, label="local_rank")


@dataclass
class StageLoad:
    """This rank's loaded stage, and what every rank agreed on.

    ``result``: this rank's tensors, plan, stats and report; ``pools``: its cache pools (None
    without ``StageLoadOptions.pools``); ``reports``: every rank's report (JSON, with
    ``"pools"``), in rank order; ``planned_bytes``: every rank's planned read bytes."""

    staged: "StagePlan"
    result: "StageResult"
    pools: Optional["CachePools"]
    reports: list[dict]
    planned_bytes: list[int]
    device: "torch.device"

    @property
    def pipeline_pools(self) -> Optional[dict]:
        """Pipeline-wide pool limits (the minimum over stages), None without pools."""
        caps = [r["pools"]["capacity"] for r in self.reports if r.get("pools")]
        return pipeline_capacity(caps) if caps else None

    def table(self, *, pools: bool = True) -> str:
        """The per-rank table ``pploader load`` prints (and the pools table, when built)."""
        text = format_table(self.reports)
        if pools and any(r.get("pools") for r in self.reports):
            text += "\n\ncache pools (per rank; its own layers only):\n" + format_pools(self.reports)
        return text


@dataclass(frozen=True)
class _Planned:
    staged: "StagePlan"
    device: "torch.device"
    pool_device: "torch.device"
    pools: Optional[PoolOptions]    # None: no pools to build


class _OpenOnce:
    """The model directory opened at most once per rank (config, index), by whichever step
    needs it first: the exchange-cost measurement, the cache-aware partition, the plan."""

    def __init__(self, model_dir: os.PathLike | str, allowed_roots: Sequence[str]) -> None:
        self.model_dir, self.allowed_roots = model_dir, allowed_roots
        self._opened: Optional[OpenedModel] = None

    def __call__(self) -> OpenedModel:
        if self._opened is None:
            self._opened = open_model(self.model_dir, allowed_roots=self.allowed_roots)
        return self._opened


def load_pipeline_stage(model_dir: os.PathLike | str, comm: "Comm",
                        options: Optional[StageLoadOptions] = None, *,
                        check_plan: Optional[Callable[["StagePlan"], None]] = None,
                        after_load: Optional[Callable[["StageResult"], None]] = None,
                        on_progress: Optional[Callable[[int], None]] = None) -> StageLoad:
    """Plan, agree, load (+ pools), agree: this rank's stage of ``model_dir`` (called on every
    rank of ``comm``'s job, each with its own options; all ranks return, or all raise).

    ``check_plan(staged)``: the caller's own checks of the plan, run in the planning step
    (raise a PPLoaderError to refuse it: it is agreed like any planning error).
    ``after_load(result)``: runs in the load step, before the pools (e.g. saving the tensors).
    ``on_progress(nbytes)``: called as bytes arrive, besides the job's progress counter.
    Failures: :class:`~pploader.errors.RankFailure` on every rank (``input_only`` when every
    failing rank found a mistake in the input while planning).

    On a GPU the read backend's staging (the pinned ring) is page-locked on a background
    thread from the start, while this rank measures, plans and agrees, and stopped before the
    load begins; the load page-locks what it did not reach. So the first load pays only the
    part that planning and agreement did not hide (all of it when they take a few ms:
    docs/benchmarks-gpu.md, fifth round).
    """
    options = options if options is not None else StageLoadOptions()
    staging = _early_staging(options)  # page-locked while this rank measures, plans, agrees
    try:
        return _load_job(model_dir, comm, options, staging, check_plan, after_load,
                         on_progress)
    finally:
        if staging is not None:
            staging.stop_preparing()


def _early_staging(options: StageLoadOptions) -> Any:
    """The read backend's host staging, started now when the load goes to a device whose
    backend has one (the pinned ring: its page-locking then overlaps planning and agreement
    instead of the load's first reads); None otherwise. Best effort: any problem here shows
    up again, agreed, in the load step."""
    from .cache.pools import pool_device
    from .io.backend import ReadOptions
    from .io.registry import prepare_staging
    try:
        device = pool_device(_device_name(options.device), local_rank=options.local_rank)
        if device.type == "cpu":
            return None
        return prepare_staging(device, ReadOptions(threads=options.threads), options.io_backend)
    except Exception as exc:  # noqa: BLE001 - the load step reports it, agreed
        logger.debug("no early staging: %s", exc)
        return None


def _load_job(model_dir: os.PathLike | str, comm: "Comm", options: StageLoadOptions,
              staging: Any, check_plan: Optional[Callable[["StagePlan"], None]],
              after_load: Optional[Callable[["StageResult"], None]],
              on_progress: Optional[Callable[[int], None]]) -> StageLoad:
    from .distributed.comm import run_agreed
    topology = comm.topology
    opened = _OpenOnce(model_dir, options.allowed_roots)
    if options.exchange_cost == "auto":  # every rank of a TP group must plan the same exchange
        asked = options

        def measure() -> float:
            from .cache.pools import pool_device
            kind = pool_device(_device_name(asked.device), local_rank=asked.local_rank).type
            return auto_exchange_cost_of(opened().index, kind)[0]
        options = replace(options, exchange_cost=run_agreed(comm, measure, share=float)[1][0])
    planned, planned_bytes = run_agreed(
        comm, lambda: _plan(model_dir, opened, topology, options, check_plan),
        share=lambda p: p.staged.progress_bytes)
    job_progress = comm.progress_adder()

    def progress(nbytes: int) -> None:
        job_progress(nbytes)
        if on_progress is not None:
            on_progress(nbytes)

    def load() -> tuple["StageResult", Optional["CachePools"], dict]:
        from .stage import load_stage
        ring = None
        if staging is not None:
            staging.stop_preparing()  # never page-lock beside the load's allocations
            ring = staging if planned.device.type != "cpu" else None
        result = load_stage(planned.staged, window_bytes=options.window_bytes,
                            threads=options.threads, device=planned.device, cancel=comm.cancel,
                            ring=ring,
                            on_progress=progress, memory_budget_bytes=options.memory_budget_bytes,
                            comm=comm, io_backend=options.io_backend)
        job_progress.flush()  # type: ignore[attr-defined]
        if after_load is not None:
            after_load(result)
        report = result.report.to_json()
        pools = None
        if planned.pools is not None:  # this stage's cache pools, after its weights
            from .cache.pools import build_rank_pools
            pools = build_rank_pools(planned.staged.spec, planned.staged.plan, planned.pools,
                                     device=planned.pool_device)
            report["pools"] = pools.report()
        return result, pools, report

    show = options.progress_bar and comm.rank == 0
    with ProgressBar(sum(planned_bytes), comm.progress_total, enabled=show):
        (result, pools, _), reports = run_agreed(comm, load, share=lambda done: done[2])
    return StageLoad(planned.staged, result, pools, reports, planned_bytes, planned.device)


def _plan(model_dir: os.PathLike | str, opened: _OpenOnce, topology: Any,
          options: StageLoadOptions, check_plan: Optional[Callable[["StagePlan"], None]]
          ) -> _Planned:
    """The planning step: devices, the partition, the plan and its transfer, the pool
    options (all input)."""
    from .cache.pools import device_memory, pool_device
    from .planning.stage import plan_stage
    device = pool_device(_device_name(options.device), local_rank=options.local_rank)
    pools_on = pool_device(_device_name(options.pool_device), local_rank=options.local_rank)
    pools = options.pools if options.build_pools else None
    if pools is not None and options.pool_memory_from_device:
        pools = replace(pools, device_bytes=device_memory(pools_on))
    partition = _cache_aware_partition(opened, topology.pp_size, topology.tp_size, options)
    if isinstance(options.exchange_cost, str):  # "auto" is resolved before planning
        raise PlanError(f"exchange_cost {options.exchange_cost!r}: give a number, None (off) or "
                        "'auto'", rank=topology.rank)
    staged = plan_stage(model_dir, topology, allowed_roots=options.allowed_roots,
                        partition=partition, range_cost_bytes=options.range_cost_bytes,
                        exchange_cost=options.exchange_cost,
                        exchange_batch_bytes=options.exchange_batch_bytes,
                        read_once=options.read_once,
                        node_ranks=_node_ranks(options.ranks_per_node, topology.rank,
                                               topology.world_size),
                        opened=opened())
    if check_plan is not None:
        check_plan(staged)
    if pools is not None:  # the cache geometry is input too: refused here, before reading
        _check_geometry(staged, topology.tp_size, topology.rank)
        _check_pool_memory(staged, pools, pools_on, topology.rank)
    return _Planned(staged, device, pools_on, pools)


def _check_pool_memory(staged: "StagePlan", pools: PoolOptions, device: "torch.device",
                       rank: int) -> None:
    """The pools these options would allocate fit the pool device (its total memory; the
    host's for CPU pools): checked from the geometry before anything is read or allocated,
    naming the option that sized them (``--requests 16777216`` asked 64 GiB of a host)."""
    import torch

    from .arguments import format_size, host_memory_bytes
    from .cache.sizing import rank_pools
    have = (int(torch.cuda.get_device_properties(device).total_memory)
            if device.type == "cuda" else host_memory_bytes())
    where = f"the pool device {device} has {format_size(have)}"
    if pools.device_bytes is not None and pools.device_bytes > have:
        raise UsageError(f"--device-memory {pools.device_bytes} (PoolOptions.device_bytes): "
                         f"{where}; give at most {have} or leave it out", rank=rank)
    if pools.budget_bytes is not None and pools.budget_bytes > have:
        raise UsageError(f"--cache-budget {pools.budget_bytes} (PoolOptions.budget_bytes): "
                         f"{where}; give at most {have}", rank=rank)
    _, cap = rank_pools(staged.spec, staged.plan, pools)
    need = cap.kv_pool_bytes + cap.state_pool_bytes
    if need > have:
        flag = ("--tokens (PoolOptions.tokens)" if cap.kv_pool_bytes >= cap.state_pool_bytes
                else "--requests (PoolOptions.requests)")
        raise UsageError(f"{flag}: this rank's cache pools would take {format_size(need)} and "
                         f"{where}; give a smaller {flag.split()[0]}, a --cache-budget, or "
                         "--no-pools", rank=rank)


def _check_geometry(staged: "StagePlan", tp: int, rank: int) -> None:
    """The stage's cache geometry, or a ConfigError (exit 2) saying the weights load without
    pools: a model whose cache cannot be sized is refused in planning, not after reading."""
    from .cache.geometry import stage_geometry
    try:
        stage_geometry(staged.spec, staged.plan.window, tp)
    except (ConfigError, PlanError) as exc:
        raise ConfigError(f"cache pools cannot be sized for this model: {exc.detail}; load it "
                          "without pools (--no-pools, StageLoadOptions.build_pools=False)",
                          file=exc.file, rank=rank) from None


def _node_ranks(per_node: Optional[int], rank: int, world_size: int) -> Optional[range]:
    if per_node is None:
        return None
    if per_node < 1 or world_size % per_node:
        raise PlanError(f"read once per node needs the ranks per node dividing the world of "
                        f"{world_size}, got {per_node} (pploader load takes $LOCAL_WORLD_SIZE)",
                        rank=rank)
    first = rank - rank % per_node
    return range(first, first + per_node)


def _device_name(device: Device) -> Optional[str]:
    return None if device is None else str(device)


def _cache_aware_partition(opened: _OpenOnce, pp: int, tp: int,
                           options: StageLoadOptions) -> Partition:
    """``balanced`` with a pool target (tokens / requests) weighs each layer's cache too:
    resolved to layer counts, the windows ``plan_job`` shows for the same options."""
    pools = options.pools
    if options.partition != "balanced" or pools is None or (pools.tokens is None
                                                             and pools.requests is None):
        return options.partition
    spec, index = opened().spec, opened().index
    costs = cache_costs(spec, tp, pools)
    return [w.num_layers for w in make_windows(spec, index, pp, "balanced", cache_bytes=costs)]


# ---- the job's plan, without launching it ------------------------------------------------

@dataclass
class JobPlan:
    """Every rank's plan and cache pools (``pploader plan``); pure, from the headers."""

    model: str
    spec: ModelSpec
    pp: int
    tp: int
    ep: int
    partition: Partition
    plans: list[RankPlan]
    summaries: list[dict]           # RankPlan.summary() + "pools", per rank
    pipeline_pools: dict            # limits and balance, or {"unavailable": why}
    exchange_auto: Optional[dict] = None  # --exchange-cost auto: the cost, residency, device
    rank: Optional[int] = None      # --rank: this rank's plan only (None: every rank)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "architecture": self.spec.architecture,
                "family": self.spec.family.name, "num_layers": self.spec.num_layers,
                "pp": self.pp, "tp": self.tp, "ep": self.ep,
                "partition": _partition_label(self.partition), "ranks": self.summaries,
                "exchange_cost_auto": self.exchange_auto, "pipeline_pools": self.pipeline_pools,
                **({} if self.rank is None else {"only_rank": self.rank})}

    def text(self) -> str:
        """The readable form ``pploader plan`` prints."""
        spec = self.spec
        out = [f"{self.model}: {spec.architecture} ({spec.family.name}), {spec.num_layers} "
               f"layers, pp {self.pp} x ep {self.ep} x tp {self.tp}"
               + ("" if self.rank is None else f" (rank {self.rank} only)"),
               plan_table(self.summaries)]
        if self.tp > 1:
            from .planning.redistribute import methods_table
            auto = self.exchange_auto
            if auto is not None:
                out.append(f"\n--exchange-cost auto: {auto['exchange_cost']} (shards "
                           f"{auto['resident_fraction']:.0%} in the page cache, device "
                           f"{auto['device']})")
            out.append("\nTP slice reads per rank (tensors / bytes read; redistribute: row "
                       "shares + all-to-all when loaded with a Comm):")
            out.append(methods_table(self.summaries))
        pipeline = self.pipeline_pools
        if "unavailable" in pipeline:
            out.append(f"\ncache pools: not derivable for this model: {pipeline['unavailable']}")
            return "\n".join(out)
        out.append("\ncache pools (per rank; its own layers only):")
        out.append(format_pools(self.summaries))
        if "balance" not in pipeline:  # one rank: the other stages were not planned
            return "\n".join(out)
        bal = pipeline["balance"]
        out.append(f"stage bytes (weights + cache at {bal['target_tokens']} tokens, "
                   f"{bal['target_requests']} requests): max/mean "
                   f"{bal['chosen']['max_over_mean']} ({_partition_label(self.partition)}) vs "
                   f"{bal['even']['max_over_mean']} (even)")
        return "\n".join(out)


def measure_exchange_cost(model_dir: os.PathLike | str, device: str = "cpu", *,
                          allowed_roots: Sequence[str] = ()) -> tuple[float, float]:
    """``--exchange-cost auto``: (exchange cost, resident fraction) for this checkpoint on a
    device kind (``"cpu"`` / ``"cuda"``), from its shards' sampled page-cache residency
    (``mincore``; no data is read) and the rates measured in docs/benchmarks-gpu.md."""
    from .arguments import check_choice
    from .storage import check_model_location
    check_model_location(model_dir, "model_dir")
    check_choice("device", str(device).partition(":")[0], ("cpu", "cuda"))
    return auto_exchange_cost_of(open_checkpoint(model_dir, allowed_roots=allowed_roots),
                                 str(device))


def auto_exchange_cost_of(index: "CheckpointIndex", device: str) -> tuple[float, float]:
    """:func:`measure_exchange_cost` of an opened checkpoint."""
    from .io.transfer.auto_cost import auto_exchange_cost
    return auto_exchange_cost([str(p) for p in index.paths.values()],
                              device.partition(":")[0])


@without_gc  # the summaries walk millions of plan objects: no full collection in the middle
def plan_job(model_dir: os.PathLike | str, pp: int, tp: int = 1, ep: int = 1, *,
             partition: Partition = "even", pools: Optional[PoolOptions] = None,
             allowed_roots: Sequence[str] = (), rank: Optional[int] = None,
             **plan_options: Any) -> JobPlan:
    """Every rank's plan (``plan_all``, the dtype policy applied as a load applies it) and
    cache pools (``pools``: how to size them, default ``PoolOptions()``), for a job of ``pp``
    x ``ep`` x ``tp`` ranks; ``plan_options``:
    ``range_cost_bytes``, ``exchange_cost``, ``exchange_batch_bytes``. Pure: headers only.

    ``rank``: that rank's plan and pools only (the plan it makes at load; other stages'
    headers are not read, so no stage balance)."""
    from .arguments import check_type
    from .planning.partition import EngineSplit
    from .planning.topology import Topology
    Topology(pp, tp, ep, 0 if rank is None else rank)  # sizes and rank checked (TopologyError
    # naming each) before any planning
    check_type("pools", pools, PoolOptions, "a PoolOptions")
    check_type("partition", partition, (str, list, tuple, EngineSplit),
               "even, balanced, vllm, sglang, an EngineSplit or layer counts", optional=False)
    pools = pools if pools is not None else PoolOptions()
    spec = load_spec(model_dir, allowed_roots=allowed_roots)
    index = open_checkpoint(model_dir, allowed_roots=allowed_roots)
    plans = plan_all(spec, index, pp, tp, ep, partition=partition,
                     cache_bytes=cache_costs(spec, tp, pools),
                     ranks=None if rank is None else (rank,), **plan_options)
    for plan in plans:  # the dtype policy, as a load applies it (rejections, warnings)
        cast_codes(spec, plan)
    summaries = [p.summary() for p in plans]
    try:
        rows, pipeline = plan_pools(spec, index, plans, pools, balance=rank is None)
    except (ConfigError, PlanError) as exc:  # e.g. a generic model's unknown layer kind
        rows, pipeline = [{} for _ in plans], {"unavailable": exc.detail}
    for summary, row in zip(summaries, rows):
        summary["pools"] = row
    return JobPlan(str(model_dir), spec, pp, tp, ep, partition, plans, summaries, pipeline,
                   rank=rank)


def _partition_label(partition: object) -> str:
    if isinstance(partition, (list, tuple)):
        return ",".join(str(n) for n in partition)
    return str(partition)
