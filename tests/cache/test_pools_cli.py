"""Cache pools through the CLI and a real load: `pploader plan --json` pools cover every layer
once, a balanced plan with a cache target equals make_windows, and `pploader load` builds each
stage's pools and gathers the pipeline-wide limits (the pool arithmetic: test_pools.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest

from helpers import run, run_ranks, tiny_config, torchrun_cmd
from pploader.cache.geometry import model_cache
from pploader.cache.pools import layer_cache_bytes
from pploader.planning.spec import spec_from_config


# ---- pploader plan --json / pploader load ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_hybrid(tiny_checkpoints: Callable[[str], Path]) -> Path:
    """tiny-qwen3_5_moe: [gdn, gdn, gdn, full_attention] x 2, routed + shared experts."""
    return tiny_checkpoints("tiny-qwen3_5_moe")


def _plan_json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    from pploader.cli import main
    assert main(["plan", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_pools_cover_every_layer_once(tiny_hybrid: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    spec = spec_from_config(tiny_config("tiny-qwen3_5_moe"))
    for pp in range(1, 5):
        for tp in (1, 2):
            out = _plan_json(capsys, "--model", str(tiny_hybrid), "--pp", str(pp), "--tp",
                             str(tp), "--cache-budget", "256K")
            stages = [r for r in out["ranks"] if r["tp_rank"] == 0]
            attn = [x for r in stages for x in r["pools"]["attention_layers"]]
            state = [x for r in stages for x in r["pools"]["state_layers"]]
            assert attn == [3, 7] and state == [0, 1, 2, 4, 5, 6]
            for r in out["ranks"]:
                p = r["pools"]
                own = model_cache(spec, tp)[r["start_layer"]:r["end_layer"]]
                assert p["kv_bytes_per_token"] == sum(c.kv_bytes_per_token for c in own)
                assert p["state_bytes_per_request"] == sum(c.state_bytes_per_request
                                                           for c in own)
                assert {x["layer"] for x in p["layers"]} == set(p["attention_layers"]) | \
                    set(p["state_layers"])
                assert p["capacity"]["pool_bytes"] <= 256 * 1024
            reqs = [r["pools"]["capacity"]["max_requests"] for r in out["ranks"]]
            assert out["pipeline_pools"]["max_requests"] == min(x for x in reqs if x is not None)


def test_plan_balanced_with_cache_target_matches_make_windows(
        tiny_hybrid: Path, capsys: pytest.CaptureFixture) -> None:
    from pploader.planning.checkpoint import open_checkpoint
    from pploader.planning.spec import load_spec
    from pploader.planning.plan import make_windows
    spec, index = load_spec(tiny_hybrid), open_checkpoint(tiny_hybrid)
    out = _plan_json(capsys, "--model", str(tiny_hybrid), "--pp", "3", "--partition",
                     "balanced", "--tokens", "100000", "--requests", "4")
    cache = layer_cache_bytes(spec, 100000, 4)
    assert cache[3] == 100000 * 128 + 0 and cache[0] == 4 * (768 + 4096)
    want = make_windows(spec, index, 3, "balanced", cache_bytes=cache)
    assert [(r["start_layer"], r["end_layer"]) for r in out["ranks"]] == \
        [(w.start_layer, w.end_layer) for w in want]
    bal = out["pipeline_pools"]["balance"]
    assert bal["chosen"]["max_over_mean"] <= bal["even"]["max_over_mean"]
    assert [r["pools"]["capacity"]["max_tokens"] for r in out["ranks"]] == [
        None if not r["pools"]["attention_layers"] else 100000 for r in out["ranks"]]


def _load_pools_rank(rank: int, world: int, model: str, pp: int, tp: int) -> dict:
    """One rank: load its stage, then build its pools and gather the pipeline-wide limits."""
    from pploader import Topology, load_stage, plan_stage
    from pploader.distributed.comm import Comm
    from pploader.cache.pools import PoolOptions, build_rank_pools, pipeline_capacity
    topo = Topology.for_world(world, rank, pp=pp, tp=tp)
    comm = Comm(topo, timeout_s=30)
    staged = plan_stage(model, topo)
    load_stage(staged)
    pools = build_rank_pools(staged.spec, staged.plan, PoolOptions(budget_bytes=200_000),
                             device="cpu")
    limits = pipeline_capacity(comm.agree(None, pools.capacity.to_json()))  # every rank's
    comm.close()
    return {"report": pools.report(), "limits": limits}


@pytest.mark.slow
def test_load_builds_each_stages_pools_and_gathers_limits(tiny_hybrid: Path) -> None:
    res = run_ranks(_load_pools_rank, 4, str(tiny_hybrid), 2, 2)
    reports = [r["report"] for r in res]
    assert [r["state_layers"] for r in reports] == [[0, 1, 2]] * 2 + [[4, 5, 6]] * 2
    assert [r["attention_layers"] for r in reports] == [[3]] * 2 + [[7]] * 2
    for r in reports:
        cap = r["capacity"]
        assert r["kv_allocated_bytes"] == cap["kv_pool_bytes"]
        assert r["state_allocated_bytes"] == cap["state_pool_bytes"]
        # tp2: 1 kv head x 16 x 2 x bf16 = 64 B/token; 3 gdn layers x (64x3x2 + 2x16x16x4) B
        assert r["kv_bytes_per_token"] == 64 and r["state_bytes_per_request"] == 3 * 2432
        assert cap["max_requests"] == 100_000 // (3 * 2432) == 13
    assert all(r["limits"] == res[0]["limits"] for r in res)
    assert res[0]["limits"]["max_requests"] == 13


@pytest.mark.slow
def test_cli_load_reports_pools_balanced_like_plan(tiny_hybrid: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    """`pploader load --partition balanced --tokens ...` places the windows `plan` printed and
    reports each rank's pools (allocated bytes = capacity) plus the pipeline-wide limits."""
    args = ["--model", str(tiny_hybrid), "--pp", "2", "--partition", "balanced", "--tokens",
            "50000", "--requests", "3"]
    planned = _plan_json(capsys, *args)
    out = run(torchrun_cmd(2, "load", *args, "--json", "--no-progress"), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    for got, want in zip(doc["ranks"], planned["ranks"]):
        assert (got["start_layer"], got["end_layer"]) == (want["start_layer"], want["end_layer"])
        p = got["pools"]
        assert p["attention_layers"] == want["pools"]["attention_layers"]
        assert p["state_layers"] == want["pools"]["state_layers"]
        assert p["kv_allocated_bytes"] + p["state_allocated_bytes"] == \
            p["capacity"]["pool_bytes"] == want["pools"]["capacity"]["pool_bytes"]
        assert p["device"] == "cpu"
    assert doc["pipeline_pools"]["max_tokens"] == 50000
    assert doc["pipeline_pools"]["max_requests"] == 3
