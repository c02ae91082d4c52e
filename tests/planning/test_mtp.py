"""Multi-token-prediction (MTP) layers of DeepSeek-V3 checkpoints.

A draft loader selects MTP layer k (global layer ``num_hidden_layers + k``), renames it to
layer 0 and streams it; the main model's stages never read a byte of an MTP layer.
"""
from __future__ import annotations

import inspect
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from helpers import CONFIGS, make_model, reference_tensors, run
from pploader import PlanError, Topology, iter_mtp_weights
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all, plan_mtp
from pploader.planning.spec import load_spec
from pploader.tiny import write_checkpoint

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def _config(**overrides: object) -> dict:
    raw = json.loads((CONFIGS / "tiny-deepseek_v3.json").read_text())
    raw.pop("pploader_tiny")
    raw.update(overrides)
    return raw


def _layer(name: str) -> int:
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-deepseek_v3: 4 decoder layers + 2 MTP layers (model.layers.4/5), several shards."""
    return make_model(tmp_path_factory.mktemp("deepseek-mtp"), _config(), shard_bytes=150_000)


def test_select_mtp_layer_k_renamed_to_layer0(deepseek: Path) -> None:
    spec, index = load_spec(deepseek), open_checkpoint(deepseek)
    n = spec.num_layers
    assert spec.num_mtp_layers == 2
    ref = reference_tensors(deepseek)
    picked = []
    for k in range(2):
        plan = plan_mtp(spec, index, k)
        want = {name for name in index.weight_map if _layer(name) == n + k}
        assert set(plan.tensors) == want and len(plan.items) == len(want)
        for item in plan.items:
            assert item.target == item.name.replace(f"model.layers.{n + k}.", "model.layers.0.")
        assert {"model.layers.0.eh_proj.weight", "model.layers.0.enorm.weight",
                "model.layers.0.shared_head.head.weight",
                "model.layers.0.mlp.experts.7.down_proj.weight"} <= {i.target for i in plan.items}
        stream = iter_mtp_weights(deepseek, k)
        assert inspect.isgenerator(stream)
        got = dict(stream)
        assert set(got) == {i.target for i in plan.items}
        for item in plan.items:
            assert torch.equal(got[item.target], ref[item.name]), item.name
        picked.append(set(plan.tensors))
    assert not picked[0] & picked[1]


def test_main_stages_never_read_mtp(deepseek: Path) -> None:
    spec, index = load_spec(deepseek), open_checkpoint(deepseek)
    mtp = [index.entry(n) for n in index.weight_map if _layer(n) >= spec.num_layers]
    assert mtp
    for pp in (1, 2, 3, 4):
        for ep in (1, 2):
            for plan in plan_all(spec, index, pp, 1, ep):
                assert all(_layer(n) < spec.num_layers for n in plan.tensors)
                for item in plan.items:
                    for off, length in item.ranges:
                        assert not any(e.file == item.file and off < e.end
                                       and e.start < off + length for e in mtp), (pp, ep, item.name)


def test_mtp_with_expert_parallelism(deepseek: Path) -> None:
    """With EP the draft's MTP layer holds only the rank's expert block, like the stages."""
    spec, index = load_spec(deepseek), open_checkpoint(deepseek)
    full = set(plan_mtp(spec, index, 1).tensors)
    seen: set[str] = set()
    for rank in range(2):
        plan = plan_mtp(spec, index, 1, Topology(1, 1, 2, rank))
        experts = {int(m.group(1)) for n in plan.tensors if (m := _EXPERT.search(n))}
        assert experts == set(range(rank * 4, rank * 4 + 4))
        assert {n for n in full if not _EXPERT.search(n)} <= set(plan.tensors)
        seen |= set(plan.tensors)
    assert seen == full


def test_mtp_errors(deepseek: Path, tmp_path: Path) -> None:
    spec, index = load_spec(deepseek), open_checkpoint(deepseek)
    for k in (-1, 2):
        with pytest.raises(PlanError, match="MTP layer"):
            plan_mtp(spec, index, k)
    # an MTP layer missing one tensor fails strictly, naming it
    ref = reference_tensors(deepseek)
    dropped = f"model.layers.{spec.num_layers + 1}.eh_proj.weight"
    write_checkpoint(tmp_path / "partial", {n: t for n, t in ref.items() if n != dropped},
                     _config(), shard_bytes=150_000)
    partial = open_checkpoint(tmp_path / "partial")
    plan_mtp(spec, partial, 0)
    with pytest.raises(PlanError, match="eh_proj"):
        plan_mtp(spec, partial, 1)
    # a checkpoint saved without MTP layers (as transformers does): main model fine, draft not
    write_checkpoint(tmp_path / "none", {n: t for n, t in ref.items()
                                         if _layer(n) < spec.num_layers}, _config())
    bare = open_checkpoint(tmp_path / "none")
    assert plan_all(spec, bare, 2)
    with pytest.raises(PlanError, match="no tensors for MTP layer 0"):
        plan_mtp(spec, bare, 0)


_RSS_SCRIPT = """
import gc, json, sys
from pploader import iter_mtp_weights
from pploader.report import current_rss_bytes, peak_rss_bytes, reset_peak_rss
path, window, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
gc.collect()
assert reset_peak_rss(), "needs /proc/self/clear_refs (Linux)"
before = current_rss_bytes()
stream = iter_mtp_weights(path, 0, window_bytes=window)
total = count = 0
if mode == "stream":
    for target, tensor in stream:
        assert target.startswith("model.layers.0.")
        total, count = total + tensor.numel() * tensor.element_size(), count + 1
        del tensor
else:  # the anti-pattern (an eager tuple over the filter): the control of the measure
    held = tuple(stream)
print(json.dumps({"growth": peak_rss_bytes() - before, "bytes": total, "count": count}))
"""


def _rss_run(path: Path, window: int, mode: str) -> dict:
    proc = run([sys.executable, "-c", _RSS_SCRIPT, str(path), str(window), mode], timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_mtp_stream_peak_rss_within_window(tmp_path: Path) -> None:
    """Streaming an MTP layer of ~50 MB through a 4 MiB window grows the peak RSS by about the
    window (plus allocator slack), not the layer; materialising the same stream (the control)
    grows it by the layer. Each measured in a fresh process so no freed heap hides a byte."""
    path = make_model(tmp_path, _config(hidden_size=512, intermediate_size=512,
                                        moe_intermediate_size=256, n_routed_experts=64,
                                        num_hidden_layers=1, first_k_dense_replace=1,
                                        q_lora_rank=64, kv_lora_rank=64,
                                        num_nextn_predict_layers=1),
                      shard_bytes=16 << 20)
    plan = plan_mtp(load_spec(path), open_checkpoint(path), 0)
    assert plan.read_bytes > 40 << 20
    window = 4 << 20
    stream, control = _rss_run(path, window, "stream"), _rss_run(path, window, "materialise")
    print("MTP layer bytes", plan.read_bytes, "window", window, "stream", stream,
          "materialised", control)
    assert stream["bytes"] == plan.read_bytes and stream["count"] == len(plan.items)
    assert stream["growth"] <= window + (16 << 20), stream
    assert control["growth"] >= plan.read_bytes * 0.9, control


def test_qwen_mtp_module_is_known_and_never_read(tmp_path: Path) -> None:
    """Official Qwen3-Next / Qwen3.5 checkpoints add an ``mtp.*`` module transformers does not
    write: strict planning accepts it and no stage reads a byte of it; other names still fail."""
    raw = json.loads((CONFIGS / "tiny-qwen3_next.json").read_text())
    raw.pop("pploader_tiny")
    path = make_model(tmp_path / "qnext", raw, shard_bytes=200_000)
    ref = reference_tensors(path)
    h = raw["hidden_size"]
    extra = {"mtp.fc.weight": torch.ones(h, 2 * h), "mtp.norm.weight": torch.ones(h),
             "mtp.pre_fc_norm_embedding.weight": torch.ones(h),
             "mtp.pre_fc_norm_hidden.weight": torch.ones(h),
             "mtp.layers.0.input_layernorm.weight": torch.ones(h),
             "mtp.layers.0.mlp.experts.0.up_proj.weight": torch.ones(32, h)}
    write_checkpoint(tmp_path / "with_mtp", {**ref, **extra}, raw, shard_bytes=200_000)
    spec, index = load_spec(tmp_path / "with_mtp"), open_checkpoint(tmp_path / "with_mtp")
    mtp = [index.entry(n) for n in extra]
    for pp, ep in ((1, 1), (2, 2), (4, 1)):
        plans = plan_all(spec, index, pp, 1, ep)
        assert set().union(*(p.tensors for p in plans)) == set(ref)
        for plan in plans:
            for item in plan.items:
                assert not any(e.file == item.file and item.ranges[0][0] < e.end
                               and e.start < item.ranges[-1][0] + item.ranges[-1][1]
                               for e in mtp), item.name
    write_checkpoint(tmp_path / "stray", {**ref, "mtpx.fc.weight": torch.ones(2)}, raw)
    with pytest.raises(PlanError, match="mtpx.fc.weight"):
        plan_all(spec, open_checkpoint(tmp_path / "stray"), 1)
