"""pploader's command line: plan | load | make-tiny | convert | bench.

Exit codes: 0 success; 1 a load failed (every rank prints the combined error); 2 bad
arguments or input found before any rank started loading.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from . import __version__
from .errors import ConfigError, PlanError, PPLoaderError, RankFailure
from .partition import parse_partition
from .read import DEFAULT_WINDOW_BYTES

if TYPE_CHECKING:  # pragma: no cover
    from .comm import Comm

__all__ = ["main", "build_parser"]

log = logging.getLogger("pploader")

_EPILOG = """\
examples:
  pploader make-tiny configs/models/tiny-llama.json /tmp/tiny
  pploader plan --model /tmp/tiny --pp 4                 # who reads what; no data read
  pploader plan --model /tmp/tiny --pp 2 --tp 2 --json   # machine-readable
  torchrun --standalone --nproc_per_node=4 -m pploader load --model /tmp/tiny --pp 4
  torchrun --nproc_per_node=8 -m pploader load --model DIR --pp 2 --ep 2 --tp 2 --json
  torchrun --nproc_per_node=2 -m pploader load --model DIR --pp 2 --device cuda
  sbatch --nodes=2 launch/slurm.sbatch --model DIR --pp 2 --tp 8   # also launch/mpirun.sh
  pploader bench --size-gb 1 --layers 16                 # ours vs read-all vs raw preadv
  pploader bench --device cuda -- --anchors PATH/bench_anchors.py   # vs GPU loaders

Every rank reads only its stage: layers [start_layer, end_layer), the embedding on the
first stage, the final norm and head on the last, its experts and its TP slice.
docs/usage.md explains every option and the JSON formats.
"""


def _partition(text: str) -> object:
    return text if text in ("even", "balanced") else parse_partition(text)


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib").rstrip("b") if text[-1:].lower() == "b" else text.lower()
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _layout_args(p: argparse.ArgumentParser, pp_required: bool = False) -> None:
    p.add_argument("--model", required=True, help="model directory: config.json + safetensors "
                   "shards (+ model.safetensors.index.json)")
    p.add_argument("--pp", type=int, required=pp_required, default=None,
                   help="pipeline stages (default for load: world size / (tp*ep))")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks per stage "
                   "(experts split in contiguous blocks)")
    p.add_argument("--partition", type=_partition, default="even",
                   help="even (default; remainder to middle stages), balanced (by bytes from the "
                   "headers), or layer counts per stage such as 8,8,9,7")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")


def _pool_args(p: argparse.ArgumentParser) -> None:
    """Options sizing each stage's KV / Mamba cache pools (docs/pools.md)."""
    g = p.add_argument_group("cache pools (docs/pools.md)")
    g.add_argument("--tokens", type=int, default=None, help="target KV tokens per stage "
                   "(sizes the pools when no budget is given; with --partition balanced, the "
                   "cache load layers are weighed at); default 4096")
    g.add_argument("--requests", type=int, default=None,
                   help="target concurrent requests (Mamba / linear-attention state slots); "
                   "default 16")
    g.add_argument("--cache-budget", type=_size, default=None, metavar="BYTES",
                   help="cache bytes per rank (e.g. 20G): report max tokens / requests it holds")
    g.add_argument("--device-memory", type=_memory, default=None, metavar="BYTES|auto",
                   help="device memory per rank; budget = this x --memory-fraction - the rank's "
                   "weight bytes (load: 'auto' = the pool device's total memory)")
    g.add_argument("--memory-fraction", type=float, default=0.9, help="default 0.9")
    g.add_argument("--mamba-ratio", type=float, default=0.5,
                   help="share of a stage's budget for the state pool when it has both "
                   "attention and state layers (default 0.5)")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    g.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: model dtype)")
    g.add_argument("--ssm-dtype", default=None,
                   help="ssm / temporal state dtype (default float32)")


def _memory(text: str) -> int:
    return -1 if text == "auto" else _size(text)


def _auto_memory(device: object) -> int:
    from .errors import PlanError
    from .pools import device_memory
    if device is None:
        raise PlanError("--device-memory auto applies to `pploader load` (pools on a GPU); "
                        "give bytes here, e.g. --device-memory 80G")
    return device_memory(device)  # type: ignore[arg-type]


def _load_partition(args: argparse.Namespace, pp: int, device: object) -> object:
    """``balanced`` with --tokens/--requests weighs each layer's cache too: resolve it to layer
    counts here so that load places exactly the windows `pploader plan` printed."""
    if args.partition != "balanced" or (args.tokens is None and args.requests is None):
        return args.partition
    from .checkpoint import open_checkpoint
    from .plan import make_windows
    from .pools import cache_costs
    from .spec import load_spec
    spec, index = load_spec(args.model), open_checkpoint(args.model)
    costs = cache_costs(spec, args.tp, _pool_options(args, device))  # type: ignore[arg-type]
    return [w.num_layers for w in make_windows(spec, index, pp, "balanced", cache_bytes=costs)]


def _pool_options(args: argparse.Namespace, device: object = None) -> object:
    from .geometry import CacheDtypes, parse_dtype
    from .pools import PoolOptions
    mem = args.device_memory
    return PoolOptions(
        tokens=args.tokens, requests=args.requests, budget_bytes=args.cache_budget,
        device_bytes=_auto_memory(device) if mem == -1 else mem,
        memory_fraction=args.memory_fraction,
        mamba_ratio=args.mamba_ratio, page_size=args.page_size,
        dtypes=CacheDtypes(kv=parse_dtype(args.kv_dtype) if args.kv_dtype else None,
                           ssm=parse_dtype(args.ssm_dtype) if args.ssm_dtype else None))


def _pipeline_pools(reports: Sequence[dict]) -> Optional[dict]:
    from .pools import pipeline_capacity
    caps = [r["pools"]["capacity"] for r in reports if r.get("pools")]
    return pipeline_capacity(caps) if caps else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pploader", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pipeline-parallel checkpoint loader: each rank reads only its stage.",
        epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"pploader {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plan", help="print every rank's plan (one process, headers only)",
                       description="Plan every rank of a PP x EP x TP layout from config.json and "
                       "the safetensors headers. Reads no tensor data; no torch.distributed.")
    _layout_args(p, pp_required=True)
    _pool_args(p)

    p = sub.add_parser("load", help="load this rank's stage (run under torchrun/srun/mpiexec)",
                       description="Each rank plans, all ranks agree, then each reads exactly its "
                       "bytes. Rank 0 prints one table (or --json) for the whole job.")
    _layout_args(p)
    _pool_args(p)
    p.add_argument("--no-pools", action="store_true", help="do not allocate cache pools")
    p.add_argument("--pool-device", default=None,
                   help="device of the cache pools (default cuda:LOCAL_RANK with GPUs, else cpu)")
    p.add_argument("--window-bytes", type=_size, default=None,
                   help=f"host memory in flight per rank (default max({DEFAULT_WINDOW_BYTES >> 20}"
                   " MiB, 2x largest tensor)); accepts 512M, 1G")
    p.add_argument("--threads", type=int, default=None,
                   help="reader threads per rank (default 1 on CPU, 16 on a GPU)")
    p.add_argument("--device", default=None,
                   help="where the weights go: cpu, cuda, cuda:N (default cuda:LOCAL_RANK when "
                   "this rank has a GPU, else cpu). On a GPU bytes go through a pinned ring "
                   "straight into device memory (O_DIRECT when the files are not cached)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="load timeout: a rank making no progress this long while others wait is "
                   "named silent (hung), one whose heartbeat stops for min(10, timeout) s is "
                   "named dead; every rank then exits 1 (default 60)")
    p.add_argument("--backend", default=None, help="torch.distributed backend (default: "
                   "$PPLOADER_BACKEND, else nccl when each rank has a GPU, else gloo)")
    p.add_argument("--save-loaded", metavar="DIR", default=None,
                   help="write each rank's tensors to DIR/rank-<rank>.safetensors")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    p.add_argument("--progress", action="store_true", help="progress bar even when not a TTY")
    p.add_argument("--memory-budget", type=_size, default=None, metavar="BYTES",
                   help="fail with a structured out-of-memory error (tensor, bytes) when a rank "
                   "would allocate more than this; accepts 512M, 1G (default: no cap)")
    p.add_argument("--read-once", action="store_true",
                   help="read tensors that several ranks of a stage need (replicated ones) on one "
                   "rank and broadcast them; pays on network storage (default off)")
    p.add_argument("--range-cost", type=_size, default=None, metavar="BYTES",
                   help="cost of one extra positional read in bytes: strided (dim-1) TP slices "
                   "are read row by row when cheaper than the covering box; 0 = always row by "
                   "row (default 64K)")

    p = sub.add_parser("make-tiny", help="write a real sharded checkpoint from a tiny config",
                       description="Write random weights with real names and shapes for the "
                       "config's family, split into several shards with an index.")
    p.add_argument("config", help="a config.json (e.g. configs/models/tiny-llama.json)")
    p.add_argument("out", help="output directory")
    p.add_argument("--shard-bytes", type=_size, default=None, help="target shard size")
    p.add_argument("--seed", type=int, default=None)

    p = sub.add_parser("convert", help="convert a trusted .bin/.pt checkpoint to safetensors",
                       description="pploader never unpickles by default. With --allow-pickle, "
                       "read SRC's pickle files with torch.load(weights_only=True) and write "
                       "safetensors shards + index to the new directory DST.")
    p.add_argument("src", help="directory with pytorch_model*.bin / *.pt / *.pth")
    p.add_argument("dst", help="new output directory (must not exist)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="required: you trust these pickle files")
    p.add_argument("--shard-bytes", type=_size, default=4 << 30, help="target shard size")

    from .bench import add_bench_parser
    add_bench_parser(sub)
    return parser


def _setup_logging(rank: Optional[int]) -> None:
    prefix = f"[rank {rank}] " if rank is not None else ""
    logging.basicConfig(level=os.environ.get("PPLOADER_LOG", "WARNING").upper(),
                        format=f"{prefix}%(levelname)s %(name)s: %(message)s", force=True)


def cmd_plan(args: argparse.Namespace) -> int:
    from .checkpoint import open_checkpoint
    from .plan import plan_all
    from .report import plan_table
    from .spec import load_spec

    from .pools import cache_costs, format_pools, plan_pools

    spec = load_spec(args.model)
    index = open_checkpoint(args.model)
    opts = _pool_options(args)
    plans = plan_all(spec, index, args.pp, args.tp, args.ep, partition=args.partition,
                     cache_bytes=cache_costs(spec, args.tp, opts))  # type: ignore[arg-type]
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
                          "pp": args.pp, "tp": args.tp, "ep": args.ep, "ranks": summaries,
                          "pipeline_pools": pipeline}, indent=1))
    else:
        print(f"{args.model}: {spec.architecture} ({spec.family.name}), {spec.num_layers} layers, "
              f"pp {args.pp} x ep {args.ep} x tp {args.tp}")
        print(plan_table(summaries))
        if "unavailable" in pipeline:
            print(f"\ncache pools: not derivable for this model: {pipeline['unavailable']}")
            return 0
        print("\ncache pools (per rank; its own layers only):")
        print(format_pools(summaries))
        bal = pipeline["balance"]
        print(f"stage bytes (weights + cache at {bal['target_tokens']} tokens, "
              f"{bal['target_requests']} requests): max/mean {bal['chosen']['max_over_mean']} "
              f"({args.partition}) vs {bal['even']['max_over_mean']} (even)")
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    """``pploader load`` on every rank: plan, agree, load, agree, report (docs/launch.md).

    Any rank failing, hanging or dying makes every rank print the combined error and exit 1.
    """
    from .bootstrap import init_distributed
    from .comm import Comm
    from .faults import fault_from_env, with_fault
    from .topology import Topology
    import torch.distributed as dist

    fault = fault_from_env()  # test-only hook, None unless PPLOADER_FAULT is set
    launch = init_distributed(backend=args.backend, timeout_s=args.timeout)
    _setup_logging(launch.rank)
    topo = Topology.for_world(launch.world_size, launch.rank, pp=args.pp, tp=args.tp, ep=args.ep)
    comm = Comm(topo, timeout_s=args.timeout)
    try:
        reports = _load_agreed(args, comm, with_fault(fault, topo.rank, comm.progress_adder()))
    except RankFailure as exc:
        sys.stderr.write(f"[rank {topo.rank}] pploader: load failed on the job: {exc}\n")
        sys.stderr.flush()
        comm.close()  # linger: every rank reads the verdict before the store's host leaves
        os._exit(1)  # never hang in process-group teardown after a peer died
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
                from .pools import format_pools
                print("\ncache pools (per rank; its own layers only):")
                print(format_pools(reports))
        sys.stdout.flush()
    dist.destroy_process_group()
    comm.close()
    return 0


def _load_agreed(args: argparse.Namespace, comm: "Comm", add: Callable[[int], None]
                 ) -> list[dict]:
    """Plan, agree, load, agree (called on all ranks); every rank's report, in rank order."""
    from .report import ProgressBar
    from .stage import load_stage, plan_stage

    topo = comm.topology
    cancel = comm.watch_failures(abort_after_s=min(10.0, args.timeout))
    staged, error, report = None, None, None
    try:
        from .pools import pool_device
        staged = plan_stage(args.model, topo, partition=_load_partition(
            args, topo.pp_size, pool_device(args.pool_device)),
            **({} if args.range_cost is None else {"range_cost_bytes": args.range_cost}))
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    planned = comm.agree(error, staged.plan.read_bytes if staged else None)
    show = not args.no_progress and topo.rank == 0 and (args.progress or sys.stderr.isatty())
    with ProgressBar(sum(planned), comm.progress_total, enabled=show):
        try:
            result = load_stage(staged, window_bytes=args.window_bytes, threads=args.threads,
                                device=pool_device(args.device), cancel=cancel, on_progress=add,
                                memory_budget_bytes=args.memory_budget,
                                comm=comm, read_once=args.read_once)
            add.flush()  # type: ignore[attr-defined]
            if args.save_loaded:
                from safetensors.torch import save_file
                Path(args.save_loaded).mkdir(parents=True, exist_ok=True)
                names = {i.target: i.name for i in result.plan.items}
                save_file({names[k]: v.contiguous().cpu() for k, v in result.state_dict.items()},
                          str(Path(args.save_loaded) / f"rank-{topo.rank}.safetensors"))
            report = result.report.to_json()
            if not args.no_pools:  # this stage's cache pools, after its weights (docs/pools.md)
                from .pools import build_rank_pools, pool_device
                device = pool_device(args.pool_device)
                report["pools"] = build_rank_pools(staged.spec, staged.plan, _pool_options(
                    args, device), device=device).report()  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - agreed on below
            error = exc
        return comm.agree(error, report)


def _env_rank() -> Optional[str]:
    """This process's rank as its launcher exported it (for message prefixes only)."""
    env = os.environ
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        if env.get(key, "").isdigit():
            return env[key]
    if "SLURM_STEP_ID" in env and env.get("SLURM_PROCID", "").isdigit():
        return env["SLURM_PROCID"]
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rank = _env_rank()
    _setup_logging(int(rank) if rank and rank.isdigit() else None)
    prefix = f"[rank {rank}] " if rank else ""
    try:
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "load":
            return cmd_load(args)
        if args.command == "make-tiny":
            from .tiny import make_tiny
            files = make_tiny(args.config, args.out, shard_bytes=args.shard_bytes, seed=args.seed)
            print(f"wrote {len(files)} shard(s) to {args.out}")
            return 0
        if args.command == "convert":
            from .pickled import convert_to_safetensors
            files = convert_to_safetensors(args.src, args.dst, allow_pickle=args.allow_pickle,
                                           shard_bytes=args.shard_bytes)
            print(f"wrote {len(files)} safetensors shard(s) to {args.dst}")
            return 0
        if args.command == "bench":
            from .bench import run_bench
            return run_bench(args)
    except RankFailure as exc:
        sys.stderr.write(f"{prefix}pploader: load failed on the job: {exc}\n")
        sys.stderr.flush()
        os._exit(1)  # never hang in process-group teardown after a peer died
    except PPLoaderError as exc:
        sys.stderr.write(f"{prefix}pploader: error: {exc}\n")
        return 2
    return 2
