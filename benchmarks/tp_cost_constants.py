"""Measure the constants of the TP read cost model on this machine (docs/tensor-parallel.md).

    torchrun --standalone --nproc_per_node 2 -m benchmarks.tp_cost_constants --file BIG_FILE [--cold]

- sequential read: ``preadv`` of 16 MiB blocks (bytes/s);
- positional read: short runs at a stride (a dim-1 slice, row by row); its overhead over
  the sequential time of the same bytes, in bytes of sequential read = ``--range-cost``;
- link: ``Comm.all_to_all_bytes`` over the 2 ranks (each sends ``--exchange-mib`` to the
  other) plus the two memory copies around it (gather into the send buffer, scatter out);
  ``--exchange-cost`` = sequential read bytes/s / exchanged bytes/s.
``--cold`` evicts the file from the page cache (POSIX_FADV_DONTNEED) before each read test.
Rank 0 prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

__all__ = ["measure_reads", "main"]


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_reads(path: str, *, cold: bool, seq_bytes: int = 1 << 30, run_bytes: int = 4096,
                  stride: int = 8192, runs: int = 20000) -> dict:
    """Sequential bytes/s and the overhead of one positional read (seconds and bytes)."""
    size = os.path.getsize(path)
    seq_bytes = min(seq_bytes, size // 2)
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        if cold:
            _evict(path)
        start, done = time.perf_counter(), 0
        while done < seq_bytes:
            done += os.preadv(fd, [view[:min(len(buf), seq_bytes - done)]], done)
        seq_s = time.perf_counter() - start
        base = size // 2  # a region the sequential test did not touch (cold stays cold)
        runs = min(runs, (size - base) // stride)
        if cold:
            _evict(path)
        start = time.perf_counter()
        for i in range(runs):
            os.preadv(fd, [view[:run_bytes]], base + i * stride)
        runs_s = time.perf_counter() - start
    finally:
        os.close(fd)
    seq_bps = seq_bytes / seq_s
    # cold: the kernel's readahead fetches the gaps too, so the runs cost their span
    overhead_s = max(0.0, runs_s / runs - run_bytes / seq_bps)
    return {"cold": cold, "seq_bytes_per_s": round(seq_bps), "runs": runs,
            "run_bytes": run_bytes, "stride": stride, "seconds_per_run": runs_s / runs,
            "range_cost_bytes": round(overhead_s * seq_bps)}


def _measure_link(comm: object, nbytes: int, repeat: int = 5) -> dict:
    """Seconds per byte exchanged: the all-to-all plus the gather/scatter copies."""
    me = comm.rank  # type: ignore[attr-defined]
    send = torch.empty(nbytes, dtype=torch.uint8)
    recv = torch.empty(nbytes, dtype=torch.uint8)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    splits = [0, nbytes] if me == 0 else [nbytes, 0]
    best = best_a2a = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        send.copy_(src)
        t0 = time.perf_counter()
        comm.all_to_all_bytes(recv, splits, send, splits)  # type: ignore[attr-defined]
        t1 = time.perf_counter()
        dst.copy_(recv)
        best = min(best, time.perf_counter() - start)
        best_a2a = min(best_a2a, t1 - t0)
    return {"exchange_bytes": nbytes, "all_to_all_bytes_per_s": round(nbytes / best_a2a),
            "exchanged_bytes_per_s": round(nbytes / best)}


def main(argv: list[str] | None = None) -> int:
    from pploader.distributed.bootstrap import init_distributed
    from pploader.distributed.comm import Comm
    from pploader.planning.topology import Topology

    p = argparse.ArgumentParser(prog="python -m benchmarks.tp_cost_constants", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--file", required=True, help="a large file on the storage to measure")
    p.add_argument("--cold", action="store_true", help="evict the file before each read test")
    p.add_argument("--exchange-mib", type=int, default=64)
    args = p.parse_args(argv)
    launch = init_distributed(backend="gloo")
    comm = Comm(Topology.for_world(launch.world_size, launch.rank, tp=launch.world_size))
    try:
        link = _measure_link(comm, args.exchange_mib << 20)
        comm.agree(None)
        reads = measure_reads(args.file, cold=args.cold) if comm.rank == 0 else {}
        comm.agree(None)
        if comm.rank == 0:
            reads["exchange_cost"] = round(reads["seq_bytes_per_s"]
                                           / link["exchanged_bytes_per_s"], 3)
            print(json.dumps({**reads, **link}))
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
