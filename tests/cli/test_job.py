"""The agreed sequence as a library function (issue 14): ``pploader.load_pipeline_stage`` on
2 gloo ranks, called directly (no CLI): both ranks load, or both raise the same RankFailure,
whichever step failed (planning: a bad file on one rank; loading: an I/O error on one rank).
Also the pieces it stands on: ``run_agreed`` and ``Comm`` namespaces (no process-wide order)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers import make_model, reference_tensors, run_ranks


def _load_job(rank: int, world: int, good: str, bad: str, bad_rank: int, step: str) -> dict:
    """Every rank calls load_pipeline_stage; ``bad_rank`` gets the bad directory (step
    "plan") or an I/O error while reading (step "load")."""
    from pploader import (Comm, PoolOptions, RankFailure, StageLoadOptions, Topology,
                          load_pipeline_stage)
    topo = Topology.for_world(world, rank, pp=world)
    comm = Comm(topo, timeout_s=30, namespace="test-job")
    model = bad if rank == bad_rank and step == "plan" else good

    def io_error(nbytes: int) -> None:
        if rank == bad_rank and step == "load":
            raise OSError(f"injected read error on rank {rank}")

    options = StageLoadOptions(pools=PoolOptions(tokens=64, requests=2), device="cpu",
                               pool_device="cpu")
    try:
        loaded = load_pipeline_stage(model, comm, options, on_progress=io_error)
    except RankFailure as exc:
        comm.close()
        return {"ok": False, "text": str(exc), "failures": exc.failures,
                "input_only": exc.input_only, "cause": type(exc.__cause__).__name__}
    names = {i.target: i.name for i in loaded.result.plan.items}
    state = {names[k]: v for k, v in loaded.result.state_dict.items()}
    comm.close()
    return {"ok": True, "state": state, "reports": loaded.reports,
            "planned": loaded.planned_bytes, "pipeline_pools": loaded.pipeline_pools,
            "pool_layers": list(loaded.pools.attention_layers) if loaded.pools else None,
            "window": (loaded.result.plan.window.start_layer,
                       loaded.result.plan.window.end_layer)}


@pytest.fixture(scope="module")
def good_and_bad(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[str]]:
    """A tiny llama, and a copy whose first and last shards (the first stage's embedding,
    the last stage's layers) are truncated."""
    root = tmp_path_factory.mktemp("job")
    good = make_model(root / "good")
    bad = root / "bad"
    shutil.copytree(good, bad)
    shards = sorted(bad.glob("*.safetensors"))
    for shard in (shards[0], shards[-1]):
        with open(shard, "r+b") as fh:
            fh.truncate(shard.stat().st_size - 100)
    return good, bad, [shards[0].name, shards[-1].name]


@pytest.mark.slow
def test_load_pipeline_stage_two_ranks(good_and_bad: tuple[Path, Path, list[str]]) -> None:
    good, bad, _ = good_and_bad
    results = run_ranks(_load_job, 2, str(good), str(bad), -1, "none", timeout_s=90)
    ref = reference_tensors(good)
    assert all(r["ok"] for r in results), results
    assert results[0]["window"][1] == results[1]["window"][0]  # the two stages meet
    for rank, res in enumerate(results):
        assert res["state"], rank
        for name, tensor in res["state"].items():
            assert torch.equal(tensor.view(torch.uint8), ref[name].view(torch.uint8)), name
        assert [r["rank"] for r in res["reports"]] == [0, 1]  # every rank's, agreed
        assert res["reports"][rank]["pools"]["capacity"]["max_tokens"] >= 64
        assert res["planned"] == results[0]["planned"] and len(res["planned"]) == 2
        start, end = res["window"]
        assert res["pool_layers"] == list(range(start, end))  # its own layers only
        assert res["pipeline_pools"] == results[0]["pipeline_pools"]
    loaded = set(results[0]["state"]) | set(results[1]["state"])
    assert loaded == set(ref)  # the stages together hold the checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_bad_file_on_one_rank_fails_every_rank_the_same(
        good_and_bad: tuple[Path, Path, list[str]], bad_rank: int) -> None:
    """Rank ``bad_rank`` plans from a copy with a truncated shard: both ranks raise the same
    RankFailure (an input mistake, found while planning) naming that rank and the file."""
    good, bad, shards = good_and_bad
    results = run_ranks(_load_job, 2, str(good), str(bad), bad_rank, "plan", timeout_s=90)
    assert [r["ok"] for r in results] == [False, False], results
    assert results[0]["text"] == results[1]["text"]
    for res in results:
        assert list(res["failures"]) == [bad_rank], res
        assert shards[-bad_rank] in res["failures"][bad_rank]  # the shard that rank reads
        assert "CheckpointError" in res["failures"][bad_rank]
        assert res["input_only"] is True
    assert results[bad_rank]["cause"] == "CheckpointError"   # its own error, chained
    assert results[1 - bad_rank]["cause"] == "NoneType"      # the other had none


@pytest.mark.slow
def test_an_io_error_while_loading_fails_every_rank_the_same(
        good_and_bad: tuple[Path, Path, list[str]]) -> None:
    good, bad, _ = good_and_bad
    results = run_ranks(_load_job, 2, str(good), str(bad), 1, "load", timeout_s=90)
    assert [r["ok"] for r in results] == [False, False], results
    assert results[0]["text"] == results[1]["text"]
    assert "rank 1" in results[0]["text"] and "injected read error on rank 1" in results[0]["text"]
    assert all(not r["input_only"] for r in results)  # the job failed, not the input


# ---- the pieces: run_agreed, Comm namespaces ----------------------------------------------

def test_run_agreed_without_a_comm_is_the_step_alone() -> None:
    from pploader.distributed.comm import run_agreed, run_guarded
    from pploader.errors import PlanError
    assert run_agreed(None, lambda: 3, share=lambda x: x * 2) == (3, [6])

    def bad() -> None:
        raise PlanError("no such tensor")
    with pytest.raises(PlanError, match="rank 4: no such tensor"):
        run_guarded(None, bad, rank=4)


def _namespaces(rank: int, world: int) -> dict:
    """Rank 0 builds its "b" Comm before its "a" Comm, rank 1 the other way round; then a
    second "a": each meets its namespace's peer of the same generation."""
    from pploader import Comm, Topology
    topo = Topology(world, rank=rank)
    order = ["b", "a"] if rank == 0 else ["a", "b"]
    comms = {name: Comm(topo, timeout_s=30, namespace=name) for name in order}
    got = {name: comms[name].agree(None, f"{name}-{rank}") for name in ("a", "b")}
    second = Comm(topo, timeout_s=30, namespace="a")
    got["a again"] = second.agree(None, f"again-{rank}")
    names = {name: c.namespace for name, c in comms.items()} | {"a again": second.namespace}
    for c in (second, *comms.values()):
        c.close()
    return {"got": got, "names": names}


@pytest.mark.slow
def test_comm_namespaces_need_no_common_construction_order() -> None:
    results = run_ranks(_namespaces, 2, timeout_s=60)
    for res in results:
        assert res["got"] == {"a": ["a-0", "a-1"], "b": ["b-0", "b-1"],
                              "a again": ["again-0", "again-1"]}
        assert res["names"] == {"a": "a/0", "b": "b/0", "a again": "a/1"}
