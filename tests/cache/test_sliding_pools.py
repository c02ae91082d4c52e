"""Window-sized pools for sliding-window layers. The expected bytes are computed here from the
config's numbers (kv heads, head dim, window, dtype), independently of pploader/cache: a sliding
layer keeps ``min(full pages, requests x ceil(min(window, max_context) / page_size))`` pages, a
full layer the full-length pages, and a model without sliding layers pools exactly as before
(the rule of docs/pools.md, written out in ``_legacy`` below)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import pytest

from helpers import make_model, run, tiny_config, torchrun_cmd
from pploader.cache.pools import (CachePools, PoolOptions, pipeline_capacity, size_for_target,
                                  size_pools, stage_capacity, stage_geometry)
from pploader.planning.partition import StageWindow, even_windows
from pploader.planning.spec import ModelSpec, spec_from_config

PS = 16  # page size


def _gpt_oss(window: int = 40) -> dict[str, Any]:
    """gpt-oss-style: sliding and full attention alternate (transformers' default layer_types)."""
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 32,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128,
            "sliding_window": window, "dtype": "bfloat16"}


def _gemma3(window: int = 32) -> dict[str, Any]:
    """Gemma-3-style: five sliding layers, then one full (the class's default pattern)."""
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "num_hidden_layers": 6, "hidden_size": 64, "intermediate_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 128, "sliding_window": window, "dtype": "bfloat16"}


def _layer_bpt(kv_heads: int, head_dim: int, tp: int, itemsize: int = 2) -> int:
    """K + V bytes per token of one layer on one TP rank (heads replicated when < tp)."""
    return 2 * max(kv_heads // tp, 1) * head_dim * itemsize


def _sliding_pages(tokens: int, requests: int, window: int,
                   max_context: Optional[int] = None) -> int:
    full = math.ceil(tokens / PS)
    return min(full, requests * math.ceil(min(window, max_context or window) / PS))


def _stages(spec: ModelSpec, pp: int) -> list[StageWindow]:
    return even_windows(spec.num_layers, pp)


@pytest.fixture(scope="module")
def gpt_oss() -> ModelSpec:
    return spec_from_config(_gpt_oss())


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tokens,requests,max_context", [(1000, 3, None), (1000, 3, 20),
                                                         (1000, 30, None), (4096, 16, None)])
def test_gpt_oss_pp2_sliding_bytes_equal_window_formula(gpt_oss: ModelSpec, tp: int,
                                                        tokens: int, requests: int,
                                                        max_context: Optional[int]) -> None:
    assert gpt_oss.layer_kinds == ("sliding_attention", "full_attention") * 2
    bpt = _layer_bpt(2, 16, tp)
    full_pages = math.ceil(tokens / PS)
    slide_pages = _sliding_pages(tokens, requests, 40, max_context)
    opts = PoolOptions(tokens=tokens, requests=requests, page_size=PS, max_context=max_context)
    for window in _stages(gpt_oss, 2):  # [0, 2) and [2, 4): one sliding + one full each
        geom = stage_geometry(gpt_oss, window, tp)
        cap = stage_capacity(geom, opts, 0)
        kinds = dict(cap.kind_bytes)
        assert kinds["sliding_attention"] == slide_pages * PS * bpt
        assert kinds["full_attention"] == full_pages * PS * bpt  # unchanged
        assert cap.kv_pool_bytes == cap.pool_bytes == (slide_pages + full_pages) * PS * bpt
        assert cap.max_tokens == full_pages * PS and cap.max_requests == requests
        assert cap.full_length_kv_bytes == 2 * full_pages * PS * bpt  # the rule before
        pools = CachePools(geom, cap)
        sliding, full = window.start_layer, window.start_layer + 1
        assert all(t.shape == (slide_pages, PS, max(2 // tp, 1), 16)
                   for t in pools.kv_cache(sliding))
        assert all(t.shape == (full_pages, PS, max(2 // tp, 1), 16) for t in pools.kv_cache(full))
        assert pools.allocated_bytes_by_kind() == kinds
        assert pools.page_allocator(sliding).capacity == slide_pages
        assert pools.page_allocator(full) is pools.pages
        assert cap.to_json()["window_saved_bytes"] == (full_pages - slide_pages) * PS * bpt


def test_gpt_oss_budget_holds_more_tokens(gpt_oss: ModelSpec) -> None:
    """64 KiB, 2 requests, window 40 (3 pages each), 128 B/token per layer, one layer of each
    kind: N + min(N, 6) pages of 2 KiB fit 32, so N = 26 (full-length pools: 16)."""
    geom = stage_geometry(gpt_oss, _stages(gpt_oss, 2)[0])
    cap = size_pools(geom, 65536, page_size=PS, requests=2)
    assert (cap.num_pages, dict(cap.window_pages), cap.max_requests) == (26, {40: 6}, 2)
    assert cap.max_tokens == 26 * PS and cap.pool_bytes == 32 * 2048 <= 65536
    legacy = size_pools(stage_geometry(spec_from_config(tiny_config(
        "tiny-llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16)), StageWindow(0, 0, 2, True, True)), 65536, page_size=PS)
    assert legacy.num_pages == 16  # the same two layers pooled full-length


def test_gemma3_pp2_sliding_only_stage_sized_per_request() -> None:
    """Gemma-3 pattern [s, s, s, s, s, f] at PP=2: stage 0 is all sliding, so its budget goes
    per request (3 layers x 2 pages x 16 tokens x 128 B = 12 KiB each), no token limit."""
    spec = spec_from_config(_gemma3())
    assert spec.family.name == "generic:gemma3_text"
    w0, w1 = _stages(spec, 2)
    g0, g1 = stage_geometry(spec, w0), stage_geometry(spec, w1)
    assert [c.kind for c in g0.layers] == ["sliding_attention"] * 3
    c0 = size_pools(g0, 65536, page_size=PS)
    assert (c0.max_requests, c0.max_tokens, dict(c0.window_pages)) == (5, None, {32: 10})
    assert c0.kv_pool_bytes == 5 * 3 * 2 * PS * 128
    # stage 1 (s, s, f), 16 requests by default: N + 2 x min(N, 32) pages of 2 KiB fit 32
    c1 = size_pools(g1, 65536, page_size=PS)
    assert (c1.num_pages, dict(c1.window_pages), c1.max_requests) == (10, {32: 10}, 16)
    assert pipeline_capacity([c0, c1])["max_requests"] == 5
    # target sizing: 4 requests x 2 pages = 8 pages per sliding layer, full layer 32 pages
    t1 = size_for_target(g1, 512, 4, page_size=PS)
    assert dict(t1.kind_bytes) == {"sliding_attention": 2 * 8 * PS * 128,
                                   "full_attention": 32 * PS * 128}


def _legacy(geom: Any, opts: PoolOptions) -> tuple[int, Optional[int], int, int]:
    """The pools before window-sized pages (docs/pools.md at main): (pages, max requests, KV
    pool bytes, state pool bytes)."""
    kv, st = geom.kv_bytes_per_token, geom.state_bytes_per_request
    if opts.budget_bytes is None:
        pages = math.ceil((opts.tokens or 4096) / PS) if kv else 0
        reqs = opts.requests or 16
    else:
        state = opts.budget_bytes if not kv else int(opts.budget_bytes * 0.5) if st else 0
        reqs = state // st if st else 0
        pages = (opts.budget_bytes - state) // (kv * PS) if kv else 0
    return pages, reqs if st else None, pages * PS * kv, reqs * st if st else 0


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-mixtral", "tiny-jamba",
                                  "tiny-qwen3_5_moe", "tiny-deepseek_v3", "tiny-falcon_h1"])
@pytest.mark.parametrize("opts", [PoolOptions(tokens=1000, requests=3, page_size=PS),
                                  PoolOptions(budget_bytes=300_000, page_size=PS)])
def test_no_sliding_layers_pools_as_before(name: str, opts: PoolOptions) -> None:
    spec = spec_from_config(tiny_config(name))
    for pp in (1, 2, 3):
        for window in _stages(spec, pp):
            geom = stage_geometry(spec, window)
            assert geom.windows == () and "window_kv_bytes_per_token" not in geom.to_json()
            cap = stage_capacity(geom, opts, 0)
            pages, reqs, kv_bytes, st_bytes = _legacy(geom, opts)
            assert (cap.num_pages, cap.max_requests, cap.kv_pool_bytes, cap.state_pool_bytes) \
                == (pages, reqs, kv_bytes, st_bytes)
            assert cap.window_pages == () and "window_pages" not in cap.to_json()
            pools = CachePools(geom, cap)
            assert all(t.shape[0] == pages for ts in pools.kv.values() for t in ts)
            assert pools.kv_allocated_bytes == kv_bytes
            assert sum(pools.allocated_bytes_by_kind().values()) == kv_bytes + st_bytes


def test_windowed_layer_of_a_hand_written_family_is_sliding() -> None:
    """Qwen2 with use_sliding_window: layers >= max_window_layers slide (PP=2 splits them)."""
    spec = spec_from_config(tiny_config("tiny-llama", architectures=["Qwen2ForCausalLM"],
                                        model_type="qwen2", use_sliding_window=True,
                                        sliding_window=48, max_window_layers=3))
    assert spec.layer_kinds == ("full_attention",) * 8  # the layout is unchanged
    w0, w1 = _stages(spec, 2)
    bpt = _layer_bpt(2, 16, 1)
    cap0 = stage_capacity(stage_geometry(spec, w0), PoolOptions(tokens=800, requests=2), 0)
    assert dict(cap0.kind_bytes) == {"full_attention": 3 * 50 * PS * bpt,
                                     "sliding_attention": 1 * 6 * PS * bpt}
    cap1 = stage_capacity(stage_geometry(spec, w1), PoolOptions(tokens=800, requests=2), 0)
    assert dict(cap1.kind_bytes) == {"sliding_attention": 4 * 6 * PS * bpt}


# ---- pploader plan / load ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny Mistral (every layer slides over 32 tokens), 8 layers."""
    cfg = tiny_config("tiny-llama", architectures=["MistralForCausalLM"], model_type="mistral",
                      sliding_window=32)
    return make_model(tmp_path_factory.mktemp("mistral"), cfg)


def test_plan_reports_bytes_per_kind_and_saving(tiny_mistral: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    from pploader.cli import main
    args = ["plan", "--model", str(tiny_mistral), "--pp", "2", "--tokens", "1024",
            "--requests", "2"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    bpt = _layer_bpt(2, 16, 1)
    for r in doc["ranks"]:
        cap = r["pools"]["capacity"]
        assert cap["window_pages"] == {"32": 4} and cap["num_pages"] == 64
        assert cap["kind_bytes"] == {"sliding_attention": 4 * 4 * PS * bpt}
        assert cap["window_saved_bytes"] == 4 * (64 - 4) * PS * bpt
        assert r["pools"]["window_kv_bytes_per_token"] == {"32": 4 * bpt}
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "rank 0 pool by kind: sliding_attention 32.00 KiB; window 32: 4 pages" in text
    assert "window-sized pools save 480.00 KiB" in text


@pytest.mark.slow
def test_load_allocates_window_sized_pools(tiny_mistral: Path) -> None:
    out = run(torchrun_cmd(2, "load", "--model", str(tiny_mistral), "--pp", "2", "--tokens",
                           "1024", "--requests", "2", "--max-context", "10", "--json",
                           "--no-progress"), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    bpt = _layer_bpt(2, 16, 1)
    for r in doc["ranks"]:  # min(32, 10) tokens = 1 page per request, 2 requests, 4 layers
        p = r["pools"]
        assert p["allocated_bytes_by_kind"] == p["capacity"]["kind_bytes"] == {
            "sliding_attention": 4 * 2 * PS * bpt}
        assert p["kv_allocated_bytes"] == p["capacity"]["kv_pool_bytes"]


@pytest.mark.slow
def test_gemma3_27b_at_128k_saves_as_documented() -> None:
    """docs/pools.md's numbers: Gemma-3-27B's published text config (62 layers, window 1024,
    pattern 6, 16 KV heads x 128, bf16), one 131,072-token request, PP=1 and PP=2."""
    spec = spec_from_config({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
        "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
        "sliding_window": 1024, "sliding_window_pattern": 6, "vocab_size": 262208,
        "query_pre_attn_scalar": 168, "dtype": "bfloat16"})
    full_layers = [i for i in range(62) if (i + 1) % 6 == 0]
    assert len(full_layers) == 10
    per_layer = 2 * 16 * 128 * 2  # 8 KiB per token
    ctx = 131072
    opts = PoolOptions(tokens=ctx, requests=1)
    whole = stage_capacity(stage_geometry(spec, StageWindow(0, 0, 62, True, True)), opts, 0)
    assert dict(whole.kind_bytes) == {"full_attention": 10 * ctx * per_layer,  # 10 GiB
                                      "sliding_attention": 52 * 1024 * per_layer}  # 416 MiB
    assert whole.full_length_kv_bytes == 62 * ctx * per_layer == 62 << 30
    assert round(1 - whole.pool_bytes / whole.full_length_kv_bytes, 3) == 0.832
    for w in _stages(spec, 2):  # 5 full + 26 sliding layers each
        cap = stage_capacity(stage_geometry(spec, w), opts, 0)
        assert cap.pool_bytes == 5 * ctx * per_layer + 26 * 1024 * per_layer
        assert cap.full_length_kv_bytes == 31 << 30
        budget = size_pools(stage_geometry(spec, w), 40 << 30, requests=16)
        assert budget.max_tokens == ((40 << 30) - 16 * 1024 * 26 * per_layer) \
            // (PS * 5 * per_layer) * PS == 963376  # full-length pools: 169,120
        assert (40 << 30) // (PS * 31 * per_layer) * PS == 169120
