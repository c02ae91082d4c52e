"""The full GPU method field: ``pploader bench --device cuda``'s run (pploader/bench/cuda.py)
with every method this repository has measured, and the GPU experiments built on it.

Methods: the standard ones (pploader/bench/gpu_methods.py), their variants
(benchmarks/gpu_method_variants.py) and the engine-shaped ones
(benchmarks/gpu_engine_methods.py). Modes besides the warm + cold field:

    python -m benchmarks.gpu_field --ckdir /tmp/ck --out OUT [--budget S] [--methods a,b]
    python -m benchmarks.gpu_field --disk --ckdir /tmp/ck       # O_DIRECT request patterns
    python -m benchmarks.gpu_field --disk-best all --ckdir /tmp/ck
    python -m benchmarks.gpu_field --together M1,M2 --pp 4       # every stage at once
    python -m benchmarks.gpu_field --pp2 [--pp 4] --ckdir /tmp/ck  # stages alone vs together
    python -m benchmarks.gpu_field --pp2-profile | --pp-reload [--pp 4]
    python -m benchmarks.gpu_field --cli-wall 1                  # torchrun + pploader load wall

Run from the repository root (``benchmarks`` is not installed with the wheel). ``--out``
defaults to ``$OUT`` when set (the device machine's result folder), else out/gpu-bench.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Optional

from pploader.bench.cuda import (GB, MethodField, available, build_parser, checkpoint_files,
                                 evict, run, run_child, standard_field, warm, write_checkpoint)

__all__ = ["full_field", "run_together", "main"]

MODULE = "benchmarks.gpu_field"


def full_field() -> MethodField:
    """Every method: standard, variants and engine-shaped; children run by this module."""
    from .gpu_engine_methods import ENGINE_ENV, ENGINE_METHODS, ENGINE_OPTIONAL
    from .gpu_method_variants import VARIANT_ENV, VARIANTS
    base = standard_field()
    return MethodField({**base.methods, **VARIANTS, **ENGINE_METHODS},
                       {**base.env, **VARIANT_ENV, **ENGINE_ENV},
                       {**ENGINE_OPTIONAL, **base.optional}, MODULE)


def run_together(args: argparse.Namespace, field: MethodField) -> list[dict]:
    """``--together M1,M2``: each method on every stage of PP=``--pp`` at once, stage k on
    cuda:k (one process each, started together), warm and cold; rows to
    OUT/gpu_together.json with each stage's GB/s and the job's (all stages' bytes over the
    slowest stage's seconds)."""
    from concurrent.futures import ThreadPoolExecutor
    write_checkpoint(args.ckdir, args.scale)
    paths, rows = checkpoint_files(args.ckdir), []
    for cache in args.caches.split(","):
        for method in args.together.split(","):
            if not available(method, field):
                continue
            resident = warm(paths) if cache == "warm" else evict(paths)
            stages = [argparse.Namespace(**{**vars(args), "stage": k, "device": f"cuda:{k}"})
                      for k in range(args.pp)]
            with ThreadPoolExecutor(args.pp) as pool:
                got = list(pool.map(lambda a: run_child(method, a, 150.0, field), stages))
            secs = [g.get("seconds") or 0.0 for g in got]
            row = {"method": method, "cache": cache, "resident_before": round(resident, 3),
                   "stages": got, "job_gbps": sum(g.get("ideal_bytes", 0) for g in got)
                   / max(secs) / GB if all(secs) else 0.0}
            rows.append(row)
            print(f"[gpu-together] {method:24s} {cache} job {row['job_gbps']:.2f} GB/s; "
                  + ", ".join(f"stage {k} {g.get('gbps', 0):.2f} {g.get('error') or g.get('verify')}"
                              for k, g in enumerate(got)), flush=True)
            Path(args.out, "gpu_together.json").write_text(json.dumps(rows, indent=1))
    return rows


def _parser() -> argparse.ArgumentParser:
    ap = build_parser(prog="python -m benchmarks.gpu_field")
    ap.description = " ".join((__doc__ or "").split("\n\n")[0].split())
    ap.set_defaults(out=os.environ.get("OUT") or "out/gpu-bench")
    ap.add_argument("--disk", action="store_true", help="only the O_DIRECT pattern sweep")
    ap.add_argument("--disk-first", action="store_true", help="the sweep, then the methods")
    ap.add_argument("--disk-best", default=None, metavar="PATTERNS",
                    help="comma list of benchmarks/disk_patterns.py patterns ('all'): O_DIRECT "
                    "reads of the stage's bytes, no GPU, twice (forward, backward)")
    ap.add_argument("--cli-wall", type=int, default=0, metavar="TRIALS",
                    help="torchrun + pploader load vs a bare torchrun NCCL script (2 GPUs), "
                    "tiny and real size, warm and cold")
    ap.add_argument("--together", default=None, metavar="METHODS",
                    help="comma list: each method on every stage at once (stage k on cuda:k)")
    ap.add_argument("--pp2", action="store_true", help="PP=--pp stages alone vs together")
    ap.add_argument("--pp2-profile", action="store_true",
                    help="PP=--pp page-cache reads and H2D copies, alone vs together")
    ap.add_argument("--pp-reload", action="store_true", help="PP=N with rings made before "
                    "the clock, and raw ceilings of one stage's bytes on another GPU")
    return ap


def _disk_sweep(paths: list[str]) -> list[dict]:
    """``--disk-first``: the O_DIRECT sweep's rows, before the methods'."""
    from .disk_patterns import disk_patterns
    return [dict(r, method="disk_odirect", cache="cold") for r in disk_patterns(paths)]


def _write(args: argparse.Namespace, name: str, rows: list[dict]) -> None:
    Path(args.out, name).write_text(json.dumps(rows, indent=1))


def main(argv: Optional[list[str]] = None) -> None:
    args = _parser().parse_args(argv)
    field = full_field()
    if args.plot or args.child:
        return run(args, field)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.together:
        run_together(args, field)
        return None
    harness = args.disk or args.disk_best or args.cli_wall or args.pp_reload or args.pp2 \
        or args.pp2_profile
    if not harness:  # the field, with the O_DIRECT sweep first when asked
        from pploader.bench.cuda import run_all
        run_all(args, field, _disk_sweep if args.disk_first else None)
        return None
    write_checkpoint(args.ckdir, args.scale)
    files = checkpoint_files(args.ckdir)
    if args.disk:
        from .disk_patterns import disk_patterns
        _write(args, "disk.json", disk_patterns(files))
    elif args.disk_best:
        from pploader import Topology, plan_stage
        from .disk_patterns import PATTERNS, disk_best
        names = list(PATTERNS) if args.disk_best == "all" else args.disk_best.split(",")
        evict(files)
        _write(args, "disk_best.json",
               disk_best(plan_stage(args.ckdir, Topology(args.pp, rank=args.stage)).plan, names))
    elif args.cli_wall:
        from pploader.tiny import make_tiny, resolve_tiny_config
        from .torchrun_wall import cli_wall
        tiny = "/tmp/pploader-tiny-llama"
        if not Path(tiny, "config.json").exists():
            make_tiny(resolve_tiny_config("llama"), tiny)
        _write(args, "cli_wall.json", cli_wall(tiny, args.ckdir, 2, args.cli_wall, warm, evict))
    elif args.pp_reload:
        from .gpu_pp_stages import pp_reload
        _write(args, f"pp{args.pp}_reload.json", pp_reload(args.ckdir, args.pp))
    elif args.pp2:
        from .gpu_pp_stages import pp_stages
        _write(args, f"pp{args.pp}.json", pp_stages(args.ckdir, args.pp))
    else:
        from .gpu_pp_stages import pp_profile
        _write(args, f"pp{args.pp}_profile.json", pp_profile(args.ckdir, args.pp))
    return None


if __name__ == "__main__":
    main()
