"""pploader's command line: plan | load | files | make-tiny | convert | bench.

Exit codes: 0 success; 1 a load failed (every rank prints the combined error); 2 bad
arguments or input (config, checkpoint, layout) found before any rank started loading, on
every rank, for ``plan`` and ``load`` alike: one line naming the problem and the fix.

Imports are lazy: ``pploader --help`` and argument mistakes never import torch.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from .errors import ConfigError, PlanError, PPLoaderError, RankFailure, UsageError
from .planning.partition import ENGINE_PARTITION_ENV, ENGINES, EngineSplit

if TYPE_CHECKING:  # pragma: no cover
    from .dist.comm import Comm
    from .stage import StagePlan
    from .testing.faults import Fault

from .cli_args import (_DEFAULT_EXCHANGE_COST, _DEFAULT_WINDOW_MIB, _LOG_LEVELS,  # noqa: F401
                       _env_rank, build_parser)

__all__ = ["main", "build_parser"]

log = logging.getLogger("pploader")


def _engine_partition(partition: object) -> object:
    """``vllm`` / ``sglang``: the engine's split, including its partition variable
    (VLLM_PP_LAYER_PARTITION / SGLANG_PP_LAYER_PARTITION) when set, as the engine reads it."""
    if isinstance(partition, str) and partition in ENGINES:
        return EngineSplit(partition, os.environ.get(ENGINE_PARTITION_ENV[partition]))
    return partition


def _auto_exchange_cost(args: argparse.Namespace) -> tuple[float, float]:
    """``--exchange-cost auto``: (cost, resident fraction) from the shards' page-cache
    residency and the device kind (io/exchange.py)."""
    from .io.exchange import auto_exchange_cost
    from .planning.checkpoint import open_checkpoint
    index = open_checkpoint(args.model, allowed_roots=args.allow_root)
    device = str(getattr(args, "device", None) or "cpu").partition(":")[0]
    return auto_exchange_cost([str(p) for p in index.paths.values()], device)


def _tp_read_kwargs(args: argparse.Namespace, exchange_cost: Optional[float] = None) -> dict:
    """The TP read options as planning kwargs; ``exchange_cost`` resolves ``auto``."""
    cost = args.exchange_cost
    if cost == "auto":
        cost = exchange_cost if exchange_cost is not None else _auto_exchange_cost(args)[0]
    kw: dict = {"exchange_cost": cost, "exchange_batch_bytes": args.exchange_batch}
    if args.range_cost is not None:
        kw["range_cost_bytes"] = args.range_cost
    return kw


def _auto_memory(device: object) -> int:
    from .errors import PlanError
    from .cache.pools import device_memory
    if device is None:
        raise PlanError("--device-memory auto applies to `pploader load` (pools on a GPU); "
                        "give bytes here, e.g. --device-memory 80G")
    return device_memory(device)  # type: ignore[arg-type]


def _load_partition(args: argparse.Namespace, pp: int, device: object) -> object:
    """``balanced`` with --tokens/--requests weighs each layer's cache too: resolve it to layer
    counts here so that load places exactly the windows `pploader plan` printed."""
    if args.partition != "balanced" or (args.tokens is None and args.requests is None):
        return _engine_partition(args.partition)
    from .planning.checkpoint import open_checkpoint
    from .planning.plan import make_windows
    from .cache.pools import cache_costs
    from .planning.spec import load_spec
    roots = args.allow_root
    spec = load_spec(args.model, allowed_roots=roots)
    index = open_checkpoint(args.model, allowed_roots=roots)
    costs = cache_costs(spec, args.tp, _pool_options(args, device))  # type: ignore[arg-type]
    return [w.num_layers for w in make_windows(spec, index, pp, "balanced", cache_bytes=costs)]


def _pool_options(args: argparse.Namespace, device: object = None) -> object:
    from .cache.geometry import CacheDtypes, parse_dtype
    from .cache.pools import PoolOptions
    mem = args.device_memory
    return PoolOptions(
        tokens=args.tokens, requests=args.requests, budget_bytes=args.cache_budget,
        device_bytes=_auto_memory(device) if mem == -1 else mem,
        memory_fraction=args.memory_fraction,
        mamba_ratio=args.mamba_ratio, page_size=args.page_size,
        dtypes=CacheDtypes(kv=parse_dtype(args.kv_dtype) if args.kv_dtype else None,
                           ssm=parse_dtype(args.ssm_dtype) if args.ssm_dtype else None))


def _pipeline_pools(reports: Sequence[dict]) -> Optional[dict]:
    from .cache.pools import pipeline_capacity
    caps = [r["pools"]["capacity"] for r in reports if r.get("pools")]
    return pipeline_capacity(caps) if caps else None


def _setup_logging(rank: Optional[int]) -> None:
    """Configure logging from PPLOADER_LOG (the CLI's only place; the library only logs)."""
    prefix = f"[rank {rank}] " if rank is not None else ""
    logging.basicConfig(level=_log_level(), format=f"{prefix}%(levelname)s %(name)s: %(message)s",
                        force=True)


def _log_level() -> str:
    level = os.environ.get("PPLOADER_LOG", "WARNING").strip().upper() or "WARNING"
    if level not in _LOG_LEVELS:
        raise UsageError(f"PPLOADER_LOG={os.environ.get('PPLOADER_LOG')!r}: use one of "
                         f"{', '.join(_LOG_LEVELS)}")
    return level


def _quiet_torch_logs() -> None:
    """Keep torch's C++ warnings (store socket errors with stack frames, printed when a peer
    or the store's host leaves first) off stderr: pploader reports those failures itself.
    Must run before torch is imported; PPLOADER_LOG=DEBUG or TORCH_CPP_LOG_LEVEL keeps them."""
    if os.environ.get("PPLOADER_LOG", "").strip().upper() != "DEBUG":
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")


def cmd_plan(args: argparse.Namespace) -> int:
    from .planning.checkpoint import open_checkpoint
    from .planning.dtypes import dtype_casts
    from .planning.plan import plan_all
    from .cache.pools import cache_costs, format_pools, plan_pools
    from .report import plan_table
    from .planning.spec import load_spec

    spec = load_spec(args.model, allowed_roots=args.allow_root)
    index = open_checkpoint(args.model, allowed_roots=args.allow_root)
    opts = _pool_options(args)
    partition = _engine_partition(args.partition)
    auto = _auto_exchange_cost(args) if args.exchange_cost == "auto" else None
    plans = plan_all(spec, index, args.pp, args.tp, args.ep,
                     partition=partition,  # type: ignore[arg-type]
                     cache_bytes=cache_costs(spec, args.tp, opts),  # type: ignore[arg-type]
                     **_tp_read_kwargs(args, auto[0] if auto else None))
    exchange = None if auto is None else {"exchange_cost": auto[0], "device": args.device,
                                          "resident_fraction": round(auto[1], 4)}
    for plan in plans:  # the dtype policy, as `load` applies it (rejections, warnings)
        dtype_casts(spec, plan)
    summaries = [p.summary() for p in plans]
    try:
        pools, pipeline = plan_pools(spec, index, plans, opts)  # type: ignore[arg-type]
    except (ConfigError, PlanError) as exc:  # e.g. a generic model's unknown layer kind
        pools, pipeline = [{} for _ in plans], {"unavailable": exc.detail}
    for summary, pool in zip(summaries, pools):
        summary["pools"] = pool
    if args.json:
        print(json.dumps({"model": str(args.model), "architecture": spec.architecture,
                          "family": spec.family.name, "num_layers": spec.num_layers,
                          "pp": args.pp, "tp": args.tp, "ep": args.ep,
                          "partition": _partition_label(partition), "ranks": summaries,
                          "exchange_cost_auto": exchange, "pipeline_pools": pipeline},
                         indent=1))
    else:
        print(f"{args.model}: {spec.architecture} ({spec.family.name}), {spec.num_layers} layers, "
              f"pp {args.pp} x ep {args.ep} x tp {args.tp}")
        print(plan_table(summaries))
        if args.tp > 1:
            from .planning.redistribute import methods_table
            if exchange is not None:
                print(f"\n--exchange-cost auto: {exchange['exchange_cost']} (shards "
                      f"{exchange['resident_fraction']:.0%} in the page cache, device "
                      f"{exchange['device']})")
            print("\nTP slice reads per rank (tensors / bytes read; redistribute: row shares "
                  "+ all-to-all when loaded with a Comm):")
            print(methods_table(summaries))
        if "unavailable" in pipeline:
            print(f"\ncache pools: not derivable for this model: {pipeline['unavailable']}")
            return 0
        print("\ncache pools (per rank; its own layers only):")
        print(format_pools(summaries))
        bal = pipeline["balance"]
        print(f"stage bytes (weights + cache at {bal['target_tokens']} tokens, "
              f"{bal['target_requests']} requests): max/mean {bal['chosen']['max_over_mean']} "
              f"({_partition_label(partition)}) vs {bal['even']['max_over_mean']} (even)")
    return 0


def _partition_label(partition: object) -> str:
    if isinstance(partition, (list, tuple)):
        return ",".join(str(n) for n in partition)
    return str(partition)


def _check_backend(backend: Optional[str]) -> None:
    """A backend this torch build and this machine can run (before any rank connects)."""
    if backend is None:
        return
    import torch
    import torch.distributed as dist
    if not dist.is_backend_available(backend):
        raise UsageError(f"--backend {backend}: this torch build has no {backend} support; use "
                         "--backend gloo (CPU) or leave --backend out")
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("--backend nccl needs a GPU on every rank and this one sees none; use "
                         "--backend gloo or leave --backend out")


def cmd_files(args: argparse.Namespace) -> int:
    """``pploader files``: which shards each node needs (docs/launch.md, stage-only files)."""
    from .planning.files import format_node_files, node_files
    found, layers = node_files(args.model, args.pp, args.tp, args.ep,
                               partition=_engine_partition(args.partition),  # type: ignore[arg-type]
                               ranks_per_node=args.ranks_per_node, nodes=args.nodes,
                               **_tp_read_kwargs(args))
    fmt = "json" if args.json else args.format
    print(format_node_files(found, fmt, model=str(args.model), layers=layers, node=args.node))
    if args.node is None and fmt != "json" and args.partition != "even":
        print(f"# load these nodes with --partition {','.join(map(str, layers))}")
    return 0


def _fault_from_env() -> Optional["Fault"]:
    """The test-only fault (``PPLOADER_FAULT``, docs/launch.md); unset, ``pploader.testing``
    is never imported."""
    if not os.environ.get("PPLOADER_FAULT"):
        return None
    from .testing.faults import fault_from_env
    return fault_from_env()


def _with_fault(fault: Optional["Fault"], rank: int,
                on_progress: Callable[[int], None]) -> Callable[[int], None]:
    """``on_progress``, wrapped by the fault injector only when a test set a fault."""
    if fault is None:
        return on_progress
    from .testing.faults import with_fault
    return with_fault(fault, rank, on_progress)


def cmd_load(args: argparse.Namespace) -> int:
    """``pploader load`` on every rank: plan, agree, load, agree, report (docs/launch.md).

    Any rank failing, hanging or dying makes every rank print the combined error and exit 1;
    when every failing rank found a mistake in the input while planning, each exits 2.
    """
    from .dist.bootstrap import init_distributed
    from .dist.comm import Comm
    from .planning.topology import Topology
    import torch.distributed as dist

    fault = _fault_from_env()  # test-only hook, None unless PPLOADER_FAULT is set
    _check_backend(args.backend)
    try:
        launch = init_distributed(backend=args.backend, timeout_s=args.timeout)
    except (RuntimeError, ValueError) as exc:  # torch's DistError and friends: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _StartFailure(f"could not start torch.distributed: {first}") from None
    _setup_logging(launch.rank)
    topo = Topology.for_world(launch.world_size, launch.rank, pp=args.pp, tp=args.tp, ep=args.ep)
    comm = Comm(topo, timeout_s=args.timeout)
    try:
        reports = _load_agreed(args, comm, _with_fault(fault, topo.rank, comm.progress_adder()))
    except RankFailure as exc:
        if exc.input_only:  # every failing rank found a mistake in the input while planning
            first = exc.first().removeprefix(f"rank {topo.rank}: ")  # own rank: in the prefix
            sys.stderr.write(f"[rank {topo.rank}] pploader: error: {first}\n")
        else:
            sys.stderr.write(f"[rank {topo.rank}] pploader: load failed on the job: {exc}\n")
        sys.stderr.flush()
        comm.close()  # linger: every rank reads the verdict before the store's host leaves
        os._exit(2 if exc.input_only else 1)  # never hang in teardown after a peer died
    if topo.rank == 0:
        if args.json:
            print(json.dumps({"model": str(args.model), "launcher": launch.source,
                              "backend": launch.backend, "world_size": launch.world_size,
                              "pp": topo.pp_size, "tp": topo.tp_size, "ep": topo.ep_size,
                              "ranks": reports, "pipeline_pools": _pipeline_pools(reports)},
                             indent=1))
        else:
            from .report import format_table
            print(format_table(reports))
            if not args.no_pools:
                from .cache.pools import format_pools
                print("\ncache pools (per rank; its own layers only):")
                print(format_pools(reports))
        sys.stdout.flush()
    dist.destroy_process_group()
    comm.close()
    return 0


def _agreed_exchange_cost(args: argparse.Namespace, comm: "Comm") -> Optional[float]:
    """``--exchange-cost auto`` on every rank: each measures, all take rank 0's value (every
    rank of a TP group must plan the same exchange). None when not auto."""
    if args.exchange_cost != "auto":
        return None
    error: Optional[BaseException] = None
    cost: Optional[float] = None
    try:
        from .cache.pools import pool_device
        kind = str(pool_device(args.device)).partition(":")[0]
        from .io.exchange import auto_exchange_cost
        from .planning.checkpoint import open_checkpoint
        index = open_checkpoint(args.model, allowed_roots=args.allow_root)
        cost = auto_exchange_cost([str(p) for p in index.paths.values()], kind)[0]
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    return float(comm.agree(error, cost)[0])


class _StartFailure(Exception):
    """torch.distributed could not start (exit 1: the job, not the input, failed)."""


def _load_agreed(args: argparse.Namespace, comm: "Comm", add: Callable[[int], None]
                 ) -> list[dict]:
    """Plan, agree, load, agree (called on all ranks); every rank's report, in rank order."""
    from .cache.pools import pool_device
    from .report import ProgressBar
    from .stage import load_stage, plan_stage

    topo = comm.topology
    cancel = comm.watch_failures(abort_after_s=min(10.0, args.timeout))
    staged: Optional["StagePlan"] = None
    error: Optional[BaseException] = None
    report: Optional[dict] = None
    device = pools_on = None
    partition: object = args.partition
    auto = _agreed_exchange_cost(args, comm)  # an agreement of its own, before planning
    try:
        device, pools_on = pool_device(args.device), pool_device(args.pool_device)
        partition = _load_partition(args, topo.pp_size, pools_on)
        staged = plan_stage(args.model, topo, allowed_roots=args.allow_root,
                            partition=partition,  # type: ignore[arg-type]
                            **_tp_read_kwargs(args, auto))
        largest = staged.plan.largest_item_bytes
        if args.window_bytes is not None and args.window_bytes < largest:
            raise UsageError(f"--window-bytes {args.window_bytes} is smaller than this stage's "
                             f"largest tensor ({largest} bytes): give --window-bytes {largest} "
                             "or more, or leave the option out")
        if not args.no_pools:  # pool options are input too: refuse them before loading
            _pool_options(args, pools_on)
    except PPLoaderError as exc:  # agreed on below
        error = exc.on_rank(topo.rank)
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    planned = comm.agree(error, None if staged is None else staged.plan.read_bytes
                         if args.read_once or args.read_once_node
                         else staged.plan.planned_read_bytes)
    show = not args.no_progress and topo.rank == 0 and (args.progress or sys.stderr.isatty())
    with ProgressBar(sum(planned), comm.progress_total, enabled=show):
        try:
            assert staged is not None and device is not None  # else the agreement raised
            result = load_stage(staged, window_bytes=args.window_bytes, threads=args.threads,
                                device=device, cancel=cancel, on_progress=add,
                                memory_budget_bytes=args.memory_budget,
                                comm=comm, read_once=args.read_once,
                                **_node_kwargs(args, topo.rank, topo.world_size, partition))
            add.flush()  # type: ignore[attr-defined]
            if args.save_loaded:
                from safetensors.torch import save_file
                Path(args.save_loaded).mkdir(parents=True, exist_ok=True)
                names = {i.target: i.name for i in result.plan.items}
                save_file({names[k]: v.contiguous().cpu() for k, v in result.state_dict.items()},
                          str(Path(args.save_loaded) / f"rank-{topo.rank}.safetensors"))
            report = result.report.to_json()
            if not args.no_pools:  # this stage's cache pools, after its weights (docs/pools.md)
                from .cache.pools import build_rank_pools
                report["pools"] = build_rank_pools(staged.spec, staged.plan, _pool_options(
                    args, pools_on), device=pools_on).report()  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - agreed on below
            error = exc
        reports = comm.agree(error, report)
    return reports


def _node_kwargs(args: argparse.Namespace, rank: int, world_size: int,
                 partition: object) -> dict:
    """``--read-once-node``: this rank's node = $LOCAL_WORLD_SIZE consecutive ranks (how
    torchrun, srun and mpiexec number ranks per node)."""
    if not args.read_once_node:
        return {}
    from .errors import PlanError
    local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") \
        or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if not local or not local.isdigit() or world_size % int(local):
        raise PlanError(f"--read-once-node needs the ranks per node ($LOCAL_WORLD_SIZE, got "
                        f"{local!r}) dividing the world of {world_size}", rank=rank)
    first = rank - rank % int(local)
    return {"node_ranks": range(first, first + int(local)), "partition": partition}


def _make_tiny(args: argparse.Namespace) -> int:
    from .tiny import make_tiny, resolve_tiny_config
    config = resolve_tiny_config(args.config)
    files = make_tiny(config, args.out, shard_bytes=args.shard_bytes, seed=args.seed)
    print(f"wrote {len(files)} shard(s) to {args.out}")
    return 0


def _is_bench(argv: Optional[Sequence[str]]) -> bool:
    """Whether the command is ``bench`` (global options only print and exit)."""
    words = list(sys.argv[1:] if argv is None else argv)
    return words[:1] == ["bench"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``pploader`` command; returns the exit code (see the module docstring)."""
    rank = _env_rank()
    prefix = f"[rank {rank}] " if rank else ""
    _quiet_torch_logs()
    args = build_parser(bench=_is_bench(argv)).parse_args(argv)
    try:
        _setup_logging(int(rank) if rank and rank.isdigit() else None)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "load":
            return cmd_load(args)
        if args.command == "files":
            return cmd_files(args)
        if args.command == "make-tiny":
            return _make_tiny(args)
        if args.command == "convert":
            from .pickled import convert_to_safetensors
            files = convert_to_safetensors(args.src, args.dst, allow_pickle=args.allow_pickle,
                                           shard_bytes=args.shard_bytes)
            print(f"wrote {len(files)} safetensors shard(s) to {args.dst}")
            return 0
        if args.command == "bench":
            from .bench.command import run_bench
            return run_bench(args)
    except RankFailure as exc:
        sys.stderr.write(f"{prefix}pploader: load failed on the job: {exc}\n")
        sys.stderr.flush()
        os._exit(1)  # never hang in process-group teardown after a peer died
    except PPLoaderError as exc:
        sys.stderr.write(f"{prefix}pploader: error: {exc}\n")
        return 2
    except _StartFailure as exc:
        sys.stderr.write(f"{prefix}pploader: error: {exc}\n")
        return 1
    return 2
