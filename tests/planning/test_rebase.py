"""A reload's plan: reused for a checkpoint of the served layout, planned afresh otherwise."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from helpers import make_model, reference_tensors
from pploader import Topology, iter_stage_weights, plan_stage
from pploader.planning.rebase import rebase_stage


@pytest.fixture()
def served(tmp_path: Path) -> Path:
    return make_model(tmp_path / "served")


def _copy(src: Path, dst: Path, scale: float = 2.0) -> Path:
    """Same layout, new values: every floating tensor scaled, written back in the same order
    and dtypes (so the headers' offsets are equal)."""
    shutil.copytree(src, dst)
    for shard in sorted(dst.glob("*.safetensors")):
        _rewrite(shard, lambda v: v * scale if v.is_floating_point() else v)
    return dst


def _rewrite(shard: Path, change: Callable[[torch.Tensor], torch.Tensor]) -> None:
    with safe_open(str(shard), "pt") as fh:   # keep the header's metadata (and its length)
        metadata = fh.metadata()
    save_file({k: change(v) for k, v in load_file(str(shard)).items()}, str(shard),
              metadata=metadata)


def _other_dtype(v: torch.Tensor) -> torch.Tensor:
    if not v.is_floating_point():
        return v
    return v.to(torch.float16 if v.dtype == torch.float32 else torch.float32)


@pytest.mark.parametrize("tp", [1, 2])
def test_same_layout_keeps_the_plan_with_the_new_files(served: Path, tmp_path: Path,
                                                       tp: int) -> None:
    topo = Topology(2, tp, 1, 1 * tp + 0)
    staged = plan_stage(served, topo)
    new_dir = _copy(served, tmp_path / "step1")
    rebased = rebase_stage(staged, new_dir)
    assert rebased is not None
    fresh = plan_stage(new_dir, topo)
    assert rebased.plan.items == fresh.plan.items
    assert dict(rebased.plan.paths) == dict(fresh.plan.paths)
    assert dict(rebased.plan.identities) == dict(fresh.plan.identities)
    assert rebased.plan == fresh.plan
    got = dict(iter_stage_weights(rebased))
    want = reference_tensors(new_dir)
    assert got and all(torch.equal(got[n], fresh_t) for n, fresh_t in
                       dict(iter_stage_weights(fresh)).items())
    name = next(n for n in got if n in want and got[n].shape == want[n].shape)
    assert torch.equal(got[name], want[name])


def test_a_different_config_or_header_is_planned_afresh(served: Path, tmp_path: Path) -> None:
    staged = plan_stage(served, Topology(2, 1, 1, 0))
    other = _copy(served, tmp_path / "cfg")
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (other / "config.json").write_text(json.dumps(config))
    assert rebase_stage(staged, other) is None

    wider = _copy(served, tmp_path / "wider", scale=1.0)   # same names, other dtype
    for shard in wider.glob("*.safetensors"):
        _rewrite(shard, _other_dtype)
    assert rebase_stage(staged, wider) is None
    assert rebase_stage(staged, tmp_path / "absent") is None


def test_a_directory_rewritten_in_place_is_checked_against_the_planned_headers(
        served: Path, tmp_path: Path) -> None:
    """The served directory itself rewritten with another layout: the comparison is with the
    headers the plan was made from, never the directory's current ones read as "old"."""
    staged = plan_stage(served, Topology(2, 1, 1, 0))
    for shard in served.glob("*.safetensors"):
        _rewrite(shard, _other_dtype)
    assert rebase_stage(staged, served) is None


def test_a_shard_cut_short_or_with_other_metadata_is_planned_afresh(served: Path,
                                                                    tmp_path: Path) -> None:
    """Same entries are not enough: the file's size and its header bytes must be the planned
    ones (a truncated shard then fails fresh planning with its own clear error)."""
    staged = plan_stage(served, Topology(2, 1, 1, 1))
    file = next(iter(staged.plan.paths))
    cut = _copy(served, tmp_path / "cut", scale=1.0)
    with open(cut / file, "r+b") as fh:
        fh.truncate((cut / file).stat().st_size - 1)
    assert rebase_stage(staged, cut) is None

    other = _copy(served, tmp_path / "meta", scale=1.0)
    tensors = load_file(str(other / file))
    save_file(tensors, str(other / file), metadata={"format": "pt", "step": "7"})
    assert rebase_stage(staged, other) is None
