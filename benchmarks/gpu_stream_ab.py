"""In one process, the pinned backend's whole load against its device stream, alternated:
is the stream (what the engine formats read through) slower than a whole load, and where?

    python -m benchmarks.gpu_stream_ab --ckdir /tmp/ck [--rounds 5]

The checkpoint is ``pploader.bench.cuda``'s (``write_checkpoint``; PP=2 stage 0, 8 GB at the
``full`` scale); its files are read into the page cache first. The process's staging is made
and page-locked, and the engine's parameters allocated, before any mode runs; round 0 warms
each mode and is not counted. Modes: ``whole`` (``DeviceLoader.load()`` into its own
tensors, then ``copy_`` into the parameters, as ``load_stage`` does), ``into`` (``load`` into
the parameters, as the DCP reader does), ``stream2g`` / ``stream32g`` (``DeviceLoader.stream``
under a 2 GiB / 32 GiB budget, each tensor ``copy_``'d as handed, as the engine formats do).
Prints every round's seconds and timings, then each mode's median.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_stream_ab",
                                 description=" ".join((__doc__ or "").split("\n\n")[0].split()))
    ap.add_argument("--ckdir", default="/tmp/ck")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    import torch

    import pploader
    from pploader.bench.cuda import write_checkpoint
    from pploader.io.device import DeviceLoader
    from pploader.io.staging import start_staging
    from pploader.planning.checkpoint import DTYPES
    write_checkpoint(args.ckdir, "full")
    for path in Path(args.ckdir).glob("*.safetensors"):
        with open(path, "rb") as fh:
            while fh.read(64 << 20):
                pass
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ring = start_staging(dev)
    assert ring is not None
    plan = pploader.plan_stage(args.ckdir, pploader.Topology(2, rank=0)).plan
    params = {i.target: torch.zeros(i.shape, dtype=DTYPES[i.dtype][0], device=dev)
              for i in plan.items}
    ring.prepare().join()
    torch.cuda.synchronize()

    def whole() -> dict:
        loader = DeviceLoader(plan, dev, ring=ring)
        for name, tensor in loader.load().items():
            params[name].copy_(tensor)
        torch.cuda.synchronize()
        return loader.timings

    def into() -> dict:
        loader = DeviceLoader(plan, dev, ring=ring)
        loader.load(params)
        torch.cuda.synchronize()
        return loader.timings

    def stream(budget: int) -> Callable[[], dict]:
        def run() -> dict:
            loader = DeviceLoader(plan, dev, ring=ring)
            for name, tensor in loader.stream(budget):
                params[name].copy_(tensor)
            torch.cuda.synchronize()
            return loader.timings
        return run

    modes = {"whole": whole, "into": into, "stream2g": stream(2 << 30),
             "stream32g": stream(32 << 30)}
    seconds: dict[str, list[float]] = {m: [] for m in modes}
    for rnd in range(args.rounds):
        for mode, run in modes.items():
            t0 = time.perf_counter()
            timings = run()
            dt = time.perf_counter() - t0
            if rnd:
                seconds[mode].append(dt)
            print(rnd, mode, round(dt, 4), {k: round(v, 4) for k, v in timings.items()},
                  flush=True)
    for mode, got in seconds.items():
        print(mode, "median", round(statistics.median(got), 4), sorted(round(s, 4) for s in got))


if __name__ == "__main__":
    main()
