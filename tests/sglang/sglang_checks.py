"""Checks shared by the SGLang engine tests (tests/sglang/test_sglang*.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from engine_suite import loads, metadata_bytes


def check_bytes(run: dict[str, Any], *, limit: float = 1.02, tp: int = 1) -> None:
    """Each rank read at most ``limit`` x its ideal bytes (``tp`` x that when its TP-split
    tensors are handed whole as views of the page cache: SGLang narrows them), by its own
    count and by the kernel's (rchar: every read syscall of the process during the load,
    so the headers, config.json and the index too; views of resident pages are none)."""
    for load in loads(run):
        syscalls = load["read_bytes"] - load["mapped_bytes"]
        whole = tp if load["mapped_bytes"] else 1
        assert load["read_bytes"] <= whole * limit * load["ideal_bytes"], load
        assert load["rchar_bytes"] is not None and syscalls <= load["rchar_bytes"] \
            <= limit * syscalls + metadata_bytes(load), load


def checkpoint_tensors(model_dir: Path) -> tuple[int, int]:
    """(tensors, bytes) SGLang's default loader hands every rank's ``load_weights``: its
    safetensors iterator (``DefaultModelLoader``'s default, 8 threads) run over the
    checkpoint, every shard, every tensor (the model drops other stages' afterwards)."""
    from sglang.srt.model_loader.weight_utils import (
        buffered_multi_thread_safetensors_weights_iterator)
    files = sorted(str(p) for p in model_dir.glob("*.safetensors"))
    count = total = 0
    for _, t in buffered_multi_thread_safetensors_weights_iterator(files, max_workers=8):
        count, total = count + 1, total + t.numel() * t.element_size()
    return count, total
