"""The argument parser of ``pploader``'s command line: subcommands, option groups and the
argument types that refuse bad values with one line naming the fix (exit 2).

Imports nothing heavy: ``pploader --help`` and argument mistakes never import torch.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

from .arg_types import text as _text, typed as _typed
from .arguments import BY_FLAG, MAX_LAYERS, MAX_RANKS
from .arguments import OPTIONS as BY_NAME
from .errors import ArgumentError
from .io.registry import AUTO, backends_help
from .planning.partition import ENGINE_PARTITION_ENV, ENGINES, parse_partition  # noqa: F401

__all__ = ["build_parser", "MAX_RANKS"]


#: read.DEFAULT_WINDOW_BYTES in MiB (a literal: --help must not import torch; a test checks it)
_DEFAULT_WINDOW_MIB = 256


#: plan.DEFAULT_EXCHANGE_COST (a literal for the same reason; the same test checks it)
_DEFAULT_EXCHANGE_COST = 0.5


#: what PPLOADER_LOG accepts
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


#: torch.distributed backends pploader runs on
_BACKENDS = ("gloo", "nccl", "mpi")  # == arguments.OPTIONS["backend"].choices (a test checks)


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
        if text in ("even", "balanced") + ENGINES:
            return text
        sizes = parse_partition(text)
        if any(n < 1 for n in sizes):  # known without the model: refused before any start
            raise argparse.ArgumentTypeError(f"partition {sizes}: every stage needs at least "
                                             "one layer; give counts of 1 or more")
        if any(n > MAX_LAYERS for n in sizes):
            raise argparse.ArgumentTypeError(f"{text[:40]}: a stage of more than {MAX_LAYERS} "
                                             "layers (no model has that many); give layer "
                                             "counts such as 8,8,9,7")
        return sizes
    except PlanError as exc:
        raise argparse.ArgumentTypeError(f"{exc.detail}; or use even / balanced / "
                                         "vllm / sglang") from None


def _parse(text: str, kind: Callable[[str], Any], what: str) -> Any:
    """``kind(text)``, or the option's one-line error saying ``text`` is not ``what``."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def _model(text: str) -> str:
    """--model: a local directory (checked when planning) or a well-formed s3:// URL."""
    from .storage import check_model_location
    try:
        return check_model_location(text, "--model")
    except ArgumentError as exc:
        raise argparse.ArgumentTypeError(exc.detail.removeprefix("--model: ")) from None


_model.spec = BY_FLAG["--model"]  # type: ignore[attr-defined]  # its table row


def _layout_args(p: argparse.ArgumentParser, pp_required: bool = False) -> None:
    p.add_argument("--model", type=_model, required=True, help="model directory or s3://bucket/prefix: "
                   "config.json + safetensors shards (+ model.safetensors.index.json)")
    p.add_argument("--pp", type=_typed("--pp"), required=pp_required, default=None,
                   help="pipeline stages (default for load: world size / (tp*ep))")
    p.add_argument("--tp", type=_typed("--tp"), default=1, help="tensor-parallel ranks per stage")
    p.add_argument("--ep", type=_typed("--ep"), default=1, help="expert-parallel ranks per stage "
                   "(experts split in contiguous blocks)")
    p.add_argument("--partition", type=_partition, default="even",
                   help="even (default; remainder to middle stages), balanced (by bytes from the "
                   "headers), vllm or sglang (exactly that engine's split; honours "
                   "VLLM_PP_LAYER_PARTITION / SGLANG_PP_LAYER_PARTITION when set), or layer "
                   "counts per stage such as 8,8,9,7")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--allow-root", type=_typed("--allow-root"), action="append", default=[],
                   metavar="DIR",
                   help="also accept config.json, the index and shards that are symlinks into "
                   "DIR (repeatable; default: the model directory and its Hugging Face cache "
                   "repo only)")


def _exchange_cost(text: str) -> Optional[float | str]:
    """A cost in the table's range (arguments.OPTIONS["exchange_cost"]), auto or off."""
    if text.strip() in ("off", "auto"):
        return None if text.strip() == "off" else "auto"
    try:
        return BY_NAME["exchange_cost"].parse(text)  # type: ignore[no-any-return]
    except ArgumentError as exc:
        raise argparse.ArgumentTypeError(exc.detail.removeprefix("exchange_cost=")
                                         + ", auto or off") from None


def _tiny_names() -> list[str]:
    """The bundled tiny configs' family names (a glob: --help must not import torch)."""
    folder = Path(__file__).resolve().parent / "tiny_configs"
    return sorted(p.name[len("tiny-"):-len(".json")] for p in folder.glob("tiny-*.json"))


def _tp_read_args(p: argparse.ArgumentParser) -> None:
    """Options that change how TP slices are read (so `plan` shows what `load` does)."""
    g = p.add_argument_group("TP slice reads (docs/tensor-parallel.md)")
    g.add_argument("--range-cost", type=_typed("--range-cost"), default=None, metavar="BYTES",
                   help="cost of one extra positional read in bytes: strided (dim-1) TP slices "
                   "are read row by row when cheaper than the covering box; 0 = always row by "
                   "row (default 64K)")
    g.add_argument("--exchange-cost", type=_exchange_cost, default=_DEFAULT_EXCHANGE_COST,
                   metavar="COST|auto|off", help="cost of one byte exchanged over the TP group in "
                   "bytes read: strided slices are read as row shares + an all-to-all when "
                   f"that is cheaper (default {_DEFAULT_EXCHANGE_COST}; off = never; auto = "
                   "from the shards' page-cache residency and the device, see "
                   "docs/tensor-parallel.md)")
    g.add_argument("--no-redistribute", dest="exchange_cost", action="store_const", const=None,
                   help="same as --exchange-cost off: read strided slices directly")
    g.add_argument("--exchange-batch", type=_typed("--exchange-batch"), default=None, metavar="BYTES",
                   help="tensor bytes per all-to-all (default 64M; larger tensors are cut "
                   "into row chunks)")


def _pool_args(p: argparse.ArgumentParser) -> None:
    """Options sizing each stage's KV / Mamba cache pools (docs/pools.md)."""
    g = p.add_argument_group("cache pools (docs/pools.md)")
    g.add_argument("--tokens", type=_typed("--tokens"), default=None, help="target KV tokens per stage "
                   "(sizes the pools when no budget is given; with --partition balanced, the "
                   "cache load layers are weighed at); default 4096")
    g.add_argument("--requests", type=_typed("--requests"), default=None,
                   help="target concurrent requests (Mamba / linear-attention state slots); "
                   "default 16")
    g.add_argument("--cache-budget", type=_typed("--cache-budget"), default=None, metavar="BYTES",
                   help="cache bytes per rank (e.g. 20G): report max tokens / requests it holds")
    g.add_argument("--device-memory", type=_memory, default=None, metavar="BYTES|auto",
                   help="device memory per rank; budget = this x --memory-fraction - the rank's "
                   "weight bytes (load: 'auto' = the pool device's total memory)")
    g.add_argument("--memory-fraction", type=_typed("--memory-fraction"), default=0.9, help="default 0.9")
    g.add_argument("--mamba-ratio", type=_typed("--mamba-ratio"), default=0.5,
                   help="share of a stage's budget for the state pool when it has both "
                   "attention and state layers (default 0.5)")
    g.add_argument("--page-size", type=_typed("--page-size"), default=16, help="tokens per KV page (default 16)")
    g.add_argument("--max-context", type=_typed("--max-context"), default=None, metavar="TOKENS",
                   help="tokens one request may reach: sliding-window layers keep min(window, "
                   "this) per request (default: the window)")
    g.add_argument("--kv-dtype", type=_typed("--kv-dtype"), default=None, help="KV cache dtype (default: model dtype)")
    g.add_argument("--ssm-dtype", type=_typed("--ssm-dtype"), default=None,
                   help="ssm / temporal state dtype (default float32)")


def _memory(text: str) -> int:
    """--device-memory: bytes (the table's range), or auto (-1: the pool device's memory)."""
    return -1 if text.strip() == "auto" else _typed("--device-memory")(text)


def _device_name(text: str) -> str:
    """cpu, cuda or cuda:N (whether this rank has that GPU is checked at plan time)."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and
                                                                         ":" in text):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: use cpu, cuda or cuda:N")
    return text


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
    p.add_argument("--device", type=_device_name, default="cpu",
                   help="the load's device kind, for --exchange-cost auto (default cpu)")
    p.add_argument("--rank", type=_typed("--rank"), default=None,
                   help="plan only this rank, as it plans itself at `load` (its row and "
                   "pools; reads only its stage's headers; no stage balance)")
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
    p.add_argument("--window-bytes", type=_typed("--window-bytes"), default=None,
                   help=f"host memory in flight per rank (default max({_DEFAULT_WINDOW_MIB}"
                   " MiB, 2x largest tensor)); accepts 512M, 1G")
    p.add_argument("--threads", type=_typed("--threads"), default=None,
                   help="reader threads per rank (default 1 on CPU, 16 on a GPU)")
    p.add_argument("--device", type=_device_name, default=None,
                   help="where the weights go: cpu, cuda, cuda:N (default cuda:LOCAL_RANK when "
                   "this rank has a GPU, else cpu). On a GPU bytes go through a pinned ring "
                   "straight into device memory (O_DIRECT when the files are not cached)")
    p.add_argument("--io-backend", type=_typed("--io-backend"), default=AUTO,
                   metavar="{" + ",".join(BY_FLAG["--io-backend"].choices) + "}",
                   help="read backend of every read: direct, --read-once, the TP exchange's row "
                   "shares, --read-once-node (default auto: the first that loads onto --device). "
                   + backends_help())
    p.add_argument("--timeout", type=_typed("--timeout"), default=60.0,
                   help="load timeout: a rank making no progress this long while others wait is "
                   "named silent (hung), one whose heartbeat stops for min(10, timeout) s is "
                   "named dead; every rank then exits 1 (default 60)")
    p.add_argument("--backend", type=_typed("--backend"), default=None, help="torch.distributed backend (default: "
                   "$PPLOADER_BACKEND, else nccl when each rank has a GPU, else gloo)")
    p.add_argument("--save-loaded", type=_text("an output directory"), metavar="DIR",
                   default=None,
                   help="write each rank's tensors to DIR/rank-<rank>.safetensors once every "
                   "rank succeeded (DIR new, empty or an earlier --save-loaded's; not inside "
                   "the model)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    p.add_argument("--progress", action="store_true", help="progress bar even when not a TTY")
    p.add_argument("--memory-budget", type=_typed("--memory-budget"), default=None, metavar="BYTES",
                   help="fail with a structured out-of-memory error (tensor, bytes) when a rank "
                   "would allocate more than this; accepts 512M, 1G (default: no cap)")
    p.add_argument("--read-once", action="store_true",
                   help="read tensors that several ranks of a stage need (replicated ones) on one "
                   "rank and broadcast them; pays on network storage (default off)")
    p.add_argument("--read-once-node", action="store_true",
                   help="read bytes that several ranks of one node need (replicated tensors, "
                   "the tied head) once per node and send them to the others; a node = "
                   "$LOCAL_WORLD_SIZE consecutive ranks (CPU or GPU loads; default off)")

    p = sub.add_parser("files", help="the shards (and bytes) each node or rank needs",
                       description="Per node (ranks placed in blocks of --ranks-per-node, as "
                       "torchrun and Slurm do) the shards its ranks read, plus config.json, the "
                       "index and tokenizer files: copy only these to node-local disk "
                       "(launch/slurm-stage-files.sbatch). Headers only; no data read.")
    _layout_args(p, pp_required=True)
    _tp_read_args(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--nodes", type=_typed("--nodes"), default=None,
                   help="number of nodes (ranks split evenly)")
    g.add_argument("--ranks-per-node", type=_typed("--ranks-per-node"), default=None,
                   help="ranks per node (default 1: one entry per rank)")
    p.add_argument("--node", type=_typed("--node"), default=None,
                   help="print only this node's files, without comments (e.g. $SLURM_NODEID)")
    p.add_argument("--format", choices=("list", "rsync", "include", "sbcast", "json"),
                   default="list", help="list / rsync (a --files-from list), include (download "
                   "tool patterns), sbcast (copy commands, $DEST), json")

    p = sub.add_parser("make-tiny", help="write a real sharded checkpoint from a tiny config",
                       description="Write random weights with real names and shapes for the "
                       "config's family, split into several shards with an index. The tiny "
                       "configs ship with pploader: name a family. The checkpoint is written to "
                       "a temporary directory and renamed into place, files mode 0644.",
                       epilog="bundled families: " + ", ".join(_tiny_names()))
    p.add_argument("config", type=_text("a family name or a config.json path"), help="a family name (one of the bundled tiny configs listed "
                   "below) or a config.json path")
    p.add_argument("out", type=_text("an output directory"),
                   help="output directory: new, empty, or an earlier pploader output "
                   "(with --force); never a directory holding other files, never s3://")
    p.add_argument("--shard-bytes", type=_typed("--shard-bytes"), default=None,
                   help="target shard size")
    p.add_argument("--seed", type=_typed("--seed"), default=None, help="random seed (default: the "
                   "config's pploader_tiny.seed, else 0)")
    p.add_argument("--force", action="store_true", help="replace an earlier pploader output "
                   "in OUT: only the files its .pploader-output marker lists are replaced, "
                   "other files kept")

    p = sub.add_parser("convert", help="convert a trusted .bin/.pt checkpoint to safetensors",
                       description="pploader never unpickles by default. With --allow-pickle, "
                       "read SRC's pickle files with torch.load(weights_only=True) and write "
                       "safetensors shards + index to the new directory DST.")
    p.add_argument("src", type=_text("the directory of the pickle files"),
                   help="directory with pytorch_model*.bin / *.pt / *.pth")
    p.add_argument("dst", type=_text("a new output directory"),
                   help="output directory: new or empty, outside SRC")
    p.add_argument("--allow-pickle", action="store_true",
                   help="required: you trust these pickle files")
    p.add_argument("--shard-bytes", type=_typed("--shard-bytes"), default=4 << 30, help="target shard size")

    if bench:  # the benchmark package, imported only for `pploader bench`
        from .bench.command import add_bench_parser
        add_bench_parser(sub)
    else:  # the same entry in `pploader --help`
        sub.add_parser("bench",
                       help="benchmark pploader against read-all-then-filter and raw preadv")
    return parser


def _env_rank() -> Optional[str]:
    """This process's rank as its launcher exported it (for message prefixes only)."""
    env = os.environ
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        if env.get(key, "").isdigit():
            return env[key]
    if "SLURM_STEP_ID" in env and env.get("SLURM_PROCID", "").isdigit():
        return env["SLURM_PROCID"]
    return None
