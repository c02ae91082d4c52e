"""``exchange_cost='auto'``: the TP exchange's cost from the shards' page-cache residency.

Apart from exchange.py (which imports torch) so ``pploader plan --exchange-cost auto`` plans
without torch; exchange.py re-exports both names.
"""
from __future__ import annotations

import os
from typing import Sequence

from .. import pagecache

__all__ = ["AUTO_EXCHANGE_COSTS", "auto_exchange_cost"]

#: ``exchange_cost`` that ``auto`` uses, per device kind: (page cache warm, cold), in bytes of
#: sequential read per exchanged byte. CPU: bench/tp_costs on a 2-core VM (gloo over loopback,
#: docs/tensor-parallel.md: 2.27 warm, 1.58 cold). CUDA: the TP exchange runs over NVLink on
#: the device while reads run at page-cache or disk speed (docs/benchmarks-gpu.md, TP rows).
AUTO_EXCHANGE_COSTS: dict[str, tuple[float, float]] = {"cpu": (2.27, 1.58),
                                                       "cuda": (0.25, 0.02)}


def auto_exchange_cost(paths: Sequence[str], device_type: str = "cpu"
                       ) -> tuple[float, float]:
    """(exchange_cost, page-cache resident fraction) for ``exchange_cost='auto'``: the sampled
    residency (mincore, no data read) of the shards ``paths`` (missing ones skipped) picks the
    warm or the cold cost of ``device_type`` (AUTO_EXCHANGE_COSTS). Warm: direct reads are
    page-cache copies, so redistribution pays only where the link is much faster than them;
    cold: every byte not read saves a device read, so read once and redistribute."""
    resident = total = 0
    for path in paths:
        try:
            size = os.path.getsize(path)
        except OSError:
            continue
        r, t = pagecache.resident_bytes_of_ranges(str(path), [(0, size)])  # looked up per call
        resident, total = resident + r, total + t
    fraction = resident / total if total else 0.0
    warm, cold = AUTO_EXCHANGE_COSTS.get(device_type, AUTO_EXCHANGE_COSTS["cpu"])
    return (warm if fraction >= 0.5 else cold), fraction
