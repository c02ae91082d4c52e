"""The GPU benchmark's CPU-side parts: its checkpoint, the stage every method loads, the output
check (it must catch a wrong byte), and on the same checkpoint two harnesses of benchmarks/:
the O_DIRECT sweep and the engine-shaped rows on CPU. The GPU rows run on a GPU machine
(docs/benchmarks-gpu.md)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmarks.disk_patterns import disk_patterns
from pploader.bench.cuda import stage_ctx, write_checkpoint
from pploader.bench.gpu_methods import verify

pytestmark = pytest.mark.slow  # writes a 60 MB checkpoint (and syncs it)


@pytest.fixture(scope="module")
def tiny_ck(tmp_path_factory: pytest.TempPathFactory) -> str:
    ck = str(tmp_path_factory.mktemp("gpubench"))
    write_checkpoint(ck, "tiny")
    return ck


def _load_stage_cpu(ctx) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    out = {}
    for f in ctx.files:
        with safe_open(ctx.path(f), framework="pt", device="cpu") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys() if k in ctx.tensors})
    return out


def test_stage_is_pp2_stage0_and_verify_catches_one_wrong_byte(tiny_ck: str) -> None:
    ctx = stage_ctx(tiny_ck, "cpu")
    names = set(ctx.tensors)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert any(".layers.0." in n for n in names) and not any(".layers.31." in n for n in names)
    assert ctx.ideal_bytes == sum(e - s for _, s, e, _, _ in ctx.tensors.values())
    out = _load_stage_cpu(ctx)
    assert verify(ctx, out) == "ok"
    name = sorted(out)[len(out) // 2]
    bad = dict(out)
    flat = bad[name].clone().reshape(-1).view(torch.uint8)
    flat[-1] ^= 0xFF                   # the last byte: inside the checked tail window
    bad[name] = flat.view(out[name].dtype).reshape(out[name].shape)
    assert name in verify(ctx, bad)
    del bad[name]
    assert "missing" in verify(ctx, bad)


def test_checkpoint_is_reused_when_unchanged(tiny_ck: str) -> None:
    files = sorted(Path(tiny_ck).glob("*.safetensors"))
    stamps = [f.stat().st_mtime_ns for f in files]
    write_checkpoint(tiny_ck, "tiny")
    assert [f.stat().st_mtime_ns for f in files] == stamps


def test_disk_sweep_reads_every_configuration(tiny_ck: str) -> None:
    paths = sorted(str(p) for p in Path(tiny_ck).glob("*.safetensors"))
    try:
        os.close(os.open(paths[0], os.O_RDONLY | os.O_DIRECT))
    except (OSError, AttributeError):
        pytest.skip("no O_DIRECT on this file system")
    rows = disk_patterns(paths, per_config_bytes=4 << 20, request_mib=(1, 4), threads=(1, 4))
    assert [(r["request_mib"], r["threads"]) for r in rows] == [(1, 1), (1, 4), (4, 1), (4, 4)]
    assert all(r["bytes"] > 0 and r["gbps"] > 0 for r in rows)


@pytest.mark.parametrize("method", ["engine_pploader_sglang", "engine_sglang_default",
                                    "engine_pploader_vllm", "engine_vllm_default"])
def test_engine_rows_run_on_cpu_and_fill_the_stage(tiny_ck: str, method: str) -> None:
    """The engine-shaped rows (the SGLang pair beside the vLLM pair) on CPU parameters: every
    stage tensor copied with the checkpoint's bytes (verify), the SGLang format's row through
    the loader's own load_engine_stage (its report: only the stage's bytes read)."""
    from benchmarks.gpu_engine_methods import ENGINE_METHODS
    ctx = stage_ctx(tiny_ck, "cpu")
    fn, prep = ENGINE_METHODS[method]
    out, info = fn(ctx, prep(ctx) if prep else {})
    assert verify(ctx, out) == "ok"
    assert set(out) == set(ctx.tensors)
    if method == "engine_pploader_sglang":
        assert info["logical_bytes"] == ctx.ideal_bytes
    if method == "engine_sglang_default":   # every shard, whole
        assert info["logical_bytes"] == sum(os.path.getsize(ctx.path(f)) for f in ctx.all_files)
