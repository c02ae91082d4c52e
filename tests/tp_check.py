"""Shared checks of TP rules on tiny transformers checkpoints (test utility): build a sweep-
sized checkpoint of a model type, then load every rank of PP=2 x TP=k on the CPU and compare
each item with an independent reference slice (tests/*_ref.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import generic_sweep
from helpers import reference_tensors
from pploader.io.read import Reader
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.planning.spec import load_spec
from sweep_shrink import model_config, tiny_config

__all__ = ["build_tiny", "check_ranks"]

#: (checkpoint name, its whole tensor, the rank's piece, TP rank) -> the expected piece
Want = Callable[[str, torch.Tensor, int], torch.Tensor]


def build_tiny(model_type: str, out: Path, **overrides: Any) -> dict[str, Any]:
    """A tiny random ``save_pretrained`` checkpoint of ``model_type`` in ``out`` (the sweep's
    sizes, then ``overrides``); its config.json."""
    arch = generic_sweep.causal_lm_types()[model_type]
    if not overrides:
        generic_sweep._checkpoint(model_type, arch, out)
        return json.loads((out / "config.json").read_text())
    import transformers
    cls = getattr(transformers, arch)
    tiny = tiny_config(model_type)
    config = model_config(type(tiny).from_dict({**tiny.to_dict(), **overrides}), cls)
    config.architectures = [arch]
    torch.manual_seed(0)
    cls._from_config(config, dtype=torch.float32).save_pretrained(out, max_shard_size="40KB")
    return json.loads((out / "config.json").read_text())


def check_ranks(path: Path, tp: int, want: Want, *,
                also: Optional[Callable[[str, torch.Tensor, torch.Tensor, int], None]] = None,
                key: Callable[[str], str] = lambda name: name.split(".")[-2]
                ) -> tuple[dict[str, int], set[str]]:
    """Every rank of PP=2 x TP=``tp``: each item read on the CPU is bitwise ``want(name,
    whole, tp_rank)`` (``also(name, whole, piece, tp_rank)`` checks more); every stored tensor
    is read. Returns how many ranks read each tensor and the ``key`` of those some rank holds
    only part of."""
    spec, index = load_spec(path), open_checkpoint(path)
    ref = reference_tensors(path)
    seen: dict[str, int] = {}
    split: set[str] = set()
    for plan in plan_all(spec, index, 2, tp, 1):
        got = dict(Reader(plan))
        rank = plan.topology.tp_rank
        for item in plan.items:
            full, piece = ref[item.name], got[item.target]
            assert torch.equal(piece, want(item.name, full, rank)), \
                (plan.topology.rank, item.name)
            if also is not None:
                also(item.name, full, piece, rank)
            seen[item.name] = seen.get(item.name, 0) + 1
            if piece.shape != full.shape:
                split.add(key(item.name))
    assert set(seen) == set(index.weight_map)
    return seen, split
