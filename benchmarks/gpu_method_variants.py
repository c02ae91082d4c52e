"""Variants of the GPU methods of ``pploader bench --device cuda``, for single questions: ring
slot sizes, transparent huge pages, destinations allocated during the reads, the old
``cudaHostAlloc`` ring, early / stopped ring preparation, O_DIRECT gap spanning, reader thread
counts, instanttensor unbuffered and fastsafetensors' copy block sizes.

Each is a ``fn(ctx, prep)`` like pploader/bench/gpu_methods.py's; benchmarks/gpu_field.py
runs them (``python -m benchmarks.gpu_field --methods pploader_first_thp,...``).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from pploader.bench.gpu_methods import (MIB, Ctx, Method, instanttensor_load,
                                        load_with_pploader, m_fastsafetensors, pploader_variant)

__all__ = ["VARIANTS", "VARIANT_ENV", "HostAllocRing"]


class HostAllocRing:
    """The ring before the registered pinned ring (for comparison only): each thread's slots in one
    ``cudaHostAlloc`` (torch ``pin_memory=True``) on the thread's first use."""

    def __init__(self, threads: int = 16, slot_bytes: int = 16 * MIB, per_thread: int = 2):
        self.threads, self.slot_bytes, self.per_thread = threads, slot_bytes, per_thread
        self._slots: list[Optional[list]] = [None] * threads
        self.alloc_seconds, self.nbytes = 0.0, 0

    def slots(self, index: int) -> list:
        if self._slots[index] is None:
            start = time.perf_counter()
            buf = torch.empty(self.per_thread * self.slot_bytes, dtype=torch.uint8,
                              pin_memory=True)
            flat, n = buf.numpy(), self.slot_bytes
            self._slots[index] = [(buf[o:o + n], memoryview(flat[o:o + n]))  # type: ignore[arg-type]
                                  for o in range(0, self.per_thread * n, n)]
            self.alloc_seconds += time.perf_counter() - start
            self.nbytes += self.per_thread * n
        return self._slots[index]  # type: ignore[return-value]

    def pin(self, index: int, slot: int) -> None:
        return None

    reached = pin  # cudaHostAlloc'd: page-locked when made

    def bind_device(self, device: Any) -> None:  # cudaHostAlloc'd: nothing to page-lock
        return None

    def stop_preparing(self) -> None:  # no background page-locking to pause
        return None

    resume = stop_preparing

    @property
    def ready_slots(self) -> int:
        return sum(s is not None for s in self._slots) * self.per_thread

    def prefault(self) -> None:
        """Allocate every thread's slots now (before a clock)."""
        for i in range(self.threads):
            self.slots(i)


def _first_with_slots(mib: int) -> Callable[[Ctx, dict], tuple[dict, dict]]:
    def run(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
        from pploader.io.device import PinnedRing
        return load_with_pploader(ctx, PinnedRing(16, mib * MIB))
    return run


def _first_variant(huge_pages: bool, overlap_alloc: bool) -> Callable[[Ctx, dict],
                                                                    tuple[dict, dict]]:
    """The first load with transparent huge pages for the ring and/or the destinations
    allocated while the first reads run (the library's defaults: neither)."""
    def run(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
        from pploader.io.device import PinnedRing
        return load_with_pploader(ctx, PinnedRing(huge_pages=huge_pages), overlap_alloc=overlap_alloc)
    return run


def _reused_with_slots(mib: int) -> Callable[[Ctx], dict]:
    def prep(ctx: Ctx) -> dict:
        from pploader.io.device import PinnedRing
        return {"ring": PinnedRing(16, mib * MIB, lazy=False)}
    return prep


def m_pploader_hostalloc(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """The first load with the old ring (cudaHostAlloc per thread, timed)."""
    return load_with_pploader(ctx, HostAllocRing())


def m_pploader_hostalloc_reused(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """A reload through a cudaHostAlloc'd ring made before the clock (fastsafetensors'
    bounce buffers are cudaHostAlloc'd; pploader's ring is page-locked by registering)."""
    return load_with_pploader(ctx, prep["ring"])


def prep_hostalloc(ctx: Ctx) -> dict:
    ring = HostAllocRing()
    ring.prefault()
    return {"ring": ring}


def m_instanttensor(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    return instanttensor_load(ctx, False)


def load_reused(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """A reload through the ring ``prep`` made before the clock."""
    return load_with_pploader(ctx, prep["ring"])


VARIANTS: dict[str, tuple[Method, Optional[Callable[[Ctx], dict]]]] = {
    "pploader_first_8mib": (_first_with_slots(8), None),
    "pploader_first_4mib": (_first_with_slots(4), None),
    "pploader_first_thp": (_first_variant(True, False), None),
    "pploader_first_overlap": (_first_variant(False, True), None),
    "pploader_first_thp_overlap": (_first_variant(True, True), None),
    "pploader_reused_8mib": (load_reused, _reused_with_slots(8)),
    "pploader_hostalloc": (m_pploader_hostalloc, None),
    "pploader_hostalloc_reused": (m_pploader_hostalloc_reused, prep_hostalloc),
    "pploader_first_early": (pploader_variant(early=True), None),
    "pploader_first_job": (pploader_variant(early=True, stop=True), None),
    "pploader_first_gap": (pploader_variant(gap=1 << 20), None),
    "pploader_first_t8_32mib": (pploader_variant(threads=8, slot_mib=32), None),
    "pploader_first_t32": (pploader_variant(threads=32, slot_mib=16), None),
    "instanttensor": (m_instanttensor, None),
    "fastsafetensors_odirect_b16m": (lambda c, p: m_fastsafetensors(c, p, 16 * MIB), None),
    "fastsafetensors_odirect_b256m": (lambda c, p: m_fastsafetensors(c, p, 256 * MIB), None),
}
VARIANT_ENV = {"fastsafetensors_odirect_b16m": {"FASTSAFETENSORS_ODIRECT": "1"},
               "fastsafetensors_odirect_b256m": {"FASTSAFETENSORS_ODIRECT": "1"}}
