"""Test helpers: tiny checkpoints and multi-rank runs over gloo on this machine."""
from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "models"


def tiny_config(name: str = "tiny-llama", **overrides: Any) -> dict:
    """A bundled tiny config (without its pploader_tiny section), with overrides applied."""
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    cfg.pop("pploader_tiny", None)
    cfg.update(overrides)
    return cfg


def make_model(out: Path, config: Optional[Mapping] = None, *, shard_bytes: int = 60_000,
               seed: int = 0) -> Path:
    """Write a tiny random checkpoint for ``config`` (default tiny-llama) into ``out``."""
    from pploader.tiny import make_tiny
    cfg = dict(config or tiny_config())
    make_tiny(cfg, out, shard_bytes=shard_bytes, seed=seed)
    return out


def reference_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint via the reference library (safe_open)."""
    from safetensors import safe_open
    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, outdir: str,
            backend: str, timeout_s: float) -> None:
    import torch.distributed as dist
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException as exc:  # noqa: BLE001 - shipped back to the test
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)  # test-internal results only, never untrusted files
    os._exit(0)


def run_ranks(fn: Callable, world: int, *args: Any, backend: str = "gloo",
              timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned ranks; return their results.

    ``fn`` must be importable (module level). A rank's exception is re-raised here.
    """
    port = free_port()
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, outdir, backend,
                                                   timeout_s)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s + 60)
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world):
            path = os.path.join(outdir, f"{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} produced no result (exit code {procs[r].exitcode})")
            with open(path, "rb") as fh:
                kind, value = pickle.load(fh)
            if kind == "error":
                raise RuntimeError(f"rank {r} failed: {value}")
            results.append(value)
        return results


def pploader_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pploader", *args]


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "pploader", *args]


def run(cmd: list[str], timeout: float = 180, **kw: Any) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(kw.pop("env", {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)


def evict_or_skip(paths: Any) -> None:
    """Drop each file's pages from the page cache (``pploader.bench.methods.evict``); skip
    the test where the file system keeps them resident (more than a tenth left)."""
    import pytest

    from pploader.bench.methods import evict
    for path in paths:
        if evict([str(path)]) > os.path.getsize(path) // 10:
            pytest.skip("this file system keeps the pages resident (no eviction)")


class JobStarted(Exception):
    """Raised in place of a job's start (a test patches it over ``init_distributed`` and the
    like): every check before the start passed."""


def run_cli(argv: list[str], capsys: Any) -> tuple[Any, str, str]:
    """``pploader.cli.main(argv)`` in this process: (its exit code, or ``"started"`` when
    :class:`JobStarted` stopped it; stdout; stderr), the root logger restored after."""
    import logging

    from pploader.cli import main
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        try:
            code: Any = main(argv)
        except SystemExit as exc:
            code = exc.code
        except JobStarted:
            code = "started"
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    out = capsys.readouterr()
    return code, out.out, out.err
