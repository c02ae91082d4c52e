"""`make-tiny` and `bench` held to `plan`'s standard (issue 32): every option validated, a
non-empty output refused unless --force, atomic writes, free space and memory checked first,
files mode 0644, a benchmark that measured nothing never PASSes."""
from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]


def _run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[Any, str, str]:
    return run_cli(argv, capsys)


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _listing(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in d.iterdir()}


# ---- make-tiny -----------------------------------------------------------------------------

def test_make_tiny_writes_0644_files_and_no_temporary_left(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    code, out, err = _run(["make-tiny", "llama", str(tmp_path / "t")], capsys)
    assert code == 0, err
    files = sorted((tmp_path / "t").iterdir())
    assert {f.name for f in files} >= {"config.json", "model.safetensors.index.json"}
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in files), \
        {f.name: oct(f.stat().st_mode) for f in files}
    assert stat.S_IMODE((tmp_path / "t").stat().st_mode) == 0o755
    assert [p.name for p in tmp_path.iterdir()] == ["t"]  # the temporary directory is gone


def test_make_tiny_refuses_a_non_empty_dir_and_force_replaces_without_mixing(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "t"
    assert _run(["make-tiny", "deepseek_v3", str(out)], capsys)[0] == 0
    (out / "README.md").write_text("mine")
    before = _listing(out)
    code, _, err = _run(["make-tiny", "llama", str(out)], capsys)
    assert code == 2
    line = _one_line(err)
    assert "not empty" in line and "--force" in line
    assert _listing(out) == before  # untouched
    code, _, err = _run(["make-tiny", "llama", str(out), "--force", "--shard-bytes", "1G"],
                        capsys)
    assert code == 0, err
    left = sorted(p.name for p in out.iterdir())
    assert left == [".pploader-output", "README.md", "config.json", "model.safetensors"], \
        left  # no old shard; README.md (not pploader's) kept
    assert json.loads((out / "config.json").read_text())["architectures"] == \
        ["LlamaForCausalLM"]
    from pploader import Topology, plan_stage
    plan_stage(out, Topology(2, rank=1))  # a consistent checkpoint


def test_make_tiny_leaves_nothing_when_the_disk_fills(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    import pploader.tiny as tiny
    real, calls = tiny.save_file, []

    def full(tensors: Any, path: str, **kw: Any) -> None:
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real(tensors, path, **kw)
    monkeypatch.setattr(tiny, "save_file", full)
    code, _, err = _run(["make-tiny", "llama", str(tmp_path / "t")], capsys)
    assert code == 1 and "No space left on device" in _one_line(err)
    assert list(tmp_path.iterdir()) == []  # no partial checkpoint, no temporary directory


def _big_config(tmp_path: Path) -> Path:
    """A real 70B-sized llama config (80 layers, hidden 8192): ~140 GB of bf16."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
           "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
           "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, "dtype": "bfloat16"}
    path = tmp_path / "llama70b.json"
    path.write_text(json.dumps(cfg))
    return path


def test_make_tiny_checks_free_space_before_allocating(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    import shutil

    import torch
    allocs: list[int] = []
    monkeypatch.setattr(torch, "randn", lambda *a, **k: allocs.append(1) or 1 / 0)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(  # type: ignore[attr-defined]
        10**12, 10**12 - 50 * 10**9, 50 * 10**9))
    code, _, err = _run(["make-tiny", str(_big_config(tmp_path)), str(tmp_path / "t")], capsys)
    assert code == 2
    line = _one_line(err)
    assert "the checkpoint needs 141" in line and "50.00 GB free" in line, line
    assert allocs == [] and not (tmp_path / "t").exists()


def test_make_tiny_checks_memory_for_one_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    import shutil

    import pploader.tiny as tiny
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(  # type: ignore[attr-defined]
        10**15, 0, 10**15))
    monkeypatch.setattr(tiny, "_available_memory", lambda: 16 * 10**9)
    code, _, err = _run(["make-tiny", str(_big_config(tmp_path)), str(tmp_path / "t")], capsys)
    assert code == 2
    line = _one_line(err)
    assert "GB of memory and 16.00 GB is available" in line and "--shard-bytes" in line, line


@pytest.mark.parametrize("argv,needle", [
    (["--seed", "-1"], "argument --seed: -1 is below 0"),
    (["--seed", "1e3"], "'1e3' is not an integer"),
    (["--seed", str(2**64)], "is too large; give an integer from 0 to 9223372036854775807"),
    (["--shard-bytes", "0"], "0 is below 65536"),
    (["--shard-bytes", "1"], "1 is below 65536"),
    (["--shard-bytes", "0.5"], "is not a whole number of bytes"),
    (["--shard-bytes", "1e30"], "is too large"),
    (["--shard-bytes", "nan"], "'nan' is not a size"),
])
def test_make_tiny_options_validated(argv: list[str], needle: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture) -> None:
    code, _, err = _run(["make-tiny", "llama", str(tmp_path / "t"), *argv], capsys)
    assert code == 2 and needle in _one_line(err)
    assert not (tmp_path / "t").exists()


def test_make_tiny_config_limits_and_options(tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    from pploader.tiny import TINY_CONFIGS
    cfg = json.loads((TINY_CONFIGS / "tiny-mixtral.json").read_text())
    cases = {"experts": (dict(cfg, num_local_experts=60_000, num_hidden_layers=100),
                         "over make-tiny's 2000000"),
             "tiny_opts": (dict(cfg, pploader_tiny={"seed": "x"}), "pploader_tiny.seed is 'x'"),
             "tiny_not_object": (dict(cfg, pploader_tiny=[1]), "pploader_tiny must be an object")}
    for name, (config, needle) in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        code, _, err = _run(["make-tiny", str(path), str(tmp_path / name)], capsys)
        assert code == 2 and needle in _one_line(err), (name, err)
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = _run(["make-tiny", str(path), str(tmp_path / "deep")], capsys)
    assert code == 2 and "levels deep" in _one_line(err)


def test_make_tiny_help_lists_the_families_without_torch() -> None:
    code = ("import sys, pploader.cli as c\n"
            "try:\n    c.main(['make-tiny', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    from pploader.tiny import tiny_families
    text = " ".join(proc.stdout.split())
    assert "bundled families: " + ", ".join(tiny_families()) in text, proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# ---- bench ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["--size-gb", "0"], "argument --size-gb: 0"), (["--size-gb", "-1"], "--size-gb: -1"),
    (["--size-gb", "nan"], "--size-gb: nan"), (["--size-gb", "inf"], "--size-gb: inf"),
    (["--layers", "0"], "--layers: 0 is below 1"), (["--pp", "0"], "--pp: 0"),
    (["--shards", "0"], "--shards: 0"), (["--repeat", "0"], "--repeat: 0 is below 1"),
    (["--threads", "-1"], "--threads: -1"), (["--torch-threads", "0"], "--torch-threads: 0"),
    (["--window-bytes", "0"], "--window-bytes"), (["--rss-scale", "1"], "--rss-scale: 1"),
    (["--rss-scale", "-2"], "--rss-scale: -2"), (["--plan-tensors", "-1"], "--plan-tensors"),
    (["--timeout", "0"], "--timeout: 0"), (["--seed", "-3"], "--seed: -3"),
    (["--pp", "40"], "--pp 40 is more stages than --layers 32"),
    (["--size-gb", "0.00001"], "too small for 32 llama layers"),
    (["--methods", "a_into,zz"], "unknown method zz"), (["--caches", ""], "unknown cache state"),
    (["--modes", "apart"], "unknown mode apart"),
    (["--size-gb", "90000", "--dir", "{tmp}/b"], "GB is free"),
    (["--markdown", "{tmp}"], "--markdown {tmp}: is a directory"),
    (["--plot", "/proc/version/x.png"], "--plot /proc/version: exists and is not a directory"),
    (["--plot", "/proc/nope/x.png"], "--plot /proc/nope: cannot write there"),
    (["--render", "{tmp}/none.json"], "--render {tmp}/none.json: cannot read it"),
    (["stray"], "unexpected arguments stray"),
])
def test_bench_options_validated_before_anything_is_written(
        argv: list[str], needle: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    import pploader.bench.data as data
    monkeypatch.setattr(data, "write_synthetic", lambda *a, **k: 1 / 0)  # never reached
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, out, err = _run(["bench", "--dir", str(tmp_path / "d"), *argv], capsys)
    assert code == 2, (argv, code, err)
    assert needle.replace("{tmp}", str(tmp_path)) in _one_line(err), err
    assert out == "" and not any(tmp_path.glob("d/llama-*"))


def test_bench_render_of_an_empty_run_never_passes(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    doc = {"command": "pploader bench", "machine": {}, "checkpoints": {}, "plan": None,
           "rows": [], "elapsed_s": 0.0,
           "config": {"size_gb": 1, "layers": 2, "shards": 1, "pp": 1, "device": "cpu",
                      "threads": 1, "torch_threads": 1, "window_bytes": None, "repeat": 1,
                      "rss_scale": 0, "methods": ["a_into"], "caches": ["warm"],
                      "modes": ["alone"], "labels": {"a_into": "pploader"}}}
    path = tmp_path / "empty.json"
    path.write_text(json.dumps(doc))
    code, out, err = _run(["bench", "--render", str(path)], capsys)
    assert code == 1 and "PASS" not in out, out
    assert "measured nothing" in err
    path.write_text(json.dumps({"rows": []}))
    code, _, err = _run(["bench", "--render", str(path)], capsys)
    assert code == 2 and "not a document saved by `pploader bench --json`" in _one_line(err)
