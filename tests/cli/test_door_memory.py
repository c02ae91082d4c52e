"""The mistakes users make, end to end in a fresh process, as a user runs them: each exits 2
(or the documented code) with one line naming the option, key or URL, no traceback, nothing
left behind, and a peak RSS less than 300 MB above a bare ``import torch`` (the reliability
promise of docs/reliability.md: refused at the door, before memory is committed).

The peak RSS of each child comes from ``os.wait4`` (the kernel's ``ru_maxrss`` of that one
process), compared with a bare ``python -c "import torch"`` child measured the same way.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from helpers import make_model, tiny_config

import pploader

#: the bound above a bare torch import (issue text: "less than 300 MB above a bare torch import")
HEADROOM_BYTES = 300 << 20
_LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
           "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "VLLM_PP_LAYER_PARTITION",
           "SGLANG_PP_LAYER_PARTITION", "PPLOADER_FAULT")


def _child(argv: list[str], cwd: Path, env: Optional[dict] = None) -> tuple[int, str, int]:
    """Exit code, stderr and peak RSS (bytes) of one fresh process."""
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCH}
    base["PYTHONPATH"] = str(Path(pploader.__file__).resolve().parents[1])
    proc = subprocess.Popen([sys.executable, *argv], cwd=cwd, env={**base, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, err, usage.ru_maxrss * 1024  # Linux: kilobytes


@pytest.fixture(scope="module")
def bare_torch_rss(tmp_path_factory: pytest.TempPathFactory) -> int:
    code, err, rss = _child(["-c", "import torch"], tmp_path_factory.mktemp("bare"))
    assert code == 0, err
    return rss


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("door")
    llama = make_model(root / "llama")
    hybrid = make_model(root / "hybrid", tiny_config("tiny-jamba"))
    nan = make_model(root / "nan")
    cfg = (nan / "config.json").read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN')
    assert "NaN" in cfg
    (nan / "config.json").write_text(cfg)
    tied = make_model(root / "tied-string")
    cfg_d = json.loads((tied / "config.json").read_text())
    cfg_d["tie_word_embeddings"] = "false"
    (tied / "config.json").write_text(json.dumps(cfg_d))
    quant = make_model(root / "quant-string")
    cfg_d = json.loads((quant / "config.json").read_text())
    cfg_d["quantization_config"] = "awq"
    (quant / "config.json").write_text(json.dumps(cfg_d))
    return {"m": llama, "hybrid": hybrid, "nan": nan, "tied": tied, "quant": quant}


P = ["-m", "pploader"]
#: (argv, needle in the one line, extra environment); {m} a llama, {o} a fresh output path
CASES: list[tuple[list[str], str, dict]] = [
    (P + ["load", "--model", "{hybrid}", "--requests", "16777216"], "--requests", {}),
    (P + ["load", "--model", "{hybrid}", "--tokens", str(2 ** 32 + 1)], "--tokens", {}),
    (P + ["load", "--model", "{m}", "--cache-budget", "1e30"], "--cache-budget", {}),
    (P + ["load", "--model", "{m}", "--device-memory", "1e30"], "--device-memory", {}),
    (P + ["load", "--model", "{m}", "--memory-budget", "0.5"], "--memory-budget", {}),
    (P + ["load", "--model", "{m}", "--timeout", "1e-9"], "--timeout", {}),
    (P + ["load", "--model", "{m}", "--timeout", "1e300"], "--timeout", {}),
    (P + ["load", "--model", "{m}", "--io-backend", "s3"], "--io-backend", {}),
    (P + ["load", "--model", "{m}", "--kv-dtype", "int3"], "--kv-dtype", {}),
    (P + ["load", "--model", "{m}", "--save-loaded", ""], "--save-loaded", {}),
    (P + ["load", "--model", "{m}", "--save-loaded", "{m}"], "--save-loaded", {}),
    (P + ["load", "--model", "{m}", "--save-loaded", "s3://bucket/out"], "--save-loaded", {}),
    (P + ["load", "--model", "{m}", "--read-once-node"], "--read-once-node", {}),
    (P + ["load", "--model", "{m}"], "WORLD_SIZE", {"RANK": "1"}),
    (P + ["plan", "--model", "{m}", "--pp", "2", "--window-bytes", "1e30"], "--window-bytes",
     {}),
    (P + ["plan", "--model", "{m}", "--pp", "2", "--allow-root", "/nonexistent/root"],
     "--allow-root", {}),
    (P + ["plan", "--model", "{nan}", "--pp", "2"], "rms_norm_eps", {}),
    (P + ["plan", "--model", "{tied}", "--pp", "2"], "tie_word_embeddings", {}),
    (P + ["plan", "--model", "{quant}", "--pp", "2"], "quantization_config", {}),
    (P + ["plan", "--model", "S3://bucket/m", "--pp", "1"], "S3://bucket/m", {}),
    (P + ["plan", "--model", "s3://", "--pp", "1"], "s3://", {}),
    (P + ["make-tiny", "llama", "", "--force"], "out", {}),
    (P + ["make-tiny", "llama", "s3://bucket/tiny"], "s3://bucket/tiny", {}),
    (P + ["make-tiny", "llama", "{o}", "--shard-bytes", "1e30"], "--shard-bytes", {}),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("argv,needle,env", CASES, ids=[" ".join(c[0][2:4] + c[0][-2:])
                                                         for c in CASES])
def test_refused_at_the_door_within_300_mb_of_bare_torch(
        argv: list[str], needle: str, env: dict, models: dict[str, Path], bare_torch_rss: int,
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    subs = {f"{{{k}}}": str(v) for k, v in models.items()} | {"{o}": str(out)}
    argv = [subs.get(a, a) for a in argv]
    before = {p: p.stat().st_mtime_ns for p in models["m"].iterdir()}
    code, err, rss = _child(argv, cwd, env)
    assert code == 2, (argv, code, err[-2000:])
    assert "Traceback" not in err, (argv, err[-3000:])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], (argv, err[-2000:])
    assert not out.exists() and not any(cwd.iterdir()), argv  # nothing written
    assert {p: p.stat().st_mtime_ns for p in models["m"].iterdir()} == before, argv
    assert rss - bare_torch_rss < HEADROOM_BYTES, (
        f"{argv}: peak RSS {rss / 2**20:.0f} MiB, bare torch {bare_torch_rss / 2**20:.0f} MiB")
