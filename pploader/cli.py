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
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

from . import EngineSplit, PlanError, PPLoaderError, RankFailure
from .cli_args_checks import ENV_BACKEND, check_engine_env, check_load_args
from .cli_signals import exit_on_signals
from .errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from . import Comm, PoolOptions, StageLoad, StagePlan, StageResult
    from .outputs import OutputDir
    from .testing.faults import Fault

from .cli_args import (_DEFAULT_EXCHANGE_COST, _DEFAULT_WINDOW_MIB, _LOG_LEVELS,  # noqa: F401
                       ENGINE_PARTITION_ENV, ENGINES, MAX_RANKS, _env_rank, build_parser)

__all__ = ["main", "build_parser"]

log = logging.getLogger("pploader")


def _engine_partition(partition: object) -> object:
    """``vllm`` / ``sglang``: the engine's split, including its partition variable
    (VLLM_PP_LAYER_PARTITION / SGLANG_PP_LAYER_PARTITION) when set, as the engine reads it."""
    if isinstance(partition, str) and partition in ENGINES:
        return EngineSplit(partition, check_engine_env(partition))
    return partition


def _auto_exchange_cost(args: argparse.Namespace) -> tuple[float, float]:
    """``--exchange-cost auto`` for ``pploader plan``: (cost, resident fraction) from the
    shards' page-cache residency and ``--device``'s kind."""
    from . import measure_exchange_cost
    return measure_exchange_cost(args.model, str(getattr(args, "device", None) or "cpu"),
                                 allowed_roots=args.allow_root)


def _tp_read_kwargs(args: argparse.Namespace,
                    exchange_cost: Union[float, str, None] = None) -> dict:
    """The TP read options as planning kwargs; ``exchange_cost`` resolves ``auto`` (a value,
    or "auto" for load_pipeline_stage to measure and agree on)."""
    cost = args.exchange_cost
    if cost == "auto":
        cost = exchange_cost if exchange_cost is not None else _auto_exchange_cost(args)[0]
    kw: dict = {"exchange_cost": cost, "exchange_batch_bytes": args.exchange_batch}
    if args.range_cost is not None:
        kw["range_cost_bytes"] = args.range_cost
    return kw


def _pool_options(args: argparse.Namespace) -> "PoolOptions":
    """The pool options; ``--device-memory auto`` (-1) is left to the load (the pool device's
    memory, StageLoadOptions.pool_memory_from_device)."""
    from . import CacheDtypes, PoolOptions
    mem = args.device_memory
    return PoolOptions(
        tokens=args.tokens, requests=args.requests, budget_bytes=args.cache_budget,
        device_bytes=None if mem == -1 else mem, memory_fraction=args.memory_fraction,
        mamba_ratio=args.mamba_ratio, page_size=args.page_size, max_context=args.max_context,
        dtypes=CacheDtypes.of(kv=args.kv_dtype, ssm=args.ssm_dtype))


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
    """``pploader plan``: every rank's plan and cache pools, from the headers."""
    from . import plan_job
    if args.device_memory == -1:
        raise PlanError("--device-memory auto applies to `pploader load` (pools on a GPU); "
                        "give bytes here, e.g. --device-memory 80G")
    auto = _auto_exchange_cost(args) if args.exchange_cost == "auto" else None
    job = plan_job(args.model, args.pp, args.tp, args.ep,
                   partition=_engine_partition(args.partition),  # type: ignore[arg-type]
                   pools=_pool_options(args), allowed_roots=args.allow_root, rank=args.rank,
                   **_tp_read_kwargs(args, auto[0] if auto else None))
    if auto is not None:  # measured here (page-cache residency), shown with the plan
        job.exchange_auto = {"exchange_cost": auto[0], "device": args.device,
                             "resident_fraction": round(auto[1], 4)}
    print(json.dumps(job.to_json(), indent=1) if args.json else job.text())
    return 0


def _check_backend(backend: Optional[str], source: str = "--backend") -> None:
    """A backend this torch build and this machine can run (before any rank connects)."""
    if backend is None:
        return
    import torch
    import torch.distributed as dist
    if not dist.is_backend_available(backend):
        raise UsageError(f"{_named(source, backend)}: this torch build has no {backend} "
                         f"support; use --backend gloo (CPU) or {_unset(source)}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError(f"{_named(source, backend)} needs a GPU on every rank and this one "
                         f"sees none; use --backend gloo or {_unset(source)}")


def _unset(source: str) -> str:
    return f"unset {source[:-1]}" if source.endswith("=") else "leave --backend out"


def _named(source: str, value: str) -> str:
    """``--flag value`` or ``VARIABLE=value``, as the user wrote it."""
    return f"{source}{value}" if source.endswith("=") else f"{source} {value}"


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


def _fault_hook(fault: Optional["Fault"], rank: int) -> Optional[Callable[[int], None]]:
    """The progress callback through which the test-only fault fires; None without one."""
    if fault is None:
        return None
    from .testing.faults import with_fault
    return with_fault(fault, rank, lambda nbytes: None)


def cmd_load(args: argparse.Namespace) -> int:
    """``pploader load`` on every rank: plan, agree, load, agree, report (docs/launch.md),
    through :func:`pploader.load_pipeline_stage`.

    Any rank failing, hanging or dying makes every rank print the combined error and exit 1;
    when every failing rank found a mistake in the input while planning, each exits 2.
    """
    check_load_args(args)  # conflicts, output paths, GPUs, environment: before any rank starts
    _pool_options(args)  # an unknown --kv-dtype / --ssm-dtype: refused here too
    return _cmd_load(args)  # Ctrl-C / SIGTERM: main's exit_on_signals (one line, 130 / 143)


def _rank_prefix() -> str:
    rank = _env_rank()
    return f"[rank {rank}] " if rank else ""


def _cmd_load(args: argparse.Namespace) -> int:
    from . import Comm, Topology, init_distributed
    import torch.distributed as dist

    fault = _fault_from_env()  # test-only hook, None unless PPLOADER_FAULT is set
    _check_backend(args.backend or os.environ.get(ENV_BACKEND),
                   "--backend" if args.backend else ENV_BACKEND + "=")
    try:
        launch = init_distributed(backend=args.backend, timeout_s=args.timeout)
    except (RuntimeError, ValueError) as exc:  # torch's DistError and friends: one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _StartFailure(f"could not start torch.distributed: {first}") from None
    _setup_logging(launch.rank)
    topo = Topology.for_world(launch.world_size, launch.rank, pp=args.pp, tp=args.tp, ep=args.ep)
    comm = Comm(topo, timeout_s=args.timeout, namespace="pploader-load",
                store_host_rank=launch.store_host_rank)
    from .outputs import discard_pending
    comm.watch_failures(abort_after_s=min(10.0, args.timeout),  # a rank left behind exits,
                        before_exit=discard_pending)  # its temporary output removed
    try:
        loaded = _load(args, comm, launch.local_rank, fault)
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
                              "ranks": loaded.reports,
                              "pipeline_pools": loaded.pipeline_pools}, indent=1))
        else:
            print(loaded.table(pools=not args.no_pools))
        sys.stdout.flush()
    dist.destroy_process_group()
    comm.close()
    return 0


class _StartFailure(Exception):
    """torch.distributed could not start (exit 1: the job, not the input, failed)."""


def _load(args: argparse.Namespace, comm: "Comm", local_rank: int,
          fault: Optional["Fault"]) -> "StageLoad":
    """The options of ``pploader load`` -> :func:`pploader.load_pipeline_stage` (all ranks)."""
    from . import StageLoadOptions, load_pipeline_stage

    topo = comm.topology
    partition = _engine_partition(args.partition)
    try:
        pools, pool_error = _pool_options(args), None
    except PPLoaderError as exc:  # e.g. an unknown --kv-dtype: refused in the planning step,
        pools, pool_error = None, exc  # agreed like any input mistake
    options = StageLoadOptions(
        partition=partition, allowed_roots=args.allow_root,  # type: ignore[arg-type]
        device=args.device, local_rank=local_rank, window_bytes=args.window_bytes,
        threads=args.threads, memory_budget_bytes=args.memory_budget,
        read_once=args.read_once, ranks_per_node=_ranks_per_node(args),
        io_backend=args.io_backend, pools=pools, build_pools=not args.no_pools,
        pool_device=args.pool_device, pool_memory_from_device=args.device_memory == -1,
        progress_bar=not args.no_progress and (args.progress or sys.stderr.isatty()),
        **_tp_read_kwargs(args, "auto"))  # "auto": measured and agreed by load_pipeline_stage

    saving = _SaveLoaded(args, topo.rank, topo.world_size) \
        if args.save_loaded is not None else None

    def check_input(staged: "StagePlan") -> None:
        if pool_error is not None:
            raise pool_error
        if saving is not None:  # checked again, agreed: a rank that cannot write refuses
            saving.claim()
        largest = staged.plan.largest_item_bytes
        if args.window_bytes is not None and args.window_bytes < largest:
            raise UsageError(f"--window-bytes {args.window_bytes} is smaller than this stage's "
                             f"largest tensor ({largest} bytes): give --window-bytes {largest} "
                             "or more, or leave the option out")

    try:
        loaded = load_pipeline_stage(args.model, comm, options, check_plan=check_input,
                                     after_load=saving.write if saving else None,
                                     on_progress=_fault_hook(fault, topo.rank))
    except BaseException:
        if saving is not None:
            saving.abandon()  # a failed job leaves no rank file
        raise
    if saving is not None:
        saving.commit()  # every rank succeeded: rename into place
    return loaded


class _SaveLoaded:
    """``--save-loaded DIR``: this rank's tensors written to a temporary name in the load
    step, renamed to ``rank-<rank>.safetensors`` only once every rank succeeded, removed when
    the job failed (pploader.outputs; the signal watcher removes it on Ctrl-C / SIGTERM)."""

    def __init__(self, args: argparse.Namespace, rank: int, world_size: int) -> None:
        self.path, self.model = args.save_loaded, args.model
        self.target: Optional["OutputDir"] = None
        self.rank = rank
        self.tmp: Optional[Path] = None
        self.name = f"rank-{rank}.safetensors"
        self.names = [f"rank-{r}.safetensors" for r in range(world_size)]

    def claim(self) -> None:
        from .outputs import claim_output
        self.target = claim_output(self.path, "--save-loaded", command="load --save-loaded",
                                   reuse=True, models=[self.model], expect=self.names)

    def write(self, result: "StageResult") -> None:
        from safetensors.torch import save_file
        from .outputs import begin_file
        assert self.target is not None  # claimed in the planning step
        names = {i.target: i.name for i in result.plan.items}
        self.tmp = begin_file(self.target, self.name)
        save_file({names[k]: v.contiguous().cpu() for k, v in result.state_dict.items()},
                  str(self.tmp))

    def commit(self) -> None:
        from .outputs import commit_file, retire_stale
        if self.target is None:
            return
        if self.tmp is not None:
            try:
                commit_file(self.target, self.tmp, self.name, self.names)
            except BaseException:
                self.abandon()  # e.g. a user's file appeared under this name: keep it
                raise
        if self.rank == 0:
            retire_stale(self.target, self.names)

    def abandon(self) -> None:
        from .outputs import abandon
        if self.target is not None:
            abandon(self.target, self.tmp)


def _ranks_per_node(args: argparse.Namespace) -> Optional[int]:
    """``--read-once-node``: the ranks per node from the launcher ($LOCAL_WORLD_SIZE, or
    Slurm's / Open MPI's), 0 when none says (the load then refuses it on every rank)."""
    if not args.read_once_node:
        return None
    from .cli_args_checks import env_ranks_per_node
    return env_ranks_per_node(os.environ) or 0  # found and checked by check_load_args


def _make_tiny(args: argparse.Namespace) -> int:
    from .tiny import make_tiny, resolve_tiny_config
    config = resolve_tiny_config(args.config)
    files = make_tiny(config, args.out, shard_bytes=args.shard_bytes, seed=args.seed,
                      force=args.force)
    print(f"wrote {len(files)} shard(s) to {args.out}")
    return 0


def _is_bench(argv: Optional[Sequence[str]]) -> bool:
    """Whether the command is ``bench`` (global options only print and exit)."""
    words = list(sys.argv[1:] if argv is None else argv)
    return words[:1] == ["bench"]


#: the commands that write files or start ranks: SIGINT / SIGTERM end them at once, from
#: the start of main (before the parser, torch or any thread), with no temporary output left
_ENDED_BY_SIGNALS = ("load", "make-tiny", "convert")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``pploader`` command; returns the exit code (see the module docstring)."""
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] and words[0] in _ENDED_BY_SIGNALS:
        with exit_on_signals(_rank_prefix()):  # one line, 130 / 143 (cli_signals)
            return _main(argv)
    return _main(argv)


def _main(argv: Optional[Sequence[str]]) -> int:
    rank = _env_rank()
    prefix = f"[rank {rank}] " if rank else ""
    _quiet_torch_logs()
    args = build_parser(bench=_is_bench(argv)).parse_args(argv)
    try:
        _setup_logging(int(rank) if rank and rank.isdigit() else None)
        return _run(args)
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
    except BrokenPipeError:  # `pploader plan --json | head -1`: the reader has what it wants
        _silence_stdout()
        return 0
    except KeyboardInterrupt:
        sys.stderr.write(f"{prefix}pploader: interrupted (Ctrl-C)\n")
        return 130
    except OSError as exc:  # permissions, a full disk, a vanished file: one line, no traceback
        sys.stderr.write(f"{prefix}pploader: error: {_os_error(exc)}\n")
        return 2 if isinstance(exc, _USER_OS_ERRORS) else 1


#: OSErrors a user causes and fixes (exit 2, like any other input mistake)
_USER_OS_ERRORS = (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                   FileExistsError)


def _os_error(exc: OSError) -> str:
    """One line: what failed, on which path, and what to do about permissions."""
    what = exc.strerror or str(exc) or type(exc).__name__
    where = f"{exc.filename}: " if exc.filename else ""
    hint = "; give this user read access (chmod / chown)" if isinstance(
        exc, PermissionError) else ""
    return f"{where}{what}{hint}"


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush raises nothing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # a captured / replaced stdout
        pass


def _use_meta_store() -> None:
    """Keep the generic family's derived model structure between runs (families/
    meta_store.py) under ``$PPLOADER_CACHE_DIR`` (default ``$XDG_CACHE_HOME/pploader`` or
    ``~/.cache/pploader``; empty: off), so planning a model again imports no transformers."""
    root = os.environ.get("PPLOADER_CACHE_DIR")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or
                            os.path.join(os.path.expanduser("~"), ".cache"), "pploader")
    if root:
        from . import use_structure_cache
        use_structure_cache(os.path.join(root, "meta"))


def _run(args: argparse.Namespace) -> int:
    """The chosen command (exceptions go to main's one-line handlers)."""
    if args.command in ("plan", "files", "load"):
        _use_meta_store()
        world = (args.pp or 1) * args.tp * args.ep
        if world > MAX_RANKS:
            raise UsageError(f"--pp x --tp x --ep = {world} ranks, more than {MAX_RANKS}: give "
                             "smaller layout sizes")
        counts = args.partition
        if isinstance(counts, list) and args.pp is not None and len(counts) != args.pp:
            raise UsageError(f"--partition {','.join(map(str, counts))} has {len(counts)} "
                             f"stage(s) but --pp is {args.pp}: give {args.pp} layer counts, "
                             f"or --pp {len(counts)}")
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
    return 2
