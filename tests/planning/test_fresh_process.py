"""Planning in a fresh process: ``pploader plan`` / ``files`` and the planning API import no
torch, numpy or transformers for hand-written families; the pure dtype table planning uses
instead of torch's dtypes agrees with torch (and safetensors), so the two cannot drift."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from pploader.cache.geometry import CacheDtypes, parse_dtype
from pploader.errors import ConfigError
from pploader.planning.dtype_table import (CODES, CONFIG_DTYPES, DTYPES, ITEMSIZE, NAME_ITEMSIZE,
                                           dtype_code, itemsize_of, torch_dtype)

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy", "transformers", "safetensors")

#: runs ``pploader`` (argv from the command line) in this process, then prints the heavy
#: top-level modules it imported as the last line of stdout
_CLI_RUNNER = (
    "import runpy, sys\n"
    "sys.argv = ['pploader', *sys.argv[1:]]\n"
    "try:\n    runpy.run_module('pploader', run_name='__main__')\n"
    "except SystemExit as exc:\n    code = exc.code\n"
    "else:\n    code = 0\n"
    f"print('\\nHEAVY', code, sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n")


def _fresh(code: str, *argv: str) -> tuple[int, list[str], str]:
    """(exit code, heavy modules imported, stdout) of ``code`` in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    last = out.stdout.strip().splitlines()[-1].split(" ", 2)
    assert last[0] == "HEAVY", (out.stdout[-2000:], out.stderr[-2000:])
    return int(last[1]), eval(last[2]), out.stdout  # noqa: S307 - our own repr of a list


# -- the dtype table against torch and safetensors ---------------------------------------------

def test_every_code_names_the_torch_dtype_of_its_itemsize() -> None:
    for code, (name, size) in CODES.items():
        dt = getattr(torch, name)
        assert isinstance(dt, torch.dtype) and str(dt) == f"torch.{name}", code
        assert dt.itemsize == size == ITEMSIZE[code], code
        assert DTYPES[code] == (dt, size) and torch_dtype(code) is dt is torch_dtype(name)
        assert dtype_code(dt) == dtype_code(name) == code
    for name, size in NAME_ITEMSIZE.items():
        assert getattr(torch, name).itemsize == size == itemsize_of(getattr(torch, name)), name
    for spelling, name in CONFIG_DTYPES.items():
        assert isinstance(getattr(torch, name), torch.dtype), spelling
    assert set(DTYPES) == set(CODES) and len(DTYPES) == len(CODES) and "F4" not in DTYPES


def test_codes_agree_with_safetensors() -> None:
    """safetensors' own code -> torch dtype table (where it has one) gives the same dtypes."""
    st = pytest.importorskip("safetensors.torch")
    theirs = getattr(st, "_TYPES", None)
    if not isinstance(theirs, dict):
        pytest.skip("safetensors.torch has no _TYPES table in this version")
    shared = set(theirs) & set(CODES)
    assert len(shared) >= 14, sorted(shared)
    assert {c: DTYPES[c][0] for c in shared} == {c: theirs[c] for c in shared}


def test_cache_dtypes_keep_names_and_check_them() -> None:
    assert parse_dtype(torch.float8_e4m3fn) == parse_dtype("torch.float8_e4m3fn") == \
        "float8_e4m3fn"
    assert parse_dtype("complex64") == "complex64" and itemsize_of("complex64") == 8  # via torch
    with pytest.raises(ConfigError, match="unknown cache dtype 'bfloat17'"):
        CacheDtypes.of(kv="bfloat17")
    with pytest.raises(ConfigError, match="unknown cache dtype"):
        CacheDtypes(ssm="Tensor")  # a torch attribute that is no dtype
    with pytest.raises(ValueError, match="no dtype"):
        torch_dtype("bfloat17")


# -- fresh processes ------------------------------------------------------------------------

@pytest.mark.parametrize("stem,layout", [
    ("tiny-llama", ["--pp", "2", "--tp", "2"]),
    ("tiny-deepseek_v3", ["--pp", "2", "--tp", "2", "--ep", "2", "--json"]),
    ("tiny-qwen3_next", ["--pp", "2", "--ep", "2"]),
    ("tiny-nemotron_h", ["--pp", "3"]),
    ("tiny-qwen3_5_moe_vl", ["--pp", "2", "--kv-dtype", "float8_e4m3fn"]),
    ("tiny-qwen3_moe", ["--pp", "2", "--tp", "2", "--exchange-cost", "auto"]),  # residency
])
def test_pploader_plan_imports_no_torch(stem: str, layout: list[str],
                                        tiny_checkpoints: Callable[[str], Path]) -> None:
    """The plan is the same as in-process (rank count, pools) and nothing heavy is imported."""
    model = tiny_checkpoints(stem)
    code, heavy, out = _fresh(_CLI_RUNNER, "plan", "--model", str(model), *layout)
    assert code in (0, None) and heavy == [], (heavy, out[-2000:])
    if "--json" in layout:
        ranks = json.loads(out[:out.rindex("HEAVY")])["ranks"]
        assert len(ranks) == 8 and all(r["pools"] for r in ranks)


def test_files_help_and_a_refused_plan_import_no_torch(tiny_checkpoints: Callable[[str], Path]
                                                       ) -> None:
    model = str(tiny_checkpoints("tiny-qwen3_moe"))
    for argv in (["--help"], ["files", "--help"], ["files", "--model", model, "--pp", "2"],
                 ["plan", "--model", model, "--pp", "99"]):  # more stages than layers: exit 2
        code, heavy, out = _fresh(_CLI_RUNNER, *argv)
        assert heavy == [] and code == (2 if "99" in argv else 0), (argv, heavy, out[-1000:])


def test_planning_api_imports_no_torch(tiny_checkpoints: Callable[[str], Path]) -> None:
    """``plan_stage`` / ``plan_job`` (the public API) plan without torch; a plan with a dtype
    cast (bfloat16 stored, float32 model) resolves torch only for its ``casts``."""
    model = str(tiny_checkpoints("tiny-deepseek_v3"))
    code = ("import sys\nfrom pploader import Topology, plan_job, plan_stage\n"
            "s = plan_stage(sys.argv[1], Topology(2, 1, 2, rank=3))\n"
            "j = plan_job(sys.argv[1], 2, 1, 2)\n"
            "assert s.plan.items and not s.casts and len(j.plans) == 4\n"
            f"print('\\nHEAVY 0', sorted({{m.split('.')[0] for m in sys.modules}} & "
            f"set({HEAVY!r})))\n")
    rc, heavy, out = _fresh(code, model)
    assert rc == 0 and heavy == [], (heavy, out[-2000:])


def test_real_scale_plan_imports_no_torch(tmp_path_factory: pytest.TempPathFactory) -> None:
    """DeepSeek-V3 as published (FP8 blocks, MLA, MTP; sparse files): one fresh process plans
    PP=8 without torch, and its table is the in-process table."""
    from real_layouts import build_layout
    model = str(build_layout("deepseek-v3", tmp_path_factory.mktemp("fresh-real")))
    code, heavy, out = _fresh(_CLI_RUNNER, "plan", "--model", model, "--pp", "8")
    assert code in (0, None) and heavy == [], (heavy, out[-2000:])
    from pploader.job import plan_job
    assert plan_job(model, 8).text().strip() == out[:out.rindex("HEAVY")].strip()


# -- pploader plan --rank: one rank's plan, as the whole job's plan has it ------------------

@pytest.mark.parametrize("stem,pp,tp,ep,partition", [
    ("tiny-deepseek_v3", 2, 2, 2, "even"),
    ("tiny-qwen3_next", 2, 1, 2, "balanced"),
    ("tiny-nemotron_h", 3, 1, 1, "2,5,1"),
])
def test_plan_one_rank_is_that_rank_of_the_job(stem: str, pp: int, tp: int, ep: int,
                                               partition: str,
                                               tiny_checkpoints: Callable[[str], Path]) -> None:
    from pploader.cache.sizing import PoolOptions
    from pploader.job import plan_job
    model = tiny_checkpoints(stem)
    parts: object = [int(n) for n in partition.split(",")] if "," in partition else partition
    opts = PoolOptions(tokens=64) if partition == "balanced" else PoolOptions()
    job = plan_job(model, pp, tp, ep, partition=parts, pools=opts)  # type: ignore[arg-type]
    assert len(job.plans) == pp * tp * ep
    for rank in range(pp * tp * ep):
        one = plan_job(model, pp, tp, ep, partition=parts, pools=opts, rank=rank)  # type: ignore[arg-type]
        assert one.plans == [job.plans[rank]] and one.summaries == [job.summaries[rank]]
        assert "balance" not in one.pipeline_pools and one.to_json()["only_rank"] == rank
        assert f"(rank {rank} only)" in one.text() and "stage bytes" not in one.text()
    assert "balance" in job.pipeline_pools and "only_rank" not in job.to_json()
    if partition == "even":  # the plan the rank makes for itself at load (plan_stage)
        from pploader import Topology, plan_stage
        for rank in range(pp * tp * ep):
            assert plan_stage(model, Topology(pp, tp, ep, rank)).plan == job.plans[rank]


def test_plan_rank_on_the_command_line(tiny_checkpoints: Callable[[str], Path]) -> None:
    model = str(tiny_checkpoints("tiny-qwen3_moe"))
    code, heavy, out = _fresh(_CLI_RUNNER, "plan", "--model", model, "--pp", "2", "--ep", "2",
                              "--rank", "3", "--json")
    assert code in (0, None) and heavy == []
    doc = json.loads(out[:out.rindex("HEAVY")])
    assert doc["only_rank"] == 3 and [r["rank"] for r in doc["ranks"]] == [3]
    proc = subprocess.run([sys.executable, "-m", "pploader", "plan", "--model", model, "--pp",
                           "2", "--rank", "2"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "pploader: error: rank 2 outside world of 2 (pp 2 x ep 1 x tp 1)"], proc.stderr
