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
from typing import TYPE_CHECKING, Callable, NoReturn, Optional, Sequence

from .errors import ConfigError, PlanError, PPLoaderError, RankFailure, UsageError
from .planning.partition import ENGINE_PARTITION_ENV, ENGINES, EngineSplit, parse_partition

if TYPE_CHECKING:  # pragma: no cover
    from .dist.comm import Comm
    from .stage import StagePlan
    from .testing.faults import Fault

__all__ = ["main", "build_parser"]

log = logging.getLogger("pploader")

#: read.DEFAULT_WINDOW_BYTES in MiB (a literal: --help must not import torch; a test checks it)
_DEFAULT_WINDOW_MIB = 256
#: plan.DEFAULT_EXCHANGE_COST (a literal for the same reason; the same test checks it)
_DEFAULT_EXCHANGE_COST = 0.5
#: what PPLOADER_LOG accepts
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: torch.distributed backends pploader runs on
_BACKENDS = ("gloo", "nccl", "mpi")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors naming the fix (``--help``), exit 2, rank-prefixed."""

    def error(self, message: str) -> NoReturn:
        rank = _env_rank()
        prefix = f"[rank {rank}] " if rank else ""
        self.exit(2, f"{prefix}{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _version() -> str:
    from . import __version__
    return __version__


_EPILOG = """\
examples:
  pploader make-tiny llama /tmp/tiny                     # or a config.json path
  pploader plan --model /tmp/tiny --pp 4                 # who reads what; no data read
  pploader plan --model /tmp/tiny --pp 2 --tp 2 --json   # machine-readable
  pploader files --model DIR --pp 2 --tp 8 --nodes 2     # which shards each node needs
  torchrun --standalone --nproc_per_node=4 -m pploader load --model /tmp/tiny --pp 4
  torchrun --nproc_per_node=8 -m pploader load --model DIR --pp 2 --ep 2 --tp 2 --json
  torchrun --nproc_per_node=2 -m pploader load --model DIR --pp 2 --device cuda
  sbatch --nodes=2 launch/slurm.sbatch --model DIR --pp 2 --tp 8   # also launch/mpirun.sh
  pploader bench --size-gb 1 --layers 16                 # ours vs read-all vs raw preadv
  pploader bench --device cuda -- --ckdir /tmp/ck --out OUT         # vs GPU loaders

Every rank reads only its stage: layers [start_layer, end_layer), the embedding on the
first stage, the final norm and head on the last, its experts and its TP slice.
docs/usage.md explains every option and the JSON formats.
"""


def _partition(text: str) -> object:
    from .errors import PlanError
    try:
        return text if text in ("even", "balanced") + ENGINES else parse_partition(text)
    except PlanError as exc:
        raise argparse.ArgumentTypeError(f"{exc.detail}; or use even / balanced / "
                                         "vllm / sglang") from None


def _engine_partition(partition: object) -> object:
    """``vllm`` / ``sglang``: the engine's split, including its partition variable
    (VLLM_PP_LAYER_PARTITION / SGLANG_PP_LAYER_PARTITION) when set, as the engine reads it."""
    if isinstance(partition, str) and partition in ENGINES:
        return EngineSplit(partition, os.environ.get(ENGINE_PARTITION_ENV[partition]))
    return partition


def _size(text: str) -> int:
    """Bytes from ``512M``, ``1G``, ``64KiB``, ``1048576``; positive."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower()
    t = t[:-2] if t.endswith("ib") else t[:-1] if t.endswith("b") else t
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes like 512M, 1G "
                                         "or 1048576") from None
    if value != value or value <= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive, e.g. 512M")
    return int(value)


def _size0(text: str) -> int:
    """A size that may be 0 (``--range-cost 0``)."""
    return 0 if text.strip() == "0" else _size(text)


def _count(text: str) -> int:
    """A positive integer (ranks, threads, tokens)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be 1 or more")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: the timeout must be positive seconds, "
                                         "e.g. 60")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be in (0, 1], e.g. 0.9")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be in [0, 1], e.g. 0.5")
    return value


def _layout_args(p: argparse.ArgumentParser, pp_required: bool = False) -> None:
    p.add_argument("--model", required=True, help="model directory: config.json + safetensors "
                   "shards (+ model.safetensors.index.json)")
    p.add_argument("--pp", type=_count, required=pp_required, default=None,
                   help="pipeline stages (default for load: world size / (tp*ep))")
    p.add_argument("--tp", type=_count, default=1, help="tensor-parallel ranks per stage")
    p.add_argument("--ep", type=_count, default=1, help="expert-parallel ranks per stage "
                   "(experts split in contiguous blocks)")
    p.add_argument("--partition", type=_partition, default="even",
                   help="even (default; remainder to middle stages), balanced (by bytes from the "
                   "headers), vllm or sglang (exactly that engine's split; honours "
                   "VLLM_PP_LAYER_PARTITION / SGLANG_PP_LAYER_PARTITION when set), or layer "
                   "counts per stage such as 8,8,9,7")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--allow-root", action="append", default=[], metavar="DIR",
                   help="also accept config.json, the index and shards that are symlinks into "
                   "DIR (repeatable; default: the model directory and its Hugging Face cache "
                   "repo only)")


def _exchange_cost(text: str) -> Optional[float]:
    if text == "off":
        return None
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"--exchange-cost must be >= 0 or off, got {text}")
    return value


def _tp_read_args(p: argparse.ArgumentParser) -> None:
    """Options that change how TP slices are read (so `plan` shows what `load` does)."""
    g = p.add_argument_group("TP slice reads (docs/tensor-parallel.md)")
    g.add_argument("--range-cost", type=_size0, default=None, metavar="BYTES",
                   help="cost of one extra positional read in bytes: strided (dim-1) TP slices "
                   "are read row by row when cheaper than the covering box; 0 = always row by "
                   "row (default 64K)")
    g.add_argument("--exchange-cost", type=_exchange_cost, default=_DEFAULT_EXCHANGE_COST,
                   metavar="COST|off", help="cost of one byte exchanged over the TP group in "
                   "bytes read: strided slices are read as row shares + an all-to-all when "
                   f"that is cheaper (default {_DEFAULT_EXCHANGE_COST}; off = never)")
    g.add_argument("--no-redistribute", dest="exchange_cost", action="store_const", const=None,
                   help="same as --exchange-cost off: read strided slices directly")
    g.add_argument("--exchange-batch", type=_size, default=None, metavar="BYTES",
                   help="tensor bytes per all-to-all (default 64M; larger tensors are cut "
                   "into row chunks)")


def _tp_read_kwargs(args: argparse.Namespace) -> dict:
    kw: dict = {"exchange_cost": args.exchange_cost,
                "exchange_batch_bytes": args.exchange_batch}
    if args.range_cost is not None:
        kw["range_cost_bytes"] = args.range_cost
    return kw


def _pool_args(p: argparse.ArgumentParser) -> None:
    """Options sizing each stage's KV / Mamba cache pools (docs/pools.md)."""
    g = p.add_argument_group("cache pools (docs/pools.md)")
    g.add_argument("--tokens", type=_count, default=None, help="target KV tokens per stage "
                   "(sizes the pools when no budget is given; with --partition balanced, the "
                   "cache load layers are weighed at); default 4096")
    g.add_argument("--requests", type=_count, default=None,
                   help="target concurrent requests (Mamba / linear-attention state slots); "
                   "default 16")
    g.add_argument("--cache-budget", type=_size, default=None, metavar="BYTES",
                   help="cache bytes per rank (e.g. 20G): report max tokens / requests it holds")
    g.add_argument("--device-memory", type=_memory, default=None, metavar="BYTES|auto",
                   help="device memory per rank; budget = this x --memory-fraction - the rank's "
                   "weight bytes (load: 'auto' = the pool device's total memory)")
    g.add_argument("--memory-fraction", type=_fraction, default=0.9, help="default 0.9")
    g.add_argument("--mamba-ratio", type=_ratio, default=0.5,
                   help="share of a stage's budget for the state pool when it has both "
                   "attention and state layers (default 0.5)")
    g.add_argument("--page-size", type=_count, default=16, help="tokens per KV page (default 16)")
    g.add_argument("--kv-dtype", default=None, help="KV cache dtype (default: model dtype)")
    g.add_argument("--ssm-dtype", default=None,
                   help="ssm / temporal state dtype (default float32)")


def _memory(text: str) -> int:
    return -1 if text == "auto" else _size(text)


def _backend(text: str) -> str:
    if text not in _BACKENDS:
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}: use gloo (CPU), nccl "
                                         "(GPUs) or mpi")
    return text


def _device_name(text: str) -> str:
    """cpu, cuda or cuda:N (whether this rank has that GPU is checked at plan time)."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and
                                                                         ":" in text):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: use cpu, cuda or cuda:N")
    return text


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


def build_parser(bench: bool = True) -> argparse.ArgumentParser:
    """The parser; ``bench=False`` lists ``bench`` without importing the benchmark
    package (main() passes it for every other command)."""
    parser = _Parser(
        prog="pploader", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pipeline-parallel checkpoint loader: each rank reads only its stage.",
        epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=f"pploader {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("plan", help="print every rank's plan (one process, headers only)",
                       description="Plan every rank of a PP x EP x TP layout from config.json and "
                       "the safetensors headers. Reads no tensor data; no torch.distributed.")
    _layout_args(p, pp_required=True)
    _tp_read_args(p)
    _pool_args(p)

    p = sub.add_parser("load", help="load this rank's stage (run under torchrun/srun/mpiexec)",
                       description="Each rank plans, all ranks agree, then each reads exactly its "
                       "bytes. Rank 0 prints one table (or --json) for the whole job.")
    _layout_args(p)
    _tp_read_args(p)
    _pool_args(p)
    p.add_argument("--no-pools", action="store_true", help="do not allocate cache pools")
    p.add_argument("--pool-device", type=_device_name, default=None,
                   help="device of the cache pools (default cuda:LOCAL_RANK with GPUs, else cpu)")
    p.add_argument("--window-bytes", type=_size, default=None,
                   help=f"host memory in flight per rank (default max({_DEFAULT_WINDOW_MIB}"
                   " MiB, 2x largest tensor)); accepts 512M, 1G")
    p.add_argument("--threads", type=_count, default=None,
                   help="reader threads per rank (default 1 on CPU, 16 on a GPU)")
    p.add_argument("--device", type=_device_name, default=None,
                   help="where the weights go: cpu, cuda, cuda:N (default cuda:LOCAL_RANK when "
                   "this rank has a GPU, else cpu). On a GPU bytes go through a pinned ring "
                   "straight into device memory (O_DIRECT when the files are not cached)")
    p.add_argument("--timeout", type=_seconds, default=60.0,
                   help="load timeout: a rank making no progress this long while others wait is "
                   "named silent (hung), one whose heartbeat stops for min(10, timeout) s is "
                   "named dead; every rank then exits 1 (default 60)")
    p.add_argument("--backend", type=_backend, default=None, help="torch.distributed backend (default: "
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
    p.add_argument("--read-once-node", action="store_true",
                   help="read bytes that several ranks of one node need (replicated tensors, "
                   "the tied head) once per node and send them to the others; a node = "
                   "$LOCAL_WORLD_SIZE consecutive ranks (CPU loads; default off)")

    p = sub.add_parser("files", help="the shards (and bytes) each node or rank needs",
                       description="Per node (ranks placed in blocks of --ranks-per-node, as "
                       "torchrun and Slurm do) the shards its ranks read, plus config.json, the "
                       "index and tokenizer files: copy only these to node-local disk "
                       "(launch/slurm-stage-files.sbatch). Headers only; no data read.")
    _layout_args(p, pp_required=True)
    _tp_read_args(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--nodes", type=int, default=None, help="number of nodes (ranks split evenly)")
    g.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per node (default 1: one entry per rank)")
    p.add_argument("--node", type=int, default=None,
                   help="print only this node's files, without comments (e.g. $SLURM_NODEID)")
    p.add_argument("--format", choices=("list", "rsync", "include", "sbcast", "json"),
                   default="list", help="list / rsync (a --files-from list), include (download "
                   "tool patterns), sbcast (copy commands, $DEST), json")

    p = sub.add_parser("make-tiny", help="write a real sharded checkpoint from a tiny config",
                       description="Write random weights with real names and shapes for the "
                       "config's family, split into several shards with an index. The tiny "
                       "configs ship with pploader: name a family (llama, qwen3_moe, ...).")
    p.add_argument("config", help="a family name (llama, mixtral, deepseek_v3, ...: a bundled "
                   "tiny config) or a config.json path")
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

    if bench:  # the benchmark package, imported only for `pploader bench`
        from .bench.command import add_bench_parser
        add_bench_parser(sub)
    else:  # the same entry in `pploader --help`
        sub.add_parser("bench",
                       help="benchmark pploader against read-all-then-filter and raw preadv")
    return parser


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
    plans = plan_all(spec, index, args.pp, args.tp, args.ep,
                     partition=partition,  # type: ignore[arg-type]
                     cache_bytes=cache_costs(spec, args.tp, opts),  # type: ignore[arg-type]
                     **_tp_read_kwargs(args))
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
                          "pipeline_pools": pipeline}, indent=1))
    else:
        print(f"{args.model}: {spec.architecture} ({spec.family.name}), {spec.num_layers} layers, "
              f"pp {args.pp} x ep {args.ep} x tp {args.tp}")
        print(plan_table(summaries))
        if args.tp > 1:
            from .planning.redistribute import methods_table
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
    try:
        device, pools_on = pool_device(args.device), pool_device(args.pool_device)
        partition = _load_partition(args, topo.pp_size, pools_on)
        staged = plan_stage(args.model, topo, allowed_roots=args.allow_root,
                            partition=partition,  # type: ignore[arg-type]
                            **_tp_read_kwargs(args))
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


def _env_rank() -> Optional[str]:
    """This process's rank as its launcher exported it (for message prefixes only)."""
    env = os.environ
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        if env.get(key, "").isdigit():
            return env[key]
    if "SLURM_STEP_ID" in env and env.get("SLURM_PROCID", "").isdigit():
        return env["SLURM_PROCID"]
    return None


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
