"""GPU transfers (issues 27, 28): read once per node over NCCL, and the windowed device stream
an engine consumes (``iter_stage_weights(device="cuda:N")``)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import make_model, run_ranks, tiny_config
from pploader import Topology, iter_stage_weights, plan_stage
from pploader.distributed.comm import Comm
from pploader.io.read import Reader

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama whose head is its embedding: at PP=2 both stages read the same bytes."""
    return make_model(tmp_path_factory.mktemp("tied"), tiny_config(tie_word_embeddings=True))


def _nccl_node_read_once(rank: int, world: int, model: str) -> dict:
    topo = Topology.for_world(world, rank, pp=2)
    comm = Comm(topo, timeout_s=60)
    from pploader import load_stage
    staged = plan_stage(model, topo, node_ranks=range(world))
    once = load_stage(staged, device=f"cuda:{rank}", comm=comm)
    plain = dict(Reader(staged.plan))
    same = set(once.state_dict) == set(plain) and all(
        v.device.type == "cuda" and torch.equal(v.cpu().view(torch.uint8),
                                                plain[k].view(torch.uint8))
        for k, v in once.state_dict.items())
    comm.agree(None)
    comm.close()
    return {"same": same, "kind": staged.kind, "read": once.stats.read_bytes,
            "plain": staged.plan.read_bytes, "extra": once.report.extra}


@two_gpus
def test_node_read_once_on_gpus_equals_plain_reads(tied_llama: Path) -> None:
    """Read once per node on the GPU backend: the tied head (stage 1) is the embedding
    (stage 0), read by one rank and sent over NCCL; bitwise the plain reads, fewer bytes."""
    res = run_ranks(_nccl_node_read_once, 2, str(tied_llama), backend="nccl")
    assert all(r["kind"] == "node_read_once" and r["same"] for r in res), res
    assert sum(r["read"] for r in res) < sum(r["plain"] for r in res)
    assert sum(r["extra"]["node_read_once"]["received_bytes"] for r in res) > 0


def test_device_stream_yields_device_tensors_in_plan_order_and_releases_them(
        tiny_llama: Path) -> None:
    """``iter_stage_weights(device=cuda)``: every tensor on the GPU, bitwise the CPU reads,
    in plan order, under a budget smaller than the stage; nothing of the stream stays alive,
    also when the consumer leaves half-way."""
    staged = plan_stage(tiny_llama, Topology(2, rank=1))
    budget = 64 << 10
    ref = dict(Reader(staged.plan))
    got = {}
    base = torch.cuda.memory_allocated(0)
    for name, tensor in iter_stage_weights(staged, device="cuda:0",
                                           device_window_bytes=budget):
        assert tensor.device == torch.device("cuda:0")
        got[name] = tensor.cpu()
        del tensor  # the consumer moves on: nothing of the stream should stay alive
    assert list(got) == list(ref)
    assert all(torch.equal(got[k].view(torch.uint8), ref[k].view(torch.uint8)) for k in ref)
    assert torch.cuda.memory_allocated(0) == base  # every stream tensor released
    stream = iter_stage_weights(staged, device="cuda:0", device_window_bytes=budget)
    for _ in range(3):
        next(stream)
    stream.close()  # readers stopped and joined, their tensors freed
    assert torch.cuda.memory_allocated(0) == base


def test_device_stream_report_and_consumer_on_another_stream(tiny_llama: Path) -> None:
    """The engine copies on its own stream: the stream's memory is reused only after those
    copies; the peak it held is reported, within the budget plus what the consumer's next
    tensor needed; a budget of one byte still completes."""
    from pploader.io.backend import ReadOptions
    from pploader.io.transfer import open_transfer
    staged = plan_stage(tiny_llama, Topology(1))
    ref = dict(Reader(staged.plan))
    largest = max(i.nbytes for i in staged.plan.items)
    for budget in (128 << 10, 1):
        params = {k: torch.zeros_like(v, device="cuda:0") for k, v in ref.items()}
        side = torch.cuda.Stream(device=0)
        reader = open_transfer(staged, "cuda:0", ReadOptions(device_window_bytes=budget))
        with torch.cuda.stream(side):
            for name, tensor in reader:
                params[name].copy_(tensor)
        torch.cuda.synchronize(0)
        assert all(torch.equal(params[k].cpu().view(torch.uint8), ref[k].view(torch.uint8))
                   for k in ref)
        report = reader.report()["device_stream"]
        assert report["budget_bytes"] == budget and "windows" not in report
        assert 0 < report["peak_device_bytes"] <= max(budget, 2 * largest) + largest
        assert reader.stats.read_bytes == staged.plan.read_bytes


def _placed(tensors) -> dict:
    """name -> (NaN mask, the non-NaN values) on the CPU, comparable across devices."""
    out = {}
    for name, t in tensors:
        t = t.cpu()
        nan = torch.isnan(t) if t.is_floating_point() else torch.zeros_like(t, dtype=torch.bool)
        out[name] = (nan, t[~nan])
    return out


def test_vllm_placed_stream_on_the_gpu_equals_the_host_one(tiny_llama: Path) -> None:
    """The vLLM load format's stream on a GPU worker (integrations/placed.py): TP mode
    ``placed`` reads the rank's ranges onto the device and places them in NaN there; the
    same tensors, NaN where unread, as the host path."""
    from pploader.integrations.placed import stage_weights
    staged = plan_stage(tiny_llama, Topology(1, 2, rank=1))
    _, host = stage_weights(staged, "placed", "threaded")
    reader, dev = stage_weights(staged, "placed", None, None, "cuda:0")
    got, want = [], _placed(host)
    for name, t in dev:
        assert t.device.type == "cuda", name
        got.append((name, t))
    got_p = _placed(got)
    assert got_p.keys() == want.keys()
    for k in want:
        assert torch.equal(got_p[k][0], want[k][0]), k
        assert torch.equal(got_p[k][1].view(torch.uint8) if got_p[k][1].numel() else got_p[k][1],
                           want[k][1].view(torch.uint8) if want[k][1].numel() else want[k][1]), k
    assert any(m.any() for m, _ in want.values())  # placed really left unread parts NaN
    assert reader.stats.read_bytes < sum(i.nbytes for i in staged.plan.items) * 2
