"""Real published checkpoint layouts as sparse safetensors files (test utility, not product code).

``build_layout("deepseek-v3", root)`` writes ``root/deepseek-v3/`` with the config.json of the
real model (``tests/data/real_configs/*.json``), a ``model.safetensors.index.json`` and ~5 GB
shards whose headers are real (names, shapes, dtypes and offsets of every tensor, from the
family's hand-written ``template(spec)`` plus the quantization companions of planning/quant.py) and
whose data regions are holes (``truncate``): a 671B checkpoint costs a few MB of disk.

Quantized layouts (DeepSeek-V3 FP8 with 128x128 ``weight_scale_inv`` blocks) quantize what the
published checkpoint quantizes: every >= 2-d linear weight of the decoder and MTP layers except
the router (``mlp.gate``), the MTP ``eh_proj``, ``embed_tokens`` and ``shared_head.head``.

Run as a script for the planning-time table of docs/benchmarks.md (MODEL: a stem under
``data/real_configs`` or, planned by the generic family, ``data/real_configs_generic``)::

    python tests/real_layouts.py [--root DIR] [MODEL ...]
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path
from typing import Mapping, Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pploader.planning.checkpoint import DTYPES, dtype_code  # noqa: E402
from pploader.planning.quant import expand_template, quant_scheme  # noqa: E402
from pploader.planning.spec import ModelSpec, spec_from_config  # noqa: E402
from pploader.tiny import model_order  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "data" / "real_configs"
MODELS = tuple(sorted(p.stem for p in CONFIGS.glob("*.json")))
SHARD_BYTES = 5 * 10 ** 9
#: components a published FP8 checkpoint keeps in the model dtype although they are 2-d weights
_UNQUANTIZED = ("mlp.gate.weight", "eh_proj.weight", "embed_tokens.weight",
                "shared_head.head.weight")


#: quantized (int4) published configs: planned like the others, kept apart from ``MODELS``
QUANT_CONFIGS = Path(__file__).resolve().parent / "data" / "real_configs_quant"
QUANT_MODELS = tuple(sorted(p.stem for p in QUANT_CONFIGS.glob("*.json")))


def real_config(model: str) -> dict:
    """The published config.json of ``model`` (a file stem under tests/data/real_configs or
    real_configs_quant)."""
    folder = QUANT_CONFIGS if model in QUANT_MODELS else CONFIGS
    return json.loads((folder / f"{model}.json").read_text())


def real_tensors(spec: ModelSpec) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (safetensors dtype, shape)}`` of every tensor, in state-dict (shard) order."""
    template = spec.family.template(spec)  # type: ignore[misc]
    model_dtype = dtype_code(spec.dtype)
    scheme = quant_scheme(spec)
    if scheme is not None and scheme.mixed:  # compressed-tensors: the layouts use one scheme
        scheme = scheme.schemes[0]  # type: ignore[attr-defined]
    if scheme is None:
        stored: Mapping[str, tuple[int, ...]] = template
        dtypes = {n: model_dtype for n in template}
    else:
        def dtype_of(stored: str) -> Optional[str]:  # by the stored name (x.qweight...)
            name = scheme.naming.logical_of(stored)
            role = spec.family.classify(name, spec.num_layers, spec.num_mtp_layers)
            quantized = (role is not None and role.placement in ("layer", "mtp")
                         and len(template[name]) >= 2 and name.endswith(".weight")
                         and not any(name.endswith("." + c) for c in _UNQUANTIZED))
            return scheme.weight_dtype if quantized else model_dtype
        stored = expand_template(scheme, template, dtype_of=dtype_of)
        dtypes = {}
        for name in template:
            weight = scheme.naming.stored(name)
            dtypes[weight] = dtype_of(weight) or model_dtype
            if dtypes[weight] != scheme.weight_dtype:
                dtypes[name] = dtypes.pop(weight)
                continue
            for cname, comp in scheme.companion_names(weight).items():
                dtypes[cname] = comp.dtype
    names = sorted(stored, key=lambda n: model_order(spec, n))  # stable: template order inside
    return {n: (dtypes[n], tuple(stored[n])) for n in names}


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPES[dtype][1]


def _write_sparse(path: Path, tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> None:
    """A safetensors file with a real header and a hole for its data region."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        end = offset + _nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + offset)


def build_layout(model: str, root: os.PathLike | str, *, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write (once; reused when complete) the sparse checkpoint of ``model`` under ``root``."""
    out = Path(root) / model
    done = out / ".complete"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = real_config(model)
    spec = spec_from_config(config)
    _write_groups(out, config, real_tensors(spec), shard_bytes)
    done.write_text("")
    return out


#: published configs of models no hand-written family covers (the generic family plans them)
GENERIC_CONFIGS = Path(__file__).resolve().parent / "data" / "real_configs_generic"
GENERIC_MODELS = tuple(sorted(p.stem for p in GENERIC_CONFIGS.glob("*.json")))
#: gpt-oss: stored dtypes of the MXFP4 expert tensors (everything else is bfloat16)
_GENERIC_DTYPES = {"_blocks": "U8", "_scales": "U8"}


def build_generic_layout(model: str, root: os.PathLike | str, *,
                         shard_bytes: int = SHARD_BYTES, mtp: bool = False) -> Path:
    """``build_layout`` for a published config under ``data/real_configs_generic`` (no
    hand-written family): names and shapes from the generic family's template (the model
    built on ``meta``, MXFP4 experts as blocks + scales), bfloat16 except MXFP4's uint8
    blocks / scales; the config.json written as published (gpt-oss has no ``torch_dtype``).
    MTP layers (``num_nextn_predict_layers``) only with ``mtp`` (the directory is then
    ``<model>-mtp``)."""
    out = Path(root) / (f"{model}-mtp" if mtp else model)
    done = out / ".complete"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((GENERIC_CONFIGS / f"{model}.json").read_text())
    spec = spec_from_config({**config, "dtype": "bfloat16"})
    template = spec.family.template(spec)  # type: ignore[misc]
    names = sorted(template, key=lambda n: model_order(spec, n))
    if not mtp:
        names = [n for n in names if getattr(spec.family.classify(
            n, spec.num_layers, spec.num_mtp_layers), "placement", None) != "mtp"]
    tensors = {n: (next((d for s, d in _GENERIC_DTYPES.items() if n.endswith(s)), "BF16"),
                   tuple(template[n])) for n in names}
    _write_groups(out, config, tensors, shard_bytes)
    done.write_text("")
    return out


#: published indexes written compactly (every name and its shard): data/published_indexes
PUBLISHED = Path(__file__).resolve().parent / "data" / "published_indexes"


def published_weight_map(model: str) -> tuple[dict[str, str], dict]:
    """``({name: shard file}, metadata)`` of a published checkpoint's index, expanded from
    ``data/published_indexes/<model>.json``: its globals, and per layer block the components
    and each layer's shard (``[a, b]``: a layer cut by a shard boundary, its components
    starting with one of ``split_first`` in shard a, the rest in shard b)."""
    facts = json.loads((PUBLISHED / f"{model}.json").read_text())
    fname = facts["files"].format
    out = {n: fname(s) for n, s in facts["globals"].items()}
    for block in facts["layers"]:
        first = tuple(block.get("split_first", ()))
        for i in range(block["count"]):
            where = block["shard"][str(i)]
            for comp in block["components"]:
                shard = where if isinstance(where, int) else where[0 if comp.startswith(first)
                                                                    else 1]
                out[f"{block['prefix']}{i}.{comp}"] = fname(shard)
    return out, facts["metadata"]


def build_published_layout(model: str, root: os.PathLike | str) -> Path:
    """A published checkpoint as sparse files: its real names and shard split
    (``published_weight_map``), its published config (``data/real_configs_generic``), shapes
    from the generic family's template for that naming (every published name must be in it
    and nothing else), its config dtype; the total must equal the published ``total_size``."""
    out = Path(root) / model
    done = out / ".complete"
    if done.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((GENERIC_CONFIGS / f"{model}.json").read_text())
    weight_map, metadata = published_weight_map(model)
    spec = spec_from_config(config).for_checkpoint(weight_map)
    template = spec.family.template(spec)  # type: ignore[misc]
    if set(template) != set(weight_map):
        raise AssertionError(f"{model}: published names != the {spec.family.name} template: "
                             f"{sorted(set(template) ^ set(weight_map))[:6]}")
    dtype = dtype_code(spec.dtype)
    shards: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for name in sorted(weight_map):
        shards.setdefault(weight_map[name], {})[name] = (dtype, tuple(template[name]))
    for fname, tensors in shards.items():
        _write_sparse(out / fname, tensors)
    total = sum(_nbytes(d, s) for t in shards.values() for d, s in t.values())
    if total != metadata["total_size"]:
        raise AssertionError(f"{model}: {total} bytes, published total_size "
                             f"{metadata['total_size']}")
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": metadata, "weight_map": weight_map}) + "\n")
    done.write_text("")
    return out


def _write_groups(out: Path, config: Mapping, tensors: Mapping[str, tuple[str, tuple[int, ...]]],
                  shard_bytes: int) -> None:
    """Shards of at most ``shard_bytes`` (in order), their index and config.json."""
    groups: list[dict[str, tuple[str, tuple[int, ...]]]] = [{}]
    size = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = _nbytes(dtype, shape)
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = (dtype, shape)
        size += nbytes
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        _write_sparse(out / fname, group)
        weight_map.update(dict.fromkeys(group, fname))
    total = sum(_nbytes(d, s) for d, s in tensors.values())
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
        + "\n")


def _main(argv: list[str]) -> int:
    """Planning time per rank and for all ranks, per layout (docs/benchmarks.md)."""
    import argparse
    import platform
    import time

    from pploader.planning.checkpoint import open_checkpoint
    from pploader.planning.plan import make_windows, plan_all, plan_rank
    from pploader.planning.spec import load_spec
    from pploader.planning.topology import Topology

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["deepseek-v3"])
    ap.add_argument("--root", default="/tmp/pploader-real-layouts")
    ap.add_argument("--layouts", default="16x1x1,1x8x1,2x8x1,8x1x8",
                    help="PPxTPxEP, comma separated")
    args = ap.parse_args(argv)
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| model | tensors | layout | one rank (last rank, fresh index) s | all ranks s |")
    print("|---|---|---|---|---|")
    for model in args.models:
        path = (build_generic_layout if model in GENERIC_MODELS else build_layout)(model, args.root)
        for layout in args.layouts.split(","):
            pp, tp, ep = (int(x) for x in layout.split("x"))
            spec = load_spec(path)
            if ep > 1 and not spec.num_experts:
                continue
            topo = Topology(pp, tp, ep, pp * tp * ep - 1)
            t0 = time.perf_counter()
            index = open_checkpoint(path)
            spec = spec.for_checkpoint(index.weight_map)
            windows = make_windows(spec, index, pp, "even")
            plan_rank(spec, index, topo, windows[topo.pp_rank])
            one = time.perf_counter() - t0
            t0 = time.perf_counter()
            plan_all(load_spec(path), open_checkpoint(path), pp, tp, ep)
            every = time.perf_counter() - t0
            print(f"| {model} | {len(index.weight_map)} | PP{pp}xTP{tp}xEP{ep} | {one:.3f} | "
                  f"{every:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
