"""PP x TP bytes read and throughput: pploader's per-rank byte-range reads vs read-all.

:func:`compare_tp_reads` is what ``pploader bench`` / docs/benchmarks.md call for the
"PP=2 x TP=2" row. Each rank of the layout is measured in turn in this process (the reader
does not need torch.distributed), from a cold page cache when ``cold`` (every shard evicted
before every measurement) or a warm one:

- ``pploader``: the rank's plan (its stage's layers, its TP slices) through the Reader;
- ``read_all``: what serving stacks do today: open every shard, ``get_tensor`` every key,
  keep (clone) the tensors the rank needs, i.e. every rank reads the whole checkpoint.

Bytes are the readers' own accounting; ``useful GB/s`` divides the bytes the rank needs
(``ideal_bytes``) by the wall time, so both methods are compared on what the rank gets.
"""
from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Optional

from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import plan_all
from pploader.io.read import Reader
from pploader.planning.shard import DEFAULT_RANGE_COST_BYTES
from pploader.planning.spec import load_spec

if TYPE_CHECKING:  # pragma: no cover
    from pploader.distributed.comm import Comm

__all__ = ["compare_tp_reads", "redistribute_bench"]


def _read_all(paths: list[str], wanted: set[str]) -> int:
    from safetensors import safe_open
    touched = 0
    for path in paths:
        with safe_open(path, framework="pt", device="cpu") as fh:
            for key in fh.keys():
                tensor = fh.get_tensor(key)
                touched += tensor.numel() * tensor.element_size()
                if key in wanted:
                    tensor.clone()
                del tensor
    return touched


def _evict(paths: list[str]) -> None:
    """Drop ``paths`` from the page cache (POSIX_FADV_DONTNEED; clean pages, no root)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def compare_tp_reads(model_dir: os.PathLike | str, *, pp: int = 2, tp: int = 2,
                     threads: int = 1, cold: bool = True,
                     ranks: Optional[list[int]] = None,
                     range_cost_bytes: int = DEFAULT_RANGE_COST_BYTES) -> dict:
    """Per-rank bytes read, seconds and GB/s of pploader vs read-all for a PP x TP layout.

    Returns ``{"layout", "cold", "ranks": [...], "total": {...}}``; each rank row has
    ``ideal_bytes``, ``pploader_read_bytes``, ``pploader_seconds``, ``pploader_gbps``,
    ``pploader_useful_gbps``, ``read_all_bytes``, ``read_all_seconds``, ``read_all_gbps``,
    ``read_all_useful_gbps``. ``ranks`` limits the measured ranks (default all);
    ``range_cost_bytes`` is the planner's row-by-row vs box rule (0 = exact byte runs).
    """
    spec, index = load_spec(model_dir), open_checkpoint(model_dir)
    plans = plan_all(spec, index, pp=pp, tp=tp, range_cost_bytes=range_cost_bytes)
    paths = [str(p) for p in index.paths.values()]
    rows = []
    for plan in plans:
        if ranks is not None and plan.topology.rank not in ranks:
            continue
        if cold:
            _evict(paths)
        reader = Reader(plan, threads=threads)
        start = time.perf_counter()
        for _ in reader:
            pass
        ours = time.perf_counter() - start
        if cold:
            _evict(paths)
        start = time.perf_counter()
        touched = _read_all(paths, {i.name for i in plan.items})
        theirs = time.perf_counter() - start
        ideal = plan.ideal_bytes
        rows.append({
            "rank": plan.topology.rank, "pp_rank": plan.topology.pp_rank,
            "tp_rank": plan.topology.tp_rank, "ideal_bytes": ideal,
            "pploader_read_bytes": reader.stats.read_bytes, "pploader_seconds": ours,
            "pploader_gbps": _gbps(reader.stats.read_bytes, ours),
            "pploader_useful_gbps": _gbps(ideal, ours),
            "read_all_bytes": touched, "read_all_seconds": theirs,
            "read_all_gbps": _gbps(touched, theirs), "read_all_useful_gbps": _gbps(ideal, theirs)})
    total = {k: sum(r[k] for r in rows) for k in ("ideal_bytes", "pploader_read_bytes",
                                                  "read_all_bytes", "pploader_seconds",
                                                  "read_all_seconds")}
    total["read_reduction"] = (total["read_all_bytes"] / total["pploader_read_bytes"]
                               if total["pploader_read_bytes"] else 0.0)
    return {"layout": {"pp": pp, "tp": tp}, "cold": cold, "threads": threads,
            "range_cost_bytes": range_cost_bytes, "ranks": rows,
            "total": total}


def _timed_load(comm: "Comm", staged: object, paths: list[str], cold: bool,
                exchange: bool) -> dict:
    """One measured load on every rank at once (rank 0 evicts, all start together)."""
    from pploader.report import proc_io
    from pploader.stage import load_stage
    if cold and comm.rank == 0:
        _evict(paths)
    comm.agree(None)
    before = proc_io().get("rchar", 0)
    start = time.perf_counter()
    result = load_stage(staged, comm=comm if exchange else None)  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    rchar = proc_io().get("rchar", 0) - before
    rows = comm.agree(None, {"seconds": seconds, "read_bytes": result.stats.read_bytes,
                             "rchar": rchar, "ideal_bytes": result.plan.ideal_bytes,
                             "extra": result.report.extra})
    del result
    return {"wall_s": max(r["seconds"] for r in rows), "ranks": rows}


def redistribute_bench(comm: "Comm", model_dir: os.PathLike | str, *, cold: bool,
                       exchange_cost: float = 0.0, repeat: int = 1) -> dict:
    """Direct (covering box), direct (row by row) and read-and-redistribute loads of the
    rank's stage, all TP ranks at once; per method the best wall of ``repeat`` runs."""
    from pploader.stage import plan_stage
    topo = comm.topology
    plans = {"direct_box": plan_stage(model_dir, topo, exchange_cost=None),
             "direct_rows": plan_stage(model_dir, topo, exchange_cost=None, range_cost_bytes=0),
             "redistribute": plan_stage(model_dir, topo, exchange_cost=exchange_cost)}
    paths = [str(p) for p in plans["direct_box"].index.paths.values()]
    out = {}
    for name, staged in plans.items():
        runs = [_timed_load(comm, staged, paths, cold, name == "redistribute")
                for _ in range(repeat)]
        best = min(runs, key=lambda r: r["wall_s"])
        ideal = sum(r["ideal_bytes"] for r in best["ranks"])
        best["gbps_per_rank"] = round(ideal / len(best["ranks"]) / best["wall_s"] / 1e9, 3)
        best["read_over_ideal"] = [round(r["read_bytes"] / r["ideal_bytes"], 4)
                                   for r in best["ranks"]]
        out[name] = best
    return {"tp": topo.tp_size, "pp": topo.pp_size, "cold": cold, "methods": out}


def main(argv: Optional[list[str]] = None) -> int:
    """``torchrun --nproc_per_node TP -m benchmarks.tp_bytes_read --model DIR [--cold]``: rank 0
    prints one JSON line per cache state (docs/benchmarks.md, TP rows)."""
    import argparse
    import json
    from pploader.distributed.bootstrap import init_distributed
    from pploader.distributed.comm import Comm
    from pploader.planning.topology import Topology
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp_bytes_read")
    p.add_argument("--model", required=True)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cold", action="store_true")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--exchange-cost", type=float, default=0.0)
    args = p.parse_args(argv)
    launch = init_distributed(backend="gloo", timeout_s=600)
    topo = Topology.for_world(launch.world_size, launch.rank, pp=args.pp,
                              tp=launch.world_size // args.pp)
    comm = Comm(topo, timeout_s=600)
    try:
        out = redistribute_bench(comm, args.model, cold=args.cold, repeat=args.repeat,
                                 exchange_cost=args.exchange_cost)
        if comm.rank == 0:
            print(json.dumps(out))
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
