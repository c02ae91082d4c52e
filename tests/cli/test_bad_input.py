"""The bad-input matrix of docs/reliability.md: one test per row (rows 18-20 live in
test_faults_dist.py, rows 24-25 in test_reload.py).

Each test asserts the error names what applies (file, tensor, rank), that nothing was
mutated (M: checkpoint bytes unchanged, destinations untouched), and for the rows marked A that
every rank of a 2-rank gloo job raises the same combined error within 30 s.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import make_model, pploader_cmd, reference_tensors, run, run_ranks, tiny_config, \
    torchrun_cmd
from pploader import (CheckpointError, ConfigError, PlanError, RankFailure, ReadError, Topology,
                      load_stage, plan_stage)
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint, parse_header
from pploader.planning.checkpoint import INDEX_NAME
from pploader.planning.dtypes import DTYPE_POLICY, dtype_action
from pploader.errors import MemoryBudgetError

# ---- helpers ------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=shutil.copy2)
    return dst


def _digest(model: Path) -> dict[str, str]:
    """sha256 of every file (through symlinks): the 'nothing mutated' witness."""
    return {str(p.relative_to(model)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(model.rglob("*")) if p.is_file()}


def _index(model: Path) -> dict:
    return json.loads((model / INDEX_NAME).read_text())


def _last_shard(model: Path) -> str:
    return sorted(set(_index(model)["weight_map"].values()))[-1]


def _last_tensor(path: Path) -> str:
    """The tensor whose bytes end the file (the one a truncation cuts)."""
    return max(parse_header(path).tensors.values(), key=lambda e: e.end).name


def _raw_file(path: Path, header: Any, data: bytes = b"", *, length: Optional[int] = None) -> Path:
    """A safetensors-like file from a header (dict or raw bytes) and data bytes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _rewrite_shard(model: Path, file: str, change: Callable[[dict], None]) -> None:
    """Load one shard, let ``change`` edit its tensors, write it back and fix the index."""
    path = model / file
    tensors = load_file(str(path))
    before = set(tensors)
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    index = _index(model)
    wmap = index["weight_map"]
    for name in before - set(tensors):
        wmap.pop(name, None)
    for name in set(tensors) - before:
        wmap[name] = file
    (model / INDEX_NAME).write_text(json.dumps(index))


def _set_config(model: Path, **changes: Any) -> None:
    cfg = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (model / "config.json").write_text(json.dumps(cfg))


class _Opens:
    """Records every path opened through os.open / io.open (pathlib, open(), parse_header)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.paths: list[str] = []
        real_os_open, real_io_open = os.open, io.open

        def os_open(path: Any, *a: Any, **k: Any) -> int:
            self.paths.append(os.fspath(path))
            return real_os_open(path, *a, **k)

        def io_open(file: Any, *a: Any, **k: Any) -> Any:
            if not isinstance(file, int):
                self.paths.append(os.fspath(file))
            return real_io_open(file, *a, **k)
        monkeypatch.setattr(os, "open", os_open)
        monkeypatch.setattr(io, "open", io_open)

    def shards(self) -> list[str]:
        return [p for p in self.paths if p.endswith(".safetensors")]


@pytest.fixture()
def model(tiny_llama: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny llama (8 layers, 12 shards + index) to damage."""
    return _copy(tiny_llama, tmp_path / "model")


def _no_data_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count tensor-data reads (the reader's preadv); headers use pread."""
    calls: list[int] = []
    real = os.preadv

    def preadv(*a: Any, **k: Any) -> int:
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(os, "preadv", preadv)
    return calls


# ---- the A rows: one 2-rank gloo job runs every scenario (rows 1, 21) --------------------


def _job(rank: int, world: int, scenarios: list[tuple[str, str, Optional[int]]]) -> list:
    """Each scenario on every rank: plan, agree, load (budget on the last rank), agree.

    Returns per scenario (outcome, message, seconds from start to the raise)."""
    from pploader.dist.comm import Comm
    out = []
    for key, model_dir, budget in scenarios:
        topo = Topology.for_world(world, rank, pp=world)
        comm = Comm(topo, timeout_s=20, namespace=f"bad/{key}")
        cancel = comm.watch_failures()
        start = time.monotonic()
        try:
            staged, error = None, None
            try:
                staged = plan_stage(model_dir, topo)
            except Exception as exc:  # noqa: BLE001 - agreed on below
                error = exc
            comm.agree(error)
            try:
                load_stage(staged, cancel=cancel,
                           memory_budget_bytes=budget if rank == world - 1 else None)
            except Exception as exc:  # noqa: BLE001 - agreed on below
                error = exc
            comm.agree(error)
            out.append(("ok", "", time.monotonic() - start))
        except RankFailure as exc:
            out.append(("RankFailure", str(exc), time.monotonic() - start))
        finally:
            comm.close()
    return out


@pytest.fixture(scope="module")
def job(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Damaged copies + the 2-rank job's outcome for each (rows 1 and 21)."""
    root = tmp_path_factory.mktemp("bad-job")
    truncated = _copy(tiny_llama, root / "truncated")
    shard = truncated / _last_shard(truncated)
    victim = _last_tensor(shard)
    shard.write_bytes(shard.read_bytes()[:-10])
    budget = _copy(tiny_llama, root / "budget")
    digests = {"truncated": _digest(truncated), "budget": _digest(budget)}
    results = run_ranks(_job, 2, [("truncated", str(truncated), None),
                                  ("budget", str(budget), 20_000)], timeout_s=60)
    return {"results": results, "victim": victim, "shard": shard.name, "digests": digests,
            "dirs": {"truncated": truncated, "budget": budget}}


def _agreed(job: dict, idx: int) -> str:
    """The combined error: the same on every rank, raised within 30 s."""
    outcomes = [res[idx] for res in job["results"]]
    assert all(kind == "RankFailure" for kind, _, _ in outcomes), outcomes
    assert len({msg for _, msg, _ in outcomes}) == 1, outcomes
    assert all(sec < 30 for _, _, sec in outcomes), outcomes
    return outcomes[0][1]


# ---- rows ---------------------------------------------------------------------------------


def test_row01_truncated_shard_caught_by_size_check(model: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    shard = model / _last_shard(model)
    victim = _last_tensor(shard)
    shard.write_bytes(shard.read_bytes()[:-10])
    before = _digest(model)
    reads = _no_data_reads(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        plan_stage(model, Topology(2, rank=1))
    msg = str(err.value)
    assert shard.name in msg and victim in msg and "rank 1" in msg and "truncated" in msg
    assert reads == []  # caught from the header + file size, before any tensor data
    assert _digest(model) == before


@pytest.mark.slow
def test_row01_truncated_shard_every_rank_agrees(job: dict) -> None:
    msg = _agreed(job, 0)
    assert job["shard"] in msg and job["victim"] in msg and "rank 1" in msg
    assert _digest(job["dirs"]["truncated"]) == job["digests"]["truncated"]


@pytest.mark.parametrize("content,needle", [
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1234567\n", "git-LFS"),
    (b"<!DOCTYPE html>\n<html><body>Sign in to continue</body></html>\n", "HTML"),
    (b"", "too short"),
])
def test_row02_not_a_safetensors_file(model: Path, content: bytes, needle: str) -> None:
    shard = model / _last_shard(model)
    shard.write_bytes(content)
    before = _digest(model)
    with pytest.raises(CheckpointError) as err:
        plan_stage(model, Topology(2, rank=1))
    msg = str(err.value)
    assert "not a safetensors file" in msg and needle in msg
    assert shard.name in msg and "rank 1" in msg
    assert _digest(model) == before


@pytest.mark.slow
def test_row02_lfs_pointer_under_torchrun_every_rank_exits_nonzero(model: Path) -> None:
    shard = model / _last_shard(model)
    shard.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 9\n")
    before = _digest(model)
    start = time.monotonic()
    out = run(torchrun_cmd(2, "load", "--model", str(model), "--pp", "2", "--timeout", "20"),
              timeout=120)
    assert out.returncode != 0
    assert time.monotonic() - start < 60  # process start-up included; the error itself is fast
    # a bad input found while planning: every rank prints the same one line and exits 2
    lines = [ln for ln in out.stderr.splitlines() if "pploader: error:" in ln]
    assert {ln.split("]")[0] for ln in lines} == {"[rank 0", "[rank 1"}, out.stderr[-3000:]
    culprit = f"rank 1, file {shard.name}: not a safetensors file: header length"
    assert all(culprit in ln for ln in lines), out.stderr[-3000:]  # the same error on both
    assert "exitcode  : 2" in out.stderr
    assert _digest(model) == before


def test_row03_bytes_after_data_region(model: Path) -> None:
    shard = model / _last_shard(model)
    shard.write_bytes(shard.read_bytes() + b"\0" * 16)
    with pytest.raises(CheckpointError, match="16 unexpected bytes after the data region") as err:
        plan_stage(model, Topology(2, rank=1))
    assert shard.name in str(err.value) and "rank 1" in str(err.value)


def test_row04_huge_header_and_absurd_tensor_count(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import pploader.planning.header as ckpt
    parsed: list[int] = []
    real_loads, real_fast = ckpt._loads, ckpt._loads_fast
    monkeypatch.setattr(ckpt, "_loads", lambda raw: parsed.append(1) or real_loads(raw))
    # the fast parse (no per-object hook) counts as a parse too
    monkeypatch.setattr(ckpt, "_loads_fast", lambda *a: parsed.append(1) or real_fast(*a))
    big = _raw_file(tmp_path / "big.safetensors", b"{}", length=100 * 1024 * 1024 + 1)
    with pytest.raises(CheckpointError, match="exceeds the 104857600-byte limit") as err:
        parse_header(big)
    assert "big.safetensors" in str(err.value)
    # the default limit (2M tensors): an object count past it is refused before json.loads
    many = b'{"x":[' + b"{}," * 2_000_001 + b"{}]}"
    absurd = _raw_file(tmp_path / "absurd.safetensors", many)
    with pytest.raises(CheckpointError, match="more than 2000000 tensors") as err:
        parse_header(absurd)
    assert "absurd.safetensors" in str(err.value)
    header = {f"t{i}": _entry("U8", [1], i, i + 1) for i in range(11)}
    with pytest.raises(CheckpointError, match="more than 10 tensors"):
        parse_header(_raw_file(tmp_path / "eleven.safetensors", header, b"x" * 11),
                     max_tensors=10)
    assert parsed == []
    assert len(parse_header(tmp_path / "eleven.safetensors").tensors) == 11
    assert parsed == [1]


@pytest.mark.parametrize("header,needle,tensor", [
    (b'{"a\xff":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', "not valid UTF-8", None),
    (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}', "not valid JSON", None),
    (b'{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,1]}}', "not valid JSON", None),
    (b'{"a":{"dtype":"F7","shape":[1],"data_offsets":[0,1]}}', "unknown dtype 'F7'", "a"),
    (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"__metadata__":{"k":1}}',
     "__metadata__ must map strings to strings", None),
    (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"__metadata__":""}',
     "__metadata__ must map strings to strings", None),
    (b'{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', "not valid Unicode", None),
])
def test_row05_bad_text_json_dtype_metadata(tmp_path: Path, header: bytes, needle: str,
                                            tensor: Optional[str]) -> None:
    path = _raw_file(tmp_path / "bad.safetensors", header, b"x")
    with pytest.raises(CheckpointError) as err:
        parse_header(path)
    assert needle in str(err.value) and "bad.safetensors" in str(err.value)
    assert err.value.file == "bad.safetensors" and (tensor is None or err.value.tensor == tensor)


@pytest.mark.parametrize("entries,data_len,needle,tensor", [
    ({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [2], 4, 12)}, 12, "overlaps", "b"),
    ({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [1], 12, 16)}, 16, "hole of 4", "b"),
    ({"a": _entry("F32", [4], 0, 16)}, 8, "past the end of the data region", "a"),
    ({"a": _entry("F32", [3], 0, 8)}, 8, "byte span 8 != numel x itemsize = 12", "a"),
    ({"a": _entry("F32", [2 ** 62, 2 ** 62], 0, 8)}, 8, "size overflow", "a"),
    ({"a": _entry("U8", [2 ** 64, 0], 0, 0)}, 0, "size overflow", "a"),
    ({"a": _entry("U8", [1], 1, 0)}, 1, "0 <= begin <= end", "a"),
])
def test_row06_ranges_spans_overflow(tmp_path: Path, entries: dict, data_len: int, needle: str,
                                     tensor: str) -> None:
    path = _raw_file(tmp_path / "ranges.safetensors", entries, b"\0" * data_len)
    with pytest.raises(CheckpointError) as err:
        parse_header(path)
    assert needle in str(err.value), str(err.value)
    assert err.value.file == "ranges.safetensors" and err.value.tensor == tensor


def test_row07_duplicate_key_rejected_where_the_reference_keeps_the_last(tmp_path: Path) -> None:
    a1, a2 = (json.dumps(_entry("U8", [1], i, i + 1)) for i in (0, 1))
    header = f'{{"a":{a1},"a":{a2}}}'.encode()
    path = _raw_file(tmp_path / "dup.safetensors", header, b"xy")
    with pytest.raises(CheckpointError, match="duplicate key 'a'") as err:
        parse_header(path)
    assert err.value.file == "dup.safetensors" and err.value.tensor == "a"
    # why it matters: the reference reader silently keeps one of them
    try:
        with safe_open(str(path), "pt") as fh:
            assert list(fh.keys()) == ["a"]
    except Exception:  # noqa: BLE001 - a stricter future reference is fine too
        pass


def test_row08_same_tensor_in_two_shards_names_both(model: Path, tmp_path: Path) -> None:
    wmap = _index(model)["weight_map"]
    other = _last_shard(model)
    name = next(n for n in sorted(wmap) if n.startswith("model.layers.5.") and wmap[n] != other)
    home = wmap[name]
    stolen = load_file(str(model / home))[name]
    path = model / other
    tensors = load_file(str(path))
    tensors[name] = stolen
    save_file(tensors, str(path))  # the index still maps it to its home shard
    with pytest.raises(CheckpointError) as err:
        plan_stage(model, Topology(2, rank=1))
    msg = str(err.value)
    assert home in msg and other in msg and name in msg and "rank 1" in msg
    # without an index: the headers themselves disagree
    flat = tmp_path / "flat"
    flat.mkdir()
    save_file({"a": torch.zeros(2)}, str(flat / "one.safetensors"))
    save_file({"a": torch.ones(2), "b": torch.ones(1)}, str(flat / "two.safetensors"))
    with pytest.raises(CheckpointError, match="tensor appears in both one.safetensors and "
                       "two.safetensors") as err:
        open_checkpoint(flat)
    assert err.value.tensor == "a"


def test_row09_every_missing_shard_listed_before_any_is_opened(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = sorted(set(_index(model)["weight_map"].values()))
    gone = [files[2], files[5], files[-1]]
    for f in gone:
        (model / f).unlink()
    opens = _Opens(monkeypatch)
    assert sorted(open_checkpoint(model).missing) == sorted(gone)  # recorded...
    with pytest.raises(CheckpointError) as err:  # ...and refused when a plan needs them
        plan_stage(model, Topology(1))
    assert f"{len(gone)} file(s) named in {INDEX_NAME} are missing" in str(err.value)
    assert all(f in str(err.value) for f in gone) and "rank 0" in str(err.value)
    assert opens.shards() == []


def test_row10_index_and_headers_disagree(model: Path, tiny_llama: Path) -> None:
    index = _index(model)
    name = "model.layers.6.self_attn.q_proj.weight"
    moved_to = _last_shard(model)
    home = index["weight_map"][name]
    index["weight_map"][name] = moved_to  # the index lies about where it lives
    (model / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        plan_stage(model, Topology(2, rank=1))
    msg = str(err.value)
    assert name in msg and "rank 1" in msg and (home in msg or moved_to in msg)
    # a shard holding a tensor the index does not list
    fresh = _copy(tiny_llama, model.parent / "extra")
    shard = _last_shard(fresh)
    path = fresh / shard
    tensors = load_file(str(path))
    tensors["model.layers.7.extra.weight"] = torch.zeros(2, dtype=torch.bfloat16)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="in the shard but not in") as err:
        plan_stage(fresh, Topology(2, rank=1))
    assert err.value.tensor == "model.layers.7.extra.weight" and err.value.file == shard


def test_row11_required_tensor_missing(model: Path) -> None:
    name = "model.layers.5.mlp.up_proj.weight"
    _rewrite_shard(model, _index(model)["weight_map"][name], lambda t: t.pop(name))
    before = _digest(model)
    with pytest.raises(PlanError, match="required tensor") as err:
        plan_stage(model, Topology(2, rank=1))
    assert err.value.tensor == name and err.value.rank == 1 and name in str(err.value)
    assert _digest(model) == before
    plan_stage(model, Topology(2, rank=0))  # stage 0 does not need it: only stage 1 fails


def test_row11_missing_quantization_scale_is_not_exempt(tmp_path: Path) -> None:
    quant = pytest.importorskip("pploader.planning.quant")
    cfg = tiny_config(quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                           "activation_scheme": "dynamic",
                                           "weight_block_size": [16, 16]})
    spec = pytest.importorskip("pploader.planning.spec").spec_from_config(cfg)
    if not hasattr(quant, "expected_tensors"):
        pytest.skip("pploader.planning.quant has no expected_tensors")
    expected = quant.expected_tensors(spec)
    scheme = quant.quant_scheme(spec)
    quantized = {n[:-len("_scale_inv")] for n in expected if n.endswith("weight_scale_inv")}
    tensors = {}
    for name, shape in expected.items():
        dtype = torch.float8_e4m3fn if name in quantized else (
            torch.float32 if name.endswith("_scale_inv") else torch.bfloat16)
        tensors[name] = torch.zeros(tuple(shape), dtype=torch.float32).to(dtype)
    scales = sorted(n for n in tensors if n.endswith("weight_scale_inv"))
    assert scheme is not None and scales, "the fp8 scheme should give block scales"
    victim = [n for n in scales if ".layers.6." in n][0]
    del tensors[victim]
    from pploader.tiny import write_checkpoint
    model = tmp_path / "fp8"
    write_checkpoint(model, tensors, cfg, shard_bytes=200_000)
    with pytest.raises(PlanError, match="missing") as err:
        plan_stage(model, Topology(2, rank=1))
    assert victim in str(err.value) and "rank 1" in str(err.value)


@pytest.mark.parametrize("value", ["../x.safetensors", "/etc/passwd", "a\x00b.safetensors",
                                   "sub\\x.safetensors", "./x.safetensors", "", "a//b", 7])
def test_row12_unsafe_weight_map_values_rejected_with_zero_files_opened(
        model: Path, monkeypatch: pytest.MonkeyPatch, value: Any) -> None:
    index = _index(model)
    name = sorted(index["weight_map"])[3]
    index["weight_map"][name] = value
    (model / INDEX_NAME).write_text(json.dumps(index))
    opens = _Opens(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(model)
    assert err.value.file == INDEX_NAME and err.value.tensor == name
    assert "weight_map value" in str(err.value)
    assert [os.path.basename(p) for p in opens.paths] == [INDEX_NAME]  # the index, nothing else


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
    victim = _last_shard(snap)
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
    _set_config(model, **change)
    reads = _no_data_reads(monkeypatch)
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
    file = _index(bf16)["weight_map"][name]
    _rewrite_shard(bf16, file, lambda t: t.update({name: t[name].to(torch.float16)}))
    with pytest.raises(PlanError) as err:
        plan_stage(bf16, Topology(2, rank=1))
    msg = str(err.value)
    assert "F16" in msg and "BF16" in msg and "allowlist" in msg
    assert err.value.file == file and err.value.tensor == name and err.value.rank == 1
    # float32 model, one tensor stored in bfloat16: exact widening -> cast on load
    f32 = make_model(tmp_path / "f32", tiny_config(dtype="float32"))
    ref = reference_tensors(f32)
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite_shard(f32, _index(f32)["weight_map"][name],
                   lambda t: t.update({name: t[name].to(torch.bfloat16)}))
    state = load_stage(plan_stage(f32, Topology(1))).state_dict
    assert state[name].dtype == torch.float32
    assert torch.equal(state[name], ref[name].to(torch.bfloat16).to(torch.float32))
    # bfloat16 model with a float32 norm: full precision by design -> kept as stored
    norm = "model.norm.weight"
    keep = make_model(tmp_path / "keep")
    _rewrite_shard(keep, _index(keep)["weight_map"][norm],
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
    ({"dtype": None, "torch_dtype": None}, "no dtype / torch_dtype"),
])
def test_row16_unknown_architecture_or_no_dtype_rejected_up_front(
        model: Path, monkeypatch: pytest.MonkeyPatch, change: dict, needle: str) -> None:
    _set_config(model, **change)
    opens = _Opens(monkeypatch)
    with pytest.raises(ConfigError, match=needle) as err:
        plan_stage(model, Topology(2, rank=1))
    assert err.value.rank == 1 and "config.json" in str(err.value)
    if "architecture" in needle:
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


@pytest.mark.slow
def test_row21_one_rank_out_of_memory_every_rank_agrees(job: dict) -> None:
    msg = _agreed(job, 1)
    assert "1 rank(s) failed" in msg and "rank 1: MemoryBudgetError" in msg
    assert re.search(r"tensor \S+: out of memory: tensor of \d+ bytes", msg), msg
    assert _digest(job["dirs"]["budget"]) == job["digests"]["budget"]


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
