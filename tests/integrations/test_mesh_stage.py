"""A ``DeviceMesh`` and a pipelining stage's window given to the pools and reload APIs
(planning/mesh.py ``resolve_stage`` / ``check_stage``): the same pools as from the
explicit Topology's plan, and a reload of exactly the stage's tensors in place, on 4 gloo
ranks (PP=2 x TP=2) on CPU; the rules themselves in one process."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest

from bind_models import TinyLM, checksum, param_ptrs
from helpers import make_model, run_ranks, tiny_config
from pploader import StageWindow, Topology
from pploader.errors import TopologyError
from pploader.planning.mesh import check_stage, pipeline_window, resolve_stage

CFG = tiny_config()  # tiny-llama: 8 layers


def _mesh(names: tuple, sizes: tuple, coord: tuple) -> SimpleNamespace:
    return SimpleNamespace(mesh_dim_names=names, get_coordinate=lambda: list(coord),
                           size=lambda d: sizes[d])


def test_resolve_and_check_stage() -> None:
    mesh = _mesh(("pp", "tp"), (2, 2), (1, 0))
    topo, window = resolve_stage(8, mesh=mesh)
    assert topo == Topology(2, 2, 1, 2) and window == StageWindow(1, 4, 8, False, True)
    job = pipeline_window(1, range(3, 8), num_stages=2)
    assert resolve_stage(8, mesh=mesh, window=job) == (topo, job)
    # a pp-only mesh (tp 1), and an ep dim found by name
    assert resolve_stage(8, mesh=_mesh(("pp",), (4,), (3,)))[0] == Topology(4, 1, 1, 3)
    assert resolve_stage(8, mesh=_mesh(("pp", "ep", "tp"), (2, 2, 2), (0, 1, 1)))[0] \
        == Topology(2, 2, 2, 3)
    # looped virtual stages: stage 3 of 4 lives on pp rank 1 of 2
    assert resolve_stage(8, mesh=mesh, window=pipeline_window(3, [6, 7], num_stages=4))[1] \
        .start_layer == 6
    with pytest.raises(TopologyError, match="stage 0 .* does not live on pipeline rank 1"):
        resolve_stage(8, mesh=mesh, window=pipeline_window(0, range(4), num_stages=2))
    with pytest.raises(TopologyError, match="model has 6"):
        resolve_stage(6, mesh=mesh, window=job)
    with pytest.raises(TopologyError, match="no dim named 'pp'"):
        resolve_stage(8, mesh=_mesh(("dp",), (2,), (0,)))
    with pytest.raises(TopologyError, match="no stage given"):
        resolve_stage(8)
    with pytest.raises(TopologyError, match="not both"):
        resolve_stage(8, mesh=mesh, topology=topo)
    check_stage(topo, window, mesh=mesh, stage_window=window)
    with pytest.raises(TopologyError, match=r"the mesh is rank 2 .* the plan is for rank 3"):
        check_stage(Topology(2, 2, 1, 3), window, mesh=mesh)
    with pytest.raises(TopologyError, match=r"layers \[3, 8\) of stage 1, the plan has \[4, 8\)"):
        check_stage(topo, window, stage_window=job)


# ---- 4 gloo ranks: a (pp, tp) DeviceMesh ------------------------------------------------------

def _pools_rank(rank: int, world: int, model: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from pploader import plan_stage
    from pploader.cache.pools import PoolOptions, build_rank_pools
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    staged = plan_stage(model, Topology(2, 2, 1, rank))   # the explicit Topology
    n = staged.spec.num_layers
    stage = pipeline_window(rank // 2, range(rank // 2 * n // 2, (rank // 2 + 1) * n // 2),
                            num_stages=2)
    out: dict = {"window": staged.plan.window, "stage": stage, "same": {}}
    weight = staged.plan.ideal_bytes
    for label, opts in (("budget", PoolOptions(budget_bytes=300_000, mamba_ratio=0.5)),
                        ("device", PoolOptions(device_bytes=8_000_000, memory_fraction=0.5))):
        kw = {"weight_bytes": weight} if label == "device" else {}
        pools = [build_rank_pools(staged.spec, staged.plan, opts),
                 build_rank_pools(staged.spec, opts=opts, mesh=mesh, **kw),
                 build_rank_pools(staged.spec, opts=opts, mesh=mesh, window=stage, **kw),
                 build_rank_pools(staged.spec, staged.plan, opts, mesh=mesh, window=stage)]
        reports = [p.report() for p in pools]
        shapes = [{layer: [tuple(t.shape) for t in ts] for layer, ts in p.kv.items()} |
                  {-1 - layer: [tuple(t.shape) for t in ts.values()]
                   for layer, ts in p.states.items()} for p in pools]
        out["same"][label] = all(r == reports[0] for r in reports) and \
            all(s == shapes[0] for s in shapes)
        out[label] = reports[0]
    errors = {}
    try:  # device_bytes without a plan: the weight bytes are needed
        build_rank_pools(staged.spec, opts=PoolOptions(device_bytes=1 << 30), mesh=mesh)
    except Exception as exc:  # noqa: BLE001 - reported back
        errors["weights"] = str(exc)
    uneven = pipeline_window(rank // 2, range(0, 3) if rank < 2 else range(3, n),
                             num_stages=2)
    try:  # the job's split is not pploader's: a plan with another window is refused
        build_rank_pools(staged.spec, staged.plan, PoolOptions(), window=uneven)
    except TopologyError as exc:
        errors["window"] = str(exc)
    own = build_rank_pools(staged.spec, opts=PoolOptions(), mesh=mesh, window=uneven)
    out["uneven"] = (own.start_layer, own.end_layer)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def hybrid(tiny_checkpoints: Callable[[str], Path]) -> Path:
    """tiny-qwen3_5_moe: [gdn, gdn, gdn, full_attention] x 2: KV and state pools."""
    return tiny_checkpoints("tiny-qwen3_5_moe")


@pytest.mark.slow
def test_pools_from_mesh_equal_pools_from_topology(hybrid: Path) -> None:
    results = run_ranks(_pools_rank, 4, str(hybrid), timeout_s=120)
    for rank, res in enumerate(results):
        assert res["same"] == {"budget": True, "device": True}, rank
        assert res["window"] == res["stage"]
        assert res["budget"]["kv_allocated_bytes"] > 0
        assert res["budget"]["state_allocated_bytes"] > 0
        assert "weight_bytes=" in res["errors"]["weights"]
        assert "pploader's split is not the job's" in res["errors"]["window"]
        assert res["uneven"] == ((0, 3) if rank < 2 else (3, 8))


def _reload_rank(rank: int, world: int, a: str, b: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from pploader import load_stage_into, plan_stage, reload_from_disk
    from pploader.bind.write import module_tensors
    from pploader.planning.mesh import mesh_topology
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    topo = mesh_topology(mesh)
    pp = topo.pp_rank
    layers = range(0, 3) if pp == 0 else range(3, 8)   # the job's (uneven) split
    window = pipeline_window(pp, layers, num_stages=2)
    model = TinyLM(CFG, window, tp=2, device="meta", all_layers=True)
    load_stage_into(model, a, topo, partition=[3, 5])   # loaded; its record is not kept
    ptrs, before = param_ptrs(model), checksum(model)
    out: dict = {}
    try:  # the mesh alone means pploader's even split: not this module's stage
        reload_from_disk(model, b, mesh=mesh)
    except Exception as exc:  # noqa: BLE001 - reported back
        out["even_error"] = f"{type(exc).__name__}: {exc}"
    out["untouched"] = checksum(model) == before and param_ptrs(model) == ptrs
    result = reload_from_disk(model, b, mesh=mesh, window=window)
    fresh = TinyLM(CFG, window, tp=2, device="meta", all_layers=True)
    load_stage_into(fresh, b, topo, partition=[3, 5])
    stage_tensors = {n for n, t in module_tensors(model).items() if t.device.type != "meta"}
    out.update(
        ptrs_kept=param_ptrs(model) == ptrs, equal_b=checksum(model) == checksum(fresh),
        changed=checksum(model) != before, window=result.plan.window,
        written=set(result.record.binding.params), stage_tensors=stage_tensors,
        plan_layers=sorted({int(i.name.split(".")[2]) for i in result.plan.items
                            if i.name.startswith("model.layers.")}))
    # the record of that reload takes the next one; a mesh given with it must agree
    again = reload_from_disk(model, a, record=result.record, mesh=mesh, window=window)
    out["again_ptrs"] = param_ptrs(model) == ptrs
    out["again_stats"] = again.stats.read_bytes
    other = pipeline_window(1 - pp, range(3, 8) if pp == 0 else range(0, 3), num_stages=2)
    try:
        reload_from_disk(model, a, record=again.record, window=other)
    except TopologyError as exc:
        out["record_error"] = str(exc)
    out["plan_bytes"] = plan_stage(a, topo, partition=[3, 5]).plan.read_bytes
    return out


@pytest.mark.slow
def test_reload_from_mesh_and_window_in_place(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a", seed=1)
    b = make_model(tmp_path / "b", seed=2)
    results = run_ranks(_reload_rank, 4, str(a), str(b), timeout_s=180)
    for rank, res in enumerate(results):
        pp = rank // 2
        assert res["even_error"].startswith("PlanError"), res
        assert ("on the meta device" if pp == 0 else "outside stage 1's layers [4, 8)") \
            in res["even_error"], res
        assert res["untouched"], rank
        assert res["ptrs_kept"] and res["equal_b"] and res["changed"], rank
        assert res["window"] == StageWindow(pp, 0 if pp == 0 else 3, 3 if pp == 0 else 8,
                                            pp == 0, pp == 1)
        assert res["plan_layers"] == ([0, 1, 2] if pp == 0 else [3, 4, 5, 6, 7])
        assert res["written"] == res["stage_tensors"], rank   # exactly the stage's tensors
        assert res["again_ptrs"] and res["again_stats"] == res["plan_bytes"]
        assert "the load record has" in res["record_error"]
