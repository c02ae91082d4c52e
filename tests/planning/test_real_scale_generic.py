"""Real published layouts of models no hand-written family covers, planned through the generic
family (sparse files: tests/real_layouts.py ``build_generic_layout``).

gpt-oss-120b (MXFP4 experts, attention sinks, biases, no ``torch_dtype``; 15 shards, 128
experts, 36 layers): exact at PP=4 and PP=4 x EP=8, checked independently of the planner
(every index name owned by exactly one stage; per stage, each stacked expert tensor's bytes
add up over the EP ranks to the tensor, every other tensor read whole by every EP rank), and
at PP=2 x TP=8: every rank's every item delivers exactly the engine's slice, written
independently in tests/gpt_oss_ref.py (the MXFP4 experts by vLLM's uneven split of the 90
intermediate blocks: 12 a rank, 6 on the last; attention by heads, sinks with q). One-rank
planning times are printed (at TP=8 for each of the 16 ranks).
"""
from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import pytest

from gpt_oss_ref import check_item, engine_slices
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import make_windows, plan_all, plan_rank
from pploader.planning.spec import load_spec
from pploader.planning.topology import Topology
from real_layouts import build_generic_layout

pytestmark = pytest.mark.slow  # the 120B meta model: ~10 s to derive on the 2-core VM


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_generic_layout("gpt-oss-120b", tmp_path_factory.mktemp("generic-layouts"))


def _one_rank_seconds(path: Path, pp: int, tp: int, ep: int, rank: int = -1) -> float:
    """One rank's plan (default the last) from a fresh index, the family already derived (as
    a rank planning after the spec was read)."""
    spec = load_spec(path)
    t0 = time.perf_counter()
    index = open_checkpoint(path)
    spec = spec.for_checkpoint(index.weight_map)
    topo = Topology(pp, tp, ep, rank % (pp * tp * ep))
    plan_rank(spec, index, topo, make_windows(spec, index, pp)[topo.pp_rank])
    return time.perf_counter() - t0


@pytest.mark.parametrize("pp,ep", [(4, 1), (4, 8)])
def test_gpt_oss_120b_exact(gpt_oss: Path, pp: int, ep: int, capsys: pytest.CaptureFixture
                            ) -> None:
    spec, index = load_spec(gpt_oss), open_checkpoint(gpt_oss)
    assert spec.family.name == "generic:gpt_oss" and spec.num_experts == 128
    assert len(set(index.weight_map.values())) == 15
    plans = plan_all(spec, index, pp, 1, ep)
    owner: dict[str, set[int]] = defaultdict(set)
    read: dict[tuple[int, str], int] = defaultdict(int)
    for plan in plans:
        for item in plan.items:
            assert item.name == item.target
            owner[item.name].add(plan.topology.pp_rank)
            read[plan.topology.pp_rank, item.name] += item.nbytes
    assert set(owner) == set(index.weight_map) and all(len(s) == 1 for s in owner.values())
    for (stage, name), nbytes in read.items():
        whole = index.entry(name).nbytes
        assert nbytes == (whole if ".experts." in name else ep * whole), (stage, name)
    seconds = _one_rank_seconds(gpt_oss, pp, 1, ep)
    with capsys.disabled():
        print(f"\ngpt-oss-120b PP={pp} x EP={ep}: one rank planned in {seconds * 1000:.0f} ms")


def test_gpt_oss_120b_exact_at_pp2_tp8(gpt_oss: Path, capsys: pytest.CaptureFixture) -> None:
    """Every item of every rank delivers exactly the reference slice of its tensor (shape,
    and the file offset of every element of small items, of the corners and 512 random
    elements of large ones); every index name on exactly one stage; the experts' down_proj
    blocks 12 a rank and 6 on the last (90 = 7 x 12 + 6), gate_up rows 2 x 32 x that."""
    spec, index = load_spec(gpt_oss), open_checkpoint(gpt_oss)
    config = json.loads((gpt_oss / "config.json").read_text())
    plans = plan_all(spec, index, 2, 8, 1)
    owner: dict[str, set[int]] = defaultdict(set)
    blocks: dict[tuple[int, int], set[tuple[int, int]]] = defaultdict(set)
    ideal = read = exchanged = 0
    for plan in plans:
        topo = plan.topology
        for item in plan.items:
            assert item.name == item.target
            entry = index.entry(item.name)
            slices, pad = engine_slices(item.name, entry.shape, config, 8, topo.tp_rank)
            problem = check_item(item, entry.start, entry.shape, slices, pad, limit=512,
                                 seed=topo.rank)
            assert problem is None, (topo.rank, item.name, problem)
            owner[item.name].add(topo.pp_rank)
            if item.name.endswith("experts.down_proj_blocks"):
                blocks[topo.pp_rank, topo.tp_rank].add((item.shape[2], item.source_shape[2]))
            if item.name.endswith("experts.gate_up_proj_blocks"):
                assert item.shape[1] == 2 * 32 * (6 if topo.tp_rank == 7 else 12), item.shape
        ideal += plan.ideal_bytes
        read += plan.read_bytes
        exchanged += plan.planned_read_bytes
    assert set(owner) == set(index.weight_map) and all(len(s) == 1 for s in owner.values())
    assert {k: v for k, v in blocks.items()} == {
        (stage, r): {(6 if r == 7 else 12, 90)} for stage in range(2) for r in range(8)}
    seconds = [_one_rank_seconds(gpt_oss, 2, 8, 1, rank) for rank in range(16)]
    with capsys.disabled():
        print(f"\ngpt-oss-120b PP=2 x TP=8: one rank planned in {min(seconds) * 1000:.0f} / "
              f"{statistics.median(seconds) * 1000:.0f} / {max(seconds) * 1000:.0f} ms "
              f"(min / median / max of the 16 ranks: "
              f"{' '.join(f'{s * 1000:.0f}' for s in seconds)}); all ranks: ideal "
              f"{ideal / 1e9:.2f} GB, read direct {read / 1e9:.2f} GB, with the exchange "
              f"{exchanged / 1e9:.2f} GB")


#: (layout, routed experts, shards): GLM-4.5-Air and the 142-shard GLM-4.5 (issue 31 item 7)
GLM = [("glm-4.5-air", 128, 43), ("glm-4.5", 160, 142)]


@pytest.fixture(scope="module", params=GLM, ids=[g[0] for g in GLM])
def glm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> tuple[Path, int, int]:
    model, experts, shards = request.param
    return (build_generic_layout(model, tmp_path_factory.mktemp("generic-layouts")), experts,
            shards)


def test_glm_router_bias_exact_at_pp2_tp8(glm: tuple[Path, int, int],
                                          capsys: pytest.CaptureFixture) -> None:
    """GLM-4.5-Air / GLM-4.5 (generic family: 128 / 160 experts,
    ``mlp.gate.e_score_correction_bias``, q/k/v biases, shared expert; 43 / 142 sparse shards
    of 5 GB): PP=2 x TP=8 plans every tensor on one stage; per stage and tensor the 8 TP ranks'
    bytes add up to the tensor (split) or each rank reads it whole (replicated: routers, their
    bias, norms), independent of the rules."""
    glm_air, experts, shards = glm
    spec, index = load_spec(glm_air), open_checkpoint(glm_air)
    assert spec.family.name == "generic:glm4_moe" and spec.num_experts == experts
    assert len(set(index.weight_map.values())) == shards
    plans = plan_all(spec, index, 2, 8, 1)
    owner: dict[str, set[int]] = defaultdict(set)
    per_rank: dict[tuple[int, str], list[int]] = defaultdict(list)
    for plan in plans:
        for item in plan.items:
            owner[item.name].add(plan.topology.pp_rank)
            per_rank[plan.topology.pp_rank, item.name].append(item.nbytes)
    assert set(owner) == set(index.weight_map) and all(len(s) == 1 for s in owner.values())
    split = replicated = 0
    for (stage, name), sizes in per_rank.items():
        whole = index.entry(name).nbytes
        assert len(sizes) == 8, (stage, name)
        if all(s == whole for s in sizes):
            replicated += 1
        else:
            assert sum(sizes) >= whole and max(sizes) * 8 - sum(sizes) < max(sizes), name
            split += 1
    routers = [n for n in index.weight_map if n.endswith(("mlp.gate.weight",
                                                         "e_score_correction_bias"))]
    assert routers and all(all(s == index.entry(n).nbytes for s in per_rank[
        next(iter(owner[n])), n]) for n in routers)
    assert split > replicated > 0
    seconds = _one_rank_seconds(glm_air, 2, 8, 1)
    with capsys.disabled():
        print(f"\n{glm_air.name} PP=2 x TP=8: one rank planned in {seconds * 1000:.0f} ms")
