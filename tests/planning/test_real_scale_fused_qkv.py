"""Real-scale fused QKV layouts through the generic family (sparse files:
tests/real_layouts.py ``build_generic_layout``; configs in tests/data/real_configs_generic/,
written by hand from the published tiiuae/falcon-40b and bigscience/bloom config.json).

Falcon-40B (``query_key_value`` in 8 KV groups of 16 + 2 heads, no biases) and BLOOM-176B
(112 heads stored ``[heads, 3, head_dim]``, biases) at PP=2 x TP=8: every item of every rank
delivers exactly the slice written here from vLLM's ``falcon.py`` / ``bloom.py`` (whole
groups / whole heads, one contiguous row block a rank; ``dense`` and ``dense_4h_to_h``
columns, their biases whole; ``dense_h_to_4h`` rows and bias; the vocabulary in
``ceil(V / tp)`` rows; norms whole), checked by shape and by the file offset of sampled
elements (tests/gpt_oss_ref.py ``check_item``). Falcon-40B at TP=16 is refused naming
``query_key_value`` (8 groups, 16 ranks: vLLM splits inside a group, which pploader's
whole-group rule does not express). One-rank planning times are printed.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import pytest

from gpt_oss_ref import check_item
from pploader.errors import PlanError
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import make_windows, plan_all, plan_rank
from pploader.planning.spec import load_spec
from pploader.planning.topology import Topology
from real_layouts import build_generic_layout

pytestmark = pytest.mark.slow  # meta models of 40B / 176B parameters, 16 ranks planned

TP = 8


def engine_slices(name: str, shape: Sequence[int], config: Mapping[str, Any], rank: int
                  ) -> tuple[tuple[slice, ...], int]:
    """``(slices of the stored tensor, zero rows after)`` vLLM's loader leaves TP rank
    ``rank`` of ``TP``: the fused qkv by its KV groups (Falcon) or heads (Bloom)."""
    whole = tuple(slice(0, n) for n in shape)
    module, leaf = name.split(".")[-2:]
    heads = config.get("num_attention_heads") or config["n_head"]
    head_dim = config["hidden_size"] // heads
    if module == "query_key_value":
        groups = config["num_kv_heads"] if config["model_type"] == "falcon" else heads
        rows = shape[0] // groups                 # (q heads per group + 2) x head_dim rows
        per = groups // TP
        assert rows * groups == shape[0] and per * TP == groups and rows % head_dim == 0
        return (slice(rank * per * rows, (rank + 1) * per * rows),) + whole[1:], 0
    if module in ("word_embeddings", "lm_head"):
        per = -(-shape[0] // TP)
        start = min(rank * per, shape[0])
        stop = min(start + per, shape[0])
        return (slice(start, stop),) + whole[1:], per - (stop - start)
    if module == "dense_h_to_4h":
        per = shape[0] // TP
        return (slice(rank * per, (rank + 1) * per),) + whole[1:], 0
    if module in ("dense", "dense_4h_to_h") and leaf == "weight":
        per = shape[1] // TP
        return (whole[0], slice(rank * per, (rank + 1) * per)), 0
    return whole, 0


def _check(path: Path) -> tuple[int, float]:
    """Every rank's items against ``engine_slices``; (items checked, slowest one-rank plan)."""
    spec, index = load_spec(path), open_checkpoint(path)
    config = json.loads((path / "config.json").read_text())
    owner: dict[str, set[int]] = defaultdict(set)
    checked = 0
    for plan in plan_all(spec, index, 2, TP, 1):
        topo = plan.topology
        for item in plan.items:
            entry = index.entry(item.name)
            slices, pad = engine_slices(item.name, entry.shape, config, topo.tp_rank)
            problem = check_item(item, entry.start, entry.shape, slices, pad, limit=256,
                                 seed=topo.rank)
            assert problem is None, (topo.rank, item.name, problem)
            owner[item.name].add(topo.pp_rank)
            checked += 1
    tied = {n for n in owner if n.endswith("word_embeddings.weight") and spec.tie_word_embeddings}
    assert set(owner) == set(index.weight_map), set(index.weight_map) - set(owner)
    assert all(len(s) == 1 or n in tied for n, s in owner.items()), \
        {n: s for n, s in owner.items() if len(s) > 1}
    slowest = 0.0
    for rank in (0, 2 * TP - 1):
        spec = load_spec(path)
        t0 = time.perf_counter()
        fresh = open_checkpoint(path)
        spec = spec.for_checkpoint(fresh.weight_map)
        topo = Topology(2, TP, 1, rank)
        plan_rank(spec, fresh, topo, make_windows(spec, fresh, 2)[topo.pp_rank])
        slowest = max(slowest, time.perf_counter() - t0)
    return checked, slowest


@pytest.mark.parametrize("model", ["falcon-40b", "bloom-176b"])
def test_fused_qkv_real_scale_pp2_tp8(model: str, tmp_path_factory: pytest.TempPathFactory,
                                      capsys: pytest.CaptureFixture) -> None:
    path = build_generic_layout(model, tmp_path_factory.mktemp("fused-qkv-layouts"))
    checked, seconds = _check(path)
    with capsys.disabled():
        print(f"\n{model} PP=2 x TP=8: {checked} items of 16 ranks exact; one rank planned in "
              f"{seconds * 1000:.0f} ms (slower of the first and last rank)")
    if model == "falcon-40b":
        spec, index = load_spec(path), open_checkpoint(path)
        assert spec.num_kv_heads == 8
        with pytest.raises(PlanError) as err:
            plan_all(spec, index, 2, 16, 1)
        assert "query_key_value" in str(err.value.tensor)
