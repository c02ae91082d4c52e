"""Every user mistake gets one clean line naming the problem and the fix, exit 2, no traceback
(issue 13). `plan` cases run in-process through ``pploader.cli.main``; `load` cases run as two
real ranks (an srun-style launch, where every rank's exit code is visible) and one under
torchrun. The table is the point: add a row for every new mistake a user can make."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from helpers import free_port, make_model, torchrun_cmd, tiny_config

from pploader.cli import main


@dataclass(frozen=True)
class Mistake:
    """One mistake: the argv (``{m}`` = the model dir), what the line must say, the fix."""

    argv: tuple[str, ...]
    problem: str          # substring naming the problem
    fix: str              # substring naming the fix
    model: str = "ok"     # which checkpoint variant {m} means (see ``variants``)
    env: tuple[tuple[str, str], ...] = ()


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj))


def _variant_bad_dtype(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    _write_json(d / "config.json", dict(cfg, dtype="float8"))


def _variant_unknown_family(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    _write_json(d / "config.json", dict(cfg, architectures=["GPT9000ForCausalLM"]))


def _variant_bad_json(d: Path) -> None:
    (d / "config.json").write_text("{ not json")


def _variant_no_config(d: Path) -> None:
    (d / "config.json").unlink()


def _variant_no_shards(d: Path) -> None:
    for f in d.glob("*.safetensors*"):
        f.unlink()


def _variant_missing_shard(d: Path) -> None:
    sorted(d.glob("*.safetensors"))[1].unlink()


def _variant_damaged_shard(d: Path) -> None:
    shard = sorted(d.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:3])


def _variant_bad_index(d: Path) -> None:
    (d / "model.safetensors.index.json").write_text("[1, 2")


def _variant_config_symlink_out(d: Path) -> None:
    outside = d.parent / f"{d.name}-elsewhere"
    outside.mkdir()
    shutil.move(str(d / "config.json"), outside / "config.json")
    (d / "config.json").symlink_to(outside / "config.json")


def _variant_shard_symlink_out(d: Path) -> None:
    outside = d.parent / f"{d.name}-shards"
    outside.mkdir()
    shard = sorted(d.glob("*.safetensors"))[0]
    shutil.move(str(shard), outside / shard.name)
    shard.symlink_to(outside / shard.name)


def _variant_f32_norm(d: Path) -> None:
    """One norm stored as F32 in a BF16 checkpoint (allowed: kept, with a warning)."""
    from safetensors.torch import load_file, save_file
    shard = next(f for f in sorted(d.glob("*.safetensors"))
                 if "model.norm.weight" in load_file(str(f)))
    tensors = load_file(str(shard))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].float()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["metadata"]["total_size"] += tensors["model.norm.weight"].numel() * 2
    _write_json(d / "model.safetensors.index.json", index)


VARIANTS: dict[str, Callable[[Path], None]] = {
    "ok": lambda d: None, "bad_dtype": _variant_bad_dtype,
    "unknown_family": _variant_unknown_family, "bad_json": _variant_bad_json,
    "no_config": _variant_no_config, "no_shards": _variant_no_shards,
    "missing_shard": _variant_missing_shard, "damaged_shard": _variant_damaged_shard,
    "bad_index": _variant_bad_index, "config_symlink_out": _variant_config_symlink_out,
    "shard_symlink_out": _variant_shard_symlink_out, "f32_norm": _variant_f32_norm,
}


@pytest.fixture(scope="module")
def variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny llama (8 layers, 4 query / 2 KV heads) and one broken copy per variant."""
    root = tmp_path_factory.mktemp("mistakes")
    ok = make_model(root / "ok")
    out = {"ok": ok}
    for name, spoil in VARIANTS.items():
        if name != "ok":
            shutil.copytree(ok, root / name)
            spoil(root / name)
            out[name] = root / name
    return out


def M(*argv: str, problem: str, fix: str, model: str = "ok", **env: str) -> Mistake:
    return Mistake(tuple(argv), problem, fix, model, tuple(env.items()))


PLAN = ("plan", "--model", "{m}")
LOAD = ("load", "--model", "{m}")

#: mistakes answered before any rank starts (argparse, config, checkpoint, layout): `plan`
#: runs in-process; `load` argument errors are refused before torch.distributed starts.
MISTAKES = {
    # --model
    "model_is_a_shard": M(*PLAN, "--pp", "1", model="shard", problem="is a file, not a directory",
                          fix="--model takes the directory"),
    "model_missing": M(*PLAN, "--pp", "1", model="missing", problem="does not exist",
                       fix="--model takes the directory"),
    "no_config": M(*PLAN, "--pp", "1", model="no_config", problem="config.json is missing",
                   fix="--model must be the directory holding config.json"),
    "config_not_json": M(*PLAN, "--pp", "1", model="bad_json", problem="not valid JSON",
                         fix="config.json"),
    "unknown_family": M(*PLAN, "--pp", "1", model="unknown_family",
                        problem="unsupported architecture 'GPT9000ForCausalLM'",
                        fix="docs/families.md"),
    "bad_dtype": M(*PLAN, "--pp", "1", model="bad_dtype", problem="unsupported dtype 'float8'",
                   fix="known: float32"),
    "no_shards": M(*PLAN, "--pp", "1", model="no_shards", problem="no *.safetensors files",
                   fix="--model must be the directory"),
    "missing_shard": M(*PLAN, "--pp", "1", model="missing_shard", problem="are missing",
                       fix="copy or download them"),
    "damaged_shard": M(*PLAN, "--pp", "1", model="damaged_shard",
                       problem="not a safetensors file", fix="fetch or write it again"),
    "index_not_json": M(*PLAN, "--pp", "1", model="bad_index", problem="not valid JSON",
                        fix="model.safetensors.index.json"),
    "config_symlink_outside": M(*PLAN, "--pp", "1", model="config_symlink_out",
                                problem="outside the allowed roots", fix="--allow-root DIR"),
    "shard_symlink_outside": M(*PLAN, "--pp", "1", model="shard_symlink_out",
                               problem="outside the allowed roots", fix="--allow-root DIR"),
    # layout
    "pp_missing": M(*PLAN, problem="required: --pp", fix="pploader plan --help"),
    "pp_zero": M(*PLAN, "--pp", "0", problem="argument --pp: 0 is below 1", fix="from 1 to 65536"),
    "pp_negative": M(*PLAN, "--pp", "-2", problem="argument --pp: -2 is below 1", fix="from 1 to"),
    "pp_not_int": M(*PLAN, "--pp", "two", problem="'two' is not an integer",
                    fix="pploader plan --help"),
    "pp_over_layers": M(*PLAN, "--pp", "9", problem="cannot split 8 layers into 9 stages",
                        fix="use --pp 8 or fewer"),
    "tp_zero": M(*PLAN, "--pp", "1", "--tp", "0", problem="argument --tp: 0", fix="from 1 to"),
    "tp_3_heads": M(*PLAN, "--pp", "1", "--tp", "3", problem="does not divide the 4 query heads",
                    fix="use --tp in [1, 2, 4]"),
    "tp_8_heads": M(*PLAN, "--pp", "1", "--tp", "8", problem="does not divide the 4 query heads",
                    fix="use --tp in [1, 2, 4]"),
    "tp_16_heads": M(*PLAN, "--pp", "2", "--tp", "16", problem="4 query heads",
                     fix="use --tp in"),
    "ep_without_experts": M(*PLAN, "--pp", "1", "--ep", "2", problem="has no experts",
                            fix="leave --ep at 1"),
    "ep_zero": M(*PLAN, "--pp", "1", "--ep", "0", problem="argument --ep", fix="from 1 to"),
    "partition_letters": M(*PLAN, "--pp", "2", "--partition", "a,b",
                           problem="comma-separated layer counts", fix="even / balanced"),
    "partition_sum": M(*PLAN, "--pp", "2", "--partition", "3,3", problem="sums to 6",
                       fix="sum to 8"),
    "partition_stages": M(*PLAN, "--pp", "3", "--partition", "4,4",
                          problem="--partition 4,4 has 2 stage(s)",
                          fix="give 3 layer counts"),
    "partition_zero": M(*PLAN, "--pp", "3", "--partition", "4,4,0",
                        problem="at least one layer", fix="counts of 1 or more"),
    # cache pool options
    "cache_budget_negative": M(*PLAN, "--pp", "1", "--cache-budget", "-5",
                               problem="-5 is below 1", fix="20G"),
    "cache_budget_unit": M(*PLAN, "--pp", "1", "--cache-budget", "12Q",
                           problem="'12Q' is not a size", fix="whole number of bytes"),
    "memory_fraction": M(*PLAN, "--pp", "1", "--memory-fraction", "2",
                         problem="--memory-fraction: 2", fix="[0.01, 1]"),
    "mamba_ratio": M(*PLAN, "--pp", "1", "--mamba-ratio", "1.5", problem="--mamba-ratio: 1.5",
                     fix="[0, 1]"),
    "page_size_zero": M(*PLAN, "--pp", "1", "--page-size", "0", problem="--page-size: 0",
                        fix="from 1 to"),
    "tokens_negative": M(*PLAN, "--pp", "1", "--tokens", "-1", problem="--tokens: -1",
                         fix="from 1 to"),
    "kv_dtype": M(*PLAN, "--pp", "1", "--kv-dtype", "floaty", problem="is not a cache dtype",
                  fix="bfloat16"),
    "device_memory_auto_plan": M(*PLAN, "--pp", "1", "--device-memory", "auto",
                                 problem="applies to `pploader load`", fix="--device-memory 80G"),
    # environment, commands
    "log_level": M(*PLAN, "--pp", "1", problem="PPLOADER_LOG='LOUD'", fix="use one of DEBUG",
                   PPLOADER_LOG="LOUD"),
    "unknown_command": M("plan-all", problem="invalid choice: 'plan-all'",
                         fix="pploader --help"),
    "make_tiny_unknown_family": M("make-tiny", "gpt9000", "{m}-new", problem="no bundled tiny "
                                  "config", fix="one of: bamba"),
    # load: refused before torch.distributed starts
    "load_timeout_zero": M(*LOAD, "--timeout", "0", problem="argument --timeout: 0",
                           fix="[1, 604800] seconds"),
    "load_timeout_negative": M(*LOAD, "--timeout", "-5", problem="argument --timeout: -5",
                               fix="[1, 604800] seconds"),
    "load_window_zero": M(*LOAD, "--window-bytes", "0", problem="argument --window-bytes",
                          fix="512M"),
    "load_window_text": M(*LOAD, "--window-bytes", "lots", problem="'lots' is not a size",
                          fix="512M"),
    "load_threads_zero": M(*LOAD, "--threads", "0", problem="argument --threads: 0",
                           fix="from 1 to 1024"),
    "load_device_string": M(*LOAD, "--device", "gpu0", problem="unknown device 'gpu0'",
                            fix="use cpu, cuda or cuda:N"),
    "load_device_index": M(*LOAD, "--device", "cuda:x", problem="unknown device 'cuda:x'",
                           fix="use cpu, cuda or cuda:N"),
    "load_pool_device": M(*LOAD, "--pool-device", "tpu", problem="unknown device 'tpu'",
                          fix="use cpu, cuda or cuda:N"),
    "load_backend": M(*LOAD, "--backend", "carrier-pigeon", problem="is not a torch.distributed backend",
                      fix="gloo, nccl, mpi"),
    "load_range_cost": M(*LOAD, "--range-cost", "-1", problem="argument --range-cost",
                         fix="64K"),
}


def _model_path(variants: dict[str, Path], which: str) -> Path:
    if which == "shard":
        return sorted(variants["ok"].glob("*.safetensors"))[0]
    if which == "missing":
        return variants["ok"].parent / "no-such-model"
    return variants[which]


def _argv(m: Mistake, model: Path) -> list[str]:
    return [a.replace("{m}", str(model)) for a in m.argv]


def _run_main(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
              capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    """``pploader.cli.main(argv)`` in this process: exit code, stdout, stderr; logging and
    the environment restored afterwards."""
    for key in ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PPLOADER_LOG"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", os.environ.get("TORCH_CPP_LOG_LEVEL", "WARNING"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    out = capsys.readouterr()
    return code, out.out, out.err


def _assert_one_clean_line(err: str, m: Mistake, where: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"{where}: expected one line, got:\n{err}"
    line = lines[0]
    assert "Traceback" not in err and "Error:" not in line.split("error:")[0], (where, line)
    assert "error:" in line, (where, line)
    assert m.problem in line, f"{where}: problem {m.problem!r} not named in: {line}"
    assert m.fix in line, f"{where}: fix {m.fix!r} not named in: {line}"
    return line


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_mistake_gives_one_line_and_exit_2(case: str, variants: dict[str, Path],
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    m = MISTAKES[case]
    code, out, err = _run_main(_argv(m, _model_path(variants, m.model)), dict(m.env),
                               monkeypatch, capsys)
    assert code == 2, (case, code, err)
    _assert_one_clean_line(err, m, case)
    assert out == "", (case, out)


def test_there_are_at_least_30_mistakes() -> None:
    assert len(MISTAKES) + len(LOAD_MISTAKES) >= 30


def test_allow_root_accepts_symlinks_into_it(variants: dict[str, Path],
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture) -> None:
    """The fix the messages name works: --allow-root DIR (repeatable) admits both symlinks."""
    for which, outside in (("config_symlink_out", "-elsewhere"), ("shard_symlink_out", "-shards")):
        model = variants[which]
        root = model.parent / f"{model.name}{outside}"
        code, out, err = _run_main(["plan", "--model", str(model), "--pp", "2", "--allow-root",
                                    str(model.parent), "--allow-root", str(root)], {},
                                   monkeypatch, capsys)
        assert code == 0, err
        assert "LlamaForCausalLM" in out
    # a root that does not exist is a mistake (issue 43), refused naming the option
    code, out, err = _run_main(["plan", "--model", str(model), "--pp", "2", "--allow-root",
                                "/nonexistent-root"], {}, monkeypatch, capsys)
    assert code == 2 and "--allow-root: /nonexistent-root is not an existing directory" in err


def test_f32_tensor_in_bf16_checkpoint_is_named_in_a_warning(
        variants: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture) -> None:
    """Kept as F32 (not cast), and said so: on `plan` and on the library's iterator."""
    from pploader import Topology, iter_stage_weights
    model = variants["f32_norm"]
    code, _, err = _run_main(["plan", "--model", str(model), "--pp", "2"], {}, monkeypatch,
                             capsys)
    assert code == 0, err
    assert "WARNING pploader.planning.dtypes: rank 1: 1 tensor(s) stored as F32 in a BF16 model" in err
    assert "model.norm.weight" in err
    with caplog.at_level(logging.WARNING, logger="pploader.planning.dtypes"):
        got = dict(iter_stage_weights(model, Topology(2, rank=1)))
    assert got["model.norm.weight"].dtype.is_floating_point
    assert got["model.norm.weight"].element_size() == 4
    assert any("model.norm.weight" in r.getMessage() for r in caplog.records)


def test_pploader_log_info_logs_the_plan(variants: dict[str, Path],
                                         monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture) -> None:
    code, _, err = _run_main(["plan", "--model", str(variants["ok"]), "--pp", "2"],
                             {"PPLOADER_LOG": "info"}, monkeypatch, capsys)
    assert code == 0
    assert "INFO pploader.planning.plan: planned 2 rank(s) (pp 2 x ep 1 x tp 1, even)" in err
    code, _, err = _run_main(["plan", "--model", str(variants["ok"]), "--pp", "2"],
                             {"PPLOADER_LOG": "WARNING"}, monkeypatch, capsys)
    assert code == 0 and err == ""


def test_help_does_not_import_torch() -> None:
    """`pploader --help` / `pploader plan --help` stay fast: no torch import for help."""
    code = ("import sys, pploader.cli as c\n"
            "for argv in (['--help'], ['plan', '--help'], ['load', '--help']):\n"
            "    try:\n        c.main(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'numpy', 'safetensors')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]
    assert "--allow-root" in out.stdout


def test_window_default_literal_matches_the_reader() -> None:
    from pploader import cli
    from pploader.io.read import DEFAULT_WINDOW_BYTES
    assert cli._DEFAULT_WINDOW_MIB << 20 == DEFAULT_WINDOW_BYTES
    from pploader.planning.plan import DEFAULT_EXCHANGE_COST
    assert cli._DEFAULT_EXCHANGE_COST == DEFAULT_EXCHANGE_COST


def test_make_tiny_by_family_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture) -> None:
    from pploader.tiny import TINY_CONFIGS, tiny_families
    assert "llama" in tiny_families() and (TINY_CONFIGS / "tiny-llama.json").is_file()
    code, out, err = _run_main(["make-tiny", "llama", str(tmp_path / "t")], {}, monkeypatch,
                               capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "t" / "config.json").read_text())["architectures"] == \
        tiny_config()["architectures"]


def test_progress_bar_is_tqdm_and_finishes_before_returning() -> None:
    import io
    from pploader.report import ProgressBar
    stream, done = io.StringIO(), [0]
    with ProgressBar(4096, lambda: done[0], stream=stream, enabled=True, interval_s=0.01):
        for _ in range(4):
            done[0] += 1024
            time.sleep(0.02)
    text = stream.getvalue()
    assert text.endswith("\n") and "pploader: 100%" in text and "4.00k/4.00k" in text


# ---- load: two real ranks ----------------------------------------------------------------

#: mistakes `load` finds once ranks run (planning, agreed by every rank; world size)
LOAD_MISTAKES = {
    "partition_sum": M(*LOAD, "--pp", "2", "--partition", "3,3", problem="sums to 6",
                       fix="sum to 8"),
    "world_mismatch": M(*LOAD, "--pp", "4", problem="!= world size 2", fix="launch 4 ranks"),
    "missing_config": M(*LOAD, "--pp", "1", "--tp", "2", model="no_config",
                  problem="config.json is missing", fix="--model must be the directory"),
    "partition_zero": M(*LOAD, "--pp", "2", "--partition", "8,0", problem="at least one layer",
                        fix="counts of 1 or more"),
    "window_too_small": M(*LOAD, "--pp", "2", "--window-bytes", "1K",
                          problem="smaller than this stage's largest tensor",
                          fix="--window-bytes 32768 or more"),
    "device_without_gpu": M(*LOAD, "--pp", "2", "--device", "cuda",
                            problem="this process sees no GPU", fix="use --device cpu"),
    "backend_nccl_on_cpu": M(*LOAD, "--pp", "2", "--backend", "nccl",
                             problem="--backend nccl", fix="--backend gloo"),
    "missing_shard": M(*LOAD, "--pp", "2", model="missing_shard", problem="are missing",
                       fix="copy or download them"),
}


def _per_rank_launch(argv: list[str], world: int = 2, timeout: float = 120
                     ) -> list[tuple[int, str]]:
    """Each rank a plain process with an srun-style environment (rank 0 hosts the store, no
    agent kills anyone): every rank's own exit code and stderr."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   SLURM_PROCID=str(rank), SLURM_NTASKS=str(world), SLURM_LOCALID=str(rank),
                   SLURM_STEP_ID="0", SLURM_JOB_ID="1", SLURM_JOB_NODELIST="localhost",
                   MASTER_PORT=str(port))
        env.pop("PPLOADER_LOG", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "pploader", *argv],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env))
    errs = [p.communicate(timeout=timeout)[1] for p in procs]
    return [(p.returncode, err) for p, err in zip(procs, errs)]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LOAD_MISTAKES))
def test_load_mistake_exits_2_on_every_rank(case: str, variants: dict[str, Path]) -> None:
    import torch
    m = LOAD_MISTAKES[case]
    if torch.cuda.is_available() and case in ("device_without_gpu", "backend_nccl_on_cpu"):
        pytest.skip("this machine has a GPU")
    results = _per_rank_launch(_argv(m, _model_path(variants, m.model)))
    for rank, (code, err) in enumerate(results):
        where = f"{case} rank {rank}"
        line = _assert_one_clean_line(err, m, where)
        assert line.startswith(f"[rank {rank}] pploader"), (where, line)
        assert code == 2, (where, code, err)


@pytest.mark.slow
def test_store_host_exiting_first_prints_no_cpp_stack_frames(variants: dict[str, Path]) -> None:
    """Rank 0 hosts the store and dies; rank 1 prints pploader's message, no C++ frames."""
    env_fault = {"PPLOADER_FAULT": "rank=0:kill"}
    os.environ.update(env_fault)
    try:
        results = _per_rank_launch(["load", "--model", str(variants["ok"]), "--pp", "2",
                                    "--timeout", "10"])
    finally:
        os.environ.pop("PPLOADER_FAULT")
    code, err = results[1]
    assert code == 1, err
    assert "[rank 1] pploader: load failed on the job" in err
    assert "rank 0: died: its process hosted the job's key-value store" in err
    assert "frame #" not in err and "Exception raised from" not in err, err


@pytest.mark.slow
def test_load_mistake_under_torchrun(variants: dict[str, Path]) -> None:
    """Under torchrun too: every rank prints the one line and exits 2 (torchrun's own
    summary lists each rank's exit code)."""
    m = LOAD_MISTAKES["partition_sum"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("PPLOADER_LOG", None)
    proc = subprocess.run(torchrun_cmd(2, *_argv(m, variants["ok"])), capture_output=True,
                          text=True, timeout=180, env=env)
    assert proc.returncode != 0
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("[rank ")]
    assert sorted(ln[:8] for ln in ours) == ["[rank 0]", "[rank 1]"], proc.stderr[-3000:]
    for line in ours:
        assert m.problem in line and m.fix in line, line
    assert "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert "frame #" not in proc.stderr
