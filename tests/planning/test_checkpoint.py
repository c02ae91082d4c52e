"""The strict header parser agrees with safetensors' own reader on many generated files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pploader import CheckpointError
from pploader.planning.checkpoint import open_checkpoint, parse_header
from pploader.planning.checkpoint import DTYPES

DTYPE_LIST = [dt for dt, _ in DTYPES.values()]


def _random_tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    n = int(torch.randint(1, 12, (1,), generator=gen))
    for i in range(n):
        dtype = DTYPE_LIST[int(torch.randint(0, len(DTYPE_LIST), (1,), generator=gen))]
        ndim = int(torch.randint(0, 4, (1,), generator=gen))
        shape = tuple(int(x) for x in torch.randint(0, 5, (ndim,), generator=gen))
        raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel() * dtype.itemsize),),
                            generator=gen, dtype=torch.uint8)
        t = raw[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape)
        out[f"t{i}.{dtype}".replace("torch.", "")] = t
    return out


@pytest.mark.parametrize("seed", range(40))
def test_header_agrees_with_safe_open(tmp_path: Path, seed: int) -> None:
    tensors = _random_tensors(seed)
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path), metadata={"seed": str(seed)})
    hdr = parse_header(path)
    raw = path.read_bytes()
    with safe_open(str(path), "pt") as fh:
        assert set(fh.keys()) == set(hdr.tensors)
        for name, entry in hdr.tensors.items():
            ref = fh.get_tensor(name)
            assert entry.shape == tuple(ref.shape)
            assert entry.torch_dtype == ref.dtype
            assert entry.nbytes == ref.numel() * ref.element_size()
            mine = raw[entry.start:entry.end]
            assert mine == ref.contiguous().view(-1).view(torch.uint8).numpy().tobytes() \
                if ref.numel() else mine == b""
    assert hdr.metadata == {"seed": str(seed)}


def test_index_and_headers_agree(tiny_llama: Path) -> None:
    index = open_checkpoint(tiny_llama)
    wmap = json.loads((tiny_llama / "model.safetensors.index.json").read_text())["weight_map"]
    assert dict(index.weight_map) == wmap
    assert index.opened_files() == ()  # nothing opened before a tensor is needed
    index.validate_all()
    assert set(index.opened_files()) == set(wmap.values())


@pytest.mark.parametrize("mutate,needle", [
    (lambda b: b[:-1], "unexpected bytes|past the end"),
    (lambda b: b + b"\0", "unexpected bytes"),
    (lambda b: b[:5], "too short"),
    (lambda b: b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 12\n", "git-LFS"),
    (lambda b: b"<!DOCTYPE html><html>login</html>", "HTML"),
    (lambda b: b"", "too short"),
])
def test_malformed_files_name_the_file(tmp_path: Path, mutate, needle: str) -> None:
    import re
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.zeros(4, 4), "b": torch.ones(3)}, str(good))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(mutate(good.read_bytes()))
    with pytest.raises(CheckpointError) as err:
        parse_header(bad)
    assert "bad.safetensors" in str(err.value)
    assert re.search(needle, str(err.value)), str(err.value)
