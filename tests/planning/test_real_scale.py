"""Planning at real scale: real published layouts as sparse files (tests/real_layouts.py).

Exact (every index name owned by exactly one stage; experts by exactly one EP rank; MTP
layers by no stage and by the draft plan), per-rank bytes as expected (independent of the
planner: from the index names and header sizes), TP slices that add up to the tensor.
Planning time per rank is reported at the end of the session (not asserted).
"""
from __future__ import annotations

import os
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Optional

import pytest

from pploader.planning.checkpoint import CheckpointIndex, open_checkpoint
from pploader.errors import CheckpointError
from pploader.planning.files import node_files
from pploader.planning.plan import RankPlan, checkpoint_roles, make_windows, plan_mtp, plan_rank
from pploader.planning.spec import ModelSpec, load_spec
from pploader.planning.topology import Topology
from real_layouts import MODELS, build_layout

_TIMES: dict[str, float] = {}
_LAYER = re.compile(r"(?:model|backbone)\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@pytest.fixture(scope="session")
def layouts(tmp_path_factory: pytest.TempPathFactory,
            request: pytest.FixtureRequest) -> Iterator[Path]:
    """The sparse checkpoints, written once per session (a few MB of disk for ~1.3 TB)."""
    root = tmp_path_factory.mktemp("real-layouts")
    yield root
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and _TIMES:
        reporter.write_line("\nplanning time per rank (real layouts, sparse files):")
        for key, seconds in sorted(_TIMES.items()):
            reporter.write_line(f"  {key}: {seconds * 1000:.0f} ms")


def _open(layouts: Path, model: str) -> tuple[ModelSpec, CheckpointIndex]:
    path = build_layout(model, layouts)
    index = open_checkpoint(path)
    return load_spec(path).for_checkpoint(index.weight_map), index


def _plan(spec: ModelSpec, index: CheckpointIndex, pp: int, tp: int, ep: int,
          stages: Optional[list[int]] = None, label: str = "") -> list[RankPlan]:
    """Plans of every rank of ``stages`` (default all), timed per rank."""
    t0 = time.perf_counter()
    roles = checkpoint_roles(spec, index)
    windows = make_windows(spec, index, pp, roles=roles)
    topo = Topology(pp, tp, ep)
    plans = [plan_rank(spec, index, t, windows[t.pp_rank], roles=roles)
             for t in topo.all_ranks() if stages is None or t.pp_rank in stages]
    _TIMES[f"{label} PP{pp}xTP{tp}xEP{ep} ({len(plans)} ranks)"] = \
        (time.perf_counter() - t0) / len(plans)
    return plans


def _layer_of(name: str) -> Optional[int]:
    found = _LAYER.match(name)
    return int(found.group(1)) if found else None


def _stage_of(name: str, spec: ModelSpec, pp: int) -> Optional[int]:
    """The stage that must own ``name``, from the name alone (None: an MTP layer): layers
    split evenly, the remainder to the middle stages (partition.even_windows' rule is
    checked by tests/planning/test_plan.py; here the count per stage is recomputed from it)."""
    layer = _layer_of(name)
    if layer is None:  # globals: the embedding on the first stage, norm + head on the last
        return 0 if "embed" in name else pp - 1
    if layer >= spec.num_layers:
        return None
    return next(s for s, (lo, hi) in enumerate(_bounds(spec.num_layers, pp)) if lo <= layer < hi)


def _bounds(layers: int, pp: int) -> list[tuple[int, int]]:
    from pploader.planning.partition import even_windows
    return [(w.start_layer, w.end_layer) for w in even_windows(layers, pp)]


def _check_exact(spec: ModelSpec, index: CheckpointIndex, plans: list[RankPlan]) -> None:
    """Every name owned by its stage only; experts by one EP rank; no MTP name in a stage."""
    holders: dict[str, set[tuple[int, int, int]]] = defaultdict(set)
    for plan in plans:
        t = plan.topology
        for name in plan.tensors:
            holders[name].add((t.pp_rank, t.ep_rank, t.tp_rank))
    topo = plans[0].topology
    stages = {p.window.pp_rank for p in plans}
    assert all(_bounds(spec.num_layers, topo.pp_size)[p.window.pp_rank]
               == (p.window.start_layer, p.window.end_layer) for p in plans)
    for name in index.weight_map:
        stage = _stage_of(name, spec, topo.pp_size)
        got = holders.get(name, set())
        if stage is None or stage not in stages:
            assert not got, f"{name} planned by {sorted(got)} (an MTP layer or another stage)"
            continue
        assert {s for s, _, _ in got} == {stage}, f"{name}: stages {sorted(got)} != {stage}"
        expert = _EXPERT.search(name)
        if expert is None or topo.ep_size == 1:
            want = {(stage, e, r) for e in range(topo.ep_size) for r in range(topo.tp_size)}
        else:
            e = next(e for e in range(topo.ep_size)
                     if int(expert.group(1)) * topo.ep_size // spec.num_experts == e)
            want = {(stage, e, r) for r in range(topo.tp_size)}
        assert got == want, f"{name}: held by {sorted(got)}, expected {sorted(want)}"


def _check_bytes(spec: ModelSpec, index: CheckpointIndex, plans: list[RankPlan]) -> None:
    """Per (stage, EP rank, tensor): the TP ranks' ideal bytes add up to the tensor's bytes
    (split), or each holds all of it (replicated), or equal shares of whole units (kv heads
    fewer than TP). With TP 1: a rank's ideal bytes = its names' header bytes."""
    pieces: dict[tuple[int, int, str], list[int]] = defaultdict(list)
    for plan in plans:
        t = plan.topology
        for item in plan.items:
            assert item.read_bytes >= item.ideal_bytes or not item.ranges, item.name
            pieces[(t.pp_rank, t.ep_rank, item.name)].append(item.ideal_bytes)
        if t.tp_size == 1:
            assert plan.ideal_bytes == sum(index.entry(n).nbytes for n in plan.tensors)
    tp = plans[0].topology.tp_size
    for (_, _, name), got in pieces.items():
        nbytes = index.entry(name).nbytes
        assert len(got) == tp, name
        ok = (sum(got) == nbytes or all(g == nbytes for g in got)
              or (len(set(got)) == 1 and sum(got) % nbytes == 0 and sum(got) // nbytes <= tp))
        assert ok, f"{name}: {nbytes} bytes, TP pieces {got}"


LAYOUTS = [  # (model, pp, tp, ep, stages planned: None = all)
    ("deepseek-v3", 16, 1, 1, None), ("deepseek-v3", 8, 1, 8, [7]),
    ("deepseek-v3", 16, 8, 1, [15]), ("deepseek-v3", 16, 2, 4, [0]),
    ("qwen3-30b-a3b", 16, 1, 1, None), ("qwen3-30b-a3b", 4, 2, 8, [3]),
    ("qwen3-next-80b-a3b", 16, 1, 1, None), ("qwen3-next-80b-a3b", 16, 1, 8, [0, 15]),
    ("qwen3-next-80b-a3b", 16, 4, 1, [7]),
    ("mixtral-8x7b", 16, 1, 1, None), ("mixtral-8x7b", 2, 4, 8, None),
    ("mixtral-8x7b", 4, 8, 1, None),
    ("llama-3.1-70b", 16, 1, 1, None), ("llama-3.1-70b", 2, 8, 1, None),
    ("jamba-v0.1", 16, 1, 1, None), ("jamba-v0.1", 4, 1, 8, None),
    ("nemotron-h-8b", 13, 1, 1, None), ("nemotron-h-8b", 2, 4, 1, None),
]


@pytest.mark.parametrize("model,pp,tp,ep,stages", LAYOUTS,
                         ids=[f"{m}-pp{p}-tp{t}-ep{e}" for m, p, t, e, _ in LAYOUTS])
def test_real_layout_plans_exactly(layouts: Path, model: str, pp: int, tp: int, ep: int,
                                   stages: Optional[list[int]]) -> None:
    spec, index = _open(layouts, model)
    plans = _plan(spec, index, pp, tp, ep, stages, label=model)
    _check_exact(spec, index, plans)
    _check_bytes(spec, index, plans)
    if stages is None and tp == 1 and ep == 1:  # the stages tile the checkpoint, MTP apart
        mtp = [n for n in index.weight_map if (_layer_of(n) or 0) >= spec.num_layers]
        assert sum(len(p.tensors) for p in plans) + len(mtp) == len(index.weight_map)


def test_all_models_have_a_layout() -> None:
    assert sorted({m for m, *_ in LAYOUTS}) == sorted(MODELS)


def test_deepseek_v3_layout_is_the_published_one(layouts: Path) -> None:
    """91,991 tensors, FP8 block scales on quantized weights, MTP layer 61."""
    spec, index = _open(layouts, "deepseek-v3")
    assert len(index.weight_map) == 91991 and spec.num_mtp_layers == 1
    scale = index.entry("model.layers.5.mlp.experts.7.down_proj.weight_scale_inv")
    weight = index.entry("model.layers.5.mlp.experts.7.down_proj.weight")
    assert weight.dtype == "F8_E4M3" and weight.shape == (7168, 2048)
    assert scale.dtype == "F32" and scale.shape == (56, 16)
    assert index.entry("model.layers.5.mlp.gate.weight").dtype == "BF16"
    assert 680e9 < sum(p.stat().st_size for p in index.paths.values()) < 700e9
    assert all(os.stat(p).st_blocks * 512 < 1 << 20 for p in index.paths.values())  # sparse


@pytest.mark.parametrize("ep", [1, 8])
def test_deepseek_v3_mtp_draft_plan(layouts: Path, ep: int) -> None:
    spec, index = _open(layouts, "deepseek-v3")
    layer61 = {n for n in index.weight_map if _layer_of(n) == 61}
    plans = [plan_mtp(spec, index, 0, Topology(1, 1, ep, r)) for r in range(ep)]
    got = [set(p.tensors) for p in plans]
    assert set().union(*got) == layer61
    experts = {n for n in layer61 if _EXPERT.search(n)}
    assert sum(len(g & experts) for g in got) == len(experts)  # each expert on one EP rank
    assert all(i.target.startswith("model.layers.0.") for p in plans for i in p.items)


def test_stage_only_directory_plans_its_stages_and_lists_every_missing_shard(
        layouts: Path, tmp_path: Path) -> None:
    """A "node" directory holding only its ranks' shards (+ config, index): those ranks plan;
    a rank of another node gets one error listing every shard it lacks."""
    src = build_layout("llama-3.1-70b", layouts)
    found, _ = node_files(src, 4, 2, nodes=2)
    node = tmp_path / "node1"
    node.mkdir()
    for f in found[1].all_files():
        os.link(src / f, node / f)  # hard links: sparse, no copy
    assert set(found[0].shards) - set(found[1].shards)  # node 0's shards really are absent
    spec, index = load_spec(node), open_checkpoint(node)
    assert set(index.missing) == set(open_checkpoint(src).paths) - set(found[1].shards)
    windows = make_windows(spec, index, 4)
    for rank in found[1].ranks:
        plan = plan_rank(spec, index, Topology(4, 2, 1, rank), windows[rank // 2])
        assert set(plan.files) <= set(found[1].shards)
    with pytest.raises(CheckpointError) as err:
        plan_rank(spec, index, Topology(4, 2, 1, 0), windows[0])
    full = open_checkpoint(src)
    needed = plan_rank(load_spec(src), full, Topology(4, 2, 1, 0), make_windows(spec, full, 4)[0])
    lacking = sorted(set(needed.files) - set(found[1].shards))
    assert lacking
    assert f"{len(lacking)} file(s) named in" in str(err.value)
    assert all(f in str(err.value) for f in lacking)


def test_node_files_are_the_union_of_their_ranks_plans(layouts: Path) -> None:
    src = build_layout("mixtral-8x7b", layouts)
    found, layers = node_files(src, 2, 2, 2, ranks_per_node=4)
    spec, index = _open(layouts, "mixtral-8x7b")
    plans = _plan(spec, index, 2, 2, 2, label="mixtral-8x7b files")
    assert [n.ranks for n in found] == [(0, 1, 2, 3), (4, 5, 6, 7)] and sum(layers) == 32
    for node in found:
        mine = [p for p in plans if p.topology.rank in node.ranks]
        assert set(node.shards) == {f for p in mine for f in p.files}
        assert node.read_bytes == sum(p.planned_read_bytes for p in mine)
        assert {"config.json", "model.safetensors.index.json"} <= set(node.metadata)
