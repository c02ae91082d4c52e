"""``pploader bench``: pploader vs read-all-then-filter vs raw preadv, on the same files.

One run writes a synthetic llama-shaped checkpoint (pploader/bench/data.py), then measures
every method (pploader/bench/methods.py) for every PP rank, warm and cold page cache, with
the ranks "alone" (one after the other, evicting in between when cold: one node per rank)
and "together" (all ranks at once on this node, sharing its page cache). Each measurement is
a fresh process. A smaller checkpoint (size / --rss-scale) shows that pploader's peak RSS does
not grow with the checkpoint; a headers-only checkpoint with --plan-tensors tensors times
planning. Results: a table (stdout), ``--json``, ``--markdown FILE``, ``--plot FILE.png``
(pploader/bench/report.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from ..arg_types import text as _text, typed as _typed
from ..errors import UsageError
from .checks import (_gigabytes, _scale, _tensors, check_bench_outputs, check_bench_plan,
                     read_rendered)
from .machine import machine_info
from .methods import (METHODS, ChildSpec, evict, make_resident, methods_for, resident_bytes,
                      spec_json)

__all__ = ["add_bench_parser", "run_bench", "DEFAULT_METHODS"]

GB = 1e9
DEFAULT_METHODS = ("a_into", "c_into", "a_owned", "c_owned", "b_into", "b_owned", "a_stream",
                   "a_borrow")
RSS_METHODS = ("a_into", "a_owned", "a_stream", "a_borrow", "b_owned")
_MAX_RESIDENT_AFTER_EVICT = 0.01  # cold runs refuse to start above this resident fraction


def add_bench_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser(
        "bench", help="benchmark pploader against read-all-then-filter and raw preadv",
        description="Write a synthetic llama-shaped checkpoint and load every PP rank's stage "
        "with pploader (a), the read-all-then-filter pattern of today's serving stacks (b) and "
        "raw os.preadv of exactly the needed bytes (c): warm and cold page cache, ranks alone "
        "and together, each measurement in a fresh process. GB = 1e9 bytes.")
    p.add_argument("--size-gb", type=_gigabytes, default=4.3,
                   help="checkpoint size in GB (default 4.3, about 4 GiB)")
    p.add_argument("--layers", type=_typed("--layers"), default=32, help="decoder layers (default 32)")
    p.add_argument("--shards", type=_typed("--shards"), default=5,
                   help="about this many shard files, split by size (default 5)")
    p.add_argument("--pp", type=_typed("--pp"), default=4, help="pipeline stages = ranks (default 4)")
    p.add_argument("--device", default="cpu",
                   choices=sorted({m.device for m in METHODS.values()} | {"cuda"}),
                   help="where tensors land (default cpu). cuda runs pploader.bench.cuda: the "
                   "raw ceiling, pploader and the other loaders (their wheels optional) in one "
                   "run (docs/benchmarks-gpu.md); "
                   "arguments after -- go to it")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma list from {', '.join(METHODS)} (default: %(default)s)")
    p.add_argument("--caches", default="warm,cold", help="warm,cold (default both)")
    p.add_argument("--modes", default="alone,together", help="alone,together (default both)")
    p.add_argument("--repeat", type=_typed("--repeat"), default=1,
                   help="repetitions; each table cell keeps the repetition with the best wall")
    p.add_argument("--threads", type=_typed("--threads"), default=1,
                   help="reader threads per rank for pploader and raw (default 1)")
    p.add_argument("--torch-threads", type=_typed("--torch-threads"), default=1,
                   help="torch intra-op threads in each rank (default 1, as under torchrun)")
    p.add_argument("--window-bytes", type=_typed("--window-bytes"), default=None,
                   help="pploader's window (default: the Reader's default)")
    p.add_argument("--rss-scale", type=_scale, default=4,
                   help="also load a checkpoint this many times smaller (warm, alone) to show "
                   "peak RSS does not grow with the checkpoint; 0 = skip (default 4)")
    p.add_argument("--plan-tensors", type=_tensors, default=100_000,
                   help="time `plan --pp P` on a headers-only checkpoint with this many "
                   "tensors; 0 = skip (default 100000)")
    p.add_argument("--dir", type=_text("a directory"), default=os.path.join(tempfile.gettempdir(), "ppbench"),
                   help="where checkpoints are written (default: %(default)s)")
    p.add_argument("--keep", action="store_true",
                   help="keep the generated checkpoints (reused by the next run with the same "
                   "sizes); default: delete them at the end")
    p.add_argument("--seed", type=_typed("--seed"), default=0)
    p.add_argument("--timeout", type=_typed("--timeout"), default=600.0,
                   help="seconds per measured process")
    p.add_argument("--json", action="store_true", help="print one JSON document, not tables")
    p.add_argument("--markdown", type=_text("a file name"), metavar="FILE", default=None, help="write a Markdown report")
    p.add_argument("--plot", type=_text("a file name"), metavar="FILE.png", default=None,
                   help="write a PNG: GB/s and bytes read / ideal per rank per method")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--render", type=_text("a JSON file saved with --json"), metavar="JSON", default=None,
                   help="measure nothing: re-render a document saved with --json")
    p.add_argument("--dcp", action="store_true", help="dcp.load: pploader's storage reader vs "
                   "torch's HuggingFaceStorageReader (pploader.bench.dcp; its options after --)")
    p.add_argument("passthrough", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def _csv(text: str, allowed: Sequence[str], what: str, flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise UsageError(f"bench {flag}: unknown {what} {', '.join(bad) or repr(text)}; "
                         f"choose from {', '.join(allowed)}")
    return items


class _Log:
    def __init__(self, quiet: bool) -> None:
        self.quiet, self.t0 = quiet, time.monotonic()

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            sys.stderr.write(f"[bench {time.monotonic() - self.t0:6.1f}s] {msg}\n")
            sys.stderr.flush()


def _child_cmd(spec: ChildSpec) -> list[str]:
    return [sys.executable, "-m", "pploader.bench.methods", spec_json(spec)]


def _child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _run_group(specs: Sequence[ChildSpec], cache: str, paths: Sequence[str],
               timeout: float) -> tuple[list[dict], dict]:
    """Start ``specs`` (one process each), set the cache state once all are ready, release
    them together, collect their results. Returns (rows, cache info)."""
    procs, logs = [], []
    for spec in specs:
        log = tempfile.TemporaryFile("w+")
        procs.append(subprocess.Popen(_child_cmd(spec), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=log, text=True,
                                      env=_child_env()))
        logs.append(log)
    try:
        for proc, log in zip(procs, logs):
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if line.strip() != "READY":
                raise RuntimeError(_child_error(proc, log, line))
        total = sum(os.path.getsize(p) for p in paths)
        if cache == "cold":
            left = evict(paths)
            if left > _MAX_RESIDENT_AFTER_EVICT * total:
                raise RuntimeError(f"eviction failed: {left} of {total} bytes still resident "
                                   "after POSIX_FADV_DONTNEED")
        else:
            make_resident(paths)
        before = resident_bytes(paths)
        for proc in procs:
            proc.stdin.write("GO\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        rows = []
        for proc, log in zip(procs, logs):
            out, _ = proc.communicate(timeout=timeout)
            result = [ln[7:] for ln in out.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode != 0 or not result:
                raise RuntimeError(_child_error(proc, log, out))
            rows.append(json.loads(result[-1]))
        after = resident_bytes(paths)
    finally:
        for proc, log in zip(procs, logs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return rows, {"file_bytes": total, "resident_before": before, "resident_after": after}


def _child_error(proc: subprocess.Popen, log: object, out: str) -> str:
    proc.wait()
    log.seek(0)  # type: ignore[attr-defined]
    tail = log.read()[-3000:]  # type: ignore[attr-defined]
    return f"measured process failed (exit {proc.returncode}): {out[-500:]}\n{tail}"


def _measure(base: ChildSpec, methods: Sequence[str], caches: Sequence[str],
             modes: Sequence[str], repeat: int, size: str, timeout: float,
             log: _Log) -> list[dict]:
    paths = list(base.files)
    rows: list[dict] = []
    for rep in range(repeat):
        order = list(methods[rep % len(methods):]) + list(methods[:rep % len(methods)])
        for cache in caches:
            for mode in modes:
                # untimed warm-up: the first group after a change of cache state or mode pays
                # for memory the VM has not touched lately (seen here as 2x walls); discard it
                specs = [replace(base, method=order[0], rank=r) for r in range(base.pp)]
                _run_group(specs[:1] if mode == "alone" else specs, cache, paths, timeout)
                for name in order:
                    specs = [replace(base, method=name, rank=r) for r in range(base.pp)]
                    groups = [[s] for s in specs] if mode == "alone" else [specs]
                    for group in groups:
                        got, info = _run_group(group, cache, paths, timeout)
                        for row in got:
                            row.update(size=size, cache=cache, mode=mode, rep=rep, **info)
                        rows.extend(got)
                    done = [r for r in rows if (r["size"], r["cache"], r["mode"], r["rep"],
                                                r["method"]) == (size, cache, mode, rep, name)]
                    ideal = sum(r["ideal_bytes"] for r in done)
                    wall = _wall(done, mode)
                    log(f"{size:5s} rep {rep} {cache:4s} {mode:8s} {name:8s} wall {wall:7.3f}s "
                        f"{ideal / wall / GB:6.2f} GB/s")
    return rows


def _wall(rows: Sequence[dict], mode: str) -> float:
    if mode == "alone":
        return max(r["seconds"] for r in rows)
    return max(r["t_end"] for r in rows) - min(r["t_start"] for r in rows)


def _plan_timing(directory: Path, tensors: int, pp: int, timeout: float, log: _Log) -> dict:
    from .data import write_wide
    count = write_wide(directory, tensors)
    best: Optional[dict] = None
    for _ in range(2):  # best of two fresh processes: the box is shared
        proc = subprocess.run(_child_cmd(ChildSpec("plan", str(directory), pp=pp)),
                              capture_output=True, text=True, timeout=timeout, env=_child_env())
        result = [ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not result:
            raise RuntimeError(f"plan timing failed: {proc.stderr[-2000:]}")
        got = json.loads(result[-1])
        if best is None or got["seconds"] < best["seconds"]:
            best = got
    assert best is not None
    best["requested_tensors"], best["tensors"] = tensors, count
    log(f"plan --pp {pp} on {count} tensors: {best['seconds']:.3f}s "
        f"(index {best['index_s']:.3f}s + plan_all {best['plan_all_s']:.3f}s)")
    return best


def run_bench(args: argparse.Namespace) -> int:
    from .report import render
    extra = [a for a in args.passthrough if a != "--"]
    if args.dcp:
        from .dcp import main as dcp_main
        return dcp_main(extra + (["--device", args.device] if args.device == "cuda" else []))
    if args.device == "cuda":
        from .cuda import main as cuda_main
        cuda_main(extra)
        return 0
    if extra:
        raise UsageError(f"bench: unexpected arguments {' '.join(extra)} (only --device cuda "
                         "takes arguments after --)")
    check_bench_outputs(args)
    if args.render:
        return render(read_rendered(args.render), as_json=args.json, markdown=args.markdown,
                      plot_path=args.plot)
    log = _Log(args.quiet)
    methods = _csv(args.methods, [m.name for m in methods_for(args.device)], "method",
                   "--methods")
    caches = _csv(args.caches, ["warm", "cold"], "cache state", "--caches")
    modes = _csv(args.modes, ["alone", "together"], "mode", "--modes")
    check_bench_plan(args)
    from ..outputs import claim_output, own_entries, release_entries
    target = claim_output(args.dir, "--dir", command="bench", reuse=True)
    root = target.path
    own_entries(target, [])  # made now and marked pploader's
    made: list[Path] = []
    started = time.monotonic()
    machine = machine_info(root)  # before measuring: its date is the run's start
    from .data import checkpoint_files, write_synthetic
    try:
        sizes = [("main", args.size_gb)]
        if args.rss_scale > 1:
            sizes.append((f"1/{args.rss_scale}", args.size_gb / args.rss_scale))
        checkpoints, rows = {}, []
        for tag, size_gb in sizes:
            directory = root / f"llama-{size_gb:g}GB-{args.layers}L-{args.shards}s"
            made.append(directory)
            own_entries(target, [directory.name])  # marked pploader's before it is written
            log(f"checkpoint {tag}: {directory} ({size_gb:g} GB) ...")
            info = write_synthetic(directory, int(size_gb * GB), args.layers,
                                   shards=args.shards, seed=args.seed)
            checkpoints[tag] = info.to_json()
            base = ChildSpec("load", str(directory), pp=args.pp, threads=args.threads,
                             window_bytes=args.window_bytes, torch_threads=args.torch_threads,
                             files=tuple(checkpoint_files(directory)))
            if tag == "main":
                rows += _measure(base, methods, caches, modes, args.repeat, tag, args.timeout,
                                 log)
            else:
                small = [m for m in methods if m in RSS_METHODS]
                if small:
                    rows += _measure(base, small, ["warm"], ["alone"], args.repeat, tag,
                                     args.timeout, log)
        plan = None
        if args.plan_tensors:
            wide = root / f"wide-{args.plan_tensors}"
            made.append(wide)
            own_entries(target, [wide.name])
            plan = _plan_timing(wide, args.plan_tensors, args.pp, args.timeout, log)
        doc = {"command": "pploader bench " + " ".join(_argv_of(args)),
               "machine": machine, "config": _config_of(args, methods, caches, modes),
               "checkpoints": checkpoints, "plan": plan, "rows": rows,
               "elapsed_s": round(time.monotonic() - started, 1)}
        code = render(doc, as_json=args.json, markdown=args.markdown, plot_path=args.plot)
    finally:
        if not args.keep:  # only what this run marked as its own
            release_entries(target, [d.name for d in made])
    return code


def _config_of(args: argparse.Namespace, methods: Sequence[str], caches: Sequence[str],
               modes: Sequence[str]) -> dict:
    return {"size_gb": args.size_gb, "layers": args.layers, "shards": args.shards,
            "pp": args.pp, "device": args.device, "threads": args.threads,
            "torch_threads": args.torch_threads, "window_bytes": args.window_bytes,
            "repeat": args.repeat, "rss_scale": args.rss_scale, "methods": list(methods),
            "caches": list(caches), "modes": list(modes),
            "labels": {m: METHODS[m].label for m in methods}}


def _argv_of(args: argparse.Namespace) -> list[str]:
    """The command line again (for the report), from sys.argv when it is ours."""
    argv = sys.argv[1:]
    return argv[argv.index("bench") + 1:] if "bench" in argv else argv
