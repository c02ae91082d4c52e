"""Read-and-redistribute on GPUs: TP=2 over NCCL (``pytest -m gpu`` on a machine with 2+ GPUs;
skipped cleanly without them). The row shares go through the DeviceLoader's pinned ring into
device memory and the pieces are swapped by an NCCL all-to-all on the device."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import make_model, run_ranks, tiny_config
from pploader import Topology, load_stage, plan_stage
from pploader.io.read import Reader
from pploader.distributed.comm import Comm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _nccl_redistribute(rank: int, world: int, model: str) -> dict:
    topo = Topology.for_world(world, rank, tp=world)
    comm = Comm(topo, timeout_s=60)
    # exchange_batch_bytes small: several all-to-alls and row-chunked tensors
    staged = plan_stage(model, topo, exchange_cost=0.0, exchange_batch_bytes=8192)
    ex = staged.plan.redistribute
    comm.agree(None)
    res = load_stage(staged, device=f"cuda:{rank}", comm=comm, cancel=comm.watch_failures())
    comm.agree(None)
    cpu = dict(Reader(staged.plan))  # direct reads, no exchange
    same = sorted(k for k, v in res.state_dict.items()
                  if torch.equal(v.cpu().view(torch.uint8), cpu[k].view(torch.uint8)))
    devices = sorted({str(v.device) for v in res.state_dict.values()})
    comm.close()
    return {"same": same, "keys": sorted(cpu), "devices": devices,
            "exchanged": len(ex.targets) if ex else 0, "batches": ex.num_batches if ex else 0,
            "read": res.stats.read_bytes, "planned": staged.plan.planned_read_bytes,
            "ideal": staged.plan.ideal_bytes, "extra": res.report.extra}


def test_nccl_tp2_redistribute_bitwise_equal_to_direct(tmp_path: Path) -> None:
    model = make_model(tmp_path / "llama", tiny_config(vocab_size=250), shard_bytes=90_000)
    results = run_ranks(_nccl_redistribute, 2, str(model), backend="nccl", timeout_s=120)
    for rank, res in enumerate(results):
        assert res["exchanged"] > 0 and res["batches"] > 1, res
        assert res["same"] == res["keys"], rank
        assert res["devices"] == [f"cuda:{rank}"]
        # O_DIRECT (chosen when the files are not cached) reads whole aligned blocks
        assert res["planned"] <= 1.02 * res["ideal"] and res["read"] >= res["planned"]
        assert res["extra"]["redistribute"]["received_bytes"] > 0


def _nccl_pipelined_groups(rank: int, world: int, model: str) -> dict:
    """The CUDA executor with small groups: several DeviceLoader runs in the background thread,
    each group swapped in one NCCL all-to-all while the next is read."""
    from pploader.io.backend import ReadOptions
    from pploader.io.transfer.exchange import ExchangeTransfer
    topo = Topology.for_world(world, rank, tp=world)
    comm = Comm(topo, timeout_s=60)
    staged = plan_stage(model, topo, exchange_cost=0.0, exchange_batch_bytes=4096)
    comm.agree(None)
    reader = ExchangeTransfer(staged, torch.device(f"cuda:{rank}"), ReadOptions(), comm,
                              group_bytes=20_000)
    out = dict(reader)
    comm.agree(None)
    cpu = dict(Reader(staged.plan))
    same = sorted(k for k, v in out.items()
                  if torch.equal(v.cpu().view(torch.uint8), cpu[k].view(torch.uint8)))
    ex = staged.plan.redistribute
    comm.close()
    return {"same": same, "keys": sorted(cpu), "all_to_alls": reader.all_to_alls,
            "groups": len(reader.groups()), "batches": ex.num_batches if ex else 0,
            "received": reader.received_bytes, "planned_received": ex.received_bytes if ex else -1}


def test_nccl_pipelined_groups_bitwise_equal(tmp_path: Path) -> None:
    model = make_model(tmp_path / "llama", tiny_config(vocab_size=250), shard_bytes=90_000)
    for tp in (2, 4) if torch.cuda.device_count() >= 4 else (2,):
        results = run_ranks(_nccl_pipelined_groups, tp, str(model), backend="nccl",
                            timeout_s=120)
        for rank, res in enumerate(results):
            assert res["same"] == res["keys"], (tp, rank)
            assert 1 < res["all_to_alls"] == res["groups"] < res["batches"], res
            assert res["received"] == res["planned_received"] > 0
