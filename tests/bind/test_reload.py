"""Hot reload in place: same data_ptrs, re-run post-processing (aliased and separate derived
parameters), validate-then-agree before any write, not-ready marking on a mid-reload fault."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from pploader import (CheckpointError, LoadRecord, NotReadyError, PlanError, RankFailure, Topology,
                      is_ready, load_stage_into, plan_stage, reload_from_disk)
from pploader.tiny import write_checkpoint

from bind_models import one_thread  # noqa: F401 - autouse fixture
from bind_models import (DeletingMLP, ReshapingMLP, TinyLM, checksum, param_ptrs,
                         storage_bytes)
from helpers import make_model, reference_tensors, run_ranks, tiny_config

CFG = tiny_config()
IDS = torch.tensor([3, 17, 42, 7, 99, 250, 1, 64])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("reload")
    return make_model(root / "a", seed=1), make_model(root / "b", seed=2)


def loaded(model_dir: Path, dtype: torch.dtype = torch.bfloat16,
           **kw: object) -> tuple[TinyLM, LoadRecord]:
    """A module loaded from ``model_dir`` and the record a reload takes."""
    topo = Topology(1)
    module = TinyLM(CFG, plan_stage(model_dir, topo).plan.window, dtype=dtype, device="meta",
                    **kw)  # type: ignore[arg-type]
    result = load_stage_into(module, model_dir, topo, allow_cast=dtype != torch.bfloat16)
    return module, result.record


def fresh(model_dir: Path, dtype: torch.dtype = torch.bfloat16, **kw: object) -> TinyLM:
    return loaded(model_dir, dtype, **kw)[0]


def out(model: TinyLM) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reload_twice_in_place(ckpts: tuple[Path, Path], dtype: torch.dtype) -> None:
    """bf16 modules take the read-straight-into path; float32 ones the borrowed-copy path."""
    a, b = ckpts
    model, record = loaded(a, dtype)
    norm = model.model.layers["0"].input_layernorm
    down = model.model.layers["0"].mlp.down_proj
    assert norm.interleaved is norm.weight                  # aliased: same Parameter
    assert down.weight_t.data_ptr() != down.weight.data_ptr()  # could not alias: separate
    ptrs, nbytes = param_ptrs(model), storage_bytes(model)
    out_a = out(model)
    assert torch.equal(out_a, out(fresh(a, dtype)))
    for src in (b, a, b):
        result = reload_from_disk(model, src, record=record)
        record = result.record
        assert torch.equal(out(model), out(fresh(src, dtype)))
        assert param_ptrs(model) == ptrs and storage_bytes(model) == nbytes
        assert "model.layers.0.mlp.down_proj" in result.processed
    assert not torch.equal(out(model), out_a)  # the two checkpoints really differ
    ref = reference_tensors(b)  # the source storage holds derived (interleaved) values
    raw = ref["model.layers.0.input_layernorm.weight"].to(dtype)
    assert torch.equal(norm.weight, raw.view(2, -1).t().reshape(-1))


@pytest.mark.parametrize("mlp,what", [(DeletingMLP, "deleted after loading"),
                                      (ReshapingMLP, "reshaped from")])
def test_post_process_that_breaks_sources_fails_before_writing(
        ckpts: tuple[Path, Path], mlp: type, what: str) -> None:
    a, b = ckpts
    model, record = loaded(a, mlp=mlp)
    before = checksum(model)
    with pytest.raises(PlanError, match=what) as err:
        reload_from_disk(model, b, record=record)
    msg = str(err.value)
    assert "model.layers.0.mlp.gate_up_proj.weight" in msg and "nothing was written" in msg
    assert "bind_derived" in msg
    assert checksum(model) == before and is_ready(model)


def _truncate_last_shard(src: Path, dst: Path) -> str:
    shutil.copytree(src, dst)
    last = sorted(dst.glob("*.safetensors"))[-1]
    with open(last, "r+b") as fh:
        fh.truncate(os.path.getsize(last) - 100)
    return last.name


def test_reload_from_truncated_checkpoint_changes_nothing(ckpts: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    a, b = ckpts
    model, record = loaded(a)
    before, ptrs = checksum(model), param_ptrs(model)
    name = _truncate_last_shard(b, tmp_path / "bad")
    with pytest.raises(CheckpointError, match=name):
        reload_from_disk(model, tmp_path / "bad", record=record)
    assert checksum(model) == before and param_ptrs(model) == ptrs and is_ready(model)


def test_fault_midway_marks_not_ready_then_restores(ckpts: tuple[Path, Path]) -> None:
    a, b = ckpts
    model, record = loaded(a)
    seen = []

    def fault(nbytes: int) -> None:
        seen.append(nbytes)
        if len(seen) == 2:
            raise OSError("injected I/O fault")

    with pytest.raises(NotReadyError, match="reload_from_disk failed after writing started"):
        reload_from_disk(model, b, record=record, on_progress=fault)
    assert not is_ready(model)
    with pytest.raises(NotReadyError, match="injected I/O fault"):
        out(model)  # never silently mixed
    reload_from_disk(model, b, record=record)  # the documented restore path
    assert is_ready(model) and torch.equal(out(model), out(fresh(b)))


def test_reload_needs_the_record_of_this_modules_load(ckpts: tuple[Path, Path]) -> None:
    """The record is the caller's (nothing is kept on the module): no record, or another
    module's record, is refused before any write."""
    a, b = ckpts
    with pytest.raises(PlanError, match="load_stage_into"):
        reload_from_disk(TinyLM(CFG, plan_stage(a, Topology(1)).plan.window), b,
                         record=None)  # type: ignore[arg-type]
    _, record = loaded(a)
    other = fresh(a)
    before = checksum(other)
    with pytest.raises(PlanError, match="replaced by a new tensor"):
        reload_from_disk(other, b, record=record)
    assert checksum(other) == before and is_ready(other)


# ---- two ranks (gloo): validation agreed before any write; faults mark every rank ----------

def _two_rank_reload(rank: int, world: int, a: str, b: str, truncated: str,
                     reshaped: str) -> dict:
    from pploader.distributed.comm import Comm
    topo = Topology(2, rank=rank)
    comm = Comm(topo, timeout_s=30)
    staged = plan_stage(a, topo)
    model = TinyLM(CFG, staged.plan.window, device="meta")
    record = load_stage_into(model, staged, comm=comm).record
    before, ptrs = checksum(model), param_ptrs(model)
    errors = {}
    for label, src in (("truncated", truncated), ("shape", reshaped)):
        try:
            reload_from_disk(model, src, record=record, comm=comm)
        except RankFailure as exc:
            errors[label] = str(exc)
        assert checksum(model) == before and param_ptrs(model) == ptrs and is_ready(model)
    fault = None
    if rank == 1:
        def fault(nbytes: int) -> None:
            raise OSError("injected fault on rank 1")
    try:
        reload_from_disk(model, b, record=record, comm=comm, on_progress=fault)
    except NotReadyError as exc:
        errors["midway"] = str(exc)
    ready_after_fault = is_ready(model)
    reload_from_disk(model, b, record=record, comm=comm)
    fresh_b = TinyLM(CFG, staged.plan.window, device="meta")
    load_stage_into(fresh_b, b, topo, comm=comm)
    comm.close()
    return {"errors": errors, "ready_after_fault": ready_after_fault,
            "restored": checksum(model) == checksum(fresh_b) and is_ready(model)}


@pytest.mark.slow
def test_two_ranks_atomic_reload(ckpts: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = ckpts
    name = _truncate_last_shard(b, tmp_path / "truncated")  # holds the last stage's tensors
    tensors = reference_tensors(b)
    wrong = "model.layers.6.mlp.down_proj.weight"             # a layer of rank 1 only
    tensors[wrong] = torch.zeros(CFG["hidden_size"], CFG["intermediate_size"] + 2,
                                 dtype=torch.bfloat16)
    write_checkpoint(tmp_path / "reshaped", tensors, CFG, shard_bytes=120_000)
    results = run_ranks(_two_rank_reload, 2, str(a), str(b), str(tmp_path / "truncated"),
                        str(tmp_path / "reshaped"), timeout_s=90)
    for rank, res in enumerate(results):
        errs = res["errors"]
        assert set(errs) == {"truncated", "shape", "midway"}, (rank, errs)
        assert "rank 1" in errs["truncated"] and name in errs["truncated"]
        assert "rank 0" not in errs["truncated"].split("failed:")[1]
        assert wrong in errs["shape"] and "rank 1" in errs["shape"]
        assert "injected fault on rank 1" in errs["midway"]
        assert res["ready_after_fault"] is False and res["restored"] is True


def test_a_checkpoint_of_the_same_layout_keeps_the_plan(ckpts: tuple[Path, Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight update (same config and headers, new values) reuses the recorded plan with
    the new files: nothing is planned again, and the result equals a fresh plan's."""
    import dataclasses

    import pploader.bind.reload as reload_mod
    a, b = ckpts
    model, record = loaded(a)
    assert record.staged is not None
    fresh_plan = reload_mod.plan_reload(dataclasses.replace(record, staged=None), b).plan

    def no_planning(*args: object, **kwargs: object) -> None:
        raise AssertionError("planned again")
    monkeypatch.setattr(reload_mod, "plan_rank", no_planning)
    result = reload_from_disk(model, b, record=record)
    assert result.plan == fresh_plan
    assert result.record.staged is not None and result.record.staged.plan == fresh_plan
    assert torch.equal(out(model), out(fresh(b)))
