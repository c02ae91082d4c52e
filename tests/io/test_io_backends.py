"""The read-backend seam (io/backend.py, io/registry.py): every CPU backend gives the bytes of the
default one and of safe_open (TP slices with vocab padding, coalesced strided reads, EP experts),
fails with the same error on a changed file, and is picked in one place."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import make_model, reference_tensors, tiny_config
from pploader import ReadError, Topology, is_borrowed, load_stage, plan_stage
from pploader.io.backend import ReadBackend, ReadOptions
from pploader.io.read import Reader
from pploader.io.registry import BACKENDS, BackendInfo, open_backend, select_backend

#: the local-file CPU backends (the object-store one has its own tests: tests/storage/)
CPU_BACKENDS = [b.name for b in BACKENDS if "cpu" in b.devices and b.storage == "file"]
BIG_RANGE_COST = 1 << 30  # strided slices read as covering boxes: gather items


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("backends")
    return {"llama": make_model(root / "llama", tiny_config(vocab_size=250)),  # padded vocab
            "moe": make_model(root / "moe", tiny_config("tiny-qwen3_moe"))}


#: (model, pp, tp, ep): the ranks of each layout are all loaded
LAYOUTS = [("llama", 1, 1, 1), ("llama", 2, 4, 1), ("moe", 1, 1, 2), ("moe", 2, 2, 2)]


def _ranks(pp: int, tp: int, ep: int) -> list[Topology]:
    return [Topology(pp, tp, ep, rank=r) for r in range(pp * tp * ep)]


def _plan(model: Path, topo: Topology, range_cost: int) -> Any:
    return plan_stage(model, topo, range_cost_bytes=range_cost, exchange_cost=None)


@pytest.mark.parametrize("range_cost", [0, BIG_RANGE_COST])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "-".join(map(str, x)))
def test_every_cpu_backend_equals_the_default_bitwise(models: dict[str, Path], layout: tuple,
                                                      range_cost: int) -> None:
    name, pp, tp, ep = layout
    for topo in _ranks(pp, tp, ep):
        staged = _plan(models[name], topo, range_cost)
        default = load_stage(staged).state_dict
        assert len(default) == len(staged.plan.items)
        for backend in CPU_BACKENDS:
            got = load_stage(staged, io_backend=backend)
            assert got.state_dict.keys() == default.keys(), backend
            for target, t in default.items():
                other = got.state_dict[target]
                assert (other.dtype, other.shape) == (t.dtype, t.shape), (backend, target)
                assert torch.equal(other, t), (backend, topo.describe(), target)
            assert got.stats.read_bytes == staged.plan.planned_read_bytes, backend
            assert got.stats.items == len(staged.plan.items), backend


def test_the_layouts_exercise_every_materialise_branch(models: dict[str, Path]) -> None:
    """Padded vocab rows, gathers of coalesced strided reads and expert slices all occur."""
    items = [i for name, pp, tp, ep in LAYOUTS for topo in _ranks(pp, tp, ep)
             for i in _plan(models[name], topo, BIG_RANGE_COST).plan.items]
    assert any(i.pad_rows for i in items)
    assert any(not i.direct for i in items)
    assert any("experts" in i.name for i in items)


@pytest.mark.parametrize("range_cost", [0, BIG_RANGE_COST])
@pytest.mark.parametrize("layout", [("llama", 1, 2, 1), ("moe", 1, 2, 2)],
                         ids=lambda x: "-".join(map(str, x)))
def test_buffered_slices_reassemble_to_safe_open(models: dict[str, Path], layout: tuple,
                                                 range_cost: int) -> None:
    """Every rank through ``buffered``: a replicated tensor equals safe_open's, a TP slice
    set (concatenated along the split dim, padding cut) and an EP expert equal it too."""
    name, pp, tp, ep = layout
    ref = reference_tensors(models[name])
    pieces: dict[str, list[torch.Tensor]] = {}
    for topo in _ranks(pp, tp, ep):
        staged = _plan(models[name], topo, range_cost)
        out = load_stage(staged, io_backend="buffered").state_dict
        names = {i.target: i.name for i in staged.plan.items}
        for target, t in out.items():
            pieces.setdefault(names[target], []).append(t)
    assert pieces.keys() == ref.keys()
    for key, parts in pieces.items():
        full = ref[key]
        if all(p.shape == full.shape for p in parts):  # replicated (or one expert's owner)
            assert all(torch.equal(p, full) for p in parts), key
            continue
        dim = next(d for d in range(full.dim()) if parts[0].shape[d] != full.shape[d])
        # a TP group's slices, once per EP/TP replica: take the first tp of them in rank order
        joined = torch.cat(parts[:tp], dim).narrow(dim, 0, full.shape[dim])
        assert torch.equal(joined, full), key


def test_changed_file_gives_the_same_error_on_every_backend(models: dict[str, Path],
                                                            tmp_path: Path) -> None:
    """A shard truncated after planning: ReadError naming the shard, its first planned tensor
    and the rank, word for word the same from each backend; nothing is returned."""
    import shutil
    model = tmp_path / "m"
    shutil.copytree(models["llama"], model)
    staged = plan_stage(model, Topology(2, rank=1))
    shard = staged.plan.items[-1].file
    path = model / shard
    path.write_bytes(path.read_bytes()[:-10])
    first = next(i.name for i in staged.plan.items if i.file == shard)
    messages = []
    for backend in CPU_BACKENDS:
        with pytest.raises(ReadError) as err:
            load_stage(staged, io_backend=backend)
        assert (err.value.file, err.value.tensor, err.value.rank) == (shard, first, 1), backend
        assert "file changed during load" in str(err.value)
        messages.append(str(err.value))
    assert len(set(messages)) == 1, messages


def test_truncated_while_reading_names_file_tensor_rank(models: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """The identity check passes (size and inode faked to match) but bytes are missing: an
    unexpected end of file, named, from each backend."""
    import dataclasses
    import os
    import shutil
    model = tmp_path / "m"
    shutil.copytree(models["llama"], model)
    staged = plan_stage(model, Topology(1))
    last = max(staged.plan.items, key=lambda i: i.ranges[-1][0] if i.ranges else -1)
    path = model / last.file
    path.write_bytes(path.read_bytes()[:last.ranges[-1][0]])
    ids = dict(staged.plan.identities)
    from pploader.planning.checkpoint import FileIdentity
    ids[last.file] = FileIdentity.of(os.stat(path))
    plan = dataclasses.replace(staged.plan, identities=ids)
    for backend in CPU_BACKENDS:
        with pytest.raises(ReadError, match="unexpected end of file") as err:
            load_stage(dataclasses.replace(staged, plan=plan), io_backend=backend)
        assert (err.value.file, err.value.rank) == (last.file, 0), backend
        assert err.value.tensor is not None, backend


def test_one_place_picks_the_backend() -> None:
    assert select_backend("cpu").name == "threaded"
    assert select_backend("cuda:1").name == "pinned"
    assert select_backend("cpu", "auto").name == "threaded"
    assert select_backend("cpu", "buffered").name == "buffered"
    with pytest.raises(ValueError, match="'buffered' loads onto cpu, not cuda:0"):
        select_backend("cuda:0", "buffered")
    with pytest.raises(ValueError, match="io_backend='gds' is not a read backend.*threaded, pinned"):
        select_backend("cpu", "gds")
    with pytest.raises(ValueError, match="no read backend loads onto meta"):
        select_backend("meta")


def test_a_table_row_is_all_a_backend_needs(models: dict[str, Path]) -> None:
    """open_backend takes its table as an argument: a new row (here the buffered factory under
    another name) is a new backend, and what it makes satisfies the protocol."""
    plan = plan_stage(models["llama"], Topology(1)).plan
    table = (BackendInfo("mine", "pploader.io.buffered:open_buffered", ("cpu",), "test"),)
    backend = open_backend(plan, "cpu", ReadOptions(), "mine", backends=table)
    assert isinstance(backend, ReadBackend)
    ref = reference_tensors(models["llama"])
    dest = {i.target: torch.empty(i.shape, dtype=ref[i.name].dtype) for i in plan.items}
    out = backend.load(dest)
    assert all(out[t] is dest[t] and torch.equal(dest[t], ref[t]) for t in dest)
    for name in CPU_BACKENDS:
        assert isinstance(open_backend(plan, "cpu", name=name), ReadBackend)
        streamed = dict(open_backend(plan, "cpu", name=name))
        assert all(torch.equal(streamed[t], ref[t]) for t in ref)


def test_borrowed_views_are_stable_after_the_stream_ends(models: dict[str, Path]) -> None:
    """The ring (not a module global) owns the borrowed mark: a view held past the end of the
    stream is no longer borrowed (nothing refills it)."""
    plan = plan_stage(models["llama"], Topology(1)).plan
    views = []
    for _, t in Reader(plan, mode="borrowed", window_bytes=2 * plan.largest_item_bytes):
        views.append(t.view(-1)[:1])
        assert is_borrowed(views[-1])
    assert not any(is_borrowed(v) for v in views)


def test_cli_help_lists_every_backend() -> None:
    out = subprocess.run([sys.executable, "-m", "pploader", "load", "--help"],
                         capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())
    for b in BACKENDS:
        assert f"{b.name} ({'/'.join(b.devices)})" in flat


@pytest.mark.slow
def test_torchrun_cli_io_backend_buffered(models: dict[str, Path], tmp_path: Path) -> None:
    """``pploader load --io-backend buffered`` (PP=2, gloo): every rank's saved tensors are
    safe_open's, and the JSON report counts the planned bytes."""
    import json

    from safetensors.torch import load_file

    from helpers import run, torchrun_cmd
    model = models["llama"]
    out = run(torchrun_cmd(2, "load", "--model", str(model), "--pp", "2", "--json",
                           "--no-pools", "--io-backend", "buffered",
                           "--save-loaded", str(tmp_path / "saved")), timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout[out.stdout.index("{"):])
    assert all(r["read_bytes"] == r["ideal_bytes"] for r in doc["ranks"])
    ref, union = reference_tensors(model), {}
    for rank in range(2):
        union.update(load_file(str(tmp_path / "saved" / f"rank-{rank}.safetensors")))
    assert union.keys() == ref.keys() and all(torch.equal(union[k], ref[k]) for k in ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 3)])
def test_in_place_writes_through_buffered_equal_the_default(models: dict[str, Path],
                                                             dtype: torch.dtype, tp: int,
                                                             rank: int) -> None:
    """load_stage_into(io_backend="buffered"): fused qkv / gate_up slices written straight
    (checkpoint dtype) or through the copy path (a cast) equal the default backend's."""
    from bind_models import TinyLM
    from pploader import load_stage_into
    topo = Topology(2, tp, rank=rank)
    stages = []
    for backend in (None, "buffered"):
        staged = plan_stage(models["llama"], topo)
        module = TinyLM(tiny_config(vocab_size=250), staged.plan.window, tp=tp, dtype=dtype,
                        device="meta")
        result = load_stage_into(module, staged, allow_cast=dtype != torch.bfloat16,
                                 io_backend=backend)
        assert result.stats.read_bytes == sum(i.read_bytes for i in staged.plan.items)
        stages.append(module.state_dict())
    assert stages[0].keys() == stages[1].keys()
    assert all(torch.equal(stages[0][k], stages[1][k]) for k in stages[0])


def test_pinned_backend_wiring_without_a_gpu(models: dict[str, Path]) -> None:
    """What the registry hands the CUDA path, checked without touching CUDA (nothing is read):
    the default ring (16 threads x 16 MiB slots), a ring fitted to the window for in-place
    writes bounded by one, a ring passed in reused."""
    from pploader.io.device import DEFAULT_DEVICE_THREADS, DEFAULT_SLOT_BYTES, DeviceLoader
    plan = plan_stage(models["llama"], Topology(1)).plan
    default = open_backend(plan, "cuda:0")
    assert isinstance(default, DeviceLoader) and isinstance(default, ReadBackend)
    assert (default.ring.threads, default.ring.slot_bytes) == (DEFAULT_DEVICE_THREADS,
                                                               DEFAULT_SLOT_BYTES)
    fitted = open_backend(plan, "cuda:0", ReadOptions(threads=4, window_bytes=1 << 20,
                                                      fit_staging=True))
    assert (fitted.ring.threads, fitted.ring.slot_bytes) == (4, (1 << 20) // 8)  # type: ignore[attr-defined]
    import dataclasses
    one = dataclasses.replace(plan, items=plan.items[:1])
    # no window: the process's staging (io/staging.py; here, without CUDA, a plain ring)
    small = open_backend(one, "cuda:0", ReadOptions(fit_staging=True))
    assert small.ring.slot_bytes == DEFAULT_SLOT_BYTES  # type: ignore[attr-defined]
    again = open_backend(plan, "cuda:1", ReadOptions(ring=default.ring))
    assert again.ring is default.ring  # type: ignore[attr-defined]


def test_staging_is_prepared_only_where_a_backend_declares_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare_staging`` (what load_pipeline_stage starts before planning) goes through the
    table like ``open_backend``: the backend's ``staging`` factory gets the device and the
    options; a backend without one (every CPU backend) gives None."""
    import sys
    import types

    from pploader.io.registry import prepare_staging
    made: list[tuple] = []
    module = types.ModuleType("fake_staging_backend")
    module.make = lambda device, options: made.append((device, options.threads)) or "staging"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_staging_backend", module)
    table = (BackendInfo("plain", "pploader.io.buffered:open_buffered", ("cpu",), "test"),
             BackendInfo("staged", "pploader.io.buffered:open_buffered", ("cpu",), "test",
                         staging="fake_staging_backend:make"))
    assert prepare_staging("cpu", backends=table) is None  # auto: the first row, none
    assert prepare_staging("cpu", ReadOptions(threads=3), "staged", backends=table) == "staging"
    assert made == [(torch.device("cpu"), 3)]
    for name in CPU_BACKENDS:
        assert prepare_staging("cpu", name=name) is None
    with pytest.raises(ValueError, match="is not a read backend"):
        prepare_staging("cpu", name="nope")


def test_same_size_rewrite_restoring_mtime_is_detected(tmp_path: Path) -> None:
    """A shard rewritten in place (same size) with its mtime put back still fails the load:
    ctime cannot be reset."""
    model = make_model(tmp_path / "m")
    plan = plan_stage(model, Topology(1)).plan
    shard = model / plan.files[-1]
    st = os.stat(shard)
    time.sleep(0.01)
    with open(shard, "r+b") as fh:  # same bytes back: only the inode's ctime moves
        data = fh.read()
        fh.seek(0)
        fh.write(data)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(shard).st_mtime_ns == st.st_mtime_ns and os.stat(shard).st_size == st.st_size
    with pytest.raises(ReadError, match="file changed during load.*ctime_ns"):
        dict(Reader(plan))
