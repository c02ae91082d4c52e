"""pploader's DCP storage reader (integrations/dcp.py) and the mesh helpers (mesh.py).

The 4-rank test runs docs/examples/dcp_pipeline_tp.py: a transformers llama split into PP=2
``torch.distributed.pipelining`` stages, each TP=2 with DTensor on a (pp, tp) DeviceMesh,
filled by ``dcp.load`` with pploader's reader; it must equal torch's HuggingFaceStorageReader
bitwise, the GPipe schedule's logits must equal a single-process transformers forward, and
each rank reads only its local shards' bytes (+ headers). The rest are single-process checks.
"""
from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.planner import ReadItem as DCPReadItem

from helpers import run_ranks
from pploader import NameMap, StageWindow, Topology
from pploader.errors import CheckpointError, PlanError, ReadError, TopologyError
from pploader.integrations.dcp import PPLoaderStorageReader
from pploader.planning.mesh import mesh_topology, pipeline_window

transformers = pytest.importorskip("transformers")  # the `hf` extra; installed in CI

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "dcp_pipeline_tp.py"
#: tiny fp32 llama, 4 layers (2 per stage), heads divisible by TP=2
CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              max_position_embeddings=64, tie_word_embeddings=False)


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dcp_pipeline_tp", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny llama written by ``save_pretrained`` in several shards (+ index)."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("dcp-llama")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(out, max_shard_size="300KB")
    return out


def reference(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def _pp_tp_rank(rank: int, world: int, model_dir: str, threads: int) -> dict:
    import pploader.io.read  # noqa: F401 - imported before the /proc/self/io window
    return example().run(model_dir, pp=2, tp=2, check=True, threads=threads)


@pytest.mark.slow
def test_pipeline_tp_dtensor_dcp_load(llama: Path) -> None:
    results = run_ranks(_pp_tp_rank, 4, str(llama), 2, timeout_s=240)
    for r, res in enumerate(results):
        topo = res["topology"]
        assert (topo.pp_rank, topo.tp_rank, topo.rank) == (r // 2, r % 2, r)
        assert res["window"] == StageWindow(r // 2, 2 * (r // 2), 2 * (r // 2) + 2,
                                            r < 2, r >= 2)
        assert res["bitwise_equal"], f"rank {r} differs from torch's HuggingFaceStorageReader"
        # exactly the local shards' bytes (dim-1 shards of o/down_proj: row runs)
        assert res["read_bytes"] == res["local_bytes"], res
        budget = 1.02 * res["local_bytes"] + res["header_bytes"]
        assert res["rchar"] <= budget, res
        assert res["storage_read_bytes"] <= budget, res
    # each TP rank holds half of each stage's sharded tensors
    assert results[0]["local_bytes"] == results[1]["local_bytes"]
    for r in (2, 3):
        assert results[r]["max_abs_diff"] <= 1e-5, results[r]


def test_single_process_subset_reads_only_its_shards(llama: Path) -> None:
    ref = reference(llama)
    keys = [k for k in ref if k.startswith("model.layers.3.") or k == "lm_head.weight"]
    state = {k: torch.full_like(ref[k], float("nan")) for k in keys}
    reader = PPLoaderStorageReader(llama)
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert all(torch.equal(state[k], ref[k]) for k in keys)
    assert reader.read_bytes == sum(t.nbytes for t in state.values())
    index = json.loads((llama / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(reader._require_index().opened_files()) == {index[k] for k in keys}
    assert len(set(index.values())) > len({index[k] for k in keys})  # some never opened


def test_name_map_and_rename(llama: Path) -> None:
    ref = reference(llama)
    names = NameMap("model.", "")
    state = {"layers.0.mlp.up_proj.weight": torch.zeros(256, 128),
             "norm.weight": torch.zeros(128)}
    dcp.load(state, storage_reader=PPLoaderStorageReader(llama, names=names), no_dist=True)
    assert torch.equal(state["norm.weight"], ref["model.norm.weight"])
    assert torch.equal(state["layers.0.mlp.up_proj.weight"], ref["model.layers.0.mlp.up_proj.weight"])
    state = {"head": torch.zeros(256, 128)}
    reader = PPLoaderStorageReader(llama, rename=lambda n: "head" if n == "lm_head.weight" else None)
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert torch.equal(state["head"], ref["lm_head.weight"])
    collide = PPLoaderStorageReader(llama, rename=lambda n: "same")
    with pytest.raises(CheckpointError, match="both map to state-dict key same"):
        collide.read_metadata()
    with pytest.raises(ValueError, match="not both"):
        PPLoaderStorageReader(llama, names=names, rename=str)


def _dcp_failure(state: dict, reader: PPLoaderStorageReader) -> BaseException:
    """The error ``dcp.load`` gathered from this (only) rank (CheckpointException wraps it)."""
    with pytest.raises(CheckpointException) as info:
        dcp.load(state, storage_reader=reader, no_dist=True)
    return info.value.failures[0][0]


def _planned(reader: PPLoaderStorageReader, state: dict) -> tuple[DefaultLoadPlanner, list]:
    """The default planner's local plan, as ``dcp.load`` makes it."""
    metadata = reader.read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, True)
    reader.set_up_storage_reader(metadata, True, rank=3)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    return planner, plan


def test_dtype_mismatch_names_rank_and_tensor(llama: Path) -> None:
    state = {"model.norm.weight": torch.zeros(128, dtype=torch.bfloat16)}
    reader = PPLoaderStorageReader(llama)
    planner, plan = _planned(reader, state)
    with pytest.raises(ReadError, match=r"rank 3.*tensor model\.norm\.weight.*does not cast"):
        reader.read_data(plan, planner)
    err = _dcp_failure(state, PPLoaderStorageReader(llama))  # dcp.load: rank 0, no_dist
    assert isinstance(err, ReadError) and (err.rank, err.tensor) == (0, "model.norm.weight")


def test_file_changed_after_headers_is_refused(llama: Path, tmp_path: Path) -> None:
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(llama, copy)
    state = {"lm_head.weight": torch.zeros(256, 128)}
    reader = PPLoaderStorageReader(copy)
    planner, plan = _planned(reader, state)
    shard = copy / reader.entry("lm_head.weight").file
    os.utime(shard, ns=(1, 1))
    with pytest.raises(ReadError, match="file changed during load"):
        reader.read_data(plan, planner)


def test_strided_boxes_and_destinations(llama: Path) -> None:
    """A dim-1 box is read as one exact range per row (range_cost_bytes=0) or as its covering
    box when runs cost more; a non-contiguous destination is filled through a copy."""
    ref = reference(llama)["model.layers.1.self_attn.o_proj.weight"]  # [128, 128] fp32
    fqn = "model.layers.1.self_attn.o_proj.weight"
    box = DCPReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, (0, 0)),
                      dest_offsets=torch.Size((0, 0)), storage_index=MetadataIndex(fqn, (0, 0)),
                      storage_offsets=torch.Size((8, 64)), lengths=torch.Size((16, 32)))
    for cost, ranges, read in ((0, 16, 16 * 32 * 4), (1 << 20, 1, 16 * 128 * 4)):
        reader = PPLoaderStorageReader(llama, range_cost_bytes=cost)
        reader.read_metadata()
        (item,) = reader._plan_items([box])
        assert (len(item.ranges), item.read_bytes) == (ranges, read)
        dst = torch.zeros(32, 16).t()  # non-contiguous [16, 32]
        planner = SimpleNamespace(resolve_tensor=lambda req, d=dst: d,
                                  commit_tensor=lambda req, t: None)
        reader.read_data(SimpleNamespace(items=[box]), planner).wait()
        assert torch.equal(dst, ref[8:24, 64:96])
        assert reader.read_bytes == read
    bad = DCPReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, (0, 0)),
                      dest_offsets=torch.Size((0, 0)), storage_index=MetadataIndex(fqn, (0, 0)),
                      storage_offsets=torch.Size((120, 0)), lengths=torch.Size((16, 128)))
    with pytest.raises(PlanError, match=r"do not fit the stored shape \[128, 128\]"):
        reader._plan_items([bad])


def test_distributed_dcp_save_is_refused(tmp_path: Path) -> None:
    """A shard with DCP's sharding metadata (tensors in chunks) is named, not misread."""
    header = json.dumps({"__metadata__": {"DCP_SHARDING_INFO": "{}"},
                         "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header
                                                 + bytes(8))
    state = {"w": torch.zeros(2)}
    err = _dcp_failure(state, PPLoaderStorageReader(tmp_path))
    assert isinstance(err, CheckpointError) and "distributed DCP save" in str(err)
    assert (err.file, err.tensor) == ("model.safetensors", "w")


def _mesh(names: tuple, sizes: tuple, coord: tuple) -> SimpleNamespace:
    return SimpleNamespace(mesh_dim_names=names, get_coordinate=lambda: list(coord),
                           size=lambda d: sizes[d])


def test_mesh_topology_and_stage_window() -> None:
    topo = mesh_topology(_mesh(("dp", "pp", "tp"), (2, 4, 2), (1, 3, 1)))
    assert topo == Topology(4, 2, 1, 7)
    assert mesh_topology(_mesh(("tp",), (8,), (5,)), pp_dim=None) == Topology(1, 8, 1, 5)
    assert mesh_topology(_mesh(("pp", "ep", "tp"), (2, 2, 2), (1, 0, 1)), ep_dim="ep") \
        == Topology(2, 2, 2, 5)
    with pytest.raises(TopologyError, match="no dim named 'pp'"):
        mesh_topology(_mesh(("tp",), (2,), (0,)))
    stage = SimpleNamespace(stage_index=1, num_stages=3)
    assert pipeline_window(stage, range(4, 8)) == StageWindow(1, 4, 8, False, False)
    assert pipeline_window(2, [9, 8], num_stages=3) == StageWindow(2, 8, 10, False, True)
    with pytest.raises(TopologyError, match="contiguous"):
        pipeline_window(0, [0, 2], num_stages=2)


def test_cpu_dim1_shard_copied_from_the_mapping_warm_or_cold(llama: Path) -> None:
    """CPU default: a dim-1 shard is one strided copy from a mapping (no read syscall),
    resident or evicted (then its pages are faulted in with the kernel's read-around)."""
    from helpers import evict_or_skip
    from pploader.report import proc_io
    import gc
    fqn = "model.layers.2.mlp.down_proj.weight"  # [128, 256] fp32
    ref = reference(llama)[fqn].clone()
    gc.collect()  # no mapping of the shard left (pages of a mapped file are not dropped)
    box = DCPReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, (0, 0)),
                      dest_offsets=torch.Size((0, 0)), storage_index=MetadataIndex(fqn, (0, 0)),
                      storage_offsets=torch.Size((0, 128)), lengths=torch.Size((128, 128)))
    nbytes = 128 * 128 * 4
    for cache in ("warm", "cold"):
        reader = PPLoaderStorageReader(llama)
        reader.read_metadata()
        path = llama / reader.entry(fqn).file
        if cache == "warm":
            path.read_bytes()
        else:
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)  # just written: dirty pages are not dropped
            os.close(fd)
            evict_or_skip([path])
        dst = torch.full((128, 128), float("nan"))
        planner = SimpleNamespace(resolve_tensor=lambda req, d=dst: d,
                                  commit_tensor=lambda req, t: None)
        if cache == "warm":  # once untimed: the modules a first read imports
            reader.read_data(SimpleNamespace(items=[box]), planner).wait()
        io0 = proc_io()
        reader.read_data(SimpleNamespace(items=[box]), planner).wait()
        rchar = proc_io().get("rchar", 0) - io0.get("rchar", 0)
        assert torch.equal(dst, ref[:, 128:]), cache
        assert reader.read_bytes == nbytes
        # warm: one strided copy from the mapping; cold: the same copy, its pages faulted in
        # with the kernel's read-around (cold="fault"): no read syscall either way
        assert reader.stats.syscalls == 0 and rchar < 4096, (cache, reader.stats, rchar)


def _one_bad_rank(rank: int, world: int, model_dir: str) -> dict:
    """Each rank loads its own quarter of the tensors into NaN-filled destinations; rank 3's
    last one has the wrong dtype. Returns whether any destination got a byte, and the error."""
    from safetensors import safe_open
    import torch.distributed as dist
    names, shapes = [], {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                names.append(k)
                shapes[k] = fh.get_slice(k).get_shape()
    mine = sorted(names)[rank::world]
    state = {k: torch.full(shapes[k], float("nan")) for k in mine}
    if rank == 3:
        state[mine[-1]] = torch.full(shapes[mine[-1]], float("nan"), dtype=torch.float16)
    try:
        dcp.load(state, storage_reader=PPLoaderStorageReader(model_dir))
        error = ""
    except CheckpointException as exc:
        error = str(exc)
    dist.barrier()
    return {"written": sum(int((~torch.isnan(t.float())).sum()) for t in state.values()),
            "error": error}


def test_dtype_mismatch_on_one_rank_means_no_rank_reads(llama: Path) -> None:
    results = run_ranks(_one_bad_rank, 4, str(llama), timeout_s=120)
    for r, res in enumerate(results):
        assert res["written"] == 0, (r, res)  # every destination still NaN: no byte read
        assert "rank 3" in res["error"] and "does not cast" in res["error"], (r, res)
    assert "refused their requests before any rank read" in results[0]["error"]


def test_shard_changed_after_read_metadata_is_refused(llama: Path, tmp_path: Path) -> None:
    """Pinned from ``read_metadata`` on: a shard rewritten (same bytes, new file) before its
    header is first parsed, or touched before the read, is refused naming file and rank."""
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(llama, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    shard = copy / index["lm_head.weight"]
    state = {"lm_head.weight": torch.zeros(256, 128)}
    reader = PPLoaderStorageReader(copy)
    metadata = reader.read_metadata()
    assert reader._require_index().opened_files() == ()  # no header parsed yet
    new = shard.with_suffix(".new")
    new.write_bytes(shard.read_bytes())
    os.replace(new, shard)  # published by rename: another inode, same bytes
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, True)
    reader.set_up_storage_reader(metadata, True, rank=2)
    with pytest.raises(CheckpointError, match=r"rank 2, file .*: file changed after "
                                              r"read_metadata"):
        reader.prepare_local_plan(planner.create_local_plan())
    dcp.load(state, storage_reader=reader, no_dist=True)  # read_metadata pins the new file
    assert torch.equal(state["lm_head.weight"], reference(llama)["lm_head.weight"])
    # a touch between read_metadata and the read is refused
    planner, plan = _planned(reader, state)
    os.utime(shard, ns=(1, 1))
    with pytest.raises(ReadError, match="rank 3.*file changed during load"):
        reader.read_data(plan, planner)


def test_missing_shard_names_the_rank(llama: Path, tmp_path: Path) -> None:
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(llama, copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    (copy / index["lm_head.weight"]).unlink()
    state = {"lm_head.weight": torch.zeros(256, 128)}
    reader = PPLoaderStorageReader(copy)
    metadata = reader.read_metadata()
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, metadata, True)
    reader.set_up_storage_reader(metadata, True, rank=1)
    with pytest.raises(CheckpointError, match=r"rank 1, file .*missing"):
        reader.prepare_local_plan(planner.create_local_plan())
