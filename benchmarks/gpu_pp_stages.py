"""PP=N stages on N GPUs (``python -m benchmarks.gpu_field --pp2 | --pp2-profile | --pp-reload
[--pp N]``): each stage alone on its own GPU, then all at once, each stage's raw ceiling alone
on its GPU (``pploader bench --device cuda``'s ``raw_preadv16`` on that stage), and the split
of that time into page-cache reads and host-to-device copies. The children are this module
(``python -m benchmarks.gpu_pp_stages --stage-child RANK`` / ``--profile-child RANK:WHAT``)
and ``python -m pploader.bench.cuda --child raw_preadv16``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["pp_stages", "pp_profile", "pp_reload", "stage_child", "profile_child", "main"]

HERE = "benchmarks.gpu_pp_stages"
RAW = "pploader.bench.cuda"


def stage_child(model: str, rank: int, pp: int = 2, reuse_ring: bool = False) -> None:
    """One stage's ``load_stage`` on its GPU; ``reuse_ring``: the pinned ring is made and
    page-locked before the clock (a reload) instead of on first use inside the load."""
    import torch
    from pploader import Topology, load_stage, plan_stage
    from pploader.io.device import PinnedRing
    torch.cuda.set_device(rank)
    torch.empty(1, device="cuda")
    ring = PinnedRing(lazy=False) if reuse_ring else None
    staged = plan_stage(model, Topology(pp, rank=rank))
    res = load_stage(staged, device=f"cuda:{rank}", ring=ring)
    print("RESULT " + json.dumps({"rank": rank, "seconds": res.report.seconds,
                                  "ideal_bytes": res.report.ideal_bytes,
                                  "gbps": res.report.gbps,
                                  "peak_rss": res.report.peak_rss_bytes}), flush=True)


def profile_child(model: str, rank: int, what: str, pp: int = 2) -> None:
    """One side of the PP=2 bottleneck profile: ``reads`` = the stage's planned bytes from the
    page cache into a pinned ring (16 threads, no GPU copy); ``h2d`` = pinned -> GPU copies
    of the same volume (no file reads)."""
    import threading as th
    import torch
    from pploader import Topology, plan_stage
    from pploader.io.device import PinnedRing
    torch.cuda.set_device(rank)
    torch.empty(1, device="cuda")
    plan = plan_stage(model, Topology(pp, rank=rank)).plan
    ring = PinnedRing(16, 16 << 20, lazy=False)
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


def pp_profile(ckdir: str, pp: int = 2) -> list[dict]:
    """Reads alone vs together, and H2D alone vs together, per stage (the PP=N profile)."""
    def spawn(rank: int, what: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", HERE, "--profile-child",
                                 f"{rank}:{what}", "--ckdir", ckdir, "--pp", str(pp)],
                                stdout=subprocess.PIPE, text=True)

    def result(p: subprocess.Popen) -> dict:
        out, _ = p.communicate(timeout=300)
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        return json.loads(line[-1][7:]) if line else {"error": out[-500:]}

    rows = []
    for what in ("reads", "h2d"):
        for rank in range(pp):
            rows.append(dict(result(spawn(rank, what)), mode="alone"))
        procs = [spawn(rank, what) for rank in range(pp)]
        rows += [dict(result(p), mode="together") for p in procs]
    for r in rows:
        print(f"[pp2-profile] {r.get('what'):5s} {r.get('mode'):8s} rank {r.get('rank')} "
              f"{r.get('gbps', 0):.2f} GB/s", flush=True)
    return rows


def pp_stages(ckdir: str, pp: int = 2) -> list[dict]:
    """Each stage alone on its GPU, then all at once, and each stage's raw ceiling alone on
    its GPU (warm page cache)."""
    def spawn(rank: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", HERE, "--stage-child",
                                 str(rank), "--ckdir", ckdir, "--pp", str(pp)],
                                stdout=subprocess.PIPE, text=True)

    def raw(rank: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", RAW, "--child",
                                 "raw_preadv16", "--ckdir", ckdir, "--device", f"cuda:{rank}",
                                 "--pp", str(pp), "--stage", str(rank)],
                                stdout=subprocess.PIPE, text=True)

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
        for rank in range(pp):
            rows.append(dict(result(raw(rank)), mode="raw_alone", trial=trial, rank=rank))
            rows.append(dict(result(spawn(rank)), mode="alone", trial=trial))
        procs = [spawn(rank) for rank in range(pp)]
        rows += [dict(result(p), mode="together", trial=trial) for p in procs]
    for r in rows:
        print(f"[pp{pp}] trial {r.get('trial')} {r.get('mode'):8s} rank {r.get('rank')} "
              f"{r.get('seconds', 0):.3f}s "
              f"{r.get('gbps', 0):.2f} GB/s", flush=True)
    return rows


def pp_reload(ckdir: str, pp: int) -> list[dict]:
    """Where the PP=N slowdown lives: each stage alone and all together with the ring made
    before the clock (no first-use page-locking in the load), and the raw ceiling of stage 0's
    bytes on GPU 1 and of stage 1's bytes on GPU 0 (GPU vs files)."""
    def run(args: list[str]) -> subprocess.Popen:
        module = RAW if args[0] == "--child" else HERE
        return subprocess.Popen([sys.executable, "-m", module, "--ckdir", ckdir,
                                 "--pp", str(pp), *args], stdout=subprocess.PIPE, text=True)

    def result(p: subprocess.Popen) -> dict:
        out, _ = p.communicate(timeout=300)
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        return json.loads(line[-1][7:]) if line else {"error": out[-500:]}

    from pploader.bench.cuda import checkpoint_files, warm
    warm(checkpoint_files(ckdir))
    rows = []
    for stage, gpu in ((0, 1), (1, 0), (0, 0), (1, 1)):
        rows.append(dict(result(run(["--child", "raw_preadv16", "--device", f"cuda:{gpu}",
                                     "--stage", str(stage)])), mode="raw_cross", stage=stage,
                         gpu=gpu))
    for trial in (0, 1):
        for rank in range(pp):
            rows.append(dict(result(run(["--stage-child", str(rank), "--reuse-ring"])),
                             mode="alone_reload", trial=trial))
        procs = [run(["--stage-child", str(rank), "--reuse-ring"]) for rank in range(pp)]
        rows += [dict(result(p), mode="together_reload", trial=trial) for p in procs]
    for r in rows:
        print(f"[pp{pp}-reload] {r.get('mode'):15s} trial {r.get('trial')} rank {r.get('rank')} "
              f"stage {r.get('stage')} gpu {r.get('gpu')} {r.get('seconds', 0):.3f}s "
              f"{r.get('gbps', 0):.2f} GB/s {r.get('error') or ''}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    """The children: ``--stage-child RANK [--reuse-ring]`` or ``--profile-child RANK:WHAT``."""
    import argparse
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--ckdir", required=True)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--stage-child", type=int, default=None)
    ap.add_argument("--reuse-ring", action="store_true")
    ap.add_argument("--profile-child", default=None, metavar="RANK:WHAT")
    args = ap.parse_args(argv)
    if args.stage_child is not None:
        stage_child(args.ckdir, args.stage_child, args.pp, args.reuse_ring)
    elif args.profile_child is not None:
        rank, what = args.profile_child.split(":")
        profile_child(args.ckdir, int(rank), what, args.pp)
    else:
        ap.error("--stage-child or --profile-child (the runs start from benchmarks.gpu_field)")


if __name__ == "__main__":
    main()
