"""Start torch.distributed from whatever launched us (or reuse an existing process group)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from .errors import TopologyError

__all__ = ["LaunchEnv", "detect_launch", "init_distributed", "free_port"]


@dataclass(frozen=True)
class LaunchEnv:
    """Rank facts found in the environment, and which launcher they came from."""

    source: str                 # "existing" | "torchrun" | "single"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise TopologyError(f"environment variable {key}={env[key]!r} is not an integer") from None


def detect_launch(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Launcher facts, in order: torchrun-style env, else a single local process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"),
                         _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                         env.get("MASTER_ADDR", "127.0.0.1"), _int(env, "MASTER_PORT")
                         if "MASTER_PORT" in env else 29500)
    return LaunchEnv("single", 0, 1, 0, "127.0.0.1", free_port())


def init_distributed(*, backend: Optional[str] = None, timeout_s: float = 60.0,
                     env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Initialise the default process group unless one exists (embedding case: reuse it)."""
    if dist.is_initialized():
        return LaunchEnv("existing", dist.get_rank(), dist.get_world_size(),
                         int(os.environ.get("LOCAL_RANK", 0)), "", 0)
    launch = detect_launch(env)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and \
            torch.cuda.device_count() > launch.local_rank else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if launch.source == "torchrun":
        # env:// honours torchrun's agent-hosted store (TORCHELASTIC_USE_AGENT_STORE)
        dist.init_process_group(backend, init_method="env://", rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
        return launch
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                          is_master=launch.rank == 0, timeout=timeout, wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=launch.rank,
                            world_size=launch.world_size, timeout=timeout)
    return launch
