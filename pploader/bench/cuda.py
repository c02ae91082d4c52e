"""``pploader bench --device cuda``: one PP=2 stage of a llama checkpoint onto one GPU,
pploader next to the raw ceiling and other loaders, warm (page cache) and cold (evicted), in
one run.

The methods are in ``bench/gpu_methods.py`` (raw 16-thread preadv -> pinned ring -> H2D
ceiling, safetensors read-all-then-filter, pploader's first load / reused ring / public API;
fastsafetensors and instanttensor when importable). Each method runs in a fresh process whose
CUDA context exists before the clock starts; everything else the method does (headers,
planning, staging buffers, destination allocation) is timed. Outputs are checked against the
file bytes. Cold = ``posix_fadvise(DONTNEED)`` (+ drop_caches when that is not enough),
residency verified by ``mincore``.

    python -m pploader.bench.cuda --ckdir /tmp/ck --out OUT [--budget S] [--methods a,b]

``pploader bench --device cuda -- ARGS`` calls this. ``--scale tiny`` makes a small checkpoint
(for a quick check), ``--scale 70b`` a Llama-3-70B-shaped one (``--pp 4 --stage K``: one of
its ~35 GB stages). GB = 10^9 bytes. The experiment harnesses built on it (method variants,
engine-shaped methods, PP=N on N GPUs, disk patterns) live in the repository's
``benchmarks/gpu_field.py``, outside the package: they pass their own :class:`MethodField`.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

__all__ = ["main", "build_parser", "run", "MethodField", "standard_field", "write_checkpoint",
           "stage_ctx", "checkpoint_files", "warm", "evict", "run_child", "available", "table",
           "run_all", "plot", "child"]

GB = 1e9
MIB = 1 << 20
_WARM_SET = ["raw_preadv16", "pploader_first", "pploader_first_populate", "pploader_prepared",
             "pploader_reused", "instanttensor_buf"]
WARM = _WARM_SET + ["raw_preadv16_first", "pploader_first_prep", "fastsafetensors_buf",
                    "pploader_api", "st_readall"] + _WARM_SET
_COLD_SET = ["raw_preadv16", "pploader_first", "fastsafetensors_odirect",
             "pploader_first_interleave", "instanttensor_buf"]
COLD = _COLD_SET + ["pploader_first", "fastsafetensors_odirect", "pploader_first_interleave",
                    "pploader_first", "fastsafetensors_odirect"]


SCALES = ("full", "70b", "tiny")


def _shapes(scale: str) -> tuple[Any, int]:
    from .data import LlamaShape
    if scale == "full":  # Llama-3-8B, 8 shards of <= 2.2 GB
        return LlamaShape(4096, 14336, 128256, 32, 32, 8, 128), 2_200_000_000
    if scale == "70b":  # Llama-3-70B (141 GB bf16; ~35 GB per PP=4 stage), shards of <= 5 GB
        return LlamaShape(8192, 28672, 128256, 80, 64, 8, 128), 5_000_000_000
    return LlamaShape(256, 896, 8192, 32, 4, 1, 64), 4 * MIB


def write_checkpoint(ckdir: str, scale: str) -> None:
    """A llama checkpoint (bf16 random bytes, sharded by size, index + config) unless the
    directory already holds the same one. Shards are written by parallel threads (each its
    own seeded stream; the 70b scale is 141 GB), then synced."""
    from concurrent.futures import ThreadPoolExecutor
    from .data import _groups, _header, _ordered_template, _random_chunks, llama_config
    import random
    from ..outputs import claim_output, own_entries, retire_stale
    shape, shard_bytes = _shapes(scale)
    # new, empty or written here before (pploader.outputs): never a user's files
    target = claim_output(ckdir, "--ckdir", command="bench.cuda", reuse=True)
    out = target.path
    stamp = out / "gpubench.json"
    want = {"scale": scale, "shape": list(shape.__dict__.values())}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return
    config = llama_config(shape)
    groups = _groups(_ordered_template(config), shard_bytes)
    pool = random.Random(1234).randbytes(64 * MIB)
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    files = [*names, "config.json", "model.safetensors.index.json", stamp.name]
    own_entries(target, files)  # listed (with the old ones) before anything is written
    retire_stale(target, files)  # the old checkpoint's files that this one does not rewrite
    stamp.unlink(missing_ok=True)

    def write(i: int) -> None:
        rng = random.Random(1234 + i)
        head, _ = _header((n, "BF16", s, math.prod(s) * 2) for n, s in groups[i])
        with open(out / names[i], "wb") as fh:
            fh.write(head)
            for _tname, s in groups[i]:
                for chunk in _random_chunks(math.prod(s) * 2, pool, rng):
                    fh.write(chunk)

    with ThreadPoolExecutor(min(8, len(groups))) as workers:
        list(workers.map(write, range(len(groups))))
    os.sync()
    weight_map = {t: names[i] for i, group in enumerate(groups) for t, _ in group}
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    stamp.write_text(json.dumps(want))


def stage_ctx(ckdir: str, device: str, pp: int = 2, stage: int = 0) -> Any:
    """The PP=2 stage 0 that every method loads (names from pploader's plan, offsets from
    the files' own headers); ``pp`` / ``stage`` pick another (the PP=N ceilings)."""
    from .. import Topology, plan_stage
    from .gpu_methods import Ctx, read_header
    names = {i.name for i in plan_stage(ckdir, Topology(pp, rank=stage)).plan.items}
    all_files = sorted(p.name for p in Path(ckdir).glob("*.safetensors"))
    tensors = {}
    for f in all_files:
        base, head = read_header(os.path.join(ckdir, f))
        for k, v in head.items():
            if k in names:
                s, e = v["data_offsets"]
                tensors[k] = (f, base + s, base + e, v["dtype"], v["shape"])
    if set(tensors) != names:
        raise SystemExit(f"plan names not found in the files: {sorted(names - set(tensors))[:3]}")
    return Ctx(ckdir, device, tensors, sorted({t[0] for t in tensors.values()}), all_files,
               sum(t[2] - t[1] for t in tensors.values()), pp, stage)


def _rss_peak() -> Optional[int]:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


@dataclass(frozen=True)
class MethodField:
    """The methods a run may measure: name -> (fn, prep or None), the environment each needs,
    optional ones (name prefix -> module that must be importable), and the module whose
    ``--child METHOD`` runs one of them in a fresh process."""

    methods: Mapping[str, tuple[Callable[..., Any], Optional[Callable[..., Any]]]]
    env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    optional: Mapping[str, str] = field(default_factory=dict)
    module: str = "pploader.bench.cuda"


def standard_field() -> MethodField:
    """What ``pploader bench --device cuda`` measures (bench/gpu_methods.py)."""
    from .gpu_methods import METHOD_ENV, METHODS, OPTIONAL
    return MethodField(METHODS, METHOD_ENV, OPTIONAL)


def child(method: str, ckdir: str, device: str, pp: int = 2, stage: int = 0,
          methods: Optional[MethodField] = None) -> None:
    """Measure ``method`` once in this process; prints ``RESULT {json}``."""
    import torch
    from .gpu_methods import verify
    table_ = (methods or standard_field()).methods
    row: dict[str, Any] = {"method": method}
    try:
        torch.cuda.set_device(device)  # pinned allocations' context on this GPU, not cuda:0
        torch.empty(1, device=device)
        torch.cuda.synchronize(device)
        ctx = stage_ctx(ckdir, device, pp, stage)
        fn, prep_fn = table_[method]
        prep = prep_fn(ctx) if prep_fn else {}
        row["rss_before"] = _rss_peak()
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        out, info = fn(ctx, prep)
        torch.cuda.synchronize(device)
        row["seconds"] = time.perf_counter() - start
        row["gbps"] = ctx.ideal_bytes / row["seconds"] / GB
        row["ideal_bytes"] = ctx.ideal_bytes
        row["rss_peak"] = _rss_peak()
        row["gpu_peak"] = torch.cuda.max_memory_allocated(device)
        row.update({k: v for k, v in info.items() if not k.startswith("_")})
        row["verify"] = verify(ctx, out)
    except Exception as exc:  # noqa: BLE001 - reported in the row
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
    print("RESULT " + json.dumps(row), flush=True)


def checkpoint_files(ckdir: str) -> list[str]:
    return sorted(str(p) for p in Path(ckdir).glob("*.safetensors"))


def _resident(paths: list[str]) -> float:
    from ..io.pagecache import resident_bytes_of_ranges
    r = t = 0
    for p in paths:
        a, b = resident_bytes_of_ranges(p, [(0, os.path.getsize(p))], sample_bytes=0, strict=True)
        r, t = r + a, t + b
    return r / t if t else 0.0


def warm(paths: list[str]) -> float:
    def read(p: str) -> None:
        with open(p, "rb", buffering=0) as fh:
            while fh.read(16 * MIB):
                pass
    ts = [threading.Thread(target=read, args=(p,)) for p in paths]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return _resident(paths)


def evict(paths: list[str]) -> float:
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    frac = _resident(paths)
    if frac > 0.01:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
        except OSError:
            pass
        frac = _resident(paths)
    return frac


def _cudart_shim() -> dict[str, str]:
    """fastsafetensors dlopens a plain ``libcudart.so``: point LD_LIBRARY_PATH at a folder
    holding that name for the CUDA runtime that came with torch (none: leave it)."""
    import glob
    import torch
    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so.*")) +
                   glob.glob("/usr/local/cuda*/lib64/libcudart.so.*"))
    if not found:
        return {}
    shim = "/tmp/pploader-cudart"
    os.makedirs(shim, exist_ok=True)
    if not os.path.exists(os.path.join(shim, "libcudart.so")):
        os.symlink(found[0], os.path.join(shim, "libcudart.so"))
    return {"LD_LIBRARY_PATH": shim + os.pathsep + os.environ.get("LD_LIBRARY_PATH", "")}


def run_child(method: str, args: argparse.Namespace, timeout: float,
              methods: Optional[MethodField] = None) -> dict:
    """One measurement of ``method`` in a fresh process (``methods.module --child``)."""
    found = methods or standard_field()
    env = dict(os.environ, **found.env.get(method, {}))
    if "fastsafetensors" in method:
        env.update(_cudart_shim())
    cmd = [sys.executable, "-m", found.module, "--child", method, "--ckdir", args.ckdir,
           "--device", args.device, "--pp", str(args.pp), "--stage", str(args.stage)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out, err = p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        out, err = str(exc.stdout or ""), f"timeout after {timeout:.0f}s"
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    return json.loads(lines[-1][7:]) if lines else {"method": method, "error": err[-400:]}


def available(method: str, methods: Optional[MethodField] = None) -> bool:
    """False for an optional method whose wheel is not importable (its row is skipped)."""
    optional = (methods or standard_field()).optional
    mod = next((m for k, m in optional.items() if method.startswith(k)), None)
    return mod is None or importlib.util.find_spec(mod) is not None


def table(rows: list[dict]) -> str:
    head = (f"{'method':24s} {'cache':5s} {'sec':>7s} {'GB/s':>7s} {'rssPk_GB':>8s} "
            f"{'gpuPk_GB':>8s}  verify / profile")
    lines = [head]
    for r in rows:
        prof = r.get("profile") or {}
        extra = " ".join(f"{k.split('_s')[0]}={v:.3f}" for k, v in prof.items()) if prof else ""
        if "plan_s" in r:
            extra = f"plan={r['plan_s']:.3f} {extra}"
        for k, v in (r.get("stream_timings") or {}).items():  # the device stream's phases
            extra += f" {k.removesuffix('_s')}={v:.3f}"
        lines.append(f"{r['method']:24s} {r.get('cache', ''):5s} {r.get('seconds', 0):7.3f} "
                     f"{r.get('gbps', 0):7.2f} {(r.get('rss_peak') or 0) / GB:8.2f} "
                     f"{(r.get('gpu_peak') or 0) / GB:8.2f}  "
                     f"{r.get('error') or r.get('verify', '')} {extra}"[:230])
    return "\n".join(lines)


def run_all(args: argparse.Namespace, methods: Optional[MethodField] = None,
            first: Optional[Callable[[list[str]], list[dict]]] = None) -> list[dict]:
    """Every method, warm then cold, each in a fresh process; rows to OUT/gpu_bench.json.
    ``first``: rows measured on the checkpoint's files before the methods (a harness's)."""
    found = methods or standard_field()
    METHODS = found.methods
    want = args.methods.split(",") if args.methods else None  # in order, repeats kept
    unknown = sorted(set(want or ()) - set(METHODS))
    if unknown:  # before writing a 16 GB checkpoint
        raise SystemExit(f"unknown method(s) {', '.join(unknown)}: use {', '.join(METHODS)}")
    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(args.ckdir, args.scale)
    gen_s = time.time() - t_start
    paths = checkpoint_files(args.ckdir)
    plan = [(m, c) for c, order in (("warm", WARM), ("cold", COLD))
            if c in args.caches.split(",") for m in (want if want is not None else order)
            if available(m, found)]
    env = {"torch": __import__("torch").__version__, "gen_s": round(gen_s, 1),
           "cpus": os.cpu_count(), "argv": sys.argv}
    rows: list[dict] = []
    if first is not None:
        rows += first(paths)
    for method, cache in plan:
        left = args.budget - (time.time() - t_start)
        if left < 20:
            rows.append({"method": method, "cache": cache, "error": "skipped: budget"})
            continue
        resident = warm(paths) if cache == "warm" else evict(paths)
        row = dict(run_child(method, args, min(150.0, left - 5), found), cache=cache,
                   resident_before=round(resident, 3))
        rows.append(row)
        print(f"[gpu-bench] {time.time() - t_start:6.1f}s {method:22s} {cache} "
              f"{row.get('gbps', 0):6.2f} GB/s {row.get('error') or row.get('verify', '')} "
              f"{json.dumps(row.get('profile', ''))}", flush=True)
        (out / "gpu_bench.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    text = table([r for r in rows if r["method"] != "disk_odirect"])
    (out / "gpu_bench.txt").write_text(text + "\n")
    print(text, flush=True)
    return rows


def plot(bench_json: str, png: str, title: str = "") -> None:
    """Bar chart of warm and cold GB/s per method from a gpu_bench.json (matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in json.loads(Path(bench_json).read_text())["rows"]
            if r["method"] != "disk_odirect"]
    methods = list(dict.fromkeys(r["method"] for r in rows if r.get("cache") in ("warm", "cold")))
    rate = {(r["method"], r["cache"]): r.get("gbps") or 0.0 for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, cache in zip(axes, ("warm", "cold")):
        names = [m for m in methods if (m, cache) in rate]
        colors = ["tab:green" if m.startswith("pploader") else "tab:gray" if m.startswith("raw")
                  else "tab:blue" for m in names]
        ax.barh(names, [rate[(m, cache)] for m in names], color=colors)
        ax.invert_yaxis()
        ax.set_xlabel("GB/s of the stage's ideal bytes")
        ax.set_title(f"{cache} page cache")
        for y, m in enumerate(names):
            ax.text(rate[(m, cache)], y, f" {rate[(m, cache)]:.1f}", va="center", fontsize=8)
    fig.suptitle(title or "one PP=2 stage onto one GPU: pploader (green), raw ceiling (gray)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def build_parser(prog: str = "pploader bench --device cuda --") -> argparse.ArgumentParser:
    """The options of the standard run (a harness adds its own to this parser)."""
    ap = argparse.ArgumentParser(prog=prog, description=" ".join(
        (__doc__ or "").split("\n\n")[0].split()))
    ap.add_argument("--ckdir", default="/tmp/ck")
    ap.add_argument("--out", default="out/gpu-bench")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--scale", default="full", choices=SCALES, help="full: Llama-3-8B (16 GB); "
                    "70b: Llama-3-70B (141 GB, for PP=4); tiny: a quick check")
    ap.add_argument("--budget", type=float, default=420.0, help="wall seconds for all methods")
    ap.add_argument("--methods", default=None, help="comma list, run in this order for each "
                    "cache (repeat a name to repeat it; default: the standard warm and cold "
                    "orders of the available methods)")
    ap.add_argument("--caches", default="warm,cold")
    ap.add_argument("--pp", type=int, default=2, help="stages (of the methods' stage)")
    ap.add_argument("--stage", type=int, default=0, help="the stage the methods load")
    ap.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"), default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap


def run(args: argparse.Namespace, methods: Optional[MethodField] = None) -> None:
    """The standard run's modes (``--plot``, ``--child``, else every method warm and cold)."""
    if args.plot:
        return plot(*args.plot)
    if args.child:
        return child(args.child, args.ckdir, args.device, args.pp, args.stage, methods)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    run_all(args, methods)
    return None


def main(argv: Optional[list[str]] = None) -> None:
    run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
