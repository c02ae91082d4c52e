"""gpt-oss's MXFP4 experts under TP: vLLM's uneven split in whole 32-value blocks.

A tiny gpt-oss in the published MXFP4 layout with ``intermediate_size`` 96 (3 blocks: TP=2
gives 2 + 1 blocks, TP=4 gives 1 + 1 + 1 + 0). Every rank's tensors, read by the planner's
reader, equal the reference slicing of safe_open's full tensors written independently in
tests/gpt_oss_ref.py (vLLM's ``_load_weights_mxfp4`` arithmetic, attention by heads), bitwise;
each rank's item delivers exactly its elements (``check_item``); dequantized with
transformers' own MXFP4 decoder, a rank's gate/up and down pieces are the full weights'
intermediate columns ``[s, e)``. A real gloo job (PP=2 x TP=2, 4 ranks) loads the same bytes
plain, exchanged (row shares + all-to-all) and read once. The unquantized (bf16) layout
follows that loader's element split (``_load_weights_other``), checked the same way.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from gpt_oss_ref import check_item, engine_slices, mxfp4_bounds
from helpers import reference_tensors, run_ranks
from pploader.families.base import ShardRule
from pploader.families.heads import ceil_share
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint, parse_header
from pploader.planning.checkpoint import FileIdentity
from pploader.planning.partition import StageWindow
from pploader.planning.plan import RankPlan, plan_all, read_item
from pploader.planning.topology import Topology
from pploader.planning.shard import tp_selection
from pploader.planning.spec import load_spec
from test_gpt_oss import _mxfp4_checkpoint

INTERMEDIATE = 96  # 3 MXFP4 blocks: uneven over 2 and 4 ranks


@pytest.fixture(scope="module")
def oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _mxfp4_checkpoint(tmp_path_factory.mktemp("oss-tp") / "oss",
                             intermediate_size=INTERMEDIATE)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _one_plan(path: Path, item: object) -> RankPlan:
    """A RankPlan of one item over one file (all the Reader needs)."""
    return RankPlan(model=str(path.parent), topology=Topology(1),
                    window=StageWindow(0, 0, 1, True, True), experts=None,
                    items=(item,), paths={path.name: str(path)},  # type: ignore[arg-type]
                    identities={path.name: FileIdentity.of(os.stat(path))}, header_bytes=0)


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


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_ceil_rule_reads_the_ranks_units(data: st.DataObject) -> None:
    """Any shape, dim, unit size and TP size: the Reader's bytes of a ``ceil`` rule's piece
    equal the reference slice (``ceil(u / tp)`` units a rank, written here), the ranks' pieces
    concatenate to the tensor, with direct or covering-box reads."""
    ndim = data.draw(st.integers(1, 4))
    dim = data.draw(st.integers(0, ndim - 1))
    units, unit = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 3))
    shape = tuple(units * unit if d == dim else data.draw(st.integers(1, 4))
                  for d in range(ndim))
    tp = data.draw(st.integers(1, 10))
    dtype = data.draw(st.sampled_from([torch.uint8, torch.bfloat16]))
    cost = data.draw(st.sampled_from([0, 64, 10 ** 12]))
    full = torch.randint(0, 255, shape, generator=torch.Generator().manual_seed(units),
                         dtype=torch.uint8).to(dtype)
    rule = ShardRule("t", dim, units=lambda _s: units, ceil=True)
    per = -(-units // tp)
    pieces = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.safetensors"
        save_file({"pad": torch.zeros(5, dtype=torch.uint8), "t": full}, str(path))
        entry = parse_header(path).tensors["t"]
        for r in range(tp):
            sel = tp_selection(rule, shape, None, r, tp, "t")  # type: ignore[arg-type]
            item = read_item(entry, "t", sel, cost)
            got = dict(Reader(_one_plan(path, item)))["t"]
            lo, hi = min(r * per, units) * unit, min((r + 1) * per, units) * unit
            want = full.narrow(dim, lo, hi - lo)
            assert tuple(got.shape) == tuple(want.shape) and _bytes(got) == _bytes(want)
            pieces.append(got)
    assert _bytes(torch.cat(pieces, dim)) == _bytes(full)


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


@pytest.mark.parametrize("tp", [2, 4])
def test_unquantized_experts_split_as_the_engine(tmp_path: Path, tp: int) -> None:
    """gpt-oss saved by transformers (bf16, ``intermediate_size`` 91: 46 + 45 over 2 ranks,
    23 x 3 + 22 over 4): vLLM's ``_load_weights_other`` element split, every rank bitwise."""
    import transformers
    import generic_sweep
    transformers.logging.set_verbosity_error()
    tiny = generic_sweep.tiny_config("gpt_oss")
    tiny.intermediate_size = 91
    config = generic_sweep.model_config(tiny, transformers.GptOssForCausalLM)
    config.architectures = ["GptOssForCausalLM"]
    torch.manual_seed(0)
    transformers.GptOssForCausalLM._from_config(config, dtype=torch.bfloat16).save_pretrained(
        tmp_path, max_shard_size="40KB")
    spec, index = load_spec(tmp_path), open_checkpoint(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    ref = reference_tensors(tmp_path)
    down: dict[int, int] = {}
    for plan in plan_all(spec, index, 2, tp, 1):
        rank = plan.topology.tp_rank
        got = dict(Reader(plan))
        for item in plan.items:
            entry = index.entry(item.name)
            slices, pad = engine_slices(item.name, entry.shape, cfg, tp, rank)
            assert check_item(item, entry.start, entry.shape, slices, pad) is None, item.name
            assert _bytes(got[item.target]) == _bytes(_want(ref[item.name], item.name, cfg, tp,
                                                            rank)), (plan.topology.rank, item.name)
            if item.name.endswith("layers.0.mlp.experts.down_proj"):
                down[rank] = item.shape[1]
    assert down == ({0: 46, 1: 45} if tp == 2 else {0: 23, 1: 23, 2: 23, 3: 22})


# ---- a real gloo job: PP=2 x TP=2 and TP=4 (an empty piece) --------------------------------
def _tp_rank(rank: int, world: int, model: str, pp: int, tp: int) -> dict:
    from pploader import Topology, load_stage, plan_stage
    from pploader.distributed.comm import Comm
    topo = Topology.for_world(world, rank, pp=pp, tp=tp)
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
@pytest.mark.parametrize("pp,tp", [(2, 2), (1, 4)])
def test_gloo_loads_the_engine_slices(oss: Path, pp: int, tp: int) -> None:
    """Plain, exchanged (every strided tensor: row shares + all-to-all over the TP group) and
    read-once loads equal the reference; at TP=4 the last rank's down_proj piece is empty."""
    config = json.loads((oss / "config.json").read_text())
    ref = reference_tensors(oss)
    results = run_ranks(_tp_rank, 4, str(oss), pp, tp)
    seen: set[str] = set()
    for res in results:
        assert res["plain"] == res["exchanged"] == res["once"]
        assert any("down_proj_blocks" in t for t in res["exchanged"]), res["exchanged"]
        for name, raw in res["plain"].items():
            assert raw == _bytes(_want(ref[name], name, config, tp, res["tp_rank"])), name
        seen |= set(res["plain"])
    assert seen == set(ref)
