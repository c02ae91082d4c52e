"""Start torch.distributed from whatever launched us, or reuse a process group that exists.

Detection order (first match wins), see docs/launch.md:

1. an already-initialised default process group (embedding: reused, never re-initialised);
2. torchrun / torch.distributed.run: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``;
3. Slurm, inside an ``srun`` step: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``,
   master = first host of ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST``;
4. MPI: Open MPI (``OMPI_COMM_WORLD_*``), MPICH/Hydra (``PMI_RANK``/``PMI_SIZE``), MVAPICH
   (``MV2_COMM_WORLD_*``), or mpi4py's ``COMM_WORLD`` (PMIx, or mpi4py already imported);
   rank 0 opens the store on a free port and broadcasts it through mpi4py;
5. otherwise a single local process.

Backend: ``nccl`` when every local rank has its own GPU, else ``gloo``; ``backend=`` or
``PPLOADER_BACKEND`` overrides.
"""
from __future__ import annotations

import os
import re
import socket
import typing
import sys
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from ..errors import TopologyError

__all__ = ["LaunchEnv", "detect_launch", "init_distributed", "parse_nodelist", "free_port",
           "choose_backend", "slurm_port"]

#: where rank facts came from
SOURCES = ("existing", "torchrun", "slurm", "mpi", "single")


@dataclass(frozen=True)
class LaunchEnv:
    """Rank facts found in the environment, and which launcher they came from.

    ``master_port == 0`` (MPI without ``MASTER_PORT``) means rank 0 picks a free port and
    broadcasts it through mpi4py. ``backend`` and ``device`` are set by init_distributed.
    ``store_host_rank``: the rank whose process hosts the job's store (None: torchrun's agent
    does, ``TORCHELASTIC_USE_AGENT_STORE``); pass it to ``Comm(store_host_rank=...)``.
    """

    source: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    backend: str = ""
    device: str = "cpu"
    store_host_rank: Optional[int] = 0

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise TopologyError(f"unknown launch source {self.source!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise TopologyError(f"{self.source}: rank {self.rank} outside world of "
                                f"{self.world_size}")
        if self.local_rank < 0:
            raise TopologyError(f"{self.source}: negative local rank {self.local_rank}")


def free_port() -> int:
    """A TCP port that was free a moment ago (for single-process runs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- Slurm hostlists ---------------------------------------------------------------------
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str) -> list[str]:
    """Split on commas that are outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise TopologyError(f"nodelist {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise TopologyError(f"nodelist {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise TopologyError(f"nodelist {text!r}: unbalanced '['")
    parts.append(text[start:])
    return parts


def _expand_brackets(body: str, whole: str) -> list[str]:
    """``01-04,07`` → ``['01', '02', '03', '04', '07']`` (zero padding kept)."""
    out = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise TopologyError(f"nodelist {whole!r}: bad range {part!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise TopologyError(f"nodelist {whole!r}: range {part!r} goes backwards")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def parse_nodelist(text: str) -> list[str]:
    """Expand a Slurm hostlist such as ``gpu[01-04,07],cpu3`` or ``r[1-2]n[1-2]`` in order."""
    text = text.strip()
    if not text:
        raise TopologyError("empty nodelist")
    hosts: list[str] = []
    for item in _split_top(text):
        if not item:
            raise TopologyError(f"nodelist {text!r}: empty host name")
        names = [""]
        for piece in re.split(r"(\[[^\]]*\])", item):
            if piece.startswith("["):
                choices = _expand_brackets(piece[1:-1], text)
                names = [n + c for n in names for c in choices]
            elif piece:
                if "[" in piece or "]" in piece:
                    raise TopologyError(f"nodelist {text!r}: unbalanced brackets in {item!r}")
                names = [n + piece for n in names]
        hosts += names
    return hosts


# ---- detection ---------------------------------------------------------------------------
def _int(env: Mapping[str, str], key: str, default: Optional[int] = None) -> int:
    if key not in env:
        if default is None:
            raise TopologyError(f"environment variable {key} is not set")
        return default
    try:
        return int(env[key])
    except ValueError:
        raise TopologyError(f"environment variable {key}={env[key]!r} is not an integer") from None


def slurm_port(env: Mapping[str, str]) -> int:
    """MASTER_PORT, else a port derived from the job and step ids (same on every rank)."""
    if "MASTER_PORT" in env:
        return _int(env, "MASTER_PORT")
    job, step = _int(env, "SLURM_JOB_ID", 0), _int(env, "SLURM_STEP_ID", 0)
    return 20000 + (job * 64 + step) % 20000


def _slurm(env: Mapping[str, str]) -> Optional[LaunchEnv]:
    """Rank facts of an srun task (not of the batch shell, which has no SLURM_STEP_ID)."""
    if not all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID")):
        return None
    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    else:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") \
            or env.get("SLURM_NODELIST")
        if not nodes:
            raise TopologyError("Slurm step without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: "
                                "set MASTER_ADDR")
        addr = parse_nodelist(nodes)[0]
    return LaunchEnv("slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                     _int(env, "SLURM_LOCALID", 0), addr, slurm_port(env))


_MPI_VARS = (  # (rank, size, local rank) per MPI flavour
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),
)


def _mpi_master(env: Mapping[str, str]) -> tuple[str, int]:
    if "MASTER_ADDR" in env and "MASTER_PORT" in env:
        return env["MASTER_ADDR"], _int(env, "MASTER_PORT")
    return "", 0  # rank 0 chooses and broadcasts through mpi4py


def _mpi_env(env: Mapping[str, str]) -> Optional[LaunchEnv]:
    for rank_key, size_key, local_key in _MPI_VARS:
        if rank_key in env and size_key in env:
            local = _int(env, local_key, _int(env, "SLURM_LOCALID", 0))
            return LaunchEnv("mpi", _int(env, rank_key), _int(env, size_key), local,
                             *_mpi_master(env))
    return None


def _mpi4py_world(env: Mapping[str, str]) -> Optional[LaunchEnv]:
    """COMM_WORLD when MPI is evidently in use (PMIx env, or mpi4py.MPI already imported)."""
    if "mpi4py.MPI" not in sys.modules and "PMIX_RANK" not in env:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    world = MPI.COMM_WORLD
    if world.Get_size() == 1 and "PMIX_RANK" not in env:
        return None
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    local = node.Get_rank()
    node.Free()
    return LaunchEnv("mpi", world.Get_rank(), world.Get_size(), local, *_mpi_master(env))


def detect_launch(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Rank facts from the environment: torchrun, Slurm step, MPI, else a single process.

    Does not look at an existing process group (init_distributed does). When Slurm and MPI
    variables disagree (mpiexec inside an allocation inherits its proxy's SLURM_PROCID),
    the MPI ones win.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"),
                         _int(env, "LOCAL_RANK", 0), env.get("MASTER_ADDR", "127.0.0.1"),
                         _int(env, "MASTER_PORT", 29500))
    slurm, mpi = _slurm(env), _mpi_env(env)
    if slurm is not None and (mpi is None or (mpi.rank, mpi.world_size) ==
                              (slurm.rank, slurm.world_size)):
        return slurm
    if mpi is not None:
        return mpi
    world = _mpi4py_world(env)
    if world is not None:
        return world
    return LaunchEnv("single", 0, 1, 0, "127.0.0.1", 0)


def choose_backend(local_rank: int, override: Optional[str] = None,
                   env: Optional[Mapping[str, str]] = None) -> str:
    """``override``, else PPLOADER_BACKEND, else nccl when this local rank has a GPU."""
    env = os.environ if env is None else env
    chosen = override or env.get("PPLOADER_BACKEND")
    if chosen:
        return chosen
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        return "nccl"
    return "gloo"


def _device(local_rank: int) -> str:
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return "cpu"


def _local_rank_from_env(env: Mapping[str, str]) -> int:
    for key in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                "MV2_COMM_WORLD_LOCAL_RANK"):
        if key in env:
            return _int(env, key)
    return 0


def _mpi_store(launch: LaunchEnv, timeout: timedelta) -> tuple[dist.Store, LaunchEnv]:
    """Rank 0 opens the store on a free port; mpi4py broadcasts host and port."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise TopologyError("launched by MPI without MASTER_ADDR/MASTER_PORT: install mpi4py "
                            "(pip install 'pploader[mpi]') or export both variables") from None
    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (launch.rank, launch.world_size):
        raise TopologyError(f"mpi4py sees rank {world.Get_rank()} of {world.Get_size()} but the "
                            f"environment says rank {launch.rank} of {launch.world_size}")
    store: Optional[dist.Store] = None
    where: object = None
    if launch.rank == 0:
        try:
            host = os.environ.get("MASTER_ADDR") or socket.gethostname()
            store = dist.TCPStore(host, 0, launch.world_size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            where = (host, int(store.port))
        except Exception as exc:  # noqa: BLE001 - every rank must hear about it
            where = f"{type(exc).__name__}: {exc}"
    where = world.bcast(where, root=0)
    if isinstance(where, str):
        raise TopologyError(f"rank 0 could not open the job's store: {where}")
    host, port = typing.cast("tuple[str, int]", where)
    if store is None:
        store = dist.TCPStore(host, port, launch.world_size, is_master=False, timeout=timeout)
    return store, replace(launch, master_addr=host, master_port=port)


def init_distributed(*, backend: Optional[str] = None, timeout_s: float = 60.0,
                     env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Initialise the default process group from the launcher (called on all ranks).

    An existing default group is reused as is (source ``"existing"``). ``timeout_s`` bounds
    store connection and the group's collectives (NCCL's 10-minute default is never used).
    """
    env = os.environ if env is None else env
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store_host = None if agent_store else 0
    if dist.is_initialized():  # the host application chose the group and the device
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return LaunchEnv("existing", dist.get_rank(), dist.get_world_size(),
                         _local_rank_from_env(env), "", 0, str(dist.get_backend()), device,
                         store_host)
    launch = detect_launch(env)
    launch = replace(launch, backend=choose_backend(launch.local_rank, backend, env),
                     device=_device(launch.local_rank), store_host_rank=store_host)
    timeout = timedelta(seconds=timeout_s)
    if launch.source == "torchrun":
        # env:// honours torchrun's agent-hosted store (TORCHELASTIC_USE_AGENT_STORE)
        dist.init_process_group(launch.backend, init_method="env://", rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
        return launch
    if launch.source == "mpi" and launch.master_port == 0:
        store, launch = _mpi_store(launch, timeout)
    else:
        # a single process opens its store on port 0: the OS picks a free port, no race
        store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                              is_master=launch.rank == 0, timeout=timeout,
                              wait_for_workers=False)
        launch = replace(launch, master_port=int(store.port))
    dist.init_process_group(launch.backend, store=store, rank=launch.rank,
                            world_size=launch.world_size, timeout=timeout)
    return launch
