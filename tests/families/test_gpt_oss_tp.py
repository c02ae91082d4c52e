"""gpt-oss's MXFP4 experts under TP: vLLM's uneven split in whole 32-value blocks.

A tiny gpt-oss in the published MXFP4 layout with ``intermediate_size`` 96 (3 blocks: TP=2
gives 2 + 1 blocks, TP=4 gives 1 + 1 + 1 + 0). Every rank's tensors, read by the planner's
reader, equal the reference slicing of safe_open's full tensors written independently in
tests/gpt_oss_ref.py (vLLM's ``_load_weights_mxfp4`` arithmetic, attention by heads), bitwise;
each rank's item delivers exactly its elements (``check_item``); dequantized with
transformers' own MXFP4 decoder, a rank's gate/up and down pieces are the full weights'
intermediate columns ``[s, e)``. A real gloo job (PP=2 x TP=2, 4 ranks) loads the same bytes
plain, exchanged (row shares + all-to-all) and read once.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpt_oss_ref import check_item, engine_slices, mxfp4_bounds
from helpers import reference_tensors, run_ranks
from pploader.families.heads import ceil_share
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec
from test_gpt_oss import _mxfp4_checkpoint

INTERMEDIATE = 96  # 3 MXFP4 blocks: uneven over 2 and 4 ranks


@pytest.fixture(scope="module")
def oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _mxfp4_checkpoint(tmp_path_factory.mktemp("oss-tp") / "oss",
                             intermediate_size=INTERMEDIATE)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _want(full: torch.Tensor, name: str, config: dict, tp: int, rank: int) -> torch.Tensor:
    slices, pad = engine_slices(name, tuple(full.shape), config, tp, rank)
    piece = full[slices]
    if pad:
        piece = torch.cat([piece, piece.new_zeros((pad,) + tuple(piece.shape[1:]))])
    return piece


def test_ceil_share_is_vllms_split() -> None:
    """90 blocks (gpt-oss-120b's 2880 / 32) over 8 ranks: 12 x 7 + 6; 3 over 4: 1, 1, 1, 0;
    the shares tile the units in order, as vLLM's bounds do."""
    assert [ceil_share(90, 8, r) for r in range(8)] == [(12 * r, 12) for r in range(7)] + [(84, 6)]
    assert [ceil_share(3, 4, r) for r in range(4)] == [(0, 1), (1, 1), (2, 1), (3, 0)]
    for units, tp in ((90, 8), (90, 16), (90, 64), (3, 2), (7, 7), (5, 3)):
        shares = [ceil_share(units, tp, r) for r in range(tp)]
        assert [f for f, _ in shares] == [min(r * -(-units // tp), units) for r in range(tp)]
        assert sum(c for _, c in shares) == units
        for r, (first, count) in enumerate(shares):
            s, e = mxfp4_bounds(units * 32, tp, r)
            assert (first * 32, (first + count) * 32) == (s, e)


@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_equals_the_engine_slices(oss: Path, tp: int) -> None:
    spec, index = load_spec(oss), open_checkpoint(oss)
    config = json.loads((oss / "config.json").read_text())
    ref = reference_tensors(oss)
    plans = plan_all(spec, index, 2, tp, 1)
    down_blocks: dict[int, int] = {}
    for plan in plans:
        rank = plan.topology.tp_rank
        got = dict(Reader(plan))
        assert {i.target for i in plan.items} == set(got)
        for item in plan.items:
            entry = index.entry(item.name)
            slices, pad = engine_slices(item.name, entry.shape, config, tp, rank)
            problem = check_item(item, entry.start, entry.shape, slices, pad)
            assert problem is None, (plan.topology.rank, item.name, problem)
            want = _want(ref[item.name], item.name, config, tp, rank)
            assert got[item.target].dtype == want.dtype, item.name
            assert _bytes(got[item.target]) == _bytes(want), (plan.topology.rank, item.name)
            if item.name.endswith("layers.0.mlp.experts.down_proj_blocks"):
                down_blocks[rank] = item.shape[2]
    assert down_blocks == ({0: 2, 1: 1} if tp == 2 else {0: 1, 1: 1, 2: 1, 3: 0})


def test_dequantized_pieces_are_the_full_weights_columns(oss: Path) -> None:
    """transformers' MXFP4 decoder on each rank's blocks + scales gives the full weight's
    intermediate columns ``[s, e)``: gate (even columns) and up (odd) of gate_up, the rows of
    down's ``[E, I, H]`` logical weight: whole blocks, gate and up kept together."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    spec, index = load_spec(oss), open_checkpoint(oss)
    ref = reference_tensors(oss)
    layer = "model.layers.3.mlp.experts."
    full_gu = convert_moe_packed_tensors(ref[layer + "gate_up_proj_blocks"],
                                         ref[layer + "gate_up_proj_scales"])  # [E, H, 2I]
    full_down = convert_moe_packed_tensors(ref[layer + "down_proj_blocks"],
                                           ref[layer + "down_proj_scales"])  # [E, I, H]
    assert full_gu.shape[-1] == 2 * INTERMEDIATE and full_down.shape[1] == INTERMEDIATE
    cover = 0
    for plan in plan_all(spec, index, 2, 2, 1)[2:]:  # layer 3 is on the second stage
        got = dict(Reader(plan))
        s, e = mxfp4_bounds(INTERMEDIATE, 2, plan.topology.tp_rank)
        gu = convert_moe_packed_tensors(got[layer + "gate_up_proj_blocks"],
                                        got[layer + "gate_up_proj_scales"])
        down = convert_moe_packed_tensors(got[layer + "down_proj_blocks"],
                                          got[layer + "down_proj_scales"])
        assert torch.equal(gu[..., ::2], full_gu[..., ::2][..., s:e])    # gate
        assert torch.equal(gu[..., 1::2], full_gu[..., 1::2][..., s:e])  # up
        assert torch.equal(down, full_down[:, s:e, :])
        assert torch.equal(got[layer + "gate_up_proj_bias"],
                           ref[layer + "gate_up_proj_bias"][:, 2 * s:2 * e])
        cover += e - s
    assert cover == INTERMEDIATE


# ---- a real gloo job: PP=2 x TP=2 ----------------------------------------------------------
def _tp_rank(rank: int, world: int, model: str) -> dict:
    from pploader import Topology, load_stage, plan_stage
    from pploader.distributed.comm import Comm
    topo = Topology.for_world(world, rank, pp=2, tp=2)
    comm = Comm(topo, timeout_s=60)
    plain = load_stage(plan_stage(model, topo, exchange_cost=None))
    exchanged_plan = plan_stage(model, topo, exchange_cost=0.0)
    exchanged = load_stage(exchanged_plan, comm=comm)
    once = load_stage(plan_stage(model, topo, read_once=True, exchange_cost=None), comm=comm)
    comm.agree(None)
    comm.close()
    ex = exchanged_plan.plan.redistribute
    return {"tp_rank": topo.tp_rank,
            "exchanged": sorted(ex.targets) if ex is not None else [],
            **{kind: {k: _bytes(v) for k, v in load.state_dict.items()}
               for kind, load in (("plain", plain), ("exchanged", exchanged), ("once", once))}}


@pytest.mark.slow
def test_gloo_pp2_tp2_loads_the_engine_slices(oss: Path) -> None:
    config = json.loads((oss / "config.json").read_text())
    ref = reference_tensors(oss)
    results = run_ranks(_tp_rank, 4, str(oss))
    seen: set[str] = set()
    for res in results:
        assert res["plain"] == res["exchanged"] == res["once"]
        assert any("down_proj_blocks" in t for t in res["exchanged"]), res["exchanged"]
        for name, raw in res["plain"].items():
            assert raw == _bytes(_want(ref[name], name, config, 2, res["tp_rank"])), name
        seen |= set(res["plain"])
    assert seen == set(ref)
