"""The public API's arguments are checked like the CLI's options (issue 44): one table
(pploader/arguments.py), an ArgumentError (a pploader.errors type, also a ValueError) naming
the argument; a string is never taken for a sequence of paths."""
from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from helpers import make_model
from pploader import (PoolOptions, PPLoaderStorageReader, StageLoadOptions, Topology,
                      iter_stage_weights, load_stage, plan_stage)
from pploader.errors import ArgumentError, PPLoaderError


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("api-args") / "m")


@pytest.fixture(scope="module")
def escaping(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Path:
    """A copy of ``model`` whose first shard is a symlink to a file outside it."""
    root = tmp_path_factory.mktemp("escape")
    inside, outside = root / "m", root / "elsewhere"
    shutil.copytree(model, inside)
    outside.mkdir()
    shard = sorted(inside.glob("*.safetensors"))[0]
    shutil.move(shard, outside / shard.name)
    shard.symlink_to(outside / shard.name)
    return inside


def _one(world: int = 1) -> Topology:
    return Topology.for_world(world, 0, pp=world)


def test_a_string_is_never_taken_for_a_list_of_roots(escaping: Path) -> None:
    """``allowed_roots="/data"`` used to admit every symlink target: the containment check
    iterated the string's characters, and "/" is one of them."""
    with pytest.raises(PPLoaderError, match="outside the allowed roots"):
        plan_stage(escaping, _one())  # the symlink is refused without a root
    for roots in ("/data", str(escaping.parent / "elsewhere"), b"/data", Path("/data")):
        with pytest.raises(ArgumentError, match="a single path, not a list") as exc:
            plan_stage(escaping, _one(), allowed_roots=roots)  # type: ignore[arg-type]
        assert exc.value.argument == "allowed_roots"
        with pytest.raises(ArgumentError, match="allowed_roots"):
            StageLoadOptions(allowed_roots=roots)  # type: ignore[arg-type]
        with pytest.raises(ArgumentError, match="allowed_roots"):
            PPLoaderStorageReader(escaping, allowed_roots=roots)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="not an existing directory"):
        plan_stage(escaping, _one(), allowed_roots=["/no/such/root"])
    staged = plan_stage(escaping, _one(), allowed_roots=[str(escaping.parent / "elsewhere")])
    assert staged.plan.items  # the fix the message names works


BAD_READS = [("threads", 0), ("threads", -1), ("threads", 2.5), ("threads", "4"),
             ("threads", 1 << 40), ("window_bytes", math.nan), ("window_bytes", 0.5),
             ("window_bytes", math.inf), ("window_bytes", 0), ("window_bytes", 1 << 62),
             ("window_bytes", "1G"), ("window_bytes", True), ("io_backend", "nope"),
             ("io_backend", 3), ("io_backend", "")]


@pytest.mark.parametrize("arg,value", BAD_READS)
def test_storage_reader_refuses_bad_arguments(model: Path, arg: str, value: object) -> None:
    with pytest.raises(ArgumentError) as exc:
        PPLoaderStorageReader(model, **{arg: value})  # type: ignore[arg-type]
    assert exc.value.argument == arg and arg in str(exc.value)


@pytest.mark.parametrize("arg,value", [a for a in BAD_READS if a[0] != "io_backend"])
def test_load_functions_refuse_bad_arguments(model: Path, arg: str, value: object) -> None:
    staged = plan_stage(model, _one())
    with pytest.raises(ArgumentError, match=arg):
        load_stage(staged, **{arg: value})  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match=arg):
        dict(iter_stage_weights(staged, **{arg: value}))  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match=arg):
        StageLoadOptions(**{arg: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [
    {"range_cost_bytes": -1}, {"range_cost_bytes": 0.5}, {"range_cost_bytes": 1e30},
    {"exchange_cost": math.nan}, {"exchange_cost": -1.0}, {"exchange_cost": "auto"},
    {"exchange_batch_bytes": 0}, {"exchange_batch_bytes": 0.5},
    {"exchange_batch_bytes": 1 << 62}])
def test_plan_stage_refuses_bad_arguments(model: Path, kwargs: dict) -> None:
    (arg,) = kwargs
    with pytest.raises(ArgumentError, match=arg) as exc:
        plan_stage(model, _one(), **kwargs)
    assert exc.value.argument == arg
    assert isinstance(exc.value, ValueError)  # also what Python raises for a bad argument


def test_plan_stage_refuses_a_topology_that_is_not_one(model: Path) -> None:
    with pytest.raises(ArgumentError, match="not a Topology"):
        plan_stage(model, None)  # type: ignore[arg-type]  # was an AttributeError


@pytest.mark.parametrize("kwargs", [
    {"tokens": 0}, {"tokens": 1 << 40}, {"requests": -1}, {"requests": 0.5},
    {"budget_bytes": 0.5}, {"budget_bytes": float("inf")}, {"device_bytes": 1 << 60},
    {"memory_fraction": 0.0}, {"memory_fraction": math.nan}, {"mamba_ratio": 1.5},
    {"page_size": 0}, {"max_context": 0}])
def test_pool_options_refuse_bad_values(kwargs: dict) -> None:
    (arg,) = kwargs
    with pytest.raises(ArgumentError, match=arg):
        PoolOptions(**kwargs)


def test_good_values_pass(model: Path) -> None:
    StageLoadOptions(allowed_roots=[str(model)], threads=2, window_bytes=1 << 20,
                     exchange_cost="auto", io_backend="buffered")
    PoolOptions(tokens=4096, requests=16, memory_fraction=0.9, mamba_ratio=0.0)
    PPLoaderStorageReader(model, threads=1, window_bytes=1 << 20, io_backend="threaded",
                          allowed_roots=(str(model),))


def _misuses(model: Path) -> list[tuple[str, Any, str]]:
    """(what, a call with one bad argument, the name the error must give)."""
    import threading

    import torch

    from pploader import (check_engine_window, get_pp_indices, load_stage_into,
                          measure_exchange_cost, pipeline_window, plan_job, reload_from_disk)
    staged = plan_stage(model, _one())
    window = staged.plan.window
    return [
        ("for_world tp=0", lambda: Topology.for_world(4, 0, tp=0), "tp"),   # ZeroDivisionError
        ("for_world ep=0", lambda: Topology.for_world(4, 0, ep=0), "ep"),
        ("for_world rank None", lambda: Topology.for_world(1, None), "rank"),  # type: ignore
        ("Topology huge", lambda: Topology(1 << 20), "pp_size"),
        ("plan_job tp huge", lambda: plan_job(model, 1, tp=10**30), "tp_size"),  # MemoryError
        ("plan_job pools", lambda: plan_job(model, 1, pools=""), "pools"),  # type: ignore
        ("plan_job partition", lambda: plan_job(model, 1, partition=None), "partition"),  # type: ignore
        ("plan_stage topology", lambda: plan_stage(model, "0"), "topology"),  # type: ignore
        ("plan_stage opened", lambda: plan_stage(model, _one(), opened=""), "opened"),  # type: ignore
        ("plan_stage node_ranks", lambda: plan_stage(model, _one(), node_ranks=0), "node_ranks"),  # type: ignore
        ("load_stage staged", lambda: load_stage(None), "staged"),  # type: ignore  # AttributeError
        ("load_stage device", lambda: load_stage(staged, device=""), "device"),
        ("load_stage cancel", lambda: load_stage(staged, cancel=""), "cancel"),  # type: ignore
        ("load_stage on_progress", lambda: load_stage(staged, on_progress=""), "on_progress"),  # type: ignore
        ("iter topology", lambda: list(iter_stage_weights(staged, topology="")), "topology"),  # type: ignore
        ("iter mode", lambda: list(iter_stage_weights(staged, mode=None)), "mode"),  # type: ignore
        ("iter ring", lambda: list(iter_stage_weights(staged, ring=object())), "ring"),  # type: ignore
        ("iter comm", lambda: list(iter_stage_weights(staged, comm="c")), "comm"),  # type: ignore
        ("reload comm", lambda: reload_from_disk(torch.nn.Linear(1, 1), model, comm="c"),  # type: ignore
         "comm"),
        ("reload model", lambda: reload_from_disk(None, model), "model"),  # type: ignore
        ("reload roots", lambda: reload_from_disk(torch.nn.Linear(1, 1), model,
                                                  allowed_roots="/x"), "allowed_roots"),
        ("reader names", lambda: PPLoaderStorageReader(model, names=""), "names"),  # type: ignore
        ("reader staging_device", lambda: PPLoaderStorageReader(model, staging_device=""),
         "staging_device"),
        ("check_engine_window", lambda: check_engine_window(None, 0, 8), "window"),  # type: ignore
        ("get_pp_indices", lambda: get_pp_indices(3, 3, 4), "no layer"),
        ("pipeline_window", lambda: pipeline_window(None, [0]), "stage"),
        ("pipeline_window layers", lambda: pipeline_window(0, None, 1), "layers"),  # type: ignore
        ("measure_exchange_cost", lambda: measure_exchange_cost(None), "model_dir"),  # type: ignore
        ("measure_exchange_cost device", lambda: measure_exchange_cost(model, "tpu"), "device"),
        ("load_stage_into module", lambda: load_stage_into(None, staged), "module"),  # type: ignore
        ("load_stage_into device", lambda: load_stage_into(torch.nn.Linear(1, 1), staged,
                                                           device="gpu0"), "device"),
        ("ReadOptions cancel", lambda: StageLoadOptions(threads=threading.Event()), "threads"),  # type: ignore
    ]


def test_every_public_misuse_is_a_named_pploader_error(model: Path) -> None:
    """Issue 44: no ZeroDivisionError, AttributeError, TypeError or MemoryError from a bad
    argument of a public function: a pploader.errors type whose message names it."""
    failed = []
    for what, call, name in _misuses(model):
        try:
            call()
            failed.append(f"{what}: accepted")
        except PPLoaderError as exc:
            if name not in str(exc):
                failed.append(f"{what}: {exc} (does not name {name})")
        except Exception as exc:  # noqa: BLE001 - what the test is about
            failed.append(f"{what}: {type(exc).__name__}: {exc}")
    assert not failed, "\n".join(failed)
