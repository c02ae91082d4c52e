"""The pinned backend's host staging: a ring of page-locked slots, reused across loads.

One pageable allocation whose slots are page-locked (``cudaHostRegister``) one by one, by the
reader that first fills a slot or ahead of a load by a background preparer, always in the
context of the ring's GPU (io/device.py reads through it).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import threading
import time
import weakref
from typing import Optional

import torch

__all__ = ["PinnedRing", "DEFAULT_SLOT_BYTES", "DEFAULT_DEVICE_THREADS"]

DEFAULT_SLOT_BYTES = 16 << 20
DEFAULT_DEVICE_THREADS = 16
_PAGE = 4096
_HUGE = 2 << 20
logger = logging.getLogger(__name__)


class PinnedRing:
    """``threads x slots_per_thread`` page-locked host buffers of ``slot_bytes``; make once and
    pass the ring to every later load.

    The ring is one pageable allocation whose slots are page-locked (``cudaHostRegister``)
    one by one: measured on an H100 host (docs/benchmarks-gpu.md) ``cudaHostAlloc`` of 512 MiB
    costs 0.19-0.21 s and serialises across threads, while first touch + registering the
    touched pages costs 0.07 s. A slot is page-locked by whoever gets to it first: the reader
    thread right after its first read into it (the read has faulted the pages in), or
    :meth:`prepare`'s background thread, which a server starts when it makes the ring, so
    that the staging is ready while it builds its model (``prepare=True`` does it at once).
    ``lazy=False`` touches and registers every slot now, on the caller's thread.
    Where registering is unavailable or fails, the slot stays pageable: copies from it are
    then synchronous (correct, slower) and ``pageable_slots`` counts them.
    """

    def __init__(self, threads: int = DEFAULT_DEVICE_THREADS, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 slots_per_thread: int = 2, *, lazy: bool = True, huge_pages: bool = False,
                 prepare: bool = False, device: "torch.device | int | str | None" = None
                 ) -> None:
        """``huge_pages``: ask for transparent huge pages (madvise) so first touch and
        page-locking handle 2 MiB pages; off by default: on the H100 host it made the first
        load no faster (docs/benchmarks-gpu.md). ``prepare``: start :meth:`prepare` now.
        ``device``: the GPU whose context page-locks the slots (a thread's CUDA calls
        otherwise run on device 0 and would create a context there in a process that uses
        another GPU); None: set by the first :class:`DeviceLoader` using the ring, or the
        current device when :meth:`prepare` starts first."""
        self.threads, self.per_thread = threads, slots_per_thread
        self.slot_bytes = -(-slot_bytes // _PAGE) * _PAGE
        total = threads * slots_per_thread * self.slot_bytes
        self._raw = torch.empty(total + _HUGE, dtype=torch.uint8)  # pageable, untouched
        skip = -self._raw.data_ptr() % _HUGE                       # 2 MiB-aligned slots
        self._buf = self._raw[skip:skip + total]
        if huge_pages:
            _advise_huge_pages(self._buf.data_ptr(), total)
        flat = self._buf.numpy()
        n = self.slot_bytes
        self._slots = [[(self._buf[o:o + n], memoryview(flat[o:o + n]))  # type: ignore[arg-type]
                        for o in range((i * slots_per_thread) * n,
                                       (i + 1) * slots_per_thread * n, n)]
                       for i in range(threads)]
        # per slot: 0 = pageable, 1 = being page-locked (by a reader or the preparer), 2 = done
        self._state = [[0] * slots_per_thread for _ in range(threads)]
        self._registered: list[int] = []
        self.alloc_seconds = 0.0      # populate + registration, summed over threads
        self.prepare_seconds = 0.0    # wall time of the background preparation (when done)
        self.pageable_slots = 0
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._preparer: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._halt = threading.Event()  # stop_preparing(): the preparer stops, the ring lives
        #: page-lock a slot a load reaches unprepared (False: io/staging.py's policy, the load
        #: uses it pageable and never waits for the driver's page-locking)
        self.lock_in_load = True  # a slot not page-locked yet is locked by its reader
        self._device: list[Optional[int]] = [_device_index(device)]  # shared with the finalizer
        self._finalizer = weakref.finalize(self, _unregister, self._registered, self._raw,
                                           self._stop, self._device)
        self._finalizer.atexit = False  # the process's exit releases everything anyway
        if not lazy:
            start = time.perf_counter()
            self._buf.fill_(0)  # first touch (torch's CPU threads), then page-lock per slot
            self.alloc_seconds += time.perf_counter() - start
            for i in range(threads):
                for b in range(slots_per_thread):
                    self.pin(i, b)
        elif prepare:
            self.prepare()

    def slots(self, index: int) -> list[tuple[torch.Tensor, memoryview]]:
        """Thread ``index``'s slots as (tensor, writable memoryview) pairs (call ``pin`` on a
        slot before an asynchronous copy from it)."""
        return self._slots[index]

    @property
    def device_index(self) -> Optional[int]:
        """The GPU whose context page-locks the slots (None: not decided yet)."""
        return self._device[0]

    def bind_device(self, device: "torch.device | int | str") -> None:
        """Page-lock in ``device``'s context from now on, unless a device was already set."""
        with self._lock:
            if self._device[0] is None:
                self._device[0] = _device_index(device)

    def prepare(self, register: bool = True) -> threading.Thread:
        """Page-lock every slot on a background thread (first slots of every reader first);
        returns that thread (join it to wait). Its pages are faulted in without writing
        (``MADV_POPULATE_WRITE``), so a reader already reading into a slot loses nothing.
        ``register=False``: only fault the pages in (no CUDA driver call). A no-op while a
        preparation runs; after :meth:`stop_preparing` it resumes with the slots left."""
        old = self._preparer
        if old is not None and self._halt.is_set() and old is not threading.current_thread():
            old.join()  # halted: it returns after its slot (outside the lock it may need)
        with self._lock:
            running = self._preparer is not None and self._preparer.is_alive() \
                and not self._halt.is_set()
            if not running and not self._stop.is_set():
                self._halt.clear()
                if self._device[0] is None and register and torch.cuda.is_available():
                    self._device[0] = torch.cuda.current_device()
                self._preparer = threading.Thread(target=self._prepare_all, args=(register,),
                                                  daemon=True, name="pploader-ring-prepare")
                self._preparer.start()
            assert self._preparer is not None
            return self._preparer

    def resume(self) -> None:
        """After a load: resume the background page-locking if it was ever started and slots
        are left (io/staging.py: a load pauses it, never page-locks itself)."""
        if self._preparer is not None and self.ready_slots < self.threads * self.per_thread:
            self.prepare()

    @property
    def ready_slots(self) -> int:
        """Slots page-locked (or given up as pageable) so far."""
        with self._lock:
            return sum(s == 2 for row in self._state for s in row)

    def reached(self, index: int, slot: int) -> None:
        """A load's reader is about to copy from thread ``index``'s ``slot``: page-locked
        already, the copy is asynchronous; not yet, the reader page-locks it now
        (``lock_in_load``, the default: a slot is reused many times in a load, and pageable
        copies ran at 6.3 GB/s against 35 GB/s on 2x H200, docs/benchmarks-gpu.md); with
        ``lock_in_load`` False it is used as pageable memory (the driver's synchronous copy)."""
        if self.lock_in_load:
            self.pin(index, slot)

    def stop_preparing(self) -> None:
        """Stop the background preparation after the slot it is on (not waited for) and
        return; a load uses the slots it did not reach as pageable memory. Every load calls it when it
        starts: page-locking beside a load slows its allocations and copies
        (docs/benchmarks-gpu.md); :meth:`resume` after the load."""
        self._halt.set()  # not waited for: the slot under way is used pageable till done

    def _prepare_all(self, register: bool) -> None:
        start = time.perf_counter()
        if register and self._device[0] is not None:
            torch.cuda.set_device(self._device[0])  # this thread's CUDA calls: that GPU only
        for b in range(self.per_thread):
            for i in range(self.threads):
                if self._stop.is_set() or self._halt.is_set():
                    return
                if register:
                    self.pin(i, b, populate=True)
                else:
                    tensor = self._slots[i][b][0]
                    _populate(tensor.data_ptr(), tensor.numel())
        self.prepare_seconds = time.perf_counter() - start

    def pin(self, index: int, slot: int, populate: bool = False) -> None:
        """Page-lock thread ``index``'s ``slot`` unless done or under way elsewhere (then wait
        for it). ``populate``: fault its pages in first without writing them (the
        preparer; a reader calls this after its read has touched the slot)."""
        with self._lock:
            state = self._state[index][slot]
            if state == 2:
                return
            if state == 1:
                self._done.wait_for(lambda: self._state[index][slot] == 2)
                return
            self._state[index][slot] = 1
        start = time.perf_counter()
        ok = False
        try:
            tensor = self._slots[index][slot][0]
            ptr = tensor.data_ptr()
            if populate:
                _populate(ptr, tensor.numel())
            ok = _host_register(ptr, tensor.numel(), self._device[0])
        finally:
            with self._lock:
                self._state[index][slot] = 2
                if ok:
                    self._registered.append(ptr)
                else:
                    self.pageable_slots += 1
                self.alloc_seconds += time.perf_counter() - start
                self._done.notify_all()

    def stop(self) -> None:
        """Stop the background preparation for good and wait for the slot under way (at the
        interpreter's exit: a daemon thread inside a CUDA call while CUDA is torn down aborts
        the process with "terminate called")."""
        self._stop.set()
        if self._preparer is not None and self._preparer is not threading.current_thread():
            self._preparer.join()

    def close(self) -> None:
        """Unregister the slots now (also done when the ring is garbage-collected)."""
        self._stop.set()
        if self._preparer is not None and self._preparer is not threading.current_thread():
            self._preparer.join()
        self._finalizer()

    @property
    def nbytes(self) -> int:
        """Host bytes page-locked so far."""
        return len(self._registered) * self.slot_bytes


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without writing them


def _populate(ptr: int, nbytes: int) -> None:
    """Fault a private anonymous range in (best effort: an older kernel refuses the advice
    and ``cudaHostRegister`` faults the pages in itself)."""
    try:
        libc = _libc()
        libc.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes),
                     ctypes.c_int(_MADV_POPULATE_WRITE))
    except OSError:
        pass


def _advise_huge_pages(ptr: int, nbytes: int) -> None:
    """madvise(MADV_HUGEPAGE) on a 2 MiB-aligned private anonymous range (best effort: where
    transparent huge pages are off or libc is not found, 4 KiB pages stay)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), ctypes.c_int(advice))
    except OSError:
        pass


def _device_index(device: "torch.device | int | str | None") -> Optional[int]:
    if device is None:
        return None
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if d.type != "cuda":
        raise ValueError(f"a pinned ring page-locks for a cuda device, not {d}")
    if d.index is not None:
        return d.index
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _host_register(ptr: int, nbytes: int, device_index: Optional[int]) -> bool:
    """cudaHostRegister(ptr, nbytes) in ``device_index``'s context (None: the thread's current
    device); False (logged once) where it is unavailable or fails."""
    global _REGISTER_WARNED
    try:
        if device_index is None:
            err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        else:
            with torch.cuda.device(device_index):
                err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) == 0:
            return True
        reason = str(err)
    except (AttributeError, RuntimeError, AssertionError) as exc:  # no CUDA / no cudart
        reason = str(exc) or type(exc).__name__
    if not _REGISTER_WARNED:
        _REGISTER_WARNED = True
        logger.warning("cudaHostRegister failed (%s): staging slots stay pageable, H2D copies "
                       "from them are synchronous", reason)
    return False


def _unregister(registered: list[int], memory: object, stop: threading.Event,
                device: list[Optional[int]]) -> None:
    """Unregister every registered slot (in the context that registered it) before ``memory``
    (kept alive until here) is freed."""
    stop.set()
    if registered and torch.cuda.is_initialized():
        with torch.cuda.device(device[0] if device[0] is not None else -1):
            for ptr in registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
    registered.clear()
    del memory


_REGISTER_WARNED = False
