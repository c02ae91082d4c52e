"""One staging policy for every load onto a GPU: the process's page-locked host staging.

Every entry point (``load_stage`` / ``load_stage_into``, the CLI's job, reload, the DCP reader,
the engine formats) reads onto a GPU through a :class:`~pploader.io.pinned_ring.PinnedRing`,
and they all get it here:

- **one ring per process and GPU** (and reader-thread count), made on first need and kept:
  a second load, a reload, another entry point reuse its page-locked slots;
- **started as early as the entry point can** (:func:`start_staging`: the CLI's job before it
  plans and agrees, the vLLM format when its loader is made, the DCP reader when it is made in
  a process that uses CUDA, a user's ``pploader.start_staging()`` at start-up): its slots are
  page-locked on a background thread meanwhile;
- **no load waits for the background page-locking**: a load stops it (the slot under way is
  finished), reads through the slots already page-locked (asynchronous copies), and its
  readers page-lock the others as they first reach them (pageable copies measured 4x slower:
  6.3 against 26 GB/s warm for a first load with nothing started, 2x H200); when the load
  ends, the background page-locking resumes for the next load
  (:func:`lend_staging` / :func:`return_staging`);
- a load that finds the ring lent to another load running in the process gets a ring of its
  own for that load (two loads never share slots).

:func:`release_staging` unregisters and frees the process's rings (tests, a process that is
done loading).
"""
from __future__ import annotations

import atexit
import logging
import threading
from typing import Optional

import torch

from .pinned_ring import DEFAULT_DEVICE_THREADS, PinnedRing

__all__ = ["start_staging", "lend_staging", "return_staging", "release_staging",
           "process_staging"]

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()
#: (GPU index, reader threads) -> the process's ring
_RINGS: dict[tuple[int, int], PinnedRing] = {}
#: ids of the process rings lent to a load now
_LENT: set[int] = set()


def _key(device: "str | torch.device | int", threads: Optional[int]) -> Optional[tuple[int, int]]:
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return index, threads or DEFAULT_DEVICE_THREADS


def process_staging(device: "str | torch.device | int",
                    threads: Optional[int] = None) -> Optional[PinnedRing]:
    """The process's ring for ``device`` (made now, not yet page-locking, if there is none);
    None for a device without CUDA staging."""
    key = _key(device, threads)
    if key is None:
        return None
    with _LOCK:
        ring = _RINGS.get(key)
        if ring is None:
            ring = _RINGS[key] = PinnedRing(key[1], device=key[0])
    return ring


def start_staging(device: "str | torch.device | int" = "cuda",
                  threads: Optional[int] = None) -> Optional[PinnedRing]:
    """Start page-locking the process's staging for ``device`` on a background thread (once;
    again after a load paused it) and return the ring; None without CUDA. Call it as early as
    possible (before building the model): the first load reads through whatever is ready."""
    ring = process_staging(device, threads)
    if ring is not None:
        with _LOCK:
            lent = id(ring) in _LENT
        if not lent:  # a load running now keeps the driver to itself; it resumes after
            ring.prepare()
    return ring


def lend_staging(device: "str | torch.device | int",
                 threads: Optional[int] = None) -> tuple[PinnedRing, bool]:
    """The ring one load reads through, and whether it is the process's (give it back with
    :func:`return_staging`): the process's ring when no other load has it (its background
    page-locking stopped for the load), else a ring of the load's own."""
    ring = process_staging(device, threads)
    if ring is None:
        raise ValueError(f"no CUDA staging for {device}")
    with _LOCK:
        shared = id(ring) not in _LENT
        if shared:
            _LENT.add(id(ring))
    if not shared:
        logger.debug("process staging of %s is lent to another load: a ring of this load's own",
                     device)
        return PinnedRing(ring.threads, ring.slot_bytes, device=ring.device_index), False
    ring.stop_preparing()
    return ring, True


def return_staging(ring: PinnedRing) -> None:
    """End a load's loan of the process's ring: its page-locking resumes in the background."""
    with _LOCK:
        _LENT.discard(id(ring))
        if not any(r is ring for r in _RINGS.values()):
            return
    ring.prepare()


def release_staging() -> None:
    """Unregister and drop every process ring not lent to a load now."""
    with _LOCK:
        gone = [k for k, r in _RINGS.items() if id(r) not in _LENT]
        rings = [_RINGS.pop(k) for k in gone]
    for ring in rings:
        ring.close()


@atexit.register
def _stop_preparers() -> None:
    """At exit, the process rings' background page-locking is stopped and waited for (the
    memory itself is released with the process)."""
    with _LOCK:
        rings = list(_RINGS.values())
    for ring in rings:
        ring.stop()
