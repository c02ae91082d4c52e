"""SGLang CPU model-load time, default loader vs load format ``pploader``, per PP rank.

Run with the SGLang venv's python (``.ci/sglang-suite.sh`` makes it):

    PY=$HOME/.cache/pploader/sglang-venv/bin/python
    $PY benchmarks/sglang_cpu.py make /tmp/sb/ckpt                 # synthetic llama (vllm_cpu's)
    $PY benchmarks/sglang_cpu.py run /tmp/sb/ckpt --pp 2 --repeat 3 --json /tmp/sb/bench.json
    $PY benchmarks/sglang_cpu.py summary /tmp/sb/bench.json        # the markdown table (medians)

``run`` starts one engine per trial, each in a fresh process, alternating the loaders (the
order flips every repeat), cold (the checkpoint's pages evicted with posix_fadvise DONTNEED
first, checked with mincore) then warm (every page read first). The time is SGLang's own:
each scheduler's ``Load weight end. elapsed=... s`` (``ModelRunner.load_model``: the model
built, its weights loaded and post-processed), the slowest rank per trial; the engine's
start wall and one greedy generate (the same tokens for both loaders) are recorded too.
SGLang's CPU engine here needs the test stand-in for its CPU kernels
(tests/sglang/stubs) and the environment of tests/sglang/engine.py.

``reloads`` measures the two loaders inside one engine instead (no engine start per trial,
so many alternated trials fit in minutes, and the model build, identical for both, is out of
the time): the engine starts with ``pploader``, then each trial is
``Engine.update_weights_from_disk(model, load_format=...)`` with ``auto`` (SGLang's
``DefaultModelLoader``) or ``pploader``, alternated (the order flips every repeat), cold then
warm as in ``run``. The time is the call's wall (both PP stages load one after another, as
SGLang runs the request); the same greedy tokens are checked after every trial:

    $PY benchmarks/sglang_cpu.py reloads /tmp/sb/ckpt --pp 2 --repeat 5 --json /tmp/sb/rl.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
LOAD_END = re.compile(r"PP(\d+)(?: TP(\d+))?[^\]]*\] Load weight end\. elapsed=([\d.]+) s")
FORMATS = {"default": "auto", "pploader": "pploader"}


def _engine(model: str, load_format: str, pp: int, log_level: str) -> "Any":
    """A CPU engine as the tests start one (tests/sglang/engine.py)."""
    import sglang
    return sglang.Engine(model_path=model, load_format=load_format, pp_size=pp, device="cpu",
                         skip_tokenizer_init=True, disable_overlap_schedule=True,
                         max_total_tokens=512, max_running_requests=4,
                         chunked_prefill_size=-1, disable_cuda_graph=True,
                         disable_radix_cache=True, random_seed=0, dtype="bfloat16",
                         mem_fraction_static=0.5, log_level=log_level)


def trial(model: str, loader: str, pp: int, out_json: str) -> None:
    """One engine: start, one generate, stop (its schedulers log the load times)."""
    sys.path.insert(0, str(ROOT / "tests" / "sglang"))
    from engine import _threads_bind   # type: ignore[import-not-found]
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = _threads_bind(pp)
    t0 = time.perf_counter()
    llm = _engine(model, FORMATS[loader], pp, "info")
    startup = time.perf_counter() - t0
    try:
        out = llm.generate(input_ids=[[1, 5, 9, 200, 17]],
                           sampling_params={"temperature": 0.0, "max_new_tokens": 4,
                                            "ignore_eos": True})
        tokens = [list(o["output_ids"]) for o in out]
    finally:
        llm.shutdown()
    Path(out_json).write_text(json.dumps({"startup_seconds": startup, "tokens": tokens}))


def run(model: Path, pp: int, repeat: int, json_out: Path,
        caches: tuple[str, ...] = ("cold", "warm")) -> None:
    from vllm_cpu import evict_checkpoint   # type: ignore[import-not-found]
    from engine import ENV   # type: ignore[import-not-found]
    stubs = str(ROOT / "tests" / "sglang" / "stubs")
    rows = []
    for rep in range(repeat):
        for cache in caches:
            for loader in (("default", "pploader") if rep % 2 == 0 else ("pploader", "default")):
                out_dir = json_out.parent / f"trial-pp{pp}-{rep}-{cache}-{loader}"
                out_dir.mkdir(parents=True, exist_ok=True)
                resident = evict_checkpoint(model) if cache == "cold" else None
                if cache == "warm":   # make sure every page is cached
                    for path in model.glob("*.safetensors"):
                        with open(path, "rb") as fh:
                            while fh.read(64 << 20):
                                pass
                env = dict(os.environ, **ENV)
                env["PYTHONPATH"] = os.pathsep.join([stubs, str(ROOT)] + [
                    p for p in [os.environ.get("PYTHONPATH")] if p])
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, __file__, "trial", str(model), loader,
                                       str(pp), str(out_dir / "engine.json")], env=env,
                                      capture_output=True, text=True)
                log = proc.stdout + proc.stderr
                (out_dir / "log.txt").write_text(log)
                if proc.returncode != 0:
                    raise SystemExit(f"trial failed, see {out_dir / 'log.txt'}")
                ranks = {int(m.group(1)): float(m.group(3)) for m in LOAD_END.finditer(log)}
                if len(ranks) != pp:
                    raise SystemExit(f"found {sorted(ranks)} of {pp} ranks' load times in "
                                     f"{out_dir / 'log.txt'}")
                row = json.loads((out_dir / "engine.json").read_text())
                row.update(loader=loader, cache=cache, repeat=rep, resident_before=resident,
                           load_seconds_by_pp_rank=[ranks[r] for r in range(pp)],
                           process_seconds=time.perf_counter() - t0)
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                       f"{os.cpu_count()} cores", "model": str(model), "pp": pp,
            "checkpoint_bytes": sum(p.stat().st_size for p in model.glob("*.safetensors")),
            "command": " ".join(sys.argv)}
    json_out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def reloads(model: Path, pp: int, repeat: int, json_out: Path,
            caches: tuple[str, ...] = ("cold", "warm")) -> None:
    """One engine, alternated ``update_weights_from_disk`` trials (module docstring)."""
    from bench_vllm import _evict   # type: ignore[import-not-found]
    from engine import ENV, _threads_bind   # type: ignore[import-not-found]
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = _threads_bind(pp)
    llm = _engine(str(model), "pploader", pp, "error")
    params = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    rows = []
    try:
        for rep in range(repeat):
            for cache in caches:
                for loader in (("default", "pploader") if rep % 2 == 0
                               else ("pploader", "default")):
                    if cache == "cold":
                        resident = _evict(model)
                    else:
                        resident = None
                        for path in model.glob("*.safetensors"):
                            with open(path, "rb") as fh:
                                while fh.read(64 << 20):
                                    pass
                    load1 = os.getloadavg()[0]
                    t0 = time.perf_counter()
                    ok, message = llm.update_weights_from_disk(
                        str(model), load_format=FORMATS[loader])[:2]
                    seconds = time.perf_counter() - t0
                    if not ok:
                        raise SystemExit(f"{loader} reload failed: {message}")
                    out = llm.generate(input_ids=[[1, 5, 9, 200, 17]], sampling_params=params)
                    row = {"loader": loader, "cache": cache, "repeat": rep,
                           "resident_before": resident, "reload_seconds": seconds,
                           "load_seconds_by_pp_rank": [seconds], "loadavg_1min": load1,
                           "tokens": [list(o["output_ids"]) for o in out]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        llm.shutdown()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                       f"{os.cpu_count()} cores", "model": str(model), "pp": pp,
            "checkpoint_bytes": sum(p.stat().st_size for p in model.glob("*.safetensors")),
            "what": "update_weights_from_disk wall, both stages", "command": " ".join(sys.argv)}
    json_out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def summary(path: Path) -> str:
    """Markdown: per cache and loader, the slowest rank's model-load time (median over
    trials, every trial's value), pploader's speed relative to the default loader (the ratio
    of the medians), and whether the greedy tokens agreed."""
    from statistics import median
    data = json.loads(path.read_text())
    cells: dict[tuple[str, str], list[float]] = {}
    tokens: dict[str, set[str]] = {}
    for row in data["rows"]:
        cells.setdefault((row["cache"], row["loader"]), []).append(
            max(row["load_seconds_by_pp_rank"]))
        tokens.setdefault(row["cache"], set()).add(json.dumps(row["tokens"]))
    m = data["meta"]
    lines = [f"PP={m['pp']}, {m['checkpoint_bytes'] / 1e9:.2f} GB, {m['date']}, {m['machine']}",
             "", f"| cache | loader | {m.get('what', 'model load s, slowest rank')} "
             "(median; trials) | speed vs default | same tokens |", "|---|---|---|---|---|"]
    for (cache, loader), values in sorted(cells.items()):
        base = median(cells.get((cache, "default"), [float("nan")]))
        trials = ", ".join(f"{x:.2f}" for x in values)
        lines.append(f"| {cache} | {loader} | {median(values):.2f} ({trials}) | "
                     f"{base / median(values):.2f}x | {len(tokens[cache]) == 1} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    from vllm_cpu import add_make   # type: ignore[import-not-found]
    add_make(sub)
    for cmd, repeat in (("run", 3), ("reloads", 5)):
        r = sub.add_parser(cmd)
        r.add_argument("model", type=Path)
        r.add_argument("--pp", type=int, default=2)
        r.add_argument("--repeat", type=int, default=repeat)
        r.add_argument("--json", type=Path, required=True)
        r.add_argument("--caches", default="cold,warm",
                       help="which cells, in this order per repeat")
    sm = sub.add_parser("summary")
    sm.add_argument("json", type=Path)
    t = sub.add_parser("trial")
    for name in ("model", "loader", "pp", "out_json"):
        t.add_argument(name)
    args = ap.parse_args()
    if args.cmd == "make":
        from vllm_cpu import make   # type: ignore[import-not-found]
        make(args.out, args.layers, args.hidden, args.intermediate, args.vocab)
    elif args.cmd == "summary":
        print(summary(args.json))
    elif args.cmd == "run":
        sys.path.insert(0, str(ROOT / "tests" / "sglang"))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        run(args.model, args.pp, args.repeat, args.json, tuple(args.caches.split(",")))
    elif args.cmd == "reloads":
        sys.path.insert(0, str(ROOT / "tests" / "sglang"))
        sys.path.insert(0, str(ROOT / "tests" / "sglang" / "stubs"))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "tests" / "sglang" / "stubs"), str(ROOT)]
            + [p for p in [os.environ.get("PYTHONPATH")] if p])
        args.json.parent.mkdir(parents=True, exist_ok=True)
        reloads(args.model, args.pp, args.repeat, args.json, tuple(args.caches.split(",")))
    else:
        trial(args.model, args.loader, int(args.pp), args.out_json)


if __name__ == "__main__":
    main()
