"""Legacy pickle checkpoints (``.bin`` / ``.pt`` / ``.pth``): refused unless the caller opts in.

A pickle can run arbitrary code when it is loaded, so pploader never unpickles by default and
never falls back to it: ``open_checkpoint`` on a directory holding only pickles fails with a
message pointing here. With an explicit ``allow_pickle=True`` (CLI: ``pploader convert
--allow-pickle SRC DST``) files are read with ``torch.load(weights_only=True)`` (PyTorch's
restricted unpickler: tensors and plain containers only, no arbitrary globals) and converted
once to safetensors; every load after that is the normal strict, stage-only path.

Converting reads whole files (pickles have no byte ranges to plan), so it holds the model in
host memory once; it is meant for small or legacy checkpoints.
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Optional, Sequence

import torch

from .planning.checkpoint import allowed_root_dirs, read_index, resolve_files
from .errors import CheckpointError

__all__ = ["PICKLE_SUFFIXES", "PICKLE_INDEX", "pickled_files", "load_pickled",
           "convert_to_safetensors"]

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
PICKLE_INDEX = "pytorch_model.bin.index.json"
_COPY_SUFFIXES = (".json", ".txt", ".model", ".tiktoken")


def pickled_files(model_dir: os.PathLike | str) -> tuple[dict[str, str], list[str]]:
    """``(weight_map, files)`` of a pickle checkpoint; the weight_map is empty without an index.

    Index values get the same safety checks as safetensors indexes (no ``..``, no absolute
    paths, no NUL or backslash). Nothing is unpickled here.
    """
    root = Path(model_dir)
    index = root / PICKLE_INDEX
    if os.path.lexists(index):
        wmap = read_index(index, PICKLE_INDEX)
        return wmap, list(dict.fromkeys(wmap.values()))
    if not root.is_dir():
        raise CheckpointError("model directory does not exist", file=str(root))
    return {}, sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)


def _refuse(files: Sequence[str], root: Path) -> CheckpointError:
    shown = ", ".join(files[:4]) + (" ..." if len(files) > 4 else "")
    return CheckpointError(f"refusing to unpickle {shown}: pickle files can run code when "
                           "loaded. If you trust them, pass allow_pickle=True (CLI: `pploader "
                           "convert --allow-pickle SRC DST`), which uses "
                           "torch.load(weights_only=True)", file=str(root))


def _reason(exc: Exception) -> str:
    """The useful line of torch's error (its restricted unpickler's reason, such as
    "Unsupported operand 149" for a pickle protocol above 2), not its advice to unpickle
    without restrictions."""
    text = str(exc).strip()
    if "WeightsUnpickler error:" in text:
        reason = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n")[0]
        hint = "; save it with pickle_protocol=2 (torch.save's default)" \
            if "Unsupported operand" in reason else ""
        return f"{' '.join(reason.split())[:200]}{hint}"
    return text.splitlines()[0][:300] if text else ""


def _load_one(path: Path, file: str) -> dict[str, torch.Tensor]:
    try:
        with warnings.catch_warnings():  # torch's note on a pickle protocol other than 2:
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # not ours
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=False)
    except Exception as exc:  # noqa: BLE001 - any failure of the restricted unpickler
        raise CheckpointError(f"torch.load(weights_only=True) refused or failed: "
                              f"{type(exc).__name__}: {_reason(exc)}", file=file) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"holds a {type(obj).__name__}, not a state dict of tensors",
                              file=file)
    for key, value in obj.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f"state dict entry is {type(value).__name__}, not a tensor "
                                  "(nested or non-tensor state dicts are not supported)",
                                  file=file, tensor=str(key))
    return obj


def load_pickled(model_dir: os.PathLike | str, *, allow_pickle: bool = False,
                 allowed_roots: Sequence[os.PathLike | str] = ()) -> dict[str, torch.Tensor]:
    """Every tensor of a pickle checkpoint, only with ``allow_pickle=True``.

    Without the opt-in nothing is read (no torch.load call). With it, each file goes through
    ``torch.load(weights_only=True)``; a tensor in two files or an index/file disagreement is
    a CheckpointError naming the files.
    """
    root = Path(model_dir)
    wmap, files = pickled_files(root)
    if not files:
        raise CheckpointError(f"no pickle files ({', '.join(PICKLE_SUFFIXES)}) found",
                              file=str(root))
    if not allow_pickle:
        raise _refuse(files, root)
    source = PICKLE_INDEX if wmap else str(root)
    paths = resolve_files(root, files, allowed_root_dirs(root, allowed_roots), source)
    out: dict[str, torch.Tensor] = {}
    owner: dict[str, str] = {}
    for file in files:
        for name, tensor in _load_one(paths[file], file).items():
            if name in owner:
                raise CheckpointError(f"tensor appears in both {owner[name]} and {file}",
                                      file=file, tensor=name)
            if wmap and wmap.get(name) != file:
                raise CheckpointError(f"{PICKLE_INDEX} maps this tensor to {wmap.get(name)}",
                                      file=file, tensor=name)
            owner[name], out[name] = file, tensor
    missing = sorted(set(wmap) - set(out))
    if missing:
        raise CheckpointError(f"{len(missing)} tensor(s) named in {PICKLE_INDEX} are in no file: "
                              + ", ".join(missing[:8]), file=PICKLE_INDEX, tensor=missing[0])
    return out


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing storage (tied weights): clone the repeats."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() else t.contiguous()
        seen.add(ptr)
    return out


def convert_to_safetensors(model_dir: os.PathLike | str, out_dir: os.PathLike | str, *,
                           allow_pickle: bool = False, shard_bytes: int = 4 << 30,
                           allowed_roots: Sequence[os.PathLike | str] = ()) -> list[str]:
    """Convert a pickle checkpoint to safetensors shards + index in a new ``out_dir``.

    Only with ``allow_pickle=True``. ``out_dir`` must be new or empty and outside
    ``model_dir`` (:func:`pploader.outputs.claim_output`). The output is written to a
    temporary directory and renamed into place, so a failure or a signal leaves no
    half-written ``out_dir``. config.json, tokenizer and other small text files are copied.
    Returns the shard names.
    """
    from .outputs import claim_output, staged_output
    from .tiny import INDEX, _group, write_shards

    src = Path(model_dir)
    target = claim_output(out_dir, "convert DST", command="convert", models=[src])
    tensors = _unshared(load_pickled(src, allow_pickle=allow_pickle,
                                     allowed_roots=allowed_roots))
    config: Optional[dict] = None
    if (src / "config.json").is_file():
        from .planning.config_limits import read_json_limited
        config = read_json_limited(src / "config.json")  # type: ignore[assignment]
    nbytes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    groups = _group(list(tensors), nbytes, shard_bytes)
    with staged_output(target, last=("config.json", INDEX)) as tmp:
        files = write_shards(tmp, groups, lambda name: tensors[name], config)
        for extra in sorted(src.iterdir()):
            if (extra.is_file() and extra.suffix in _COPY_SUFFIXES and extra.name
                    not in ("config.json", PICKLE_INDEX)):
                shutil.copyfile(extra, tmp / extra.name)
    return files
