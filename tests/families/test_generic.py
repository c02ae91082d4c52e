"""The generic family (transformers' meta model) against the hand-written families.

For every hand-written family (each build case of tests/family_table.py, both expert namings,
and each bundled tiny config): the generic family, built from the same config.json, plans exactly
the same reads per rank (tensor, target, file, byte ranges, shape) for PP 1-4 x EP 1-2.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from family_table import IDS, TINY_ROWS, VARIANTS, HfCheckpoints, Row
from helpers import make_model, tiny_config
from pploader.planning.checkpoint import CheckpointIndex, open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec, spec_from_config
from pploader.families import generic
from pploader.planning.spec import ModelSpec


def _generic_spec(path: Path) -> ModelSpec:
    config = json.loads((path / "config.json").read_text())
    return spec_from_config(config, family=generic.family_for(config))


def _reads(spec: ModelSpec, index: CheckpointIndex, pp: int, tp: int, ep: int) -> list:
    return [(p.topology.rank, p.tensors, tuple((i.name, i.target, i.file, i.ranges, i.shape,
                                                i.gather, i.pad_rows) for i in p.items))
            for p in plan_all(spec, index, pp, tp, ep)]


def assert_same_plans(path: Path, *, tp: int = 1) -> None:
    hand, index = load_spec(path), open_checkpoint(path)
    gen = _generic_spec(path)
    assert gen.family.name.startswith("generic:") and not hand.family.name.startswith("generic")
    assert gen.num_layers == hand.num_layers and gen.num_experts == hand.num_experts
    assert gen.moe_layers == hand.moe_layers and gen.tie_word_embeddings == hand.tie_word_embeddings
    for pp in range(1, min(4, hand.num_layers) + 1):
        for ep in (1, 2) if hand.num_experts else (1,):
            assert _reads(gen, index, pp, tp, ep) == _reads(hand, index, pp, tp, ep), (pp, ep)


@pytest.mark.slow
@pytest.mark.parametrize("case,fmt", VARIANTS, ids=IDS)
def test_generic_plans_equal_hand_written(hf_checkpoints: HfCheckpoints, case: str,
                                          fmt: str) -> None:
    assert_same_plans(hf_checkpoints(case, fmt))


@pytest.mark.parametrize("row", TINY_ROWS, ids=[r.family for r in TINY_ROWS])
def test_generic_plans_equal_hand_written_bundled(row: Row, tmp_path: Path) -> None:
    """The bundled tiny configs (checkpoints written from the hand-written templates; small
    shards, so layers straddle shard boundaries)."""
    assert_same_plans(make_model(tmp_path, tiny_config(row.tiny),  # type: ignore[arg-type]
                                 shard_bytes=30_000))
