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
import shutil
from pathlib import Path
from typing import Callable, Mapping, Optional

import torch
from safetensors.torch import save_file

from .errors import ConfigError
from .outputs import OutputDir, claim_output, staged_output
from .planning.config_limits import read_json_limited
from .planning.spec import ModelSpec, spec_from_config

__all__ = ["make_tiny", "write_checkpoint", "write_shards", "model_order", "TINY_CONFIGS",
           "tiny_families", "resolve_tiny_config", "MAX_TINY_TENSORS"]

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
    """Write ``tensors`` as shards of about ``shard_bytes`` (0 = one file) plus an index into
    ``out_dir`` (new, empty or an earlier pploader output: :mod:`pploader.outputs`),
    atomically; files mode 0644."""
    target = claim_output(out_dir, "output", command="write_checkpoint", reuse=True)
    sizes = {n: (tuple(t.shape), t.numel() * t.element_size()) for n, t in tensors.items()}
    groups = _group(list(sizes), {n: b for n, (_, b) in sizes.items()}, shard_bytes)
    return _write(target, groups, lambda name: tensors[name].contiguous(), config)


def _group(names: list[str], nbytes: Mapping[str, int], shard_bytes: int) -> list[list[str]]:
    """``names`` in order, cut into shards of about ``shard_bytes`` (0 = one shard)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        if shard_bytes and groups[-1] and size + nbytes[name] > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes[name]
    return groups


def _write(target: OutputDir, groups: list[list[str]],
           make: Callable[[str], torch.Tensor], config: Optional[Mapping]) -> list[str]:
    """Write the checkpoint into a temporary directory, then publish it to ``target``
    (:func:`pploader.outputs.staged_output`: config.json and the index renamed last)."""
    with staged_output(target, last=("config.json", INDEX)) as tmp:
        return write_shards(tmp, groups, make, config)


def write_shards(folder: Path, groups: list[list[str]], make: Callable[[str], torch.Tensor],
                 config: Optional[Mapping]) -> list[str]:
    """The shards (``make`` gives each tensor, one shard in memory at a time), the index and
    config.json, written into ``folder``; returns the shard names."""
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    names = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    for fname, group in zip(names, groups):
        shard = {name: make(name) for name in group}
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del shard
    if len(groups) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": dict(sorted(weight_map.items()))}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


#: the index file of a sharded checkpoint
INDEX = "model.safetensors.index.json"


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


def make_tiny(config_path: os.PathLike | str | Mapping, out_dir: os.PathLike | str, *,
              shard_bytes: Optional[int] = None, seed: Optional[int] = None,
              force: bool = False) -> list[str]:
    """Write the checkpoint described by ``config_path`` (a config.json, or its contents) into
    ``out_dir``; returns shard names.

    ``out_dir`` must be new, empty or (with ``force``) an earlier pploader output, whose files
    alone are replaced (:func:`pploader.outputs.claim_output`). Checked before anything is
    allocated or written: the config's limits (size, depth, counts), the template's tensor
    count, the memory one shard needs and the free space on ``out_dir``'s file system.
    Written shard by shard into a temporary directory, then renamed into place."""
    target = claim_output(out_dir, "make-tiny OUT", command="make-tiny", force=force)
    if isinstance(config_path, Mapping):
        raw = json.loads(json.dumps(config_path))  # a copy, as JSON would give it
        config_path = "config"
    else:
        raw = read_json_limited(config_path, what=Path(config_path).name)
    if not isinstance(raw, dict):
        raise ConfigError("not a JSON object", file=str(config_path))
    opts = raw.pop("pploader_tiny", {}) or {}
    if not isinstance(opts, dict):
        raise ConfigError("pploader_tiny must be an object (shard_bytes, seed)",
                          file=str(config_path))
    spec = spec_from_config(raw)
    if spec.family.template is None:
        raise ConfigError(f"family {spec.family.name} has no tensor template to generate from")
    _check_template_size(spec)
    seed = _opt_int(opts, "seed", 0, config_path) if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    template = spec.family.template(spec)
    order = sorted(template, key=lambda n: model_order(spec, n))
    nbytes = {n: math.prod(template[n]) * spec.dtype.itemsize for n in order}
    total = sum(nbytes.values())
    shard = shard_bytes if shard_bytes is not None else _opt_int(
        opts, "shard_bytes", total // 3 + 1, config_path)
    groups = _group(order, nbytes, shard)
    _check_resources(out_dir, total, max(sum(nbytes[n] for n in g) for g in groups))
    return _write(target, groups, lambda n: _random(tuple(template[n]), spec.dtype, gen), raw)


#: the most tensors make-tiny generates (a real DeepSeek-V3 has ~92 k)
MAX_TINY_TENSORS = 2_000_000


def _check_template_size(spec: ModelSpec) -> None:
    """The template's size estimated from the counts, refused before it is built."""
    per_layer = 32 + 4 * (spec.num_experts if spec.num_experts else 0)
    estimate = (spec.num_layers + spec.num_mtp_layers) * per_layer
    if estimate > MAX_TINY_TENSORS:
        raise ConfigError(f"{spec.num_layers} layers x {spec.num_experts} experts would be about "
                          f"{estimate} tensors, over make-tiny's {MAX_TINY_TENSORS}: use a tiny "
                          "config (num_hidden_layers, num_experts)", file="config.json")


def _opt_int(opts: Mapping, key: str, default: int, path: os.PathLike | str) -> int:
    value = opts.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ConfigError(f"pploader_tiny.{key} is {value!r}: give an integer >= 0",
                          file=str(path))
    return value


def _available_memory() -> Optional[int]:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def _check_resources(out_dir: os.PathLike | str, total: int, largest_shard: int) -> None:
    """Free space for the whole checkpoint and memory for its largest shard, before either
    is used (a ConfigError saying how much is needed and what there is)."""
    out = Path(out_dir)
    probe = next((p for p in [out, *out.parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free
    if total > free:
        raise ConfigError(f"the checkpoint needs {total / 1e9:.2f} GB and {probe} has "
                          f"{free / 1e9:.2f} GB free: use a smaller config or another OUT",
                          file=str(out))
    memory = _available_memory()
    if memory is not None and 2 * largest_shard > memory:  # the tensors + the file's bytes
        raise ConfigError(f"one shard needs {2 * largest_shard / 1e9:.2f} GB of memory and "
                          f"{memory / 1e9:.2f} GB is available: pass a smaller --shard-bytes "
                          "or use a smaller config", file=str(out))
