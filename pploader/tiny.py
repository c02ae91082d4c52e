"""make-tiny: write a real, sharded safetensors checkpoint from a config and its family template.

The config file is a config.json plus an optional ``"pploader_tiny"`` object
(``shard_bytes``: target shard size, shards split by size so layers straddle boundaries;
``seed``). Names and shapes come from the family template, i.e. the same naming as real
checkpoints of that architecture.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Mapping, Optional

import torch
from safetensors.torch import save_file

from .errors import ConfigError
from .planning.spec import ModelSpec, spec_from_config

__all__ = ["make_tiny", "write_checkpoint", "model_order", "TINY_CONFIGS", "tiny_families",
           "resolve_tiny_config"]

#: the bundled tiny configs (package data; ``configs/models`` in the repository)
TINY_CONFIGS = Path(__file__).resolve().parent / "tiny_configs"


def tiny_families() -> list[str]:
    """Names ``make-tiny`` accepts in place of a path (``tiny-<name>.json`` bundled)."""
    return sorted(p.name[len("tiny-"):-len(".json")] for p in TINY_CONFIGS.glob("tiny-*.json"))


def resolve_tiny_config(name_or_path: os.PathLike | str) -> Path:
    """A bundled tiny config by family name (``llama``, ``tiny-llama``), else a file path."""
    text = str(name_or_path)
    bundled = TINY_CONFIGS / f"tiny-{text.removeprefix('tiny-').removesuffix('.json')}.json"
    if os.sep not in text and not text.endswith(".json") and bundled.is_file():
        return bundled
    path = Path(name_or_path)
    if path.is_file():
        return path
    if os.sep not in text and bundled.is_file():
        return bundled
    raise ConfigError(f"no such config file and no bundled tiny config of that name; give a "
                      f"config.json path or one of: {', '.join(tiny_families())}", file=text)


def write_checkpoint(out_dir: os.PathLike | str, tensors: Mapping[str, torch.Tensor],
                     config: Optional[Mapping] = None, *, shard_bytes: int = 0) -> list[str]:
    """Write ``tensors`` as shards of about ``shard_bytes`` (0 = one file) plus an index."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shard_bytes and groups[-1] and size + nbytes > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t.contiguous()
        size += nbytes
    if len(groups) == 1:
        save_file(groups[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map, total = [], {}, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(out / fname), metadata={"format": "pt"})
        files.append(fname)
        for name, t in group.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    return torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8).view(dtype) \
        if dtype.itemsize == 1 else torch.randint(0, 1000, shape, generator=gen).to(dtype)


def model_order(spec: "ModelSpec", name: str) -> tuple[int, int]:
    """Order tensors as a model's state dict does: embed, layers 0.., MTP, norm + head."""
    role = spec.family.classify(name, spec.num_layers, spec.num_mtp_layers)
    if role is None or role.placement == "first":
        return (0, 0)
    if role.placement == "last":
        return (2, 0)
    return (1, role.layer or 0)


def make_tiny(config_path: os.PathLike | str, out_dir: os.PathLike | str, *,
              shard_bytes: Optional[int] = None, seed: Optional[int] = None) -> list[str]:
    """Write the checkpoint described by ``config_path`` into ``out_dir``; returns shard names."""
    try:
        raw = json.loads(Path(config_path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", file=str(config_path)) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"not valid JSON: {exc}", file=str(config_path)) from None
    if not isinstance(raw, dict):
        raise ConfigError("not a JSON object", file=str(config_path))
    opts = raw.pop("pploader_tiny", {}) or {}
    spec = spec_from_config(raw)
    if spec.family.template is None:
        raise ConfigError(f"family {spec.family.name} has no tensor template to generate from")
    gen = torch.Generator().manual_seed(int(seed if seed is not None else opts.get("seed", 0)))
    template = spec.family.template(spec)
    tensors = {name: _random(tuple(template[name]), spec.dtype, gen)
               for name in sorted(template, key=lambda n: model_order(spec, n))}
    total = sum(math.prod(s) for s in template.values()) * spec.dtype.itemsize
    shard = shard_bytes if shard_bytes is not None else int(opts.get("shard_bytes", total // 3 + 1))
    return write_checkpoint(out_dir, tensors, raw, shard_bytes=shard)
