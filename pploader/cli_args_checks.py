"""Checks ``pploader`` runs on its arguments and environment before a job starts.

Everything here runs before ``torch.distributed`` is initialised (and before any byte of the
checkpoint is read): a conflict between options, an output path that cannot be written, a GPU
option on a machine without one, an environment variable the docs name with a bad value. Each
raises ``UsageError`` naming the flag (or variable) to change; ``pploader`` exits 2.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Mapping, Optional

from .errors import UsageError

__all__ = ["check_load_args", "check_writable_dir", "check_env",
           "check_launch_env", "env_ranks_per_node",
           "check_engine_env", "publish_mode", "FILE_MODE", "ENV_BACKEND"]

#: mode of every file pploader writes (readable by the group and others, as `cp` would)
FILE_MODE = 0o644

#: the environment variable ``--backend`` defaults to (docs/launch.md)
ENV_BACKEND = "PPLOADER_BACKEND"


def publish_mode(path: os.PathLike | str, mode: int = FILE_MODE) -> None:
    """Give a written file ``mode`` (safetensors' writer leaves 0600)."""
    os.chmod(path, mode)


def check_writable_dir(path: os.PathLike | str, flag: str) -> Path:
    """``path`` is (or can be made) a directory this process can create files in: made now,
    probed with a temporary file, so a mistake is found before any byte is read."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a directory; give a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        from .outputs import probe_writable
        probe_writable(out)
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write there ({exc.strerror or exc}); give a "
                         "writable directory") from None
    return out


def _gpu_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_gpu_option(value: Optional[str], flag: str, gpus: int, other: str) -> None:
    """``--device`` / ``--pool-device`` naming a GPU this machine does not have."""
    if value is None or not value.startswith("cuda"):
        return
    index = int(value.partition(":")[2] or 0)
    if gpus == 0:
        raise UsageError(f"{flag} {value}: this process sees no GPU; use {flag} cpu{other}")
    if index >= gpus:
        raise UsageError(f"{flag} {value}: this process sees {gpus} GPU(s) (cuda:0 to "
                         f"cuda:{gpus - 1}); give one of them")


def check_engine_env(engine: str, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The engine's partition variable (VLLM_PP_LAYER_PARTITION, ...) when set, checked like
    ``--partition``'s layer counts; None when unset or empty."""
    from .planning.partition import ENGINE_PARTITION_ENV
    env = os.environ if env is None else env
    var = ENGINE_PARTITION_ENV[engine]
    text = env.get(var)
    if text is None or not text.strip():
        return None
    if not all(p.strip().isdigit() and int(p) > 0 for p in text.split(",")):
        raise UsageError(f"{var}={text!r}: give comma-separated layer counts of 1 or more "
                         "(e.g. 8,8,9,7) or unset it")
    return text


def check_env(env: Optional[Mapping[str, str]] = None,
              args: Optional[argparse.Namespace] = None) -> None:
    """The environment variables docs/launch.md names, as strictly as their flags, each only
    where it applies (``args``: the command's options; None = every variable): a broken
    VLLM_PP_LAYER_PARTITION never breaks ``--partition even``."""
    from .arguments import OPTIONS
    from .planning.partition import ENGINE_PARTITION_ENV
    backends = OPTIONS["backend"].choices or ()
    env = os.environ if env is None else env
    backend = env.get(ENV_BACKEND)
    if backend is not None and backend not in backends and (
            args is None or getattr(args, "backend", None) is None):
        raise UsageError(f"{ENV_BACKEND}={backend!r}: unknown backend; use one of "
                         f"{', '.join(backends)} or unset it")
    for engine in ENGINE_PARTITION_ENV:
        if args is None or getattr(args, "partition", None) == engine:
            check_engine_env(engine, env)
    local = env.get("LOCAL_WORLD_SIZE")
    if local is not None and not (local.strip().isdigit() and int(local) > 0) and (
            args is None or getattr(args, "read_once_node", False)):
        raise UsageError(f"LOCAL_WORLD_SIZE={local!r}: must be a positive integer (ranks on "
                         "this node); fix the launcher's environment or unset it")


def check_launch_env(env: Optional[Mapping[str, str]] = None) -> int:
    """The launcher's rank variables make sense together (before torch.distributed starts);
    returns the world size they give. RANK without WORLD_SIZE (or the reverse) is a launch
    mistake, not a single process; a torchrun-style world needs MASTER_ADDR."""
    from .distributed.bootstrap import detect_launch
    from .errors import TopologyError
    env = os.environ if env is None else env
    given = [k for k in ("RANK", "WORLD_SIZE") if k in env]
    if len(given) == 1:
        other = ({"RANK", "WORLD_SIZE"} - set(given)).pop()
        raise UsageError(f"{given[0]}={env[given[0]]!r} is set but {other} is not: a launcher "
                         "sets both (torchrun, or RANK, WORLD_SIZE, MASTER_ADDR and "
                         "MASTER_PORT by hand); set both, or unset it for one process")
    try:
        launch = detect_launch(env)
    except TopologyError as exc:
        raise UsageError(f"{exc.detail}: fix the launcher's environment") from None
    if launch.source == "torchrun":
        if not 0 <= launch.rank < launch.world_size:
            raise UsageError(f"RANK={launch.rank} is outside WORLD_SIZE={launch.world_size}: "
                             "fix the launcher's environment")
        if launch.world_size > 1 and not env.get("MASTER_ADDR") and env.get(
                "TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
            raise UsageError(f"WORLD_SIZE={launch.world_size} but MASTER_ADDR is not set: "
                             "launch with torchrun, or export MASTER_ADDR and MASTER_PORT")
    return launch.world_size


def _check_together(args: argparse.Namespace, world: int) -> None:
    """Options that make no sense together, or on this launch."""
    if args.window_bytes is not None and args.memory_budget is not None \
            and args.window_bytes > args.memory_budget:
        raise UsageError(f"--window-bytes {args.window_bytes} is larger than --memory-budget "
                         f"{args.memory_budget}: the window must fit the budget; give a "
                         "smaller window or a larger budget")
    if args.cache_budget is not None and args.device_memory is not None:
        raise UsageError("--cache-budget and --device-memory both size the pools (the budget "
                         "would win): give one of them")
    if getattr(args, "read_once_node", False):
        if world == 1:
            raise UsageError("--read-once-node on one rank: there is no other rank to share "
                             "with; leave it out, or launch several ranks (torchrun)")
        local = env_ranks_per_node(os.environ)
        if local is None:
            raise UsageError("--read-once-node needs the ranks per node from the launcher: "
                             "set LOCAL_WORLD_SIZE (torchrun sets it; Slurm "
                             "SLURM_NTASKS_PER_NODE, Open MPI OMPI_COMM_WORLD_LOCAL_SIZE)")
        if world % local:
            raise UsageError(f"--read-once-node: {local} ranks per node do not divide the "
                             f"world of {world} ranks; fix LOCAL_WORLD_SIZE or the launch")


def env_ranks_per_node(env: Mapping[str, str]) -> Optional[int]:
    """The ranks per node a launcher exported (LOCAL_WORLD_SIZE, Slurm's, Open MPI's)."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = env.get(key, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def _check_io_backend_storage(args: argparse.Namespace) -> None:
    """``--io-backend`` reads the storage ``--model`` is on (s3 only for s3://, and back)."""
    from .io.registry import BACKENDS
    from .storage import is_remote
    if args.io_backend in (None, "auto"):
        return
    info = next(b for b in BACKENDS if b.name == args.io_backend)
    storage = "s3" if is_remote(args.model) else "file"
    if info.storage != storage:
        fits = [b.name for b in BACKENDS if b.storage == storage]
        where = "an s3:// model" if storage == "s3" else "a local model"
        raise UsageError(f"--io-backend {args.io_backend} reads {info.storage} storage and "
                         f"--model is {where}; use --io-backend {' or '.join(['auto', *fits])}")


def check_load_args(args: argparse.Namespace) -> None:
    """Every conflict `pploader load` can find before torch.distributed starts."""
    check_env(args=args)
    from .planning.checkpoint import check_model_dir
    from .storage import is_remote
    if not is_remote(args.model):
        check_model_dir(args.model)  # a missing --model: one line, before any rank starts
    world = check_launch_env()
    _check_together(args, world)
    _check_io_backend_storage(args)
    gpus = _gpu_count() if any(str(v or "").startswith("cuda") for v in (
        args.device, args.pool_device)) or args.io_backend not in (None, "auto") else 0
    _check_gpu_option(args.device, "--device", gpus, " or leave --device out")
    _check_gpu_option(args.pool_device, "--pool-device", gpus,
                      " or leave --pool-device out (pools then go where the weights go)")
    if args.io_backend not in (None, "auto"):
        from .io.registry import BACKENDS
        info = next(b for b in BACKENDS if b.name == args.io_backend)
        device = args.device or ("cuda" if gpus else "cpu")
        kind = device.partition(":")[0]
        if kind not in info.devices:
            fits = [b.name for b in BACKENDS if kind in b.devices]
            chosen = "" if args.device else " (the default --device on this machine)"
            raise UsageError(f"--io-backend {args.io_backend} loads onto "
                             f"{'/'.join(info.devices)}, not {device}{chosen}; use --io-backend "
                             f"{' or '.join(['auto', *fits])}, or --device {info.devices[0]}")
    if args.save_loaded is not None:  # pploader.outputs: new, empty or pploader's own
        from .outputs import claim_output
        claim_output(args.save_loaded, "--save-loaded", command="load --save-loaded",
                     reuse=True, models=[args.model])
