"""Property-based tests (hypothesis) for the header parser, the index and the planner, plus a
bounded run of the header fuzzer (the long run is documented in docs/reliability.md)."""
from __future__ import annotations

import json
import math
import os
import random
import struct
from pathlib import Path, PurePosixPath
from typing import Any, Optional

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from fuzz_headers import check_accepted, run_fuzz
from pploader import PPLoaderError
from pploader.planning.checkpoint import parse_header
from pploader.planning.plan import plan_all
from pploader.planning.spec import spec_from_config
from pploader.planning.checkpoint import (DTYPES, CheckpointIndex, FileIdentity, ShardHeader,
                                          TensorEntry)
from pploader.planning.index import _safe_relpath
from pploader.errors import CheckpointError

_SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])

# ---- header parser ------------------------------------------------------------------------

_names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12).filter(
    lambda s: s != "__metadata__")
_tensors = st.dictionaries(
    _names, st.tuples(st.sampled_from(list(DTYPES)),
                      st.lists(st.integers(0, 5), max_size=3)), max_size=6)
_metadata = st.one_of(st.none(), st.dictionaries(_names, st.text(max_size=8), max_size=3))


def _write(path: Path, header: bytes, data: bytes) -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@_SETTINGS
@given(tensors=_tensors, metadata=_metadata, order=st.randoms(use_true_random=False),
       pad=st.booleans())
def test_valid_headers_are_accepted_and_agree_with_the_reference(
        tmp_path: Path, tensors: dict, metadata: Optional[dict], order: random.Random,
        pad: bool) -> None:
    """Any well-formed file (any names, dtypes, empty/0-d shapes, key order, padding) parses,
    and the reference reader sees the same names, shapes, dtypes, metadata and bytes."""
    obj: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = math.prod(shape) * DTYPES[dtype][1]
        obj[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    items = list(obj.items())
    order.shuffle(items)
    obj = dict(items)
    if metadata is not None:
        obj["__metadata__"] = metadata
    header = json.dumps(obj, ensure_ascii=order.random() < 0.5).encode()
    if pad:
        header += b" " * (-len(header) % 8)
    data = bytes(order.getrandbits(8) for _ in range(offset))
    path = _write(tmp_path / "ok.safetensors", header, data)
    hdr = parse_header(path)
    assert check_accepted(hdr, path.stat().st_size) is None
    assert set(hdr.tensors) == set(tensors) and dict(hdr.metadata) == (metadata or {})
    raw = path.read_bytes()
    with safe_open(str(path), "numpy") as fh:
        assert set(fh.keys()) == set(hdr.tensors)
        for name, entry in hdr.tensors.items():
            sl = fh.get_slice(name)
            assert (tuple(sl.get_shape()), sl.get_dtype()) == (entry.shape, entry.dtype)
        assert (fh.metadata() or {}) == dict(hdr.metadata)
    for entry in hdr.tensors.values():
        start = entry.start - hdr.data_start
        assert raw[entry.start:entry.end] == data[start:start + entry.nbytes]


@_SETTINGS
@given(blob=st.binary(max_size=300))
def test_arbitrary_bytes_only_ever_raise_checkpoint_error(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "junk.safetensors"
    path.write_bytes(blob)
    try:
        hdr = parse_header(path)
    except CheckpointError as exc:
        assert exc.file == "junk.safetensors"
    else:
        assert check_accepted(hdr, len(blob)) is None


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4), max_leaves=25)
_entryish = st.fixed_dictionaries({"dtype": st.sampled_from(list(DTYPES)) | _json,
                                   "shape": st.lists(st.integers(-2, 2 ** 64), max_size=3) | _json,
                                   "data_offsets": st.lists(st.integers(-1, 64), max_size=3)
                                   | _json}) | _json


@_SETTINGS
@given(obj=st.dictionaries(st.text(max_size=6), _entryish, max_size=5) | _json,
       data_len=st.integers(0, 64))
def test_arbitrary_json_headers_only_ever_raise_checkpoint_error(
        tmp_path: Path, obj: Any, data_len: int) -> None:
    """Structured junk with a correct length prefix: accepted only when fully consistent."""
    try:
        header = json.dumps(obj).encode()
    except ValueError:  # e.g. a float the encoder refuses
        return
    path = _write(tmp_path / "j.safetensors", header, b"\0" * data_len)
    try:
        hdr = parse_header(path)
    except CheckpointError:
        return
    assert check_accepted(hdr, path.stat().st_size) is None


@_SETTINGS
@given(value=st.text(st.sampled_from("ab./\\\x00:~ "), max_size=12))
def test_accepted_weight_map_values_stay_inside_the_model_directory(value: str) -> None:
    try:
        name = _safe_relpath(value, "t", "index.json")
    except CheckpointError:
        return
    parts = PurePosixPath(name).parts
    assert name and not PurePosixPath(name).is_absolute() and ".." not in parts
    assert os.path.normpath(os.path.join("/root/model", name)).startswith("/root/model/")


def test_header_fuzzer_bounded_run(tmp_path: Path) -> None:
    """A few thousand generated + mutated headers; see ``python -m tests.fuzz_headers``."""
    result = run_fuzz(3000, seed=12345, crash_dir=tmp_path / "crashes")
    assert result.ok, result.crashes[:5]
    assert result.count == 3000 and result.accepted > 100 and result.rejected > 1000
    assert result.differential_checked == result.accepted  # every accepted file vs safe_open
    assert len(result.kinds) >= 20  # every mutation kind was exercised


# ---- planner ------------------------------------------------------------------------------


@st.composite
def _layouts(draw: st.DrawFn) -> dict:
    heads = draw(st.sampled_from([1, 2, 4, 6, 8]))
    layers = draw(st.integers(1, 6))
    pp = draw(st.integers(1, layers + 1))
    cuts = sorted(draw(st.lists(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1,
                                unique=True))) if 0 < pp - 1 <= layers - 1 else []
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [layers])]
    partition = draw(st.sampled_from(["even", "balanced", "explicit", "junk"]))
    cfg = {"architectures": [draw(st.sampled_from(["LlamaForCausalLM", "Qwen2ForCausalLM",
                                                   "Qwen3ForCausalLM"]))],
           "hidden_size": draw(st.sampled_from([8, 12, 16])),
           "intermediate_size": draw(st.sampled_from([4, 6, 8, 12])),
           "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": draw(st.sampled_from([d for d in range(1, heads + 1)
                                                        if heads % d == 0])),
           "head_dim": draw(st.sampled_from([2, 4])),
           "vocab_size": draw(st.integers(2, 24)),
           "tie_word_embeddings": draw(st.booleans()), "dtype": "bfloat16"}
    return {"cfg": cfg, "pp": pp, "tp": draw(st.sampled_from([1, 2, 3, 4])),
            "files": draw(st.integers(1, 4)), "seed": draw(st.integers(0, 2 ** 16)),
            "partition": {"explicit": sizes if len(sizes) == pp else "even",
                          "junk": draw(st.lists(st.integers(0, 3), max_size=4))}.get(
                              partition, partition)}


def _synthetic_index(cfg: dict, n_files: int, seed: int) -> tuple[Any, CheckpointIndex, dict]:
    """The family template's tensors as an in-memory checkpoint (random bytes, no files)."""
    spec = spec_from_config(cfg)
    template = spec.family.template(spec)
    names = list(template)
    gen = torch.Generator().manual_seed(seed)
    per = -(-len(names) // n_files)
    headers, paths, wmap, blobs = {}, {}, {}, {}
    for f in range(n_files):
        chunk = names[f * per:(f + 1) * per]
        if not chunk:
            continue
        file = f"model-{f:05d}.safetensors"
        entries, offset = {}, 8
        for name in chunk:
            nbytes = math.prod(template[name]) * 2
            entries[name] = TensorEntry(name, file, "BF16", tuple(template[name]), offset,
                                        offset + nbytes)
            offset += nbytes
            wmap[name] = file
        blobs[file] = torch.randint(0, 256, (offset,), generator=gen, dtype=torch.uint8)
        paths[file] = Path("/nonexistent") / file
        headers[file] = ShardHeader(file, paths[file], FileIdentity(offset, 0, 0), 0, 8,
                                    entries, {})
    return spec, CheckpointIndex(Path("/nonexistent"), wmap, paths, "synthetic", headers), blobs


def _emulate(item: Any, blob: torch.Tensor) -> torch.Tensor:
    """What the reader assembles for ``item`` (ranges -> buffer -> gather -> zero padding),
    as int16 (same itemsize as bf16, and bitwise comparable)."""
    raw = torch.cat([blob[o:o + n] for o, n in item.ranges]) if item.ranges else \
        torch.empty(0, dtype=torch.uint8)
    t = raw.view(torch.int16).reshape(item.buffer_shape)
    for dim, intervals in item.gather:
        t = torch.cat([t.narrow(dim, a, n) for a, n in intervals], dim)
    assert tuple(t.shape) == ((item.shape[0] - item.pad_rows,) + item.shape[1:]
                              if item.pad_rows else item.shape)
    return t


@settings(max_examples=120, deadline=None, derandomize=True)
@given(layout=_layouts())
def test_planner_plans_cover_every_tensor_exactly_and_only_raise_pploader_errors(
        layout: dict) -> None:
    cfg, pp, tp = layout["cfg"], layout["pp"], layout["tp"]
    spec, index, blobs = _synthetic_index(cfg, layout["files"], layout["seed"])
    try:
        plans = plan_all(spec, index, pp, tp, partition=layout["partition"])
    except PPLoaderError:
        return  # e.g. pp > layers, tp not dividing heads, a junk partition
    windows = [plans[s * tp].window for s in range(pp)]
    assert windows[0].start_layer == 0 and windows[-1].end_layer == spec.num_layers
    assert all(a.end_layer == b.start_layer for a, b in zip(windows, windows[1:]))
    assert all(w.num_layers >= 1 for w in windows)
    full = {n: blobs[e.file][e.start:e.end].view(torch.int16).reshape(e.shape)
            for f in index.paths for n, e in index.header(f).tensors.items()}
    for stage in range(pp):
        w = windows[stage]
        stage_plans = plans[stage * tp:(stage + 1) * tp]
        expect = set()
        for name in index.weight_map:
            role = spec.family.classify(name, spec.num_layers, 0)
            if role.placement == "layer" and w.owns(role.layer):
                expect.add(name)
            elif role.placement == "first" and w.has_embed:
                expect.add(name)
            elif role.placement == "last" and w.has_head:
                expect.add(name)
            if spec.tie_word_embeddings and role.role == "embed" and w.has_head:
                expect.add(name)  # the tied head is read from the embedding
        by_target: dict[str, list] = {}
        for plan in stage_plans:
            assert set(plan.tensors) == expect
            assert plan.read_bytes >= plan.ideal_bytes
            for item in plan.items:
                entry = index.entry(item.name)
                assert all(entry.start <= o and o + n <= entry.end for o, n in item.ranges)
                if item.direct:
                    assert item.read_bytes == item.ideal_bytes
                by_target.setdefault(item.target, []).append(item)
        for target, items in by_target.items():
            assert len(items) == tp  # every TP rank of the stage holds a piece
            _reassembles(items, full[items[0].name], blobs)


def _reassembles(items: list, full: torch.Tensor, blobs: dict) -> None:
    """The TP pieces (replicated units deduplicated) concatenate back to the whole tensor."""
    pieces = [_emulate(i, blobs[i.file]) for i in items]
    dims = [d for d in range(full.dim()) if any(p.shape[d] != full.shape[d] for p in pieces)]
    assert len(dims) <= 1
    if not dims:
        assert all(torch.equal(p, full) for p in pieces)
        return
    dim = dims[0]
    unique = [pieces[0]]
    for p in pieces[1:]:
        if not (p.shape == unique[-1].shape and torch.equal(p, unique[-1])):
            unique.append(p)
    assert torch.equal(torch.cat(unique, dim), full)
