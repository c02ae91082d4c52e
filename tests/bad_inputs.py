"""Helpers of the bad-input matrix tests (tests/cli/test_bad_input.py, test_bad_input_load.py):
private copies of a checkpoint to damage, hand-made shard files, and recorders of the files
opened and the tensor-data reads made."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from safetensors.torch import load_file, save_file

from pploader.planning.checkpoint import INDEX_NAME, parse_header


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=shutil.copy2)
    return dst


def file_digests(model: Path) -> dict[str, str]:
    """sha256 of every file (through symlinks): the 'nothing mutated' witness."""
    return {str(p.relative_to(model)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(model.rglob("*")) if p.is_file()}


def index_json(model: Path) -> dict:
    return json.loads((model / INDEX_NAME).read_text())


def last_shard(model: Path) -> str:
    return sorted(set(index_json(model)["weight_map"].values()))[-1]


def last_tensor(path: Path) -> str:
    """The tensor whose bytes end the file (the one a truncation cuts)."""
    return max(parse_header(path).tensors.values(), key=lambda e: e.end).name


def raw_file(path: Path, header: Any, data: bytes = b"", *, length: Optional[int] = None) -> Path:
    """A safetensors-like file from a header (dict or raw bytes) and data bytes."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def header_entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def rewrite_shard(model: Path, file: str, change: Callable[[dict], None]) -> None:
    """Load one shard, let ``change`` edit its tensors, write it back and fix the index."""
    path = model / file
    tensors = load_file(str(path))
    before = set(tensors)
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    index = index_json(model)
    wmap = index["weight_map"]
    for name in before - set(tensors):
        wmap.pop(name, None)
    for name in set(tensors) - before:
        wmap[name] = file
    (model / INDEX_NAME).write_text(json.dumps(index))


def set_config(model: Path, **changes: Any) -> None:
    cfg = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (model / "config.json").write_text(json.dumps(cfg))


class Opens:
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


def no_data_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count tensor-data reads (the reader's preadv); headers use pread."""
    calls: list[int] = []
    real = os.preadv

    def preadv(*a: Any, **k: Any) -> int:
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(os, "preadv", preadv)
    return calls
