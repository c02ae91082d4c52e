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
from typing import Optional

from .checkpoint import open_checkpoint
from .plan import plan_all
from .read import Reader
from .shard import DEFAULT_RANGE_COST_BYTES
from .spec import load_spec

__all__ = ["compare_tp_reads"]


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
