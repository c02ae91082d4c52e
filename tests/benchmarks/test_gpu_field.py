"""The GPU method field of benchmarks/ on top of ``pploader bench --device cuda``: the package
runs only its standard methods and options, the harness adds its own through a ``MethodField``
and runs its children as itself (the GPU rows run on a device, docs/benchmarks-gpu.md)."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_field
from benchmarks.gpu_engine_methods import ENGINE_METHODS
from benchmarks.gpu_method_variants import VARIANTS
from pploader.bench import cuda
from pploader.bench.gpu_methods import METHODS

ROOT = Path(__file__).resolve().parents[2]


def test_the_field_is_the_standard_methods_plus_the_harness_ones() -> None:
    field = gpu_field.full_field()
    assert set(field.methods) == set(METHODS) | set(VARIANTS) | set(ENGINE_METHODS)
    assert not (set(METHODS) & set(VARIANTS)) and not (set(METHODS) & set(ENGINE_METHODS))
    assert field.module == "benchmarks.gpu_field"
    # the standard orders name only standard methods: `pploader bench --device cuda` runs them
    assert set(cuda.WARM) | set(cuda.COLD) <= set(METHODS)
    assert cuda.standard_field().module == "pploader.bench.cuda"


@pytest.mark.parametrize("argv", [["--pp2"], ["--disk"], ["--cli-wall", "1"],
                                  ["--together", "raw_preadv16"], ["--disk-best", "all"]])
def test_harness_modes_only_in_the_harness(argv: list[str],
                                           capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        cuda.build_parser().parse_args(argv)
    assert exc.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err
    assert gpu_field._parser().parse_args(argv) is not None


def test_children_run_as_the_field_module_with_their_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[list[str], dict]] = []

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess:
        seen.append((cmd, kw["env"]))  # type: ignore[arg-type]
        return subprocess.CompletedProcess(cmd, 0, 'RESULT {"method": "m", "seconds": 1}\n', "")

    monkeypatch.setattr(cuda.subprocess, "run", fake_run)
    monkeypatch.setattr(cuda, "_cudart_shim", lambda: {})
    args = argparse.Namespace(ckdir="/x", device="cuda:1", pp=4, stage=2)
    got = cuda.run_child("fastsafetensors_odirect_b16m", args, 5.0, gpu_field.full_field())
    assert got == {"method": "m", "seconds": 1}
    cmd, env = seen[-1]
    assert cmd[1:5] == ["-m", "benchmarks.gpu_field", "--child", "fastsafetensors_odirect_b16m"]
    assert cmd[cmd.index("--stage") + 1] == "2" and cmd[cmd.index("--device") + 1] == "cuda:1"
    assert env["FASTSAFETENSORS_ODIRECT"] == "1"
    cuda.run_child("raw_preadv16", args, 5.0)  # the package's own: its own module
    assert seen[-1][0][1:5] == ["-m", "pploader.bench.cuda", "--child", "raw_preadv16"]


def test_unknown_method_refused_before_a_checkpoint_is_written(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pploader.bench.cuda", "--ckdir",
                           str(tmp_path / "ck"), "--out", str(tmp_path / "out"), "--methods",
                           "pploader_first_thp"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode != 0 and "unknown method(s) pploader_first_thp" in proc.stderr
    assert not (tmp_path / "ck").exists()


def test_pp_stage_children_need_a_child_flag() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_pp_stages", "--ckdir", "/x"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "--stage-child or --profile-child" in proc.stderr
