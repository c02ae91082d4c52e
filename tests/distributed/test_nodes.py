"""Two nodes, for real, on one host (issue 16 part 5): two torchrun agents (``--nnodes 2``,
``--node-rank 0/1``) meet through a rendezvous on localhost; each "node" runs in its own
working directory holding ``model/`` with only the shards its ranks read (+ config, index),
so ``--model model`` is the same path on both nodes, as on a real cluster with node-local
copies. The loads are bitwise equal to the single-node load; each node reads exactly its
ranks' planned bytes; a rank failing on node 1 stops node 0 within the timeout.

The agents use torchrun's static rendezvous (``--master-addr/--master-port``): it keeps
``--node-rank``, so node k runs ranks ``[k * nproc, (k + 1) * nproc)``, the ones whose shards
it holds. (c10d rendezvous numbers nodes in its own order, which a stage-only copy cannot
follow.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from helpers import free_port, torchrun_cmd
from pploader.planning.files import node_files
from test_launch import _job_json, assert_saved_equals_reference

pytestmark = pytest.mark.slow

TIMEOUT_S = 8


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               TORCH_CPP_LOG_LEVEL="ERROR", **extra)
    for key in list(env):  # this test decides the launcher
        if key.startswith(("SLURM_", "PMI_", "OMPI_")) or key in ("RANK", "WORLD_SIZE"):
            del env[key]
    return env


def _node_dirs(model: Path, root: Path, pp: int, tp: int) -> list[Path]:
    """node<k>/model holding only node k's files (hard links); returns the node directories."""
    found, _ = node_files(model, pp, tp, nodes=2)
    dirs = []
    for node in found:
        home = root / f"node{node.node}"
        (home / "model").mkdir(parents=True)
        for f in node.all_files():
            os.link(model / f, home / "model" / f)
        dirs.append(home)
    assert set(found[0].shards) != set(found[1].shards)
    return dirs


def _two_nodes(dirs: list[Path], nproc: int, args: list[str], env: dict[str, str],
               timeout: float = 300) -> list[subprocess.CompletedProcess]:
    port = free_port()
    procs = []
    for rank, home in enumerate(dirs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               f"--node-rank={rank}", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
               f"--master-port={port}", "-m", "pploader", "load", "--model", "model", *args]
        procs.append(subprocess.Popen(cmd, cwd=home, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _saved(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


@pytest.mark.parametrize("pp, tp", [(2, 1), (2, 2)])
def test_two_nodes_each_with_its_stage_files(tiny_llama: Path, tmp_path: Path, pp: int,
                                             tp: int) -> None:
    dirs = _node_dirs(tiny_llama, tmp_path, pp, tp)
    nproc = pp * tp // 2
    common = ["--pp", str(pp), "--tp", str(tp), "--json", "--backend", "gloo", "--no-pools",
              "--timeout", str(TIMEOUT_S)]
    nodes = _two_nodes(dirs, nproc, common + ["--save-loaded", str(tmp_path / "nodes")], _env())
    assert [n.returncode for n in nodes] == [0, 0], nodes[0].stderr[-2000:] + nodes[1].stderr[-2000:]
    job = _job_json(nodes[0].stdout)
    assert job["world_size"] == pp * tp and [r["rank"] for r in job["ranks"]] == list(range(pp * tp))
    assert_saved_equals_reference(tmp_path / "nodes", tiny_llama, pp, tp)
    # the same bytes as the single-node load of the full directory
    single = subprocess.run(torchrun_cmd(pp * tp, "load", "--model", str(tiny_llama), *common,
                                         "--save-loaded", str(tmp_path / "single")),
                            capture_output=True, text=True, timeout=300, env=_env())
    assert single.returncode == 0, single.stderr[-2000:]
    for rank in range(pp * tp):
        a, b = _saved(tmp_path / "nodes" / f"rank-{rank}.safetensors"), \
            _saved(tmp_path / "single" / f"rank-{rank}.safetensors")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    # each node read exactly what its ranks planned, from its own files only
    found, _ = node_files(tiny_llama, pp, tp, nodes=2)
    for node in found:
        reports = [r for r in job["ranks"] if r["rank"] in node.ranks]
        assert sum(r["read_bytes"] for r in reports) == node.read_bytes
        if tp == 1:
            assert node.read_bytes == sum(r["ideal_bytes"] for r in reports)


def test_failure_on_node_1_reaches_node_0(tiny_llama: Path, tmp_path: Path) -> None:
    dirs = _node_dirs(tiny_llama, tmp_path, 2, 2)
    started = time.monotonic()
    nodes = _two_nodes(dirs, 2, ["--pp", "2", "--tp", "2", "--backend", "gloo", "--no-pools",
                                 "--timeout", str(TIMEOUT_S)],
                       _env(PPLOADER_FAULT="rank=3:raise"), timeout=120)
    elapsed = time.monotonic() - started
    assert nodes[0].returncode != 0 and nodes[1].returncode != 0
    assert "injected fault" in nodes[0].stderr and "rank 3" in nodes[0].stderr, \
        nodes[0].stderr[-3000:]
    assert elapsed < 90, f"both nodes out after {elapsed:.0f} s"
