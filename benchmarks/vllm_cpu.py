"""vLLM startup and weight-load wall, default loader vs load format ``pploader``, per worker.

Run with the vLLM venv's python (``.ci/vllm-suite.sh`` makes it):

    PY=$HOME/.cache/pploader/vllm-venv/bin/python
    $PY benchmarks/vllm_cpu.py make /tmp/vb/ckpt            # synthetic llama, ~1.2 GB bf16
    $PY benchmarks/vllm_cpu.py run /tmp/vb/ckpt --pp 2 --repeat 3 --json /tmp/vb/bench.json
    $PY benchmarks/vllm_cpu.py summary /tmp/vb/bench.json      # the markdown table (medians)

``run`` starts one engine per trial, each in a fresh process, alternating the loaders, cold
(the checkpoint's pages evicted with posix_fadvise DONTNEED first, checked with mincore) then
warm. After the first generate each trial times ``RELOADS`` reloads of the same (warm)
checkpoint, a generate after each: the default engine through vLLM's own reload API
(``collective_rpc("reload_weights", weights_path=...)``) every time, the pploader engine
alternating that API and ``pploader.integrations.vllm.reload``; ``summary`` compares each
with the default engine's reload at the same position in the same repeat (an engine's later
reloads run at another speed than its first, for both loaders). Every worker measures its
own ``load_weights`` (wall, /proc/self/io rchar and
read_bytes deltas, bytes handed to the model) through a thin wrapper loader registered in
the workers (they re-import this file as ``__mp_main__``), and the script measures the
``LLM(...)`` constructor wall (the whole startup).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

OUT_ENV = "PPLOADER_BENCH_OUT"   # directory the workers write their measurements into
RELOADS = 4   # per engine, after its first generate (trial)
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _proc_io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as fh:
        for line in fh:
            key, value = line.split(":")
            out[key] = int(value)
    return out


def _register_measured_loaders() -> None:
    """``bench_default`` / ``bench_pploader``: the real loaders, timed per worker."""
    import torch
    from vllm.model_executor.model_loader import DefaultModelLoader, register_model_loader

    from pploader.integrations.vllm import PPLoaderModelLoader, load_report

    def measured(base: type, name: str) -> type:
        class Measured(base):  # type: ignore[misc, valid-type]
            def __init__(self, load_config: Any) -> None:
                if base is DefaultModelLoader:   # it picks files by the format's name
                    load_config.load_format = "auto"
                super().__init__(load_config)
                self.handed_bytes = 0   # a reload's loader calls get_all_weights only

            def get_all_weights(self, *args: Any, **kwargs: Any) -> Iterator:
                for tname, tensor in super().get_all_weights(*args, **kwargs):
                    self.handed_bytes += tensor.numel() * tensor.element_size()
                    yield tname, tensor

            def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
                self.handed_bytes = 0
                io0, t0 = _proc_io(), time.perf_counter()
                super().load_weights(model, model_config)
                seconds, io1 = time.perf_counter() - t0, _proc_io()
                from vllm.distributed.parallel_state import get_pp_group, get_tp_group
                pp, tp = get_pp_group().rank_in_group, get_tp_group().rank_in_group
                report = load_report(None).get("load", {})
                handed = report.get("read_bytes", self.handed_bytes)
                record = {"loader": name, "pp_rank": pp, "tp_rank": tp,
                          "load_weights_seconds": seconds, "bytes_handed": handed,
                          "mapped_bytes": report.get("mapped_bytes"),
                          "ideal_bytes": report.get("ideal_bytes"),
                          "rchar": io1["rchar"] - io0["rchar"],
                          "disk_read_bytes": io1["read_bytes"] - io0["read_bytes"]}
                out = Path(os.environ[OUT_ENV]) / f"{name}-pp{pp}-tp{tp}.json"
                out.write_text(json.dumps(record))
        return Measured

    register_model_loader("bench_default")(measured(DefaultModelLoader, "default"))
    register_model_loader("bench_pploader")(measured(PPLoaderModelLoader, "pploader"))


if os.environ.get(OUT_ENV):   # the engine's workers import this file too (spawn)
    _register_measured_loaders()


# ---- making the checkpoint ---------------------------------------------------------------
def add_make(sub: Any) -> None:
    """The ``make`` subcommand (a synthetic llama), shared with sglang_cpu.py."""
    m = sub.add_parser("make")
    m.add_argument("out", type=Path)
    m.add_argument("--layers", type=int, default=10)
    m.add_argument("--hidden", type=int, default=2048)
    m.add_argument("--intermediate", type=int, default=5632)
    m.add_argument("--vocab", type=int, default=32000)


def make(out: Path, layers: int, hidden: int, inter: int, vocab: int) -> None:
    """A llama of tiny-model structure but large tensors (random bf16, ~1.2 GB default)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pploader.tiny import make_tiny
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads":
           hidden // 128, "num_key_value_heads": max(1, hidden // 512), "head_dim": 128,
           "vocab_size": vocab, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
           "dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    make_tiny(cfg, out, shard_bytes=300 << 20, seed=0, force=True)
    total = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out}: {total / 1e9:.2f} GB")


# ---- one trial (child process) -----------------------------------------------------------
def trial(model: str, loader: str, pp: int, tp: int, out_dir: str) -> None:
    from vllm import LLM, SamplingParams

    from pploader.integrations.vllm import WORKER_EXTENSION, reload
    t0 = time.perf_counter()
    extra = {"worker_extension_cls": WORKER_EXTENSION} if loader == "pploader" else {}
    llm = LLM(model=model, load_format=f"bench_{loader}", pipeline_parallel_size=pp,
              tensor_parallel_size=tp, distributed_executor_backend="mp",
              skip_tokenizer_init=True, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=128, compilation_config={"mode": 2, "backend": "eager"},
              dtype="bfloat16", seed=0, **extra)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": [1, 5, 9, 200, 17]}], params, use_tqdm=False)]
    tokens = generate()
    # reloads from the same (now warm) checkpoint, position for position alike on both engines
    # (an engine's n-th reload is slower or faster than its first for either loader): the
    # default engine reloads through vLLM's API each time; the pploader engine alternates
    # vLLM's API and pploader's reload, so each is compared with the default's at its position
    reloads, kept = [], True
    for k in range(RELOADS):
        api = "pploader" if loader == "pploader" and k % 2 else "vllm"
        t1 = time.perf_counter()
        if api == "vllm":
            llm.collective_rpc("reload_weights", kwargs={"weights_path": model})
        else:
            reload(llm, model)
        reloads.append({"api": api, "seconds": time.perf_counter() - t1})
        kept = kept and generate() == tokens
    first = {r["api"]: r["seconds"] for r in reversed(reloads)}
    Path(out_dir, f"engine-{loader}.json").write_text(
        json.dumps({"startup_seconds": startup, "tokens": tokens, "reloads": reloads,
                    "vllm_reload_seconds": first["vllm"],
                    "pploader_reload_seconds": first.get("pploader"),
                    "tokens_kept_by_reloads": kept}))


# ---- the driver -----------------------------------------------------------------------
def evict_checkpoint(model: Path) -> int:
    """Drop the checkpoint's clean pages from the page cache; returns bytes still resident."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pploader.io.pagecache import resident_bytes_of_ranges
    left = 0
    for path in model.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        left += resident_bytes_of_ranges(str(path), [(0, path.stat().st_size)], strict=True)[0]
    return left


def run(model: Path, pp: int, tp: int, repeat: int, json_out: Path,
        caches: tuple[str, ...] = ("cold", "warm")) -> None:
    rows = []
    for rep in range(repeat):
        for cache in caches:
            for loader in (("default", "pploader") if rep % 2 == 0 else ("pploader", "default")):
                out_dir = json_out.parent / f"trial-pp{pp}-tp{tp}-{rep}-{cache}-{loader}"
                out_dir.mkdir(parents=True, exist_ok=True)
                for stale in out_dir.glob("*.json"):   # an earlier run's workers
                    stale.unlink()
                resident = evict_checkpoint(model) if cache == "cold" else None
                if cache == "warm":   # make sure every page is cached
                    for path in model.glob("*.safetensors"):
                        with open(path, "rb") as fh:
                            while fh.read(64 << 20):
                                pass
                env = dict(os.environ, **ENGINE_ENV, **{OUT_ENV: str(out_dir)})
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, __file__, "trial", str(model), loader,
                                       str(pp), str(tp), str(out_dir)], env=env,
                                      capture_output=True, text=True)
                (out_dir / "log.txt").write_text(proc.stdout + proc.stderr)
                if proc.returncode != 0:
                    raise SystemExit(f"trial failed, see {out_dir / 'log.txt'}")
                row = json.loads((out_dir / f"engine-{loader}.json").read_text())
                row.update(loader=loader, cache=cache, repeat=rep,
                           resident_before=resident, process_seconds=time.perf_counter() - t0,
                           workers=[json.loads(p.read_text()) for p in
                                    sorted(out_dir.glob(f"{loader}-pp*.json"))])
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                       f"{os.cpu_count()} cores", "model": str(model), "pp": pp, "tp": tp,
            "checkpoint_bytes": sum(p.stat().st_size for p in model.glob("*.safetensors"))}
    json_out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def _reload_pairs(rows: list[dict[str, Any]], cache: str) -> dict[str, list[float]]:
    """Per API of the pploader engine: default reload s / pploader-engine reload s, each
    against the default engine's reload at the same position in the same repeat."""
    engines: dict[tuple[int, str], list[dict[str, Any]]] = {
        (r["repeat"], r["loader"]): r.get("reloads", []) for r in rows if r["cache"] == cache}
    ratios: dict[str, list[float]] = {"vllm": [], "pploader": []}
    for (rep, loader), mine in engines.items():
        base = engines.get((rep, "default"))
        if loader != "pploader" or not base:
            continue
        for k, step in enumerate(mine[:len(base)]):
            ratios[step["api"]].append(base[k]["seconds"] / step["seconds"])
    return ratios


def summary(path: Path) -> str:
    """Markdown: per cache and loader, the slowest worker's load_weights (median over trials,
    with every trial's value) and the reload walls; pploader's speed relative to the default
    (reloads: the median of the ratios to the default engine's reload at the same position)."""
    from statistics import median
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:   # a run's log (one JSON row per trial): the trials so far
        rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        data = {"rows": rows, "meta": {"pp": "?", "tp": "?", "checkpoint_bytes": 0,
                                       "date": "(log)", "machine": platform.node()}}
    cells: dict[tuple[str, str], dict[str, list[float]]] = {}
    for row in data["rows"]:
        cell = cells.setdefault((row["cache"], row["loader"]), {"load": [], "vllm": [],
                                                                "pploader": []})
        cell["load"].append(max(w["load_weights_seconds"] for w in row["workers"]))
        steps = row.get("reloads") or [
            {"api": api, "seconds": row[f"{api}_reload_seconds"]} for api in ("vllm", "pploader")
            if row.get(f"{api}_reload_seconds") is not None]
        for step in steps:
            cell[step["api"]].append(step["seconds"])
    m = data["meta"]
    lines = [f"PP={m['pp']} TP={m['tp']}, {m['checkpoint_bytes'] / 1e9:.2f} GB, {m['date']}, "
             f"{m['machine']}", "",
             "| cache | loader | `load_weights` s, slowest worker (median; trials) | speed vs "
             "default | vLLM `reload_weights` s (median) | pploader `reload` s (median) | "
             "reload speed vs the default engine's at the same position (vLLM API / pploader's;"
             " median of pairs) |",
             "|---|---|---|---|---|---|---|"]
    for (cache, loader), cell in sorted(cells.items()):
        base_cell = cells.get((cache, "default"))
        mine = median(cell["load"])
        base = median(base_cell["load"]) if base_cell else float("nan")
        trials = ", ".join(f"{x:.2f}" for x in cell["load"])
        walls = [f"{median(cell[api]):.2f}" if cell[api] else "-" for api in ("vllm", "pploader")]
        ratios = _reload_pairs(data["rows"], cache) if loader == "pploader" else {}
        speed = " / ".join(f"{median(r):.2f}x ({len(r)})" if r else "-"
                           for r in ratios.values()) if any(ratios.values()) else "-"
        lines.append(f"| {cache} | {loader} | {mine:.2f} ({trials}) | {base / mine:.2f}x | "
                     f"{walls[0]} | {walls[1]} | {speed} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_make(sub)
    r = sub.add_parser("run")
    r.add_argument("model", type=Path)
    r.add_argument("--pp", type=int, default=2)
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("--repeat", type=int, default=1)
    r.add_argument("--json", type=Path, required=True)
    r.add_argument("--caches", default="cold,warm", help="which cells, in this order per repeat")
    sm = sub.add_parser("summary")
    sm.add_argument("json", type=Path)
    t = sub.add_parser("trial")
    for name in ("model", "loader", "pp", "tp", "out_dir"):
        t.add_argument(name)
    args = ap.parse_args()
    if args.cmd == "make":
        make(args.out, args.layers, args.hidden, args.intermediate, args.vocab)
    elif args.cmd == "summary":
        print(summary(args.json))
    elif args.cmd == "run":
        args.json.parent.mkdir(parents=True, exist_ok=True)
        run(args.model, args.pp, args.tp, args.repeat, args.json, tuple(args.caches.split(",")))
    else:
        trial(args.model, args.loader, int(args.pp), int(args.tp), args.out_dir)


if __name__ == "__main__":
    main()
