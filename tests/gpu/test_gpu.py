"""GPU path (``pytest -m gpu`` on a CUDA machine; skipped cleanly without CUDA)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bind_models import MOE_CONFIG, MoEStage, TinyLM, make_moe, param_ptrs, plan_moe
from helpers import make_model, run_ranks, tiny_config
from pploader import (LoadRecord, RankFailure, Topology, load_stage, load_stage_into, plan_stage,
                      reload_from_disk)
from pploader.io.read import Reader
from pploader.distributed.comm import Comm

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _cpu(plan) -> dict[str, torch.Tensor]:
    return dict(Reader(plan))


@pytest.mark.parametrize("direct_io", [False, True, None])
@pytest.mark.parametrize("pp,tp,rank", [(2, 1, 0), (2, 1, 1), (1, 2, 1), (2, 2, 2)])
def test_device_loader_equals_cpu_reader(tiny_llama: Path, pp: int, tp: int, rank: int,
                                         direct_io) -> None:
    from pploader.io.device import DeviceLoader, PinnedRing
    plan = plan_stage(tiny_llama, Topology(pp, tp, rank=rank)).plan
    ring = PinnedRing(threads=4, slot_bytes=1 << 16)  # small slots: many chunks per tensor
    out = DeviceLoader(plan, "cuda:0", ring=ring, direct_io=direct_io).load()
    ref = _cpu(plan)
    assert set(out) == set(ref)
    for k, v in out.items():
        assert v.device.type == "cuda"
        assert torch.equal(v.cpu().view(torch.uint8), ref[k].view(torch.uint8)), k


def test_device_loader_into_given_destinations_keeps_pointers(tiny_llama: Path) -> None:
    from pploader.io.device import DeviceLoader
    plan = plan_stage(tiny_llama, Topology(1)).plan
    ref = _cpu(plan)
    dest = {k: torch.zeros_like(v, device="cuda:0") for k, v in ref.items()}
    ptrs = {k: v.data_ptr() for k, v in dest.items()}
    DeviceLoader(plan, "cuda:0").load(dest)
    for k, v in dest.items():
        assert v.data_ptr() == ptrs[k] and torch.equal(v.cpu(), ref[k])


@pytest.mark.parametrize("overlap_alloc,huge_pages,lazy", [(True, False, True),
                                                        (False, True, True),
                                                        (False, False, False)])
def test_device_loader_ring_and_allocation_modes_equal_cpu(tiny_llama: Path, overlap_alloc: bool,
                                                           huge_pages: bool, lazy: bool) -> None:
    """Destinations allocated while the first reads run (or before), a THP or 4 KiB ring,
    slots used pageable (never page-locked inside the load, io/staging.py) or page-locked
    up front (``lazy=False``), or on first use (``lock_in_load``, the old policy): the same
    bytes; the ring unregisters on close()."""
    from pploader.io.device import DeviceLoader, PinnedRing
    plan = plan_stage(tiny_llama, Topology(2, 2, rank=1)).plan
    ring = PinnedRing(threads=3, slot_bytes=1 << 16, lazy=lazy, huge_pages=huge_pages)
    ring.lock_in_load = huge_pages  # one case of the old policy, kept for measurements
    loader = DeviceLoader(plan, "cuda:0", ring=ring)
    loader.overlap_alloc = overlap_alloc
    out = loader.load()
    ref = _cpu(plan)
    assert set(out) == set(ref)
    for k, v in out.items():
        assert torch.equal(v.cpu().view(torch.uint8), ref[k].view(torch.uint8)), k
    assert ring.pageable_slots == 0
    assert (ring.nbytes > 0) == (not lazy or huge_pages), ring.nbytes  # lazy: none in load
    assert set(loader.timings) >= {"residency_s", "destinations_s", "io_s"}
    again = DeviceLoader(plan, "cuda:0", ring=ring).load()  # the ring reused: same bytes
    assert all(torch.equal(again[k], v) for k, v in out.items())
    ring.close()
    assert ring.nbytes == 0


@pytest.mark.parametrize("prepare_ring,interleave,gap", [(True, False, 0), (False, True, 0),
                                                        (True, True, 1 << 20)])
def test_device_loader_prepared_ring_and_request_patterns_equal_cpu(
        tiny_llama: Path, prepare_ring: bool, interleave: bool, gap: int) -> None:
    """A ring page-locked ahead on its background thread (joined, or racing the readers), the
    readers' requests round-robin over the files and/or spanning gaps (O_DIRECT): the same
    bytes, every slot page-locked, none pageable."""
    from pploader.io.device import DeviceLoader, PinnedRing
    plan = plan_stage(tiny_llama, Topology(2, 2, rank=1)).plan  # strided TP reads: gaps
    ring = PinnedRing(threads=3, slot_bytes=1 << 16, prepare=prepare_ring)
    if prepare_ring:
        ring.prepare().join()
        assert ring.nbytes == 3 * 2 * (1 << 16) and ring.prepare_seconds > 0
    for direct in (False, True):
        loader = DeviceLoader(plan, "cuda:0", ring=ring, direct_io=direct,
                              prepare_ring=not prepare_ring)
        loader.interleave_files, loader.direct_gap_bytes = interleave, gap
        out = loader.load()
        ref = _cpu(plan)
        assert set(out) == set(ref)
        for k, v in out.items():
            assert torch.equal(v.cpu().view(torch.uint8), ref[k].view(torch.uint8)), (direct, k)
    assert ring.pageable_slots == 0
    ring.close()
    assert ring.nbytes == 0


def test_ring_populated_ahead_is_read_pageable_then_page_locked_after(tiny_llama: Path) -> None:
    """prepare(register=False) only faults the pages in; a load reads through them pageable
    (it never page-locks) and resumes the preparation afterwards, which page-locks them."""
    from pploader.io.device import DeviceLoader, PinnedRing
    plan = plan_stage(tiny_llama, Topology(1)).plan
    ring = PinnedRing(threads=2, slot_bytes=1 << 16)
    ring.prepare(register=False).join()
    assert ring.nbytes == 0 and ring.pageable_slots == 0
    out = DeviceLoader(plan, "cuda:0", ring=ring).load()
    ref = _cpu(plan)
    assert all(torch.equal(out[k].cpu().view(torch.uint8), v.view(torch.uint8))
               for k, v in ref.items())
    ring.prepare().join()  # the resumed preparation (it registers now)
    assert ring.nbytes == 4 * (1 << 16) and ring.pageable_slots == 0
    ring.close()


def test_process_staging_is_reused_lent_once_and_resumed(tiny_llama: Path) -> None:
    """io/staging.py: loads without a ring read through the process's ring for their GPU
    (the same ring each time, page-locked in the background between loads, never inside
    one); a second load while it is lent gets its own ring; the bytes are always right."""
    from pploader.io import staging
    from pploader.io.device import DeviceLoader
    from pploader.io.registry import open_backend
    staging.release_staging()
    plan = plan_stage(tiny_llama, Topology(1)).plan
    ref = _cpu(plan)
    first = open_backend(plan, "cuda:0")
    ring = first.ring
    assert ring is staging.process_staging("cuda:0")
    out = first.load()
    assert first.ready_slots == 0  # nothing was page-locked when the first load started
    assert all(torch.equal(out[k].cpu().view(torch.uint8), v.view(torch.uint8))
               for k, v in ref.items())
    assert ring._preparer is not None
    ring._preparer.join()  # resumed after the load: every slot page-locked now
    assert ring.nbytes == ring.threads * ring.per_thread * ring.slot_bytes
    held = open_backend(plan, "cuda:0")  # lent to this one ...
    other = open_backend(plan, "cuda:0")  # ... so this one reads through its own
    assert held.ring is ring and other.ring is not ring
    assert all(torch.equal(other.load()[k].cpu().view(torch.uint8), v.view(torch.uint8))
               for k, v in ref.items())
    again = held.load()
    assert held.ready_slots == ring.threads * ring.per_thread
    assert all(torch.equal(again[k], out[k]) for k in out)
    assert isinstance(held, DeviceLoader)
    staging.release_staging()
    assert ring.nbytes == 0


@pytest.mark.parametrize("overlap_alloc", [False, True])
def test_device_loader_bad_destination_names_tensor_and_stops_readers(
        tiny_llama: Path, overlap_alloc: bool) -> None:
    from pploader.io.device import DeviceLoader
    from pploader.errors import ReadError
    plan = plan_stage(tiny_llama, Topology(1)).plan
    ref = _cpu(plan)
    dest = {k: torch.zeros_like(v, device="cuda:0") for k, v in ref.items()}
    victim = plan.items[len(plan.items) // 2].target
    dest[victim] = torch.zeros(3, device="cuda:0", dtype=ref[victim].dtype)
    loader = DeviceLoader(plan, "cuda:0")
    loader.overlap_alloc = overlap_alloc
    with pytest.raises(ReadError, match=victim.replace(".", r"\.")):
        loader.load(dest)
    good = {k: v for k, v in dest.items() if k != victim}
    assert all(not v.any() for k, v in good.items()
               if plan.items[0].target != k) or overlap_alloc  # nothing copied before the check


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


@pytest.fixture(scope="module")
def tiny_hybrid_gpu(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers import make_model, tiny_config
    return make_model(tmp_path_factory.mktemp("hybrid"), tiny_config("tiny-qwen3_5_moe"))


def test_pools_allocated_on_device(tiny_hybrid_gpu: Path) -> None:
    from pploader.cache.pools import PoolOptions, build_rank_pools
    staged = plan_stage(tiny_hybrid_gpu, Topology(2, rank=1))
    pools = build_rank_pools(staged.spec, staged.plan, PoolOptions(budget_bytes=1 << 20),
                             device="cuda:0")
    rep = pools.report()
    tensors = [t for ts in pools.kv.values() for t in ts] + \
        [t for ts in pools.states.values() for t in ts.values()]
    assert tensors and all(t.device.type == "cuda" for t in tensors)
    assert rep["kv_allocated_bytes"] + rep["state_allocated_bytes"] == \
        sum(t.nbytes for t in tensors)
    assert set(rep["state_layers"]) | set(rep["attention_layers"]) <= set(range(4, 8))


def _nccl_read_once(rank: int, world: int, model: str) -> dict:
    topo = Topology.for_world(world, rank, pp=1, tp=2)
    comm = Comm(topo, timeout_s=60)
    staged = plan_stage(model, topo)
    shared = load_stage(plan_stage(model, topo, read_once=True), device=f"cuda:{rank}",
                        comm=comm)
    plain = dict(Reader(staged.plan))
    same = set(shared.state_dict) == set(plain) and all(
        torch.equal(v.cpu(), plain[k]) for k, v in shared.state_dict.items())
    comm.agree(None)  # rank 0 hosts the store: keep it until both ranks are done
    comm.close()
    return {"same": same, "read": shared.stats.read_bytes, "plain": staged.plan.read_bytes}


@two_gpus
def test_nccl_read_once_broadcast_equals_plain_reads(tiny_llama: Path) -> None:
    res = run_ranks(_nccl_read_once, 2, str(tiny_llama), backend="nccl")
    assert all(r["same"] for r in res), res
    # replicated tensors (norms) were read by one rank only: fewer bytes than plain reads
    assert sum(r["read"] for r in res) < sum(r["plain"] for r in res)


def _nccl_pipeline(rank: int, world: int, model: str) -> dict:
    from pploader.integrations.hf import build_stage, pipeline_forward
    topo = Topology.for_world(world, rank)
    comm = Comm(topo, timeout_s=60)
    stage = build_stage(model, topo)
    stage.model.to(f"cuda:{rank}")
    ids = torch.arange(10, device=f"cuda:{rank}").reshape(1, 10) % 60
    logits = pipeline_forward(stage, ids, comm)
    comm.agree(None)
    comm.close()
    return {"logits": None if logits is None else logits.cpu()}


@two_gpus
def test_nccl_pipeline_forward_matches_single_process(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float()
    model.save_pretrained(tmp_path / "m")
    res = run_ranks(_nccl_pipeline, 2, str(tmp_path / "m"), backend="nccl")
    ids = torch.arange(10).reshape(1, 10) % 60
    with torch.no_grad():
        ref = model.cuda()(ids.cuda(), use_cache=False).logits.cpu()
    assert res[0]["logits"] is None
    assert (res[1]["logits"] - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("device", ["cuda", torch.device("cuda")])
def test_unindexed_cuda_device_as_the_docs_write_it(tiny_llama: Path, device) -> None:
    """``load_stage(device="cuda")``, ``iter_stage_weights(device="cuda")`` and
    ``load_stage_into(..., device="cuda")`` as the docs write them land on the current GPU
    (the readers' ``torch.cuda.set_device`` refused an unindexed device on torch 2.11)."""
    from pploader import iter_stage_weights
    here = torch.device("cuda", torch.cuda.current_device())
    staged = plan_stage(tiny_llama, Topology(2, rank=1))
    ref = _cpu(staged.plan)
    loaded = load_stage(staged, device=device).state_dict
    streamed = {k: v.clone() for k, v in iter_stage_weights(staged, device=device)}
    for got in (loaded, streamed):
        assert set(got) == set(ref)
        for k, v in got.items():
            assert v.device == here and torch.equal(v.cpu(), ref[k]), k
    topo = Topology(1)
    module, _ = _stage_loaded(tiny_llama, topo, device, torch.bfloat16)
    _same(module, _stage(tiny_llama, topo, "cpu", torch.bfloat16))


# ---- load_stage_into / reload_from_disk onto a CUDA module ------------------------------------

@pytest.fixture
def device_loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Items written by the ``pinned`` backend (DeviceLoader: pinned ring + async H2D) into
    given destinations (bind/write.py's in-place writes), per load() call."""
    from pploader.io.device import DeviceLoader
    calls: list[int] = []
    load = DeviceLoader.load

    def spy(self, destinations=None):  # type: ignore[no-untyped-def]
        calls.append(len(destinations or {}))
        return load(self, destinations)
    monkeypatch.setattr(DeviceLoader, "load", spy)
    return calls


def _stage_loaded(model_dir: Path, topo: Topology, device: str, dtype: torch.dtype
                  ) -> tuple[TinyLM, LoadRecord]:
    staged = plan_stage(model_dir, topo)
    module = TinyLM(tiny_config(), staged.plan.window, tp=topo.tp_size, dtype=dtype,
                    device="meta")
    result = load_stage_into(module, staged, device=device, allow_cast=dtype != torch.bfloat16)
    return module, result.record


def _stage(model_dir: Path, topo: Topology, device: str, dtype: torch.dtype) -> TinyLM:
    return _stage_loaded(model_dir, topo, device, dtype)[0]


def _same(gpu: torch.nn.Module, cpu: torch.nn.Module) -> None:
    a, b = gpu.state_dict(keep_vars=True), cpu.state_dict(keep_vars=True)
    assert a.keys() == b.keys()
    for name, t in a.items():
        assert t.device.type == "cuda", name
        assert torch.equal(t.detach().cpu(), b[name].detach()), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pp,tp,rank", [(1, 1, 0), (2, 2, 3)])
def test_load_stage_into_cuda_equals_cpu_and_reload_keeps_pointers(
        tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, device_loads: list[int],
        pp: int, tp: int, rank: int, dtype: torch.dtype) -> None:
    """Fused qkv / gate_up slices on cuda:0 equal a CPU bind; bf16 destinations go through
    DeviceLoader (every item), float32 ones (a cast) through the ring + copy_ path; reloading
    twice keeps every data_ptr (derived parameters included)."""
    topo = Topology(pp, tp, rank=rank)
    n_items = len(plan_stage(tiny_llama, topo).plan.items)
    gpu, record = _stage_loaded(tiny_llama, topo, "cuda:0", dtype)
    _same(gpu, _stage(tiny_llama, topo, "cpu", dtype))
    assert sum(device_loads) == (n_items if dtype == torch.bfloat16 else 0)
    ptrs = param_ptrs(gpu)
    other = make_model(tmp_path_factory.mktemp("other"), seed=5)
    for src in (other, tiny_llama):
        record = reload_from_disk(gpu, src, record=record).record
        assert param_ptrs(gpu) == ptrs
        _same(gpu, _stage(src, topo, "cpu", dtype))


@pytest.mark.parametrize("tp,ep,rank", [(1, 1, 0), (2, 2, 5)])
def test_stacked_experts_onto_cuda_equal_cpu(tmp_path: Path, device_loads: list[int],
                                             tp: int, ep: int, rank: int) -> None:
    moe = make_moe(tmp_path)
    topo = Topology(2, tp, ep, rank=rank)
    staged = plan_moe(moe, topo)
    gpu = MoEStage(MOE_CONFIG, staged.plan.window, tp=tp, ep=ep)
    cpu = MoEStage(MOE_CONFIG, staged.plan.window, tp=tp, ep=ep)
    load_stage_into(gpu, staged, device="cuda:0")
    load_stage_into(cpu, plan_moe(moe, topo))
    _same(gpu, cpu)
    assert sum(device_loads) == len(staged.plan.items)


_GPU0_CONTEXT = r'''
def gpu0_context() -> int:
    """1 when the driver's primary context of device 0 is active in this process."""
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
    return active.value
'''

_ONLY_GPU1 = _GPU0_CONTEXT + r'''
import json, sys
import torch
from pploader import Topology, plan_stage
from pploader.io.device import DeviceLoader
from pploader.io.pinned_ring import PinnedRing
from pploader.io.read import Reader
torch.cuda.set_device(1)                    # what a rank on GPU 1 does (bootstrap.py)
plan = plan_stage(sys.argv[1], Topology(1)).plan
loaded = DeviceLoader(plan, "cuda:1").load()          # the process's staging on GPU 1
ring = PinnedRing(threads=2, slot_bytes=1 << 16, prepare=True, device="cuda:1")
ring.prepare().join()                                 # the background preparer
same = all(torch.equal(loaded[k].cpu(), v) for k, v in Reader(plan))
print(json.dumps({"same": same, "gpu0_context": gpu0_context(), "registered": ring.nbytes}))
'''

_RAW_CEILING_GPU1 = _GPU0_CONTEXT + r'''
import json, sys
import torch
from pploader.bench.cuda import stage_ctx
from pploader.bench.gpu_methods import m_raw, prep_raw, verify
torch.cuda.set_device(1)
ctx = stage_ctx(sys.argv[1], "cuda:1", pp=1, stage=0)
out, _ = m_raw(ctx, prep_raw(ctx, threads=4, chunk=1 << 16))
print(json.dumps({"verify": verify(ctx, out), "gpu0_context": gpu0_context(),
                  "devices": sorted({str(t.device) for t in out.values()})}))
'''


@two_gpus
def test_background_threads_touch_only_their_gpu(tiny_llama: Path) -> None:
    """A process on GPU 1 whose reader threads and ring preparer page-lock memory never makes
    a CUDA context on GPU 0 (a new thread's CUDA calls default to device 0: ~0.5 GB of GPU 0
    per rank otherwise). Checked with the driver's primary-context state, in a fresh process."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _ONLY_GPU1, str(tiny_llama)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["same"] and res["registered"] == 4 * (1 << 16)
    assert res["gpu0_context"] == 0, res


@two_gpus
def test_raw_ceiling_on_gpu1_stays_on_gpu1(tiny_llama: Path) -> None:
    """The benchmark's raw ceiling on GPU 1: its reader threads make GPU 1 current, so no
    context on GPU 0 is made inside its clock (that cost made GPUs 1-3 look ~40% slower)."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _RAW_CEILING_GPU1, str(tiny_llama)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res == {"verify": "ok", "gpu0_context": 0, "devices": ["cuda:1"]}, res


def _pipeline_stage_with_early_staging(rank: int, world: int, model: str) -> dict:
    import pploader.io.registry as registry
    from pploader import StageLoadOptions, load_pipeline_stage
    made: list = []
    real = registry.prepare_staging

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(real(*args, **kwargs))
        return made[-1]
    registry.prepare_staging = recording  # type: ignore[assignment]
    topo = Topology.for_world(world, rank, pp=world)
    comm = Comm(topo, timeout_s=60)
    loaded = load_pipeline_stage(model, comm, StageLoadOptions(device=f"cuda:{rank}",
                                                               local_rank=rank))
    state = loaded.result.state_dict
    cpu = dict(Reader(loaded.staged.plan))
    ring = made[0] if made else None
    comm.close()
    return {"same": state.keys() == cpu.keys() and all(
                torch.equal(v.cpu(), cpu[k]) for k, v in state.items()),
            "devices": sorted({str(v.device) for v in state.values()}),
            "ring": ring is not None, "ring_device": getattr(ring, "device_index", None),
            "preparer_alive": bool(ring is not None and ring._preparer is not None
                                   and ring._preparer.is_alive()),
            "pageable": getattr(ring, "pageable_slots", None),
            "registered": getattr(ring, "nbytes", 0)}


@two_gpus
def test_load_pipeline_stage_prepares_the_ring_while_planning(tiny_llama: Path) -> None:
    """load_pipeline_stage on GPUs starts the pinned ring's page-locking before planning (the
    registry's staging of the pinned backend, on the rank's GPU), stops it before the load, and
    loads through that ring: bitwise the CPU reads, every used slot page-locked."""
    res = run_ranks(_pipeline_stage_with_early_staging, 2, str(tiny_llama), backend="nccl")
    for rank, r in enumerate(res):
        assert r["same"] and r["devices"] == [f"cuda:{rank}"], r
        assert r["ring"] and r["ring_device"] == rank and not r["preparer_alive"], r
        assert r["pageable"] == 0 and r["registered"] > 0, r


def test_readers_wait_for_work_queued_on_a_reused_block(tmp_path: Path) -> None:
    """A destination may get a block freed while a kernel on the allocating stream still reads
    it (the caching allocator allows that on one stream); the readers' copies, on their own
    streams, must wait for it. Everything comes from the allocator's cache and a page-locked
    ring, as in the exchange's later groups (a cudaMalloc or page-locking in between would
    serialise the streams and hide the race)."""
    from pploader.io.device import DeviceLoader, PinnedRing
    model = make_model(tmp_path / "big", tiny_config(vocab_size=40_000), shard_bytes=8 << 20)
    plan = plan_stage(model, Topology(2, rank=0)).plan
    embed = max(plan.items, key=lambda i: i.read_bytes)  # 40k x 64 bf16: 5 MiB
    ring = PinnedRing(4, 4 << 20, device="cuda:0")
    ring.prepare().join()
    cpu = _cpu(plan)
    first = DeviceLoader(plan, "cuda:0", ring=ring).load()  # the allocator caches its blocks
    torch.cuda.synchronize()
    block = first[embed.target].data_ptr()
    del first
    old = torch.full((embed.read_bytes,), 7, dtype=torch.uint8, device="cuda:0")
    seen = torch.empty_like(old)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued on the current stream
    seen.copy_(old)                    # runs after the sleep: it must still read 7s
    lo, hi = old.data_ptr(), old.data_ptr() + old.numel()
    del old                            # back to the pool while the copy is queued
    out = DeviceLoader(plan, "cuda:0", ring=ring).load()
    torch.cuda.synchronize()
    reused = [n for n, t in out.items()
              if t.data_ptr() < hi and t.data_ptr() + t.numel() * t.element_size() > lo]
    assert reused, f"precondition: a destination reuses the freed block ({lo == block})"
    assert bool((seen == 7).all()), f"{reused} written before the queued copy read the block"
    assert all(torch.equal(v.cpu(), cpu[k]) for k, v in out.items())


def test_page_cache_dma_bench_methods_copy_the_right_bytes(tmp_path: Path, capsys) -> None:
    """benchmarks/page_cache_dma.py: the ring, and page-locking the mapped page cache per chunk and
    per file, each verified against the files (a method's error would be in its row)."""
    import json

    from benchmarks import page_cache_dma as pcd
    pcd._write_stages(tmp_path, stages=1, stage_mib=8)
    capsys.readouterr()
    pcd._child(tmp_path / "0", torch.cuda.current_device(),
               ["ring:2:1", "register_chunks:3:1", "register_files:2:3"], 0.0)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["method"] for r in rows] == ["ring", "register_chunks", "register_files"]
    assert all("error" not in r and r["GBps"] > 0 for r in rows), rows
