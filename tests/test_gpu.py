"""GPU path (``pytest -m gpu`` on a CUDA machine; skipped cleanly without CUDA)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import run_ranks
from pploader import RankFailure, Reader, Topology, load_stage, plan_stage
from pploader.comm import Comm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _cpu(plan) -> dict[str, torch.Tensor]:
    return dict(Reader(plan))


@pytest.mark.parametrize("pp,tp,rank", [(2, 1, 0), (2, 1, 1), (1, 2, 1), (2, 2, 2)])
def test_device_loader_equals_cpu_reader(tiny_llama: Path, pp: int, tp: int, rank: int) -> None:
    from pploader.device import DeviceLoader, PinnedRing
    plan = plan_stage(tiny_llama, Topology(pp, tp, rank=rank)).plan
    ring = PinnedRing(threads=4, slot_bytes=1 << 16)  # small slots: many chunks per tensor
    out = DeviceLoader(plan, "cuda:0", ring=ring).load()
    ref = _cpu(plan)
    assert set(out) == set(ref)
    for k, v in out.items():
        assert v.device.type == "cuda"
        assert torch.equal(v.cpu().view(torch.uint8), ref[k].view(torch.uint8)), k


def test_device_loader_into_given_destinations_keeps_pointers(tiny_llama: Path) -> None:
    from pploader.device import DeviceLoader
    plan = plan_stage(tiny_llama, Topology(1)).plan
    ref = _cpu(plan)
    dest = {k: torch.zeros_like(v, device="cuda:0") for k, v in ref.items()}
    ptrs = {k: v.data_ptr() for k, v in dest.items()}
    DeviceLoader(plan, "cuda:0").load(dest)
    for k, v in dest.items():
        assert v.data_ptr() == ptrs[k] and torch.equal(v.cpu(), ref[k])


def _nccl_load(rank: int, world: int, model: str) -> dict:
    topo = Topology.for_world(world, rank, pp=world)
    comm = Comm(topo, timeout_s=60)
    staged = plan_stage(model, topo)
    comm.agree(None)
    res = load_stage(staged, device=f"cuda:{rank}", cancel=comm.watch_failures())
    comm.agree(None)
    cpu = dict(Reader(staged.plan))
    same = all(torch.equal(v.cpu(), cpu[k]) for k, v in res.state_dict.items())
    devices = {str(v.device) for v in res.state_dict.values()}
    comm.close()
    return {"same": same, "n": len(res.state_dict), "devices": sorted(devices)}


@two_gpus
def test_nccl_pp2_load_bitwise_equal_to_cpu(tiny_llama: Path) -> None:
    res = run_ranks(_nccl_load, 2, str(tiny_llama), backend="nccl")
    assert all(r["same"] for r in res)
    assert res[0]["devices"] == ["cuda:0"] and res[1]["devices"] == ["cuda:1"]


def _nccl_fail(rank: int, world: int, model: str) -> str:
    topo = Topology.for_world(world, rank, pp=world)
    comm = Comm(topo, timeout_s=30)
    error = RuntimeError("injected failure on rank 1") if rank == 1 else None
    try:
        comm.agree(error)
    except RankFailure as exc:
        return str(exc)
    return "no error"


@two_gpus
def test_nccl_rank_failure_reaches_both_ranks(tiny_llama: Path) -> None:
    res = run_ranks(_nccl_fail, 2, str(tiny_llama), backend="nccl")
    assert all("rank 1" in r and "injected failure" in r for r in res), res
