"""pploader bench: the synthetic checkpoint is real, cache control works, and one tiny end-to-end
run computes per-rank rows, ratios and targets (structure only: no timing assertions)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import pploader_cmd, reference_tensors, run

from pploader.bench.data import llama_shape, write_synthetic, write_wide
from pploader.bench.methods import evict, make_resident, resident_bytes
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec


@pytest.mark.parametrize("size,layers", [(20e6, 4), (4.3e9, 32), (1e9, 16)])
def test_shape_hits_the_requested_size(size: float, layers: int) -> None:
    shape = llama_shape(int(size), layers)
    assert abs(shape.total_bytes - size) / size < 0.01
    assert shape.heads % shape.kv_heads == 0 and shape.heads * shape.head_dim == shape.hidden


def test_synthetic_checkpoint_is_valid_and_layers_straddle_shards(tmp_path: Path) -> None:
    info = write_synthetic(tmp_path / "ck", 2_000_000, 4, shards=3, seed=1)
    ref = reference_tensors(tmp_path / "ck")  # safetensors itself parses every shard
    assert sum(t.numel() * t.element_size() for t in ref.values()) == info.data_bytes
    assert all(t.dtype == torch.bfloat16 for t in ref.values())
    index = open_checkpoint(tmp_path / "ck")
    index.validate_all()
    layer_files: dict[str, set] = {}
    for name, file in index.weight_map.items():
        if name.startswith("model.layers."):
            layer_files.setdefault(name.split(".")[2], set()).add(file)
    assert len(info.files) >= 3 and any(len(f) > 1 for f in layer_files.values())
    again = write_synthetic(tmp_path / "ck", 2_000_000, 4, shards=3, seed=1)  # reused
    assert again == info


def test_wide_checkpoint_plans_every_tensor(tmp_path: Path) -> None:
    count = write_wide(tmp_path / "wide", 500, shards=3)
    spec, index = load_spec(tmp_path / "wide"), open_checkpoint(tmp_path / "wide")
    plans = plan_all(spec, index, 2)
    assert count >= 500 and sum(len(p.items) for p in plans) == count == len(index.weight_map)


def test_evict_and_warm_are_verified_by_mincore(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * (4 << 20))
    paths = [str(path)]
    left = evict(paths)
    assert left <= 64 << 10, "POSIX_FADV_DONTNEED should leave (almost) nothing resident"
    assert make_resident(paths) == resident_bytes(paths) >= 4 << 20


@pytest.mark.slow
def test_bench_end_to_end_tiny(tmp_path: Path) -> None:
    md, png = tmp_path / "bench.md", tmp_path / "bench.png"
    proc = run(pploader_cmd("bench", "--size-gb", "0.01", "--layers", "4", "--shards", "3",
                            "--pp", "2", "--methods", "a_into,c_into,b_owned", "--caches",
                            "cold", "--modes", "together", "--rss-scale", "0",
                            "--plan-tensors", "300", "--dir", str(tmp_path / "ck"), "--json",
                            "--quiet", "--markdown", str(md), "--plot", str(png)), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())  # cleaned up
    summary = {s["method"]: s for s in doc["summary"]}
    assert set(summary) == {"a_into", "c_into", "b_owned"}
    for s in summary.values():
        assert [ln["rank"] for ln in s["ranks"]] == [0, 1]
        total = s["total"]
        assert total["ideal_bytes"] == sum(ln["ideal_bytes"] for ln in s["ranks"]) > 0
        assert total["seconds"] > 0 and math.isfinite(total["gbps"])
    # pploader and raw read exactly the ideal bytes (accounting and /proc rchar)
    for name in ("a_into", "c_into"):
        for ln in summary[name]["ranks"]:
            assert ln["acct"] == pytest.approx(1.0, abs=1e-9)
            assert 1.0 <= ln["rchar"] <= 1.05
    # read-all touches every tensor of every shard: per rank the whole checkpoint
    data = doc["checkpoints"]["main"]["data_bytes"]
    for ln in summary["b_owned"]["ranks"]:
        assert ln["acct"] == pytest.approx(data / ln["ideal_bytes"])
    # cold really was cold, then the run brought the files back
    row = doc["rows"][0]
    assert row["resident_before"] <= 0.01 * row["file_bytes"] < row["resident_after"]
    checks = {c["target"]: c for c in doc["targets"]}
    assert checks["same bytes from every method (crc of each tensor's ends)"]["status"] == "PASS"
    assert any(t.startswith("(a) vs (c), into, cold") for t in checks)
    assert any(t.startswith("plan --pp 2") for t in checks)
    assert "| method |" in md.read_text() and png.stat().st_size > 10_000
