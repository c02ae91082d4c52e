"""GPU benchmark: pploader in the same run as the shared anchor loaders (issue 9).

The anchor script (``shared/anchors/bench_anchors.py``: raw 16-thread preadv ceiling,
safetensors, runai-model-streamer, fastsafetensors, instanttensor) is imported as a module
and gains pploader's methods, so every method shares its checkpoint, cache states
(warm / evicted), subprocess isolation, timing and byte-for-byte verification:

- ``p_pploader``       pinned ring allocated in setup (like the raw ceiling's ring)
- ``p_pploader_alloc`` ring allocation (cudaHostAlloc) counted inside the timed load
                       (lazy: each reader thread pins its own slots on first use)
- ``p_pploader_alloc4`` the same with 4 MiB slots (a 128 MiB ring: pinning costs less)

Reads are buffered when the planned ranges are mostly in the page cache and O_DIRECT when
they are not (``DeviceLoader(direct_io=None)``).

Run on a GPU machine (``pploader bench --device cuda`` calls this)::

    python -m pploader.bench_cuda --anchors PATH/bench_anchors.py --ckdir /tmp/ck --out OUT

``--pp2`` instead loads both PP=2 stages, each alone on its own GPU and then both at
once, to show that stages do not serialise.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["load_anchors", "register", "main"]

_LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
             "tie_word_embeddings": False, "dtype": "bfloat16", "rms_norm_eps": 1e-5}
_TINY = dict(_LLAMA_8B, hidden_size=256, intermediate_size=896, vocab_size=8192,
             num_attention_heads=4, num_key_value_heads=1, head_dim=64)


def load_anchors(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_anchors", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import the anchor script {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_config(ckdir: str, scale: str) -> None:
    path = Path(ckdir) / "config.json"
    if not path.exists():
        path.write_text(json.dumps(_LLAMA_8B if scale == "full" else _TINY))


def register(anchors: ModuleType, scale: str, threads: int, slot_mib: int) -> None:
    """Add pploader's methods to the anchor script's registry."""
    def prep(ctx: Any) -> dict:
        _write_config(ctx.ckdir, scale)
        if not ctx.cuda():
            return {}
        from pploader.device import PinnedRing
        return {"ring": PinnedRing(threads, slot_mib << 20)}

    def prep_alloc(ctx: Any) -> dict:
        _write_config(ctx.ckdir, scale)
        return {}

    def run(ctx: Any, prep: dict, slot_mib: int = slot_mib) -> tuple[dict, dict]:
        from pploader import Topology, plan_stage
        from pploader.device import DeviceLoader, PinnedRing
        t0 = time.perf_counter()
        if not ctx.cuda():  # CPU smoke run of the plumbing: the windowed Reader
            from pploader import Reader
            staged = plan_stage(ctx.ckdir, Topology(2, rank=0))
            return dict(Reader(staged.plan, threads=threads)), {
                "logical_bytes": staged.plan.read_bytes, "api": "pploader Reader (cpu)"}
        ring = prep.get("ring") or PinnedRing(threads, slot_mib << 20, lazy=True)
        n_threads = ring.threads
        ring_s = time.perf_counter() - t0
        staged = plan_stage(ctx.ckdir, Topology(2, rank=0))
        plan_s = time.perf_counter() - t0 - ring_s
        loader = DeviceLoader(staged.plan, ctx.dev, ring=ring)
        out = loader.load()
        ring_s = ring.alloc_seconds
        return out, {"logical_bytes": staged.plan.read_bytes,
                     "ring_alloc_s": round(ring.alloc_seconds, 4),
                     "plan_s": round(plan_s, 4), "pinned_bytes": ring.nbytes,
                     "direct_io": loader.direct,
                     "api": f"pploader DeviceLoader x{n_threads} threads, {slot_mib} MiB slots"
                            f"{', O_DIRECT' if loader.direct else ''}",
                     "_keep": ring}

    def variant(n_threads: int, mib: int) -> tuple:
        def prep_v(ctx: Any) -> dict:
            _write_config(ctx.ckdir, scale)
            from pploader.device import PinnedRing
            return {"ring": PinnedRing(n_threads, mib << 20)} if ctx.cuda() else {}
        return (lambda c, p: run(c, p, mib), prep_v)

    anchors.METHODS["p_pploader"] = (run, prep)
    anchors.METHODS["p_pploader_alloc"] = (run, prep_alloc)
    anchors.METHODS["p_pploader_alloc4"] = (lambda c, p: run(c, p, 4), prep_alloc)
    anchors.METHODS["p_pploader_t4x64"] = variant(4, 64)
    anchors.METHODS["p_pploader_t8x32"] = variant(8, 32)
    for order in (anchors.WARM_ORDER, anchors.COLD_ORDER):
        for name in ("p_pploader_t8x32", "p_pploader_t4x64", "p_pploader_alloc4",
                     "p_pploader_alloc", "p_pploader"):
            if name not in order:
                order.insert(1, name)
    anchors.HERE = os.path.abspath(__file__)  # type: ignore[attr-defined]  # children re-enter through this wrapper


def _stage_child(model: str, rank: int) -> None:
    import torch
    from pploader import Topology, load_stage, plan_stage
    torch.cuda.set_device(rank)
    torch.empty(1, device="cuda")
    staged = plan_stage(model, Topology(2, rank=rank))
    res = load_stage(staged, device=f"cuda:{rank}")
    print("RESULT " + json.dumps({"rank": rank, "seconds": res.report.seconds,
                                  "ideal_bytes": res.report.ideal_bytes,
                                  "gbps": res.report.gbps,
                                  "peak_rss": res.report.peak_rss_bytes}), flush=True)


def _profile_child(model: str, rank: int, what: str) -> None:
    """One side of the PP=2 bottleneck profile: ``reads`` = the stage's planned bytes from the
    page cache into a pinned ring (16 threads, no GPU copy); ``h2d`` = pinned -> GPU copies
    of the same volume (no file reads)."""
    import threading as th
    import torch
    from pploader import Topology, plan_stage
    from pploader.device import PinnedRing
    torch.cuda.set_device(rank)
    torch.empty(1, device="cuda")
    plan = plan_stage(model, Topology(2, rank=rank)).plan
    ring = PinnedRing(16, 16 << 20)
    total = plan.read_bytes
    start = time.perf_counter()
    if what == "reads":
        jobs = [(plan.paths[i.file], off + a, min(16 << 20, n - a)) for i in plan.items
                for off, n in i.ranges for a in range(0, n, 16 << 20)]
        it, lock = iter(jobs), th.Lock()

        def worker(k: int) -> None:
            fds: dict[str, int] = {}
            _, view = ring.slots(k)[0]
            while True:
                with lock:
                    job = next(it, None)
                if job is None:
                    break
                path, off, n = job
                fd = fds.get(path) or fds.setdefault(path, os.open(path, os.O_RDONLY))
                got = 0
                while got < n:
                    got += os.preadv(fd, [view[got:n]], off + got)
            for fd in fds.values():
                os.close(fd)
        threads = [th.Thread(target=worker, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        dst = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
        streams = [torch.cuda.Stream() for _ in range(4)]
        for j in range(total // (16 << 20)):
            with torch.cuda.stream(streams[j % 4]):
                dst.copy_(ring.slots(j % 16)[0][0], non_blocking=True)
        torch.cuda.synchronize()
    sec = time.perf_counter() - start
    print("RESULT " + json.dumps({"rank": rank, "what": what, "seconds": sec,
                                  "gbps": total / sec / 1e9}), flush=True)


def _pp2_profile(ckdir: str) -> list[dict]:
    """Reads alone vs together, and H2D alone vs together, per stage (the PP=2 profile)."""
    def spawn(rank: int, what: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--profile-child",
                                 f"{rank}:{what}", "--ckdir", ckdir], stdout=subprocess.PIPE,
                                text=True)

    def result(p: subprocess.Popen) -> dict:
        out, _ = p.communicate(timeout=300)
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        return json.loads(line[-1][7:]) if line else {"error": out[-500:]}

    rows = []
    for what in ("reads", "h2d"):
        for rank in (0, 1):
            rows.append(dict(result(spawn(rank, what)), mode="alone"))
        procs = [spawn(0, what), spawn(1, what)]
        rows += [dict(result(p), mode="together") for p in procs]
    for r in rows:
        print(f"[pp2-profile] {r.get('what'):5s} {r.get('mode'):8s} rank {r.get('rank')} "
              f"{r.get('gbps', 0):.2f} GB/s", flush=True)
    return rows


def _pp2(ckdir: str) -> list[dict]:
    """Each stage alone on its GPU, then both at once (warm page cache)."""
    def spawn(rank: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--stage-child",
                                 str(rank), "--ckdir", ckdir], stdout=subprocess.PIPE, text=True)

    def result(p: subprocess.Popen) -> dict:
        out, _ = p.communicate(timeout=300)
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        return json.loads(line[-1][7:]) if line else {"error": out[-500:]}

    for path in Path(ckdir).glob("*.safetensors"):  # warm page cache for both stages
        with open(path, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass
    rows = []
    for trial in (0, 1):
        for rank in (0, 1):
            rows.append(dict(result(spawn(rank)), mode="alone", trial=trial))
        procs = [spawn(0), spawn(1)]
        rows += [dict(result(p), mode="together", trial=trial) for p in procs]
    for r in rows:
        print(f"[pp2] trial {r.get('trial')} {r.get('mode'):8s} rank {r.get('rank')} "
              f"{r.get('seconds', 0):.3f}s "
              f"{r.get('gbps', 0):.2f} GB/s", flush=True)
    return rows


def plot(anchors_json: str, png: str, title: str = "") -> None:
    """Bar chart of warm and cold GB/s per method from an anchors.json (matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = json.loads(Path(anchors_json).read_text())["results"]
    methods = list(dict.fromkeys(r["method"] for r in rows if r.get("cache") in ("warm", "cold")))
    rate = {(r["method"], r["cache"]): r.get("gbps") or 0.0 for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, cache in zip(axes, ("warm", "cold")):
        names = [m for m in methods if (m, cache) in rate]
        colors = ["tab:green" if m.startswith("p_") else "tab:gray" if m.startswith("a_")
                  else "tab:blue" for m in names]
        ax.barh(names, [rate[(m, cache)] for m in names], color=colors)
        ax.invert_yaxis()
        ax.set_xlabel("GB/s of the stage's ideal bytes (8.03 GB)")
        ax.set_title(f"{cache} page cache")
        for y, m in enumerate(names):
            ax.text(rate[(m, cache)], y, f" {rate[(m, cache)]:.1f}", va="center", fontsize=8)
    fig.suptitle(title or "one PP=2 stage onto one GPU: pploader (green), raw ceiling (gray)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--anchors", default=os.environ.get("PPLOADER_ANCHORS",
                     str(Path(__file__).resolve().parents[2] / "shared/anchors/bench_anchors.py")))
    pre.add_argument("--threads", type=int, default=int(os.environ.get("PPLOADER_BENCH_THREADS", 16)))
    pre.add_argument("--slot-mib", type=int, default=int(os.environ.get("PPLOADER_BENCH_SLOT_MIB", 16)))
    pre.add_argument("--pp2", action="store_true")
    pre.add_argument("--stage-child", type=int, default=None)
    pre.add_argument("--profile-child", default=None)
    pre.add_argument("--pp2-profile", action="store_true")
    pre.add_argument("--plot", nargs=2, metavar=("ANCHORS_JSON", "PNG"), default=None)
    known, rest = pre.parse_known_args(argv)
    if known.plot:
        return plot(*known.plot)
    if known.stage_child is not None:
        ck = rest[rest.index("--ckdir") + 1]
        return _stage_child(ck, known.stage_child)
    if known.profile_child is not None:
        rank, what = known.profile_child.split(":")
        return _profile_child(rest[rest.index("--ckdir") + 1], int(rank), what)
    if known.pp2_profile:
        rows = _pp2_profile(rest[rest.index("--ckdir") + 1])
        Path(os.environ.get("OUT") or ".", "pp2_profile.json").write_text(json.dumps(rows))
        return None
    if known.pp2:
        ck = rest[rest.index("--ckdir") + 1]
        rows = _pp2(ck)
        out = os.environ.get("OUT") or "."
        Path(out, "pp2.json").write_text(json.dumps(rows, indent=1))
        return None
    anchors = load_anchors(known.anchors)
    scale = rest[rest.index("--scale") + 1] if "--scale" in rest else "full"
    register(anchors, scale, known.threads, known.slot_mib)
    # children are started as `python <this file> <anchor args>`: forward our options
    os.environ.update(PPLOADER_ANCHORS=known.anchors, PPLOADER_BENCH_THREADS=str(known.threads),
                      PPLOADER_BENCH_SLOT_MIB=str(known.slot_mib))
    sys.argv = [anchors.HERE, *rest]
    anchors.main()


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repo, not pploader/
    main()
