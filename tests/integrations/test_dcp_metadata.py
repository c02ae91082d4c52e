"""The DCP reader's plan-step facts (integrations/dcp_metadata.py): each rank's CPU copy
threads are its CPUs shared among the ranks of its host whose CPUs overlap, 1 to the cap; the
global plan step hands each rank its own count."""
from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.checkpoint.planner import LoadPlan

from helpers import make_model, tiny_config
from pploader.integrations.dcp import PPLoaderStorageReader
from pploader.integrations.dcp_metadata import GlobalStep, LocalFacts, copy_threads


def _facts(host: str, cpus: range) -> LocalFacts:
    return LocalFacts(host, frozenset(cpus))


def test_copy_threads_share_a_hosts_cpus() -> None:
    two = range(2)
    # 4 ranks on one 2-core host: 1 thread each (torch's reader runs 1); alone: both cores
    assert copy_threads([_facts("a", two)] * 4, 4) == [1, 1, 1, 1]
    assert copy_threads([_facts("a", two)], 4) == [2]
    # 2 ranks of a 32-core host, each pinned to its own half: the cap; shared: 16 each, cap
    assert copy_threads([_facts("a", range(16)), _facts("a", range(16, 32))], 4) == [4, 4]
    assert copy_threads([_facts("a", range(32))] * 2, 8) == [8, 8]
    assert copy_threads([_facts("a", range(32))] * 8, 8) == [4] * 8
    # other hosts do not count; a plan without facts (a custom planner's) gets None
    assert copy_threads([_facts("a", two), _facts("b", two), None], 4) == [2, 2, None]


def test_local_facts_are_this_process() -> None:
    here = LocalFacts.here()
    assert here.cpus == frozenset(os.sched_getaffinity(0)) and here.host
    assert LocalFacts.here() == here


def test_global_step_gives_each_rank_its_threads(tmp_path: Path) -> None:
    model = make_model(tmp_path / "llama", tiny_config(), shard_bytes=40_000)
    reader = PPLoaderStorageReader(model)
    reader.read_metadata()
    reader.set_up_storage_reader(None, True, rank=0)  # type: ignore[arg-type]
    local = reader.prepare_local_plan(LoadPlan([]))
    assert local.storage_data == LocalFacts.here()
    plans = reader.prepare_global_plan([local, local, LoadPlan([])])
    cpus = len(os.sched_getaffinity(0))
    share = max(1, min(4, cpus // 2))
    assert [p.storage_data for p in plans] == [GlobalStep(3, share), GlobalStep(3, share),
                                                GlobalStep(3, None)]
