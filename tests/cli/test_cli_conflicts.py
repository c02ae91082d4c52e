"""Argument conflicts found before the job starts, and no traceback for a user-caused
condition (issue 32): each case exit 2 (or 0 / 130), one line naming the flag to change."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import JobStarted, make_model, run_cli

import pploader.cli as cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("conflicts") / "ok")


@pytest.fixture()
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """`load` stops where torch.distributed would start (the checks before it all ran)."""
    import pploader

    def start(*a: object, **k: object) -> None:
        raise JobStarted()
    monkeypatch.setattr(pploader, "init_distributed", start)
    for key in ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PPLOADER_LOG",
                "PPLOADER_BACKEND", "LOCAL_WORLD_SIZE", "VLLM_PP_LAYER_PARTITION",
                "SGLANG_PP_LAYER_PARTITION"):
        monkeypatch.delenv(key, raising=False)


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[object, str]:
    code, _, err = run_cli(argv, capsys)
    return code, err


def _no_gpu() -> bool:
    import torch
    return not torch.cuda.is_available()


#: (argv after `load --model M`, environment, what the one line must say)
LOAD_CONFLICTS = {
    "pinned_on_cpu": (["--io-backend", "pinned", "--device", "cpu"], {},
                      "--io-backend pinned loads onto cuda, not cpu"),
    "pool_device_cuda": (["--device", "cpu", "--pool-device", "cuda"], {},
                         "--pool-device cuda: this process sees no GPU; use --pool-device cpu"),
    "device_cuda_index": (["--device", "cuda:7"], {}, "--device cuda:7: this process sees"),
    "save_loaded_under_a_file": (["--save-loaded", "{m}/config.json/out"], {},
                                 "is inside the model directory {m}"),
    "save_loaded_is_a_file": (["--save-loaded", "{m}/config.json"], {},
                              "is inside the model directory {m}"),
    "exchange_cost_nan": (["--exchange-cost", "nan"], {}, "argument --exchange-cost: nan"),
    "exchange_cost_inf": (["--exchange-cost", "inf"], {},
                          "inf is out of range; give a number in [0, 1000]"),
    "exchange_cost_text": (["--exchange-cost", "cheap"], {}, "'cheap' is not a number"),
    "env_backend": ([], {"PPLOADER_BACKEND": "carrier-pigeon"},
                    "PPLOADER_BACKEND='carrier-pigeon': unknown backend"),
    "env_backend_nccl": ([], {"PPLOADER_BACKEND": "nccl"}, "PPLOADER_BACKEND=nccl"),
    "env_local_world_size": (["--read-once-node"], {"LOCAL_WORLD_SIZE": "two"},
                             "LOCAL_WORLD_SIZE='two': must be a positive integer"),
    "env_vllm_partition": (["--partition", "vllm"], {"VLLM_PP_LAYER_PARTITION": "4,x"},
                           "VLLM_PP_LAYER_PARTITION='4,x'"),
    "env_sglang_partition": (["--partition", "sglang"], {"SGLANG_PP_LAYER_PARTITION": "0,8"},
                             "SGLANG_PP_LAYER_PARTITION='0,8'"),
}
GPU_CASES = {"pinned_on_cpu", "pool_device_cuda", "device_cuda_index", "env_backend_nccl"}


@pytest.mark.parametrize("case", sorted(LOAD_CONFLICTS))
def test_load_conflict_refused_before_the_job_starts(
        case: str, model: Path, no_start: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    if case in GPU_CASES and not _no_gpu():
        pytest.skip("this machine has a GPU")
    extra, env, needle = LOAD_CONFLICTS[case]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = ["load", "--model", str(model), *[a.replace("{m}", str(model)) for a in extra]]
    code, err = _run(argv, capsys)
    assert code == 2, (case, code, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle.replace("{m}", str(model)) in lines[0], (case, lines[0])


def test_valid_load_arguments_reach_the_start(model: Path, no_start: None, tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    """The checks refuse only conflicts: a sound command line gets to init_distributed, and
    --save-loaded's directory is probed but not made (made only when a rank writes to it)."""
    out = tmp_path / "new" / "saved"
    code, err = _run(["load", "--model", str(model), "--device", "cpu", "--io-backend",
                      "threaded", "--save-loaded", str(out), "--exchange-cost", "0.25"], capsys)
    assert code == "started", err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_plan_engine_partition_variable_checked_like_the_flag(
        model: Path, no_start: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "four,four")
    code, err = _run(["plan", "--model", str(model), "--pp", "2", "--partition", "vllm"],
                     capsys)
    assert code == 2 and err.count("\n") == 1 and "VLLM_PP_LAYER_PARTITION='four,four'" in err
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,5")
    code, err = _run(["plan", "--model", str(model), "--pp", "2", "--partition", "vllm"],
                     capsys)
    assert code == 0, err


def test_ctrl_c_in_plan_is_one_line_exit_130(model: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    def interrupted(*a: object, **k: object) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "cmd_plan", interrupted)
    code, err = _run(["plan", "--model", str(model), "--pp", "2"], capsys)
    assert code == 130 and err == "pploader: interrupted (Ctrl-C)\n"


def test_broken_pipe_is_silent_exit_0(model: Path) -> None:
    """`plan --json | head -1`: no BrokenPipeError, no 'Exception ignored' at exit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PPLOADER_LOG", None)
    proc = subprocess.run(
        f"set -o pipefail; {sys.executable} -m pploader plan --model {model} --pp 2 --json "
        "| head -c 1", shell=True, executable="/bin/bash", capture_output=True, text=True,
        timeout=120, env=env)
    assert proc.stdout == "{" and proc.stderr == "", proc.stderr
    assert proc.returncode == 0


def test_ctrl_c_during_load_one_line_exit_130(model: Path) -> None:
    """A rank stuck in its load (the test-only hang fault, after planning: INFO logs say
    so) gets SIGINT: its last line says so, no traceback, exit 130."""
    import threading
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PPLOADER_FAULT="rank=0:hang", PPLOADER_LOG="INFO")
    proc = subprocess.Popen([sys.executable, "-m", "pploader", "load", "--model", str(model),
                             "--pp", "1", "--no-progress", "--timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    planned = threading.Event()

    def read() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            lines.append(line.rstrip("\n"))
            if "planned" in line:
                planned.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert planned.wait(120), lines
    time.sleep(0.5)  # into the read, where the fault hangs
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130, lines
    reader.join(10)
    text = "\n".join(lines)
    assert "Traceback" not in text, text[-3000:]
    assert lines[-1].endswith("pploader: interrupted (Ctrl-C)"), text[-3000:]


def test_save_loaded_files_are_mode_0644(model: Path, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("PPLOADER_LOG", None)
    out = tmp_path / "saved"
    proc = subprocess.run([sys.executable, "-m", "pploader", "load", "--model", str(model),
                           "--pp", "1", "--no-pools", "--save-loaded", str(out), "--json"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["world_size"] == 1
    saved = out / "rank-0.safetensors"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o644


@pytest.mark.parametrize("kind", ["fifo", "dir", "device"])
def test_non_regular_shard_is_named_as_such(kind: str, model: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    import shutil
    bad = tmp_path / "m"
    shutil.copytree(model, bad)
    shard = sorted(bad.glob("*.safetensors"))[1]
    shard.unlink()
    if kind == "fifo":
        os.mkfifo(shard)
    elif kind == "dir":
        shard.mkdir()
    else:
        shard.symlink_to("/dev/zero")
    argv = ["plan", "--model", str(bad), "--pp", "1"] + (
        ["--allow-root", "/dev"] if kind == "device" else [])
    code, err = _run(argv, capsys)
    word = {"fifo": "a FIFO", "dir": "a directory", "device": "a device"}[kind]
    assert code == 2 and err.count("\n") == 1, err
    assert f"file {shard.name}: is {word}, not a regular file" in err
    assert "missing" not in err


def test_permission_error_on_a_rank_is_an_input_error() -> None:
    """Agreed by every rank as a mistake of the input (exit 2), its line without the type."""
    from pploader.errors import RankFailure
    exc = RankFailure({1: "PermissionError: [Errno 13] Permission denied: '/m/x.safetensors'"})
    assert exc.input_only
    assert exc.first() == "rank 1: [Errno 13] Permission denied: '/m/x.safetensors'"


@pytest.mark.gpu
def test_gpu_options_pass_the_checks_on_a_gpu_machine(model: Path, no_start: None,
                                                      capsys: pytest.CaptureFixture) -> None:
    """With GPUs: pinned onto cuda starts; a GPU index past the machine's is refused."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    code, err = _run(["load", "--model", str(model), "--io-backend", "pinned", "--device",
                      "cuda", "--pool-device", "cuda:0"], capsys)
    assert code == "started", err
    count = torch.cuda.device_count()
    code, err = _run(["load", "--model", str(model), "--pool-device", f"cuda:{count}"], capsys)
    assert code == 2 and f"this process sees {count} GPU(s)" in err and err.count("\n") == 1
