"""Launching: bootstrap detection (unit), torchrun / mpiexec / Slurm jobs and embedding (real)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import ROOT, reference_tensors, run, run_ranks, torchrun_cmd
from pploader.distributed.bootstrap import (LaunchEnv, choose_backend, detect_launch, parse_nodelist,
                                     slurm_port)
from pploader.errors import TopologyError
from pploader.testing.faults import Fault, fault_from_env

LAUNCH = ROOT / "launch"


# ---- Slurm hostlists -------------------------------------------------------------------
@pytest.mark.parametrize("text, hosts", [
    ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
    ("node1", ["node1"]),
    ("n[009-011]", ["n009", "n010", "n011"]),
    ("x[8-10]", ["x8", "x9", "x10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a[3]-ib,b-[1-2].c", ["a3-ib", "b-1.c", "b-2.c"]),
    (" h1,h2 ", ["h1", "h2"]),
])
def test_parse_nodelist(text: str, hosts: list[str]) -> None:
    assert parse_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["", "a[1-", "a]", "a[3-1]", "a[x]", "a,,b", "a[[1]]", "a[1-2"])
def test_parse_nodelist_rejects_malformed(text: str) -> None:
    with pytest.raises(TopologyError):
        parse_nodelist(text)


# ---- detection -------------------------------------------------------------------------
SLURM_STEP = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
              "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "1234",
              "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_STEP_NODELIST": "gpu[03-04]"}


def test_torchrun_env_wins_over_slurm() -> None:
    env = dict(SLURM_STEP, RANK="2", WORLD_SIZE="4", LOCAL_RANK="2", MASTER_ADDR="h",
               MASTER_PORT="1234")
    assert detect_launch(env) == LaunchEnv("torchrun", 2, 4, 2, "h", 1234)


def test_slurm_step_master_is_first_host_of_the_step() -> None:
    launch = detect_launch(SLURM_STEP)
    assert (launch.source, launch.rank, launch.world_size, launch.local_rank) == \
        ("slurm", 5, 8, 1)
    assert launch.master_addr == "gpu03"
    assert launch.master_port == slurm_port(SLURM_STEP)
    assert 20000 <= launch.master_port < 40000
    other_step = dict(SLURM_STEP, SLURM_STEP_ID="1")
    assert slurm_port(other_step) != slurm_port(SLURM_STEP)
    pinned = detect_launch(dict(SLURM_STEP, MASTER_ADDR="head", MASTER_PORT="7000"))
    assert (pinned.master_addr, pinned.master_port) == ("head", 7000)


def test_slurm_batch_shell_is_not_a_rank() -> None:
    """The batch script itself has SLURM_PROCID=0 but no step: a single local process."""
    env = {k: v for k, v in SLURM_STEP.items() if k != "SLURM_STEP_ID"}
    assert detect_launch(env).source == "single"


@pytest.mark.parametrize("env, expected", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, (3, 4, 1)),
    ({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2"}, (2, 3, 2)),
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2"}, (1, 2, 0)),
])
def test_mpi_env(env: dict, expected: tuple) -> None:
    launch = detect_launch(env)
    assert launch.source == "mpi"
    assert (launch.rank, launch.world_size, launch.local_rank) == expected
    assert launch.master_port == 0  # chosen by rank 0, broadcast through mpi4py
    pinned = detect_launch(dict(env, MASTER_ADDR="h", MASTER_PORT="9"))
    assert (pinned.master_addr, pinned.master_port) == ("h", 9)


def test_mpiexec_inside_slurm_trusts_mpi_when_they_disagree() -> None:
    """Hydra's proxies are srun tasks: their SLURM_PROCID is the node index, not the rank."""
    env = dict(SLURM_STEP, SLURM_PROCID="1", SLURM_NTASKS="2", PMI_RANK="6", PMI_SIZE="16")
    assert (detect_launch(env).source, detect_launch(env).rank) == ("mpi", 6)
    agreeing = dict(SLURM_STEP, PMI_RANK="5", PMI_SIZE="8")
    assert detect_launch(agreeing).source == "slurm"


def test_bad_values_are_topology_errors() -> None:
    with pytest.raises(TopologyError, match="RANK"):
        detect_launch({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(TopologyError, match="outside"):
        detect_launch({"RANK": "2", "WORLD_SIZE": "2"})
    assert detect_launch({}).source == "single"


def test_backend_choice() -> None:
    assert choose_backend(0, "gloo", {}) == "gloo"
    assert choose_backend(0, None, {"PPLOADER_BACKEND": "mpi"}) == "mpi"
    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert choose_backend(0, None, {}) == expected
    assert choose_backend(10_000, None, {}) == "gloo"  # no GPU for this local rank


def test_fault_hook_parsing() -> None:
    assert fault_from_env({}) is None
    assert fault_from_env({"PPLOADER_FAULT": "rank=1:raise"}) == Fault(1, "raise", 0)
    assert fault_from_env({"PPLOADER_FAULT": "rank=0:kill:after_bytes=9"}) == Fault(0, "kill", 9)
    for bad in ("rank=1", "raise", "rank=x:hang", "rank=1:explode", "rank=1:hang:when=3"):
        with pytest.raises(Exception, match="PPLOADER_FAULT"):
            fault_from_env({"PPLOADER_FAULT": bad})


# ---- real launches -----------------------------------------------------------------------
def _job_json(text: str) -> dict:
    """Rank 0's --json document, wherever it sits among launcher messages."""
    return json.JSONDecoder().raw_decode(text, text.index('{\n "model"'))[0]


def assert_saved_equals_reference(saved: Path, model: Path, pp: int, tp: int) -> None:
    """Each rank's --save-loaded file equals safe_open's tensors bitwise; TP slices of a
    stage concatenate (along the one dim where they differ) to the whole tensor."""
    from safetensors import safe_open
    ref = reference_tensors(model)
    seen: set[str] = set()
    for stage in range(pp):
        parts: dict[str, list[torch.Tensor]] = {}
        for tp_rank in range(tp):
            with safe_open(str(saved / f"rank-{stage * tp + tp_rank}.safetensors"), "pt") as fh:
                for name in fh.keys():
                    parts.setdefault(name, []).append(fh.get_tensor(name))
        for name, slices in parts.items():
            assert len(slices) == tp, name
            whole = ref[name]
            if all(s.shape == whole.shape for s in slices):
                got = slices
            else:
                dim = next(d for d in range(whole.dim()) if slices[0].shape[d] != whole.shape[d])
                got = [torch.cat(slices, dim)]
            for g in got:
                assert g.dtype == whole.dtype and torch.equal(
                    g.contiguous().view(torch.uint8), whole.contiguous().view(torch.uint8)), name
            seen.add(name)
    assert seen == set(ref)


@pytest.mark.slow
@pytest.mark.parametrize("pp, tp", [(4, 1), (2, 2)])
def test_torchrun_four_ranks(tiny_llama: Path, tmp_path: Path, pp: int, tp: int) -> None:
    out = run(torchrun_cmd(4, "load", "--model", str(tiny_llama), "--pp", str(pp), "--tp",
                           str(tp), "--json", "--save-loaded", str(tmp_path)), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    job = _job_json(out.stdout)
    assert (job["launcher"], job["world_size"], job["pp"], job["tp"]) == ("torchrun", 4, pp, tp)
    assert [r["rank"] for r in job["ranks"]] == [0, 1, 2, 3]
    assert [(r["pp_rank"], r["tp_rank"]) for r in job["ranks"]] == \
        [(rank // tp, rank % tp) for rank in range(4)]  # TP innermost
    assert_saved_equals_reference(tmp_path, tiny_llama, pp, tp)


@pytest.mark.slow
def test_mpiexec_three_ranks(tiny_llama: Path, tmp_path: Path) -> None:
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if not mpiexec.exists():
        pytest.skip("no mpiexec next to the interpreter (pip install mpich mpi4py)")
    out = run([str(LAUNCH / "mpirun.sh"), "--model", str(tiny_llama), "--pp", "3", "--json",
               "--save-loaded", str(tmp_path)], timeout=240,
              env={"NP": "3", "MPIEXEC": str(mpiexec), "PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr[-3000:]
    job = _job_json(out.stdout)
    assert (job["launcher"], job["world_size"], job["pp"]) == ("mpi", 3, 3)
    assert [r["rank"] for r in job["ranks"]] == [0, 1, 2]
    assert_saved_equals_reference(tmp_path, tiny_llama, 3, 1)


def _embedded(rank: int, world: int, model: str) -> dict[str, Any]:
    """A host application owns the process group; pploader must reuse it as is."""
    import torch.distributed as dist
    from pploader import Topology, load_stage, plan_stage
    from pploader.distributed.bootstrap import init_distributed
    from pploader.distributed.comm import Comm

    group, backend = dist.group.WORLD, dist.get_backend()

    def no_reinit(*_: Any, **__: Any) -> None:
        raise AssertionError("pploader re-initialised the process group")
    dist.init_process_group = no_reinit  # type: ignore[assignment]
    launch = init_distributed()
    topo = Topology.for_world(world, rank, pp=world)
    comm = Comm(topo, timeout_s=30)
    staged = plan_stage(model, topo)
    comm.agree(None)
    result = load_stage(staged, cancel=comm.watch_failures())
    counts = comm.agree(None, len(result.state_dict))
    comm.close()
    again = Comm(topo, timeout_s=30)  # a second handle: the next generation of its namespace
    echoed = again.agree(None, f"second-{rank}")
    again.close()
    ref = reference_tensors(Path(model))
    names = {i.target: i.name for i in result.plan.items}
    wrong = [k for k, t in result.state_dict.items()
             if not torch.equal(t.view(torch.uint8), ref[names[k]].view(torch.uint8))]
    return {"source": launch.source, "rank": launch.rank, "same_group": dist.group.WORLD is group,
            "same_backend": dist.get_backend() == backend, "wrong": wrong,
            "names": sorted(names.values()), "counts": counts, "echoed": echoed}


@pytest.mark.slow
def test_embedding_reuses_the_existing_process_group(tiny_llama: Path) -> None:
    results = run_ranks(_embedded, 2, str(tiny_llama), timeout_s=60)
    for rank, res in enumerate(results):
        assert (res["source"], res["rank"]) == ("existing", rank)
        assert res["same_group"] and res["same_backend"]
        assert res["wrong"] == []
        assert res["counts"] == [len(r["names"]) for r in results]
        assert res["echoed"] == ["second-0", "second-1"]
    assert sorted(results[0]["names"] + results[1]["names"]) == \
        sorted(reference_tensors(tiny_llama))


# ---- Slurm (real cluster: .ci/slurm-up.sh) -----------------------------------------------
def _slurm_reason() -> str:
    if shutil.which("sbatch") is None or shutil.which("squeue") is None:
        return "Slurm is not installed (run .ci/slurm-up.sh as root)"
    try:
        probe = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                               timeout=5)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no Slurm controller answers ({exc}); run .ci/slurm-up.sh"
    if probe.returncode != 0 or not any(s.startswith(("idle", "mix", "alloc"))
                                        for s in probe.stdout.split()):
        return f"no Slurm node is up ({(probe.stderr or probe.stdout).strip()[:200]}); " \
               "run .ci/slurm-up.sh"
    return ""


def _sbatch(script: Path, workdir: Path, name: str, args: list[str], env: dict[str, str],
            options: tuple[str, ...] = ()) -> tuple[str, Path]:
    out = workdir / f"{name}.out"
    res = subprocess.run(["sbatch", "--parsable", f"--chdir={workdir}", f"--output={out}",
                          f"--job-name=pploader-{name}", *options, str(script), *args],
                         capture_output=True, text=True, timeout=30,
                         env=dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1",
                                  PYTHONUNBUFFERED="1", **env))
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().split(";")[0], out


def _wait_jobs(job_ids: list[str], timeout_s: float) -> dict[str, str]:
    """Poll squeue (no accounting) until the jobs leave the queue; their final states."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-o", "%i", "-j", ",".join(job_ids)],
                           capture_output=True, text=True, timeout=10)
        if not set(q.stdout.split()) & set(job_ids):
            break
        time.sleep(1)
    else:
        subprocess.run(["scancel", *job_ids], timeout=10)
        pytest.fail(f"Slurm jobs {job_ids} still queued/running after {timeout_s} s")
    states = {}
    for job in job_ids:
        show = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True,
                              text=True, timeout=10).stdout
        fields = dict(f.split("=", 1) for f in show.split() if "=" in f)
        states[job] = f"{fields.get('JobState', '?')} {fields.get('ExitCode', '?')}"
    return states


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_jobs(tiny_llama: Path, tmp_path: Path) -> None:
    reason = _slurm_reason()
    if reason:
        pytest.skip(reason)
    model = ["--model", str(tiny_llama), "--json"]
    node = _sbatch(LAUNCH / "slurm.sbatch", tmp_path, "node", model + ["--pp", "4"],
                   {"NPROC_PER_NODE": "4"})
    rank = _sbatch(LAUNCH / "slurm-per-rank.sbatch", tmp_path, "rank",
                   model + ["--pp", "2", "--tp", "2"], {})
    bad = _sbatch(LAUNCH / "slurm-per-rank.sbatch", tmp_path, "fault",
                  model + ["--pp", "2", "--timeout", "20"], {"PPLOADER_FAULT": "rank=1:raise"},
                  ("--ntasks=2",))
    states = _wait_jobs([node[0], rank[0], bad[0]], timeout_s=180)
    for (job, out), launcher, pp, tp in [(node, "torchrun", 4, 1), (rank, "slurm", 2, 2)]:
        text = out.read_text()
        assert states[job].startswith("COMPLETED") and states[job].endswith("0:0"), \
            (states[job], text[-3000:])
        report = _job_json(text)
        assert (report["launcher"], report["world_size"], report["pp"], report["tp"]) == \
            (launcher, 4, pp, tp)
        ranks = report["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
        assert all(r["tensors"] > 0 and r["read_bytes"] >= r["ideal_bytes"] > 0 for r in ranks)
        assert sum(r["tensors"] for r in ranks[::tp]) == len(reference_tensors(tiny_llama))
    text = bad[1].read_text()
    assert states[bad[0]].startswith("FAILED"), (states[bad[0]], text[-3000:])
    for r in range(2):
        assert f"[rank {r}] pploader: load failed on the job" in text, text[-3000:]
    assert text.count("rank 1: RuntimeError: injected fault") == 2, text[-3000:]
