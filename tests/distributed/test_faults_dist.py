"""Fail together (issue 8 rows 18-20): a rank that raises, hangs or is SIGKILLed mid-load makes
every rank exit non-zero, in bounded time, naming the culprit, with no process left behind.

Faults come from the test-only hook PPLOADER_FAULT (pploader/testing/faults.py), which prints the
wall-clock time it fires; bounds are measured from there. Under torchrun the agent hosts the
store and kills the remaining workers once one exits; under a per-rank launch (Slurm-style
environment, rank 0 hosts the store, nobody kills anyone) pploader alone must get every
rank out.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from helpers import free_port, torchrun_cmd

pytestmark = pytest.mark.slow

TIMEOUT_S = 6  # --timeout: hung after 6 s without progress, dead after min(10, 6) s unbeaten
_FAULT_AT = re.compile(r"PPLOADER_FAULT: \w+ after \d+ bytes at t=([0-9.]+)")


@dataclass
class Job:
    """What a launched job did: exit codes, when each process ended, its stderr."""

    returncodes: list[int]
    ended_at: list[float]
    stderr: list[str]
    fault_at: Optional[float]
    leftovers: list[int]

    @property
    def all_stderr(self) -> str:
        return "\n".join(self.stderr)


def _env(marker: str, fault: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PPLOADER_FAULT=fault,
               PPLOADER_TEST_MARKER=marker, TORCH_CPP_LOG_LEVEL="ERROR")
    for key in list(env):  # this test decides the launcher, not the CI's environment
        if key.startswith(("SLURM_", "PMI_", "OMPI_")) or key in ("RANK", "WORLD_SIZE"):
            del env[key]
    return env


def _leftovers(marker: str) -> list[int]:
    """Live processes started by this job (found by the marker in their environment)."""
    found = []
    needle = f"PPLOADER_TEST_MARKER={marker}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
        except OSError:
            pass
    return found


def _settle(marker: str, grace_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + grace_s
    while (left := _leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _fault_time(text: str) -> Optional[float]:
    m = _FAULT_AT.search(text)
    return float(m.group(1)) if m else None


def _wait_all(procs: list[subprocess.Popen], limit_s: float) -> list[float]:
    ended: list[Optional[float]] = [None] * len(procs)
    deadline = time.monotonic() + limit_s
    while None in ended and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.05)
    for i, p in enumerate(procs):
        if ended[i] is None:
            p.kill()
            p.wait()
            ended[i] = float("inf")
    return ended  # type: ignore[return-value]


def _torchrun(model: Path, fault: str, tmp: Path, nproc: int = 3) -> Job:
    marker = uuid.uuid4().hex
    err = tmp / "torchrun.err"
    with open(err, "w") as fh:
        proc = subprocess.Popen(torchrun_cmd(nproc, "load", "--model", str(model), "--pp",
                                             str(nproc), "--timeout", str(TIMEOUT_S)),
                                stdout=subprocess.DEVNULL, stderr=fh, env=_env(marker, fault))
        ended = _wait_all([proc], 180)
    text = err.read_text()
    return Job([proc.returncode], ended, [text], _fault_time(text), _settle(marker))


def _per_rank(model: Path, fault: str, tmp: Path, world: int = 2) -> Job:
    """Each rank a plain process with an srun-style environment: rank 0 hosts the store."""
    marker, port = uuid.uuid4().hex, free_port()
    procs, files = [], []
    for rank in range(world):
        env = _env(marker, fault)
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank),
                   SLURM_STEP_ID="0", SLURM_JOB_ID="1", SLURM_JOB_NODELIST="localhost",
                   MASTER_PORT=str(port))
        files.append(open(tmp / f"rank{rank}.err", "w"))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pploader", "load", "--model", str(model), "--pp",
             str(world), "--timeout", str(TIMEOUT_S)],
            stdout=subprocess.DEVNULL, stderr=files[-1], env=env))
    ended = _wait_all(procs, 180)
    for fh in files:
        fh.close()
    texts = [(tmp / f"rank{r}.err").read_text() for r in range(world)]
    return Job([p.returncode for p in procs], ended, texts, _fault_time("\n".join(texts)),
               _settle(marker))


def _assert_failed_line(text: str, rank: int) -> None:
    assert f"[rank {rank}] pploader: load failed on the job" in text, text[-3000:]


# ---- under torchrun ----------------------------------------------------------------------
def test_row18_exception_on_one_rank_every_rank_raises_it(tiny_llama: Path,
                                                           tmp_path: Path) -> None:
    job = _torchrun(tiny_llama, "rank=1:raise", tmp_path)
    text = job.all_stderr
    assert job.returncodes[0] != 0 and job.fault_at is not None, text[-3000:]
    assert job.ended_at[0] - job.fault_at < 30
    for rank in range(3):
        _assert_failed_line(text, rank)
    # every rank prints the same combined error naming rank 1 and its message
    assert text.count("rank 1: RuntimeError: injected fault (PPLOADER_FAULT) on rank 1") == 3
    assert job.leftovers == []


def test_row19_hung_rank_named_silent_after_the_load_timeout(tiny_llama: Path,
                                                             tmp_path: Path) -> None:
    job = _torchrun(tiny_llama, "rank=2:hang", tmp_path)
    text = job.all_stderr
    assert job.returncodes[0] != 0 and job.fault_at is not None, text[-3000:]
    waited = job.ended_at[0] - job.fault_at
    assert TIMEOUT_S - 1 < waited < TIMEOUT_S + 20, waited
    for rank in (0, 1):
        _assert_failed_line(text, rank)
    assert text.count("rank 2: no answer within the load timeout") == 2, text[-3000:]
    assert job.leftovers == []


def test_row20_sigkilled_rank_torchrun_exits_nonzero(tiny_llama: Path, tmp_path: Path) -> None:
    job = _torchrun(tiny_llama, "rank=1:kill", tmp_path)
    assert job.returncodes[0] != 0 and job.fault_at is not None, job.all_stderr[-3000:]
    assert job.ended_at[0] - job.fault_at < TIMEOUT_S + 20
    assert job.leftovers == []


# ---- one process per rank, nobody kills the survivors but pploader ----------------------
@pytest.mark.parametrize("fault, culprit, needle", [
    ("rank=0:kill", 0, "rank 0: died: its process hosted the job's key-value store"),
    ("rank=1:kill", 1, "rank 1: died: no heartbeat"),
    ("rank=1:hang", 1, "rank 1: no answer within the load timeout"),
])
def test_rows19_20_per_rank_launch(tiny_llama: Path, tmp_path: Path, fault: str, culprit: int,
                                   needle: str) -> None:
    job = _per_rank(tiny_llama, fault, tmp_path)
    survivor = 1 - culprit
    text = job.stderr[survivor]
    assert job.fault_at is not None, job.all_stderr[-3000:]
    assert job.returncodes[survivor] == 1, job.all_stderr[-3000:]
    _assert_failed_line(text, survivor)
    assert needle in text, text[-3000:]
    assert job.ended_at[survivor] - job.fault_at < TIMEOUT_S + 20
    if fault.endswith("kill"):
        assert job.returncodes[culprit] == -9
    else:  # the hung rank notices the job failed and leaves by itself
        assert job.returncodes[culprit] == 1
        assert "still busy" in job.stderr[culprit] and "exiting" in job.stderr[culprit]
        assert job.ended_at[culprit] - job.ended_at[survivor] < min(10, TIMEOUT_S) + 10
    assert job.leftovers == []


# ---- the agreement itself, through the API -----------------------------------------------
def _late_and_slow(rank: int, world: int) -> dict:
    """Rank 0 agrees at once; rank 1 is slow but progressing; rank 2 is silent for longer than
    the timeout and only then agrees. All must reach the one verdict: rank 2 silent."""
    from pploader.distributed.comm import Comm
    from pploader.errors import RankFailure
    from pploader.planning.topology import Topology

    began = time.monotonic()
    comm = Comm(Topology.for_world(world, rank), timeout_s=2.0)
    if rank == 1:
        for _ in range(8):  # 4 s of progress: slower than the timeout, but not hung
            time.sleep(0.5)
            comm.touch()
    if rank == 2:
        time.sleep(4.5)
    start = time.monotonic()
    try:
        comm.agree(None, rank)
        outcome: dict = {"ok": True}
    except RankFailure as exc:
        outcome = {"ok": False, "text": str(exc), "silent": list(exc.silent),
                   "failures": exc.failures}
    outcome["waited"] = time.monotonic() - start
    time.sleep(max(0.0, 7.0 - (time.monotonic() - began)))  # a server stays up (rank 0: store)
    comm.close()
    return outcome


def test_one_verdict_for_slow_late_and_prompt_ranks() -> None:
    from helpers import run_ranks
    results = run_ranks(_late_and_slow, 3, timeout_s=30)
    assert [r["ok"] for r in results] == [False, False, False], results
    assert all(r["silent"] == [2] and r["failures"] == {} for r in results), results
    assert len({r["text"] for r in results}) == 1
    assert results[2]["waited"] < 1.0  # the late rank reads the verdict, it does not wait
