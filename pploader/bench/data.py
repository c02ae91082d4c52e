"""Synthetic checkpoints for ``pploader bench``: llama-shaped, any size, written streaming.

Two kinds:
- :func:`write_synthetic`: a real sharded bf16 llama checkpoint of about ``total_bytes``,
  shards split by size (so layers straddle shard boundaries), written tensor by tensor
  (never more than one tensor in memory) with random bytes.
- :func:`write_wide`: a checkpoint with many tiny tensors (e.g. 100k) whose data region is
  a sparse hole: only the headers are real. It exists to time planning, which reads headers only.
"""
from __future__ import annotations

import json
import math
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ..planning.spec import spec_from_config
from ..tiny import model_order

__all__ = ["LlamaShape", "llama_shape", "llama_config", "write_synthetic", "write_wide",
           "SynthInfo", "checkpoint_files"]

_ITEMSIZE = 2  # bf16
_POOL_BYTES = 64 << 20
_WRITE_CHUNK = 16 << 20


@dataclass(frozen=True)
class LlamaShape:
    """The dimensions of a llama-style decoder (bf16)."""

    hidden: int
    intermediate: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def layer_bytes(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        q = self.heads * self.head_dim
        return _ITEMSIZE * (2 * q * h + 2 * kv * h + 3 * h * self.intermediate + 2 * h)

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_bytes + _ITEMSIZE * (2 * self.vocab * self.hidden
                                                              + self.hidden)


def _dims(hidden: int) -> tuple[int, int, int]:
    head_dim = 128 if hidden >= 1024 else 64 if hidden >= 256 else 16
    heads = max(1, hidden // head_dim)
    kv = max(d for d in range(1, heads + 1) if heads % d == 0 and d <= max(1, heads // 4))
    return heads, kv, head_dim


def llama_shape(total_bytes: int, layers: int) -> LlamaShape:
    """Dimensions close to ``total_bytes`` with llama proportions (intermediate ≈ 3.5 x hidden,
    vocab = 16 x hidden); the intermediate size absorbs the remainder."""
    best = None
    for hidden in [32, 64, 128, 256, 384] + list(range(512, 16385, 512)):
        heads, kv, head_dim = _dims(hidden)
        vocab = 16 * hidden
        base = LlamaShape(hidden, 0, vocab, layers, heads, kv, head_dim)
        per_layer = (total_bytes - (base.total_bytes - layers * base.layer_bytes)) / layers
        inter = int((per_layer - base.layer_bytes) / (_ITEMSIZE * 3 * hidden))
        inter -= inter % 16
        if inter < 16:
            continue
        shape = LlamaShape(hidden, inter, vocab, layers, heads, kv, head_dim)
        score = abs(math.log(inter / hidden / 3.5))
        if best is None or score < best[0]:
            best = (score, shape)
    if best is None:
        raise ValueError(f"{total_bytes} bytes is too small for {layers} llama layers")
    return best[1]


def llama_config(shape: LlamaShape) -> dict:
    """A config.json for ``shape`` (LlamaForCausalLM, bf16, untied head)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
            "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "vocab_size": shape.vocab, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
            "tie_word_embeddings": False, "dtype": "bfloat16"}


def _ordered_template(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes from the family template, in state-dict order (embed, layers, head)."""
    spec = spec_from_config(config)
    template = spec.family.template(spec)  # type: ignore[misc]

    return [(n, tuple(template[n]))
            for n in sorted(template, key=lambda n: model_order(spec, n))]


def _groups(tensors: list[tuple[str, tuple[int, ...]]], shard_bytes: int
            ) -> list[list[tuple[str, tuple[int, ...]]]]:
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * _ITEMSIZE
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    return groups


def _header(entries: Iterable[tuple[str, str, tuple[int, ...], int]]) -> tuple[bytes, int]:
    """Serialised safetensors header (padded to 8 bytes) and the data length."""
    obj: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, dtype, shape, nbytes in entries:
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(obj, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, pos


def _random_chunks(nbytes: int, pool: bytes, rng: random.Random) -> Iterator[memoryview]:
    """``nbytes`` of pseudo-random data: slices of a random pool at random offsets."""
    view = memoryview(pool)
    while nbytes:
        n = min(nbytes, _WRITE_CHUNK)
        off = rng.randrange(0, len(pool) - n + 1)
        yield view[off:off + n]
        nbytes -= n


@dataclass(frozen=True)
class SynthInfo:
    """What was written: shape, shard files and their sizes."""

    directory: str
    shape: LlamaShape
    files: tuple[str, ...]
    file_bytes: tuple[int, ...]
    data_bytes: int
    seed: int

    def to_json(self) -> dict:
        out = asdict(self)
        out["shape"] = asdict(self.shape)
        return out


def checkpoint_files(directory: os.PathLike | str) -> list[str]:
    """Absolute paths of the shard files of a model directory, sorted."""
    return sorted(str(p) for p in Path(directory).glob("*.safetensors"))


def write_synthetic(out_dir: os.PathLike | str, total_bytes: int, layers: int, *,
                    shards: int = 5, seed: int = 0) -> SynthInfo:
    """Write a llama-shaped bf16 checkpoint of about ``total_bytes`` into ``out_dir``.

    Reuses the directory when its ``ppbench.json`` records the same request and every file
    still has its recorded size.
    """
    out = Path(out_dir)
    request = {"total_bytes": total_bytes, "layers": layers, "shards": shards, "seed": seed}
    meta_path = out / "ppbench.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("request") == request and all(
                (out / f).is_file() and (out / f).stat().st_size == n
                for f, n in zip(meta["info"]["files"], meta["info"]["file_bytes"])):
            info = meta["info"]
            return SynthInfo(info["directory"], LlamaShape(**info["shape"]), tuple(info["files"]),
                             tuple(info["file_bytes"]), info["data_bytes"], info["seed"])
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    shape = llama_shape(total_bytes, layers)
    config = llama_config(shape)
    tensors = _ordered_template(config)
    groups = _groups(tensors, shape.total_bytes // shards + 1)
    rng = random.Random(seed)
    pool = rng.randbytes(_POOL_BYTES)
    files, sizes, weight_map = [], [], {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        head, _ = _header((n, "BF16", s, math.prod(s) * _ITEMSIZE) for n, s in group)
        with open(out / fname, "wb") as fh:
            fh.write(head)
            for name, s in group:
                for chunk in _random_chunks(math.prod(s) * _ITEMSIZE, pool, rng):
                    fh.write(chunk)
                weight_map[name] = fname
            fh.flush()
            os.fsync(fh.fileno())
        files.append(fname)
        sizes.append((out / fname).stat().st_size)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    index = {"metadata": {"total_size": shape.total_bytes}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    info = SynthInfo(str(out), shape, tuple(files), tuple(sizes), shape.total_bytes, seed)
    meta_path.write_text(json.dumps({"request": request, "info": info.to_json()}, indent=1))
    return info


def write_wide(out_dir: os.PathLike | str, num_tensors: int, *, shards: int = 10) -> int:
    """A llama checkpoint with at least ``num_tensors`` tiny tensors; data regions are sparse
    holes (headers only are real). Returns the tensor count."""
    layers = max(1, math.ceil((num_tensors - 3) / 9))
    shape = LlamaShape(hidden=16, intermediate=32, vocab=64, layers=layers, heads=2,
                       kv_heads=1, head_dim=8)
    config = llama_config(shape)
    tensors = _ordered_template(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per = math.ceil(len(tensors) / shards)
    weight_map = {}
    for i in range(shards):
        group = tensors[i * per:(i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        head, data = _header((n, "BF16", s, math.prod(s) * _ITEMSIZE) for n, s in group)
        with open(out / fname, "wb") as fh:
            fh.write(head)
            fh.truncate(len(head) + data)
        weight_map.update({n: fname for n, _ in group})
    (out / "config.json").write_text(json.dumps(config) + "\n")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return len(tensors)
