"""The bad-input matrix of docs/reliability.md, rows 13-17 and 21-23: a cache layout's
links, config and dtype mismatches, unknown architectures, pickle-only checkpoints, memory
budgets and files that change during the load (rows 1-12 and the A rows' 2-rank job: in
test_bad_input.py). Each test asserts the error names what applies (file, tensor, rank) and
that nothing was mutated.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from bad_inputs import (
    Opens,
    index_json,
    last_shard,
    no_data_reads,
    rewrite_shard,
    set_config,
)
from helpers import (
    make_model,
    pploader_cmd,
    reference_tensors,
    run,
    tiny_config,
)

from pploader import (
    CheckpointError,
    ConfigError,
    PlanError,
    ReadError,
    Topology,
    load_stage,
    plan_stage,
)
from pploader.errors import MemoryBudgetError
from pploader.io.read import Reader
from pploader.planning.checkpoint import INDEX_NAME
from pploader.planning.dtypes import DTYPE_POLICY, dtype_action


def _hf_cache(src: Path, cache: Path) -> Path:
    """The Hugging Face hub cache layout: snapshots/<rev>/<file> -> ../../blobs/<sha256>."""
    blobs, snap = cache / "blobs", cache / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        sha = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy2(f, blobs / sha)
        (snap / f.name).symlink_to(Path("../../blobs") / sha)
    return snap


def test_row13_hf_cache_symlinks_load_and_escapes_are_rejected(tiny_llama: Path,
                                                               tmp_path: Path) -> None:
    snap = _hf_cache(tiny_llama, tmp_path / "models--tiny--llama")
    staged = plan_stage(snap, Topology(1))
    state = load_stage(staged).state_dict
    ref = reference_tensors(tiny_llama)
    assert set(state) == set(ref)
    assert all(torch.equal(state[k].view(torch.uint8), ref[k].view(torch.uint8)) for k in ref)
    # one shard now points outside the repo folder
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    victim = last_shard(snap)
    shutil.copy2(snap / victim, outside / victim)
    (snap / victim).unlink()
    (snap / victim).symlink_to(outside / victim)
    with pytest.raises(CheckpointError, match="outside the allowed roots") as err:
        plan_stage(snap, Topology(2, rank=1))
    assert err.value.file == victim and "rank 1" in str(err.value)
    plan_stage(snap, Topology(2, rank=1), allowed_roots=[str(outside)])  # explicit opt-in


@pytest.mark.parametrize("change,topo,needles", [
    ({"intermediate_size": 96}, Topology(2, rank=1), ["[64, 128]", "[64, 96]", "shape"]),
    ({}, Topology(1, 3, rank=2), ["--tp 3", "4 query heads"]),  # heads, checked first
    ({"num_hidden_layers": 6}, Topology(2, rank=1), ["num_hidden_layers=6", "model.layers.6."]),
    ({"num_hidden_layers": 10}, Topology(2, rank=1), ["missing", "model.layers.8."]),
])
def test_row14_config_mismatch_rejected_before_allocating(
        model: Path, monkeypatch: pytest.MonkeyPatch, change: dict, topo: Topology,
        needles: list[str]) -> None:
    set_config(model, **change)
    reads = no_data_reads(monkeypatch)
    allocs: list[int] = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocs.append(1) or real_empty(*a, **k))
    with pytest.raises(PlanError) as err:
        plan_stage(model, topo)
    msg = str(err.value)
    assert all(n in msg for n in needles), msg
    assert f"rank {topo.rank}" in msg and (err.value.tensor or err.value.file == "config.json")
    assert reads == [] and allocs == []


def test_row15_dtype_policy(tmp_path: Path) -> None:
    # float16 tensor in a bfloat16 model: not on the allowlist -> rejected at plan time
    bf16 = make_model(tmp_path / "bf16")
    name = "model.layers.6.self_attn.o_proj.weight"
    file = index_json(bf16)["weight_map"][name]
    rewrite_shard(bf16, file, lambda t: t.update({name: t[name].to(torch.float16)}))
    with pytest.raises(PlanError) as err:
        plan_stage(bf16, Topology(2, rank=1))
    msg = str(err.value)
    assert "F16" in msg and "BF16" in msg and "allowlist" in msg
    assert err.value.file == file and err.value.tensor == name and err.value.rank == 1
    # float32 model, one tensor stored in bfloat16: exact widening -> cast on load
    f32 = make_model(tmp_path / "f32", tiny_config(dtype="float32"))
    ref = reference_tensors(f32)
    name = "model.layers.1.mlp.up_proj.weight"
    rewrite_shard(f32, index_json(f32)["weight_map"][name],
                   lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    state = load_stage(plan_stage(f32, Topology(1))).state_dict
    assert state[name].dtype == torch.float32
    assert torch.equal(state[name], ref[name].to(torch.bfloat16).to(torch.float32))
    # bfloat16 model with a float32 norm: full precision by design -> kept as stored
    norm = "model.norm.weight"
    keep = make_model(tmp_path / "keep")
    rewrite_shard(keep, index_json(keep)["weight_map"][norm],
                   lambda t: t.update({norm: t[norm].to(torch.float32)}))
    got = load_stage(plan_stage(keep, Topology(1))).state_dict[norm]
    assert got.dtype == torch.float32
    # the table itself
    assert dtype_action("BF16", "BF16") == "keep"
    assert dtype_action("I8", "BF16") is None and dtype_action("I8", "BF16", quantized=True)
    assert dtype_action("F8_E4M3", "BF16") is None
    assert dtype_action("BF16", "F16") is None and dtype_action("F16", "BF16") is None
    assert all(act in ("cast", "keep") for act in DTYPE_POLICY.values())


@pytest.mark.parametrize("change,needle", [
    ({"architectures": ["NotAModelForCausalLM"]}, "unsupported architecture"),
    ({"architectures": None}, "no `architectures` list"),
])
def test_row16_unknown_architecture_rejected_up_front(
        model: Path, monkeypatch: pytest.MonkeyPatch, change: dict, needle: str) -> None:
    set_config(model, **change)
    opens = Opens(monkeypatch)
    with pytest.raises(ConfigError, match=needle) as err:
        plan_stage(model, Topology(2, rank=1))
    assert err.value.rank == 1 and "config.json" in str(err.value)
    assert "LlamaForCausalLM" in str(err.value)  # the supported list is shown
    assert opens.shards() == [] and not any(p.endswith(INDEX_NAME) for p in opens.paths)


class _Evil:
    """A pickle payload that would create a file if it were ever unpickled unsafely."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.marker,))


def test_row17_pickle_only_refused_by_default_opt_in_uses_weights_only(
        tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pploader.pickled import convert_to_safetensors, load_pickled
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy2(tiny_llama / "config.json", legacy / "config.json")
    ref = reference_tensors(tiny_llama)
    names = sorted(ref)
    torch.save({k: ref[k] for k in names[:10]}, legacy / "pytorch_model-00001-of-00002.bin")
    torch.save({k: ref[k] for k in names[10:]}, legacy / "pytorch_model-00002-of-00002.bin")
    # the loader itself never falls back to unpickling
    with pytest.raises(CheckpointError, match="pploader never unpickles") as err:
        plan_stage(legacy, Topology(1))
    assert "--allow-pickle" in str(err.value)
    calls: list[int] = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(1) or real_load(*a, **k))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_pickled(legacy)
    assert calls == []  # refused without reading a byte of pickle
    out = run(pploader_cmd("convert", str(legacy), str(tmp_path / "nope")))
    assert out.returncode == 2 and "allow_pickle=True" in out.stderr
    assert not (tmp_path / "nope").exists()
    # opt-in: torch.load(weights_only=True), converted once, then the normal strict path
    seen: list[dict] = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.append(k) or real_load(*a, **k))
    convert_to_safetensors(legacy, tmp_path / "converted", allow_pickle=True)
    assert seen and all(k.get("weights_only") is True for k in seen)
    state = load_stage(plan_stage(tmp_path / "converted", Topology(1))).state_dict
    assert set(state) == set(ref) and all(torch.equal(state[k], ref[k]) for k in ref)
    # a malicious pickle is refused by the restricted unpickler and runs nothing
    evil = tmp_path / "evil"
    evil.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"model.embed_tokens.weight": torch.zeros(1), "x": _Evil(str(marker))},
               evil / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only=True") as err:
        load_pickled(evil, allow_pickle=True)
    assert err.value.file == "pytorch_model.bin" and not marker.exists()


def test_row21_memory_budget_is_a_structured_oom(tiny_llama: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    staged = plan_stage(tiny_llama, Topology(2, rank=1))
    total = sum(i.nbytes for i in staged.plan.items)
    with pytest.raises(MemoryBudgetError) as err:
        load_stage(staged, memory_budget_bytes=total // 2)
    e = err.value
    assert e.rank == 1 and e.tensor in staged.plan.tensors and e.file in staged.plan.files
    assert e.budget_bytes == total // 2 and e.in_use_bytes + e.nbytes > total // 2
    assert f"{e.nbytes} bytes" in str(e) and e.tensor in str(e)
    load_stage(staged, memory_budget_bytes=total)  # exactly enough is enough
    from pploader.cli import build_parser
    args = build_parser().parse_args(["load", "--model", "m", "--memory-budget", "512M"])
    assert args.memory_budget == 512 << 20
    # a real allocator failure becomes the same structured error
    import pploader.io.read as read_mod

    def failing_empty(*a: Any, **k: Any) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate "
                           "123 bytes")
    monkeypatch.setattr(read_mod.torch, "empty", failing_empty)
    with pytest.raises(MemoryBudgetError, match="allocating tensor of") as err:
        dict(Reader(staged.plan))
    assert err.value.tensor == staged.plan.items[0].name and err.value.rank == 1


def _tp_plan(model: Path) -> tuple[Any, list]:
    """A plan with several batches in one file (TP slices are not adjacent)."""
    plan = plan_stage(model, Topology(1, 2, rank=0)).plan
    first = plan.items[0].file
    same = [i for i in plan.items if i.file == first]
    assert len(same) >= 3
    end = same[0].ranges[-1][0] + same[0].ranges[-1][1]
    assert end < same[1].ranges[0][0]  # so the second item is read by a later batch
    return plan, same


def test_row22_file_truncated_during_load(model: Path) -> None:
    plan, same = _tp_plan(model)
    path = model / same[0].file
    cut = same[1].ranges[0][0]
    done: list[int] = []

    def truncate_once(_: int) -> None:
        if not done:
            done.append(1)
            os.truncate(path, cut)  # the next read of this file hits EOF: no mmap, no SIGBUS
    with pytest.raises(ReadError, match="changed during load") as err:
        dict(Reader(plan, threads=1, on_progress=truncate_once))
    assert err.value.file == same[1].file and err.value.rank == 0
    assert err.value.tensor == same[1].name


def test_row23_file_rewritten_in_place_during_load(model: Path) -> None:
    plan, same = _tp_plan(model)
    path = model / same[0].file
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 10 ** 9))
    plan = plan_stage(model, Topology(1, 2, rank=0)).plan  # identities as of now

    def rewrite(_: int) -> None:  # same inode, same size: only the content (and mtime) change
        with open(path, "r+b") as fh:
            fh.seek(same[-1].ranges[0][0])
            fh.write(b"\x7f" * 8)
    with pytest.raises(ReadError, match="changed during load") as err:
        dict(Reader(plan, threads=1, on_progress=rewrite))
    assert err.value.file == same[0].file and "mtime_ns" in str(err.value)
    assert "renaming" in str(err.value)


def test_row23_publish_by_rename_keeps_the_load_consistent(model: Path) -> None:
    plan, same = _tp_plan(model)
    path = model / same[0].file
    ref = dict(Reader(plan))
    done: list[int] = []

    def publish(_: int) -> None:  # the documented way: write elsewhere, rename over
        if not done:
            done.append(1)
            tmp = path.with_suffix(".new")
            tmp.write_bytes(b"\0" * path.stat().st_size)
            os.replace(tmp, path)
    got = dict(Reader(plan, threads=1, on_progress=publish))
    assert done and all(torch.equal(got[k].view(torch.uint8), ref[k].view(torch.uint8))
                        for k in ref)


def test_config_without_dtype_takes_the_stored_dtype(model: Path) -> None:
    """A config.json naming no dtype (gpt-oss's) is planned in the checkpoint's stored dtype,
    as transformers (``dtype="auto"``) and vLLM do; the load keeps every tensor as stored."""
    from pploader.planning.spec import load_spec
    stored = {t.dtype for t in load_stage(plan_stage(model, Topology(1))).state_dict.values()}
    set_config(model, dtype=None, torch_dtype=None)
    assert load_spec(model).dtype in stored
    got = load_stage(plan_stage(model, Topology(1))).state_dict
    assert {t.dtype for t in got.values()} == stored


def test_convert_prints_no_torch_pickle_protocol_warning(tmp_path: Path) -> None:
    """Issue 43: torch's "Detected pickle protocol 4" UserWarning is not pploader's to print;
    the refusal is one line with the restricted unpickler's reason and the fix."""
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"w": torch.ones(2, 2)}, src / "pytorch_model.bin", pickle_protocol=4)
    out = run(pploader_cmd("convert", str(src), str(tmp_path / "dst"), "--allow-pickle"))
    assert "UserWarning" not in out.stderr and "Detected pickle protocol" not in out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    if out.returncode == 0:  # a torch whose restricted unpickler reads protocol 4
        assert not lines, out.stderr
        return
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "Unsupported operand" in lines[0] and "pickle_protocol=2" in lines[0], lines[0]
    assert "weights_only` set to `False`" not in lines[0]  # never advise unrestricted loads
    assert not (tmp_path / "dst").exists()
