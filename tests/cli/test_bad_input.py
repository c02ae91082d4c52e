"""The bad-input matrix of docs/reliability.md, rows 1-12 (a shard, a header or the index is
wrong) and the A rows' 2-rank job (rows 1 and 21); rows 13-17 and 21-23 live in
test_bad_input_load.py, rows 18-20 in test_faults_dist.py, rows 24-25 in test_reload.py.

Each test asserts the error names what applies (file, tensor, rank), that nothing was
mutated (M: checkpoint bytes unchanged, destinations untouched), and for the rows marked A that
every rank of a 2-rank gloo job raises the same combined error within 30 s.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from bad_inputs import (
    Opens,
    copy_model,
    file_digests,
    header_entry,
    index_json,
    last_shard,
    last_tensor,
    no_data_reads,
    raw_file,
    rewrite_shard,
)
from helpers import (
    run,
    run_ranks,
    tiny_config,
    torchrun_cmd,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pploader import (
    CheckpointError,
    PlanError,
    RankFailure,
    Topology,
    load_stage,
    plan_stage,
)
from pploader.planning.checkpoint import INDEX_NAME, open_checkpoint, parse_header


# ---- the A rows: one 2-rank gloo job runs every scenario (rows 1, 21) --------------------


def _job(rank: int, world: int, scenarios: list[tuple[str, str, Optional[int]]]) -> list:
    """Each scenario on every rank: plan, agree, load (budget on the last rank), agree.

    Returns per scenario (outcome, message, seconds from start to the raise)."""
    from pploader.distributed.comm import Comm
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
    truncated = copy_model(tiny_llama, root / "truncated")
    shard = truncated / last_shard(truncated)
    victim = last_tensor(shard)
    shard.write_bytes(shard.read_bytes()[:-10])
    budget = copy_model(tiny_llama, root / "budget")
    digests = {"truncated": file_digests(truncated), "budget": file_digests(budget)}
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
    shard = model / last_shard(model)
    victim = last_tensor(shard)
    shard.write_bytes(shard.read_bytes()[:-10])
    before = file_digests(model)
    reads = no_data_reads(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        plan_stage(model, Topology(2, rank=1))
    msg = str(err.value)
    assert shard.name in msg and victim in msg and "rank 1" in msg and "truncated" in msg
    assert reads == []  # caught from the header + file size, before any tensor data
    assert file_digests(model) == before


@pytest.mark.slow
def test_row01_truncated_shard_every_rank_agrees(job: dict) -> None:
    msg = _agreed(job, 0)
    assert job["shard"] in msg and job["victim"] in msg and "rank 1" in msg
    assert file_digests(job["dirs"]["truncated"]) == job["digests"]["truncated"]


@pytest.mark.parametrize("content,needle", [
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1234567\n", "git-LFS"),
    (b"<!DOCTYPE html>\n<html><body>Sign in to continue</body></html>\n", "HTML"),
    (b"", "too short"),
])
def test_row02_not_a_safetensors_file(model: Path, content: bytes, needle: str) -> None:
    shard = model / last_shard(model)
    shard.write_bytes(content)
    before = file_digests(model)
    with pytest.raises(CheckpointError) as err:
        plan_stage(model, Topology(2, rank=1))
    msg = str(err.value)
    assert "not a safetensors file" in msg and needle in msg
    assert shard.name in msg and "rank 1" in msg
    assert file_digests(model) == before


@pytest.mark.slow
def test_row02_lfs_pointer_under_torchrun_every_rank_exits_nonzero(model: Path) -> None:
    shard = model / last_shard(model)
    shard.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 9\n")
    before = file_digests(model)
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
    assert file_digests(model) == before


def test_row03_bytes_after_data_region(model: Path) -> None:
    shard = model / last_shard(model)
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
    big = raw_file(tmp_path / "big.safetensors", b"{}", length=100 * 1024 * 1024 + 1)
    with pytest.raises(CheckpointError, match="exceeds the 104857600-byte limit") as err:
        parse_header(big)
    assert "big.safetensors" in str(err.value)
    # the default limit (MAX_TENSORS): an object count past it is refused before json.loads
    many = b'{"x":[' + b"{}," * (ckpt.MAX_TENSORS + 1) + b"{}]}"
    absurd = raw_file(tmp_path / "absurd.safetensors", many)
    with pytest.raises(CheckpointError, match=f"more than {ckpt.MAX_TENSORS} tensors") as err:
        parse_header(absurd)
    assert "absurd.safetensors" in str(err.value)
    header = {f"t{i}": header_entry("U8", [1], i, i + 1) for i in range(11)}
    with pytest.raises(CheckpointError, match="more than 10 tensors"):
        parse_header(raw_file(tmp_path / "eleven.safetensors", header, b"x" * 11),
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
    path = raw_file(tmp_path / "bad.safetensors", header, b"x")
    with pytest.raises(CheckpointError) as err:
        parse_header(path)
    assert needle in str(err.value) and "bad.safetensors" in str(err.value)
    assert err.value.file == "bad.safetensors" and (tensor is None or err.value.tensor == tensor)


@pytest.mark.parametrize("entries,data_len,needle,tensor", [
    ({"a": header_entry("F32", [2], 0, 8), "b": header_entry("F32", [2], 4, 12)}, 12, "overlaps", "b"),
    ({"a": header_entry("F32", [2], 0, 8), "b": header_entry("F32", [1], 12, 16)}, 16, "hole of 4", "b"),
    ({"a": header_entry("F32", [4], 0, 16)}, 8, "past the end of the data region", "a"),
    ({"a": header_entry("F32", [3], 0, 8)}, 8, "byte span 8 != numel x itemsize = 12", "a"),
    ({"a": header_entry("F32", [2 ** 62, 2 ** 62], 0, 8)}, 8, "size overflow", "a"),
    ({"a": header_entry("U8", [2 ** 64, 0], 0, 0)}, 0, "size overflow", "a"),
    ({"a": header_entry("U8", [1], 1, 0)}, 1, "0 <= begin <= end", "a"),
])
def test_row06_ranges_spans_overflow(tmp_path: Path, entries: dict, data_len: int, needle: str,
                                     tensor: str) -> None:
    path = raw_file(tmp_path / "ranges.safetensors", entries, b"\0" * data_len)
    with pytest.raises(CheckpointError) as err:
        parse_header(path)
    assert needle in str(err.value), str(err.value)
    assert err.value.file == "ranges.safetensors" and err.value.tensor == tensor


def test_row07_duplicate_key_rejected_where_the_reference_keeps_the_last(tmp_path: Path) -> None:
    a1, a2 = (json.dumps(header_entry("U8", [1], i, i + 1)) for i in (0, 1))
    header = f'{{"a":{a1},"a":{a2}}}'.encode()
    path = raw_file(tmp_path / "dup.safetensors", header, b"xy")
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
    wmap = index_json(model)["weight_map"]
    other = last_shard(model)
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
    files = sorted(set(index_json(model)["weight_map"].values()))
    gone = [files[2], files[5], files[-1]]
    for f in gone:
        (model / f).unlink()
    opens = Opens(monkeypatch)
    assert sorted(open_checkpoint(model).missing) == sorted(gone)  # recorded...
    with pytest.raises(CheckpointError) as err:  # ...and refused when a plan needs them
        plan_stage(model, Topology(1))
    assert f"{len(gone)} file(s) named in {INDEX_NAME} are missing" in str(err.value)
    assert all(f in str(err.value) for f in gone) and "rank 0" in str(err.value)
    assert opens.shards() == []


def test_row10_index_and_headers_disagree(model: Path, tiny_llama: Path) -> None:
    index = index_json(model)
    name = "model.layers.6.self_attn.q_proj.weight"
    moved_to = last_shard(model)
    home = index["weight_map"][name]
    index["weight_map"][name] = moved_to  # the index lies about where it lives
    (model / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        plan_stage(model, Topology(2, rank=1))
    msg = str(err.value)
    assert name in msg and "rank 1" in msg and (home in msg or moved_to in msg)
    # a shard holding a tensor the index does not list
    fresh = copy_model(tiny_llama, model.parent / "extra")
    shard = last_shard(fresh)
    path = fresh / shard
    tensors = load_file(str(path))
    tensors["model.layers.7.extra.weight"] = torch.zeros(2, dtype=torch.bfloat16)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match="in the shard but not in") as err:
        plan_stage(fresh, Topology(2, rank=1))
    assert err.value.tensor == "model.layers.7.extra.weight" and err.value.file == shard


def test_row11_required_tensor_missing(model: Path) -> None:
    name = "model.layers.5.mlp.up_proj.weight"
    rewrite_shard(model, index_json(model)["weight_map"][name], lambda t: t.pop(name))
    before = file_digests(model)
    with pytest.raises(PlanError, match="required tensor") as err:
        plan_stage(model, Topology(2, rank=1))
    assert err.value.tensor == name and err.value.rank == 1 and name in str(err.value)
    assert file_digests(model) == before
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
    index = index_json(model)
    name = sorted(index["weight_map"])[3]
    index["weight_map"][name] = value
    (model / INDEX_NAME).write_text(json.dumps(index))
    opens = Opens(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(model)
    assert err.value.file == INDEX_NAME and err.value.tensor == name
    assert "weight_map value" in str(err.value)
    assert [os.path.basename(p) for p in opens.paths] == [INDEX_NAME]  # the index, nothing else


@pytest.mark.slow
def test_row21_one_rank_out_of_memory_every_rank_agrees(job: dict) -> None:
    msg = _agreed(job, 1)
    assert "1 rank(s) failed" in msg and "rank 1: MemoryBudgetError" in msg
    assert re.search(r"tensor \S+: out of memory: tensor of \d+ bytes", msg), msg
    assert file_digests(job["dirs"]["budget"]) == job["digests"]["budget"]
