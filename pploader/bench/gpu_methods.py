"""The loaders ``pploader bench --device cuda`` compares, each putting one PP=2 stage of a
llama-shaped checkpoint onto a GPU (see bench/cuda.py for the driver, docs/benchmarks-gpu.md
for the results). Competitors are written here from their public APIs; fastsafetensors and
instanttensor are optional (their rows are skipped when the wheel is not importable).

Every method is ``fn(ctx, prep) -> (tensors by checkpoint name, info)``; ``prep`` (not timed)
builds what a method is allowed to have before the clock starts.
"""
from __future__ import annotations

import json
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["Ctx", "METHODS", "METHOD_ENV", "verify"]

MIB = 1 << 20
_DT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass
class Ctx:
    """The stage to load: ``tensors[name] = (file, start, end, dtype, shape)`` (absolute
    offsets), its files, and the device."""

    ckdir: str
    device: str
    tensors: dict[str, tuple[str, int, int, str, list[int]]]
    files: list[str]          # the files holding the stage (sorted)
    all_files: list[str]      # every shard of the checkpoint
    ideal_bytes: int
    pp: int = 2               # the stage loaded: stage ``stage`` of PP=``pp``
    stage: int = 0

    def path(self, file: str) -> str:
        return os.path.join(self.ckdir, file)


def _header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        head = json.loads(fh.read(n))
    head.pop("__metadata__", None)
    return 8 + n, head


# ---- raw ceiling: 16 threads preadv -> pinned ring -> async H2D --------------------------

def run_threads(threads: int, worker: Callable[[int], None],
                device: Optional[torch.device | int | str] = None) -> None:
    """``worker(0..threads-1)`` on their own threads; the first error is re-raised. With
    ``device``, each thread makes it current first: a new thread's CUDA calls go to device 0
    otherwise, and on another GPU the first of them makes a context there inside the clock."""
    errors: list[BaseException] = []
    index = device if device is None or isinstance(device, int) else torch.device(device).index
    if device is not None and index is None:  # "cuda": the caller's current device
        index = torch.cuda.current_device()

    def guarded(i: int) -> None:
        try:
            if index is not None:
                torch.cuda.set_device(index)
            worker(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    pool = [threading.Thread(target=guarded, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def prep_raw(ctx: Ctx, threads: int = 16, chunk: int = 16 * MIB) -> dict:
    """The ceiling's ring exists before the clock starts (2 pinned chunks per thread)."""
    ring = torch.empty(threads * 2 * chunk, dtype=torch.uint8, pin_memory=True)
    return {"threads": threads, "chunk": chunk, "ring": ring}


def m_raw(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """Headers parsed inside the clock; each file-contiguous run of stage tensors is read in
    ``chunk`` pieces by 16 threads into their pinned chunks and copied to one device buffer."""
    if "ring" not in prep:  # the same, its ring made inside the clock (cudaHostAlloc)
        prep = prep_raw(ctx)
    threads, chunk, ring = prep["threads"], prep["chunk"], prep["ring"]
    runs: list[list[Any]] = []
    for f in ctx.files:
        base, head = _header(ctx.path(f))
        for name, v in sorted(((k, v) for k, v in head.items() if k in ctx.tensors),
                              key=lambda kv: kv[1]["data_offsets"][0]):
            s, e = base + v["data_offsets"][0], base + v["data_offsets"][1]
            if runs and runs[-1][0] == f and runs[-1][2] == s:
                runs[-1][2] = e
                runs[-1][3].append((name, s, e, v))
            else:
                runs.append([f, s, e, [(name, s, e, v)]])
    total = sum(r[2] - r[1] for r in runs)
    big = torch.empty(total, dtype=torch.uint8, device=ctx.device)
    out, jobs, pos = {}, [], 0
    fds = {f: os.open(ctx.path(f), os.O_RDONLY) for f in ctx.files}
    for f, s, e, ents in runs:
        for name, ts, te, v in ents:
            out[name] = big[pos + ts - s:pos + te - s].view(_DT[v["dtype"]]).view(v["shape"])
        jobs += [(fds[f], o, min(chunk, e - o), pos + o - s) for o in range(s, e, chunk)]
        pos += e - s
    it, lock = iter(jobs), threading.Lock()
    flat = ring.numpy()

    def worker(i: int) -> None:
        stream = torch.cuda.Stream(device=ctx.device)
        events: list[Optional[torch.cuda.Event]] = [None, None]
        j = 0
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                break
            fd, off, n, dst = job
            b = j % 2
            if events[b] is not None:
                events[b].synchronize()  # type: ignore[union-attr]
            base = (2 * i + b) * chunk
            view = memoryview(flat[base:base + n])
            got = 0
            while got < n:
                k = os.preadv(fd, [view[got:]], off + got)
                if k <= 0:
                    raise OSError(f"short read at {off + got}")
                got += k
            with torch.cuda.stream(stream):
                big[dst:dst + n].copy_(ring[base:base + n], non_blocking=True)
                events[b] = torch.cuda.Event()
                events[b].record(stream)  # type: ignore[union-attr]
            j += 1
        stream.synchronize()

    try:
        run_threads(threads, worker, ctx.device)
    finally:
        for fd in fds.values():
            os.close(fd)
    return out, {"logical_bytes": total, "_keep": ring,
                 "api": f"os.preadv x{threads} threads, {chunk >> 20} MiB chunks, 2 pinned "
                        "chunks/thread, per-thread stream copy_(non_blocking)"}


# ---- safetensors read-all-then-filter ----------------------------------------------------

def m_st_readall(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """safe_open(device='cpu') on every shard, get_tensor of every key, keep the stage's."""
    from safetensors import safe_open
    out = {}
    for f in ctx.all_files:
        with safe_open(ctx.path(f), framework="pt", device="cpu") as sf:
            for k in sf.keys():
                t = sf.get_tensor(k)
                if k in ctx.tensors:
                    out[k] = t.to(ctx.device)
    torch.cuda.synchronize(ctx.device)
    return out, {"logical_bytes": sum(os.path.getsize(ctx.path(f)) for f in ctx.all_files),
                 "api": "safetensors safe_open(cpu).get_tensor(every key), keep stage .to(cuda)"}


# ---- fastsafetensors (optional) ----------------------------------------------------------

def m_fastsafetensors(ctx: Ctx, prep: dict, block_bytes: Optional[int] = None
                      ) -> tuple[dict, dict]:
    """SafeTensorsFileLoader(nogds) over the stage's files, filtered to the stage's tensors;
    O_DIRECT or buffered as FASTSAFETENSORS_ODIRECT says (set per method by the driver).
    ``block_bytes``: its ``max_copy_block_size`` (default 16 GiB: one request, so one reader
    thread, per file run; 16 MiB makes its 16 threads take 16 MiB requests in file order,
    pploader's pattern)."""
    from fastsafetensors import SafeTensorsFileLoader
    loader = SafeTensorsFileLoader(None, ctx.device, nogds=True)
    names = set(ctx.tensors)
    loader.set_tensor_filter(lambda n: n in names)
    loader.add_filenames({0: [ctx.path(f) for f in ctx.files]})
    fb = loader.copy_files_to_device() if block_bytes is None else \
        loader.copy_files_to_device(max_copy_block_size=block_bytes)
    out = {k: fb.get_tensor(k) for k in ctx.tensors}
    torch.cuda.synchronize(ctx.device)
    return out, {"logical_bytes": ctx.ideal_bytes, "_keep": (loader, fb),
                 "api": "fastsafetensors SafeTensorsFileLoader(nogds).set_tensor_filter(stage)"
                        f" ODIRECT={os.environ.get('FASTSAFETENSORS_ODIRECT', 'default')}"}


# ---- instanttensor (optional) ------------------------------------------------------------

def _instanttensor(ctx: Ctx, buffered: bool) -> tuple[dict, dict]:
    from instanttensor import BackendPolicy
    from instanttensor import safe_open as it_open
    kw: dict[str, Any] = dict(tensor_filter=list(ctx.tensors), tensor_name_match_mode="exact")
    if buffered:
        kw["backend"] = BackendPolicy.BUFFERED
    dev = torch.device(ctx.device).index or 0
    out = {}
    with it_open([ctx.path(f) for f in ctx.files], framework="pt", device=dev, **kw) as fh:
        for name, t in fh.tensors():
            out[name] = t
    torch.cuda.synchronize(ctx.device)
    return out, {"logical_bytes": ctx.ideal_bytes,
                 "api": f"instanttensor safe_open(stage files, tensor_filter=stage"
                        f"{', BUFFERED' if buffered else ''}).tensors()"}


def m_instanttensor(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    return _instanttensor(ctx, False)


def m_instanttensor_buf(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    return _instanttensor(ctx, True)


# ---- pploader ----------------------------------------------------------------------------

class HostAllocRing:
    """The ring before issue 17 (for comparison only): each thread's slots in one
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


def _pploader(ctx: Ctx, ring: Any, overlap_alloc: bool = False, early: bool = False,
              prepare: bool = False, interleave: bool = False, gap: int = 0,
              populate: bool = False, stop: bool = False) -> tuple[dict, dict]:
    """plan_stage + DeviceLoader.load, timed from before the ring. ``early``: the ring is
    made first and prepared in the background while planning runs (what a server does when
    it makes the ring at start-up); ``prepare``: the loader starts the ring's background
    page-locking during the load; ``populate``: the ring's pages are faulted in on a
    background thread from the start (no page-locking there); ``interleave`` / ``gap``: the
    readers' request order and O_DIRECT gap spanning. ``stop`` (with ``early``): the
    preparation is stopped after planning, before the load (what load_pipeline_stage does)."""
    from pploader import Topology, plan_stage
    from pploader.io.device import DeviceLoader, PinnedRing
    t0 = time.perf_counter()
    ring = ring if ring is not None else PinnedRing(prepare=early)
    if populate:
        ring.prepare(register=False)
    staged = plan_stage(ctx.ckdir, Topology(ctx.pp, rank=ctx.stage))
    t_plan = time.perf_counter() - t0
    if stop:
        ring.stop_preparing()
    loader = DeviceLoader(staged.plan, ctx.device, ring=ring, prepare_ring=prepare)
    loader.overlap_alloc = overlap_alloc
    loader.interleave_files, loader.direct_gap_bytes = interleave, gap
    out = loader.load()
    return ({i.name: out[i.target] for i in staged.plan.items},
            {"logical_bytes": staged.plan.read_bytes, "plan_s": t_plan,
             "profile": dict(loader.timings), "ring_pin_s": ring.alloc_seconds,
             "ring_prepare_s": getattr(ring, "prepare_seconds", 0.0),
             "pinned_bytes": ring.nbytes, "direct_io": loader.direct, "_keep": ring,
             "requests": loader.stats.syscalls,
             "api": f"plan_stage + DeviceLoader x{ring.threads} threads, "
                    f"{ring.slot_bytes >> 20} MiB slots{', O_DIRECT' if loader.direct else ''}"
                    f"{', interleaved files' if interleave else ''}"})


def m_pploader_first(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """A process's first load: ring, planning, residency check, destinations all timed."""
    return _pploader(ctx, None)


def _variant(**kw: Any) -> Callable[[Ctx, dict], tuple[dict, dict]]:
    def run(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
        ring = None
        if "threads" in kw or "slot_mib" in kw:
            from pploader.io.device import PinnedRing
            ring = PinnedRing(kw.get("threads", 16), kw.get("slot_mib", 16) * MIB,
                              prepare=kw.get("early", False))
        rest = {k: v for k, v in kw.items() if k not in ("threads", "slot_mib")}
        return _pploader(ctx, ring, **rest)
    return run


def prep_prepared(ctx: Ctx) -> dict:
    """The ring made and its preparation started when the server starts, then the server
    builds its model (0.3 s here; a real model's construction takes longer) before loading."""
    from pploader.io.device import PinnedRing
    ring = PinnedRing(prepare=True)
    time.sleep(0.3)
    return {"ring": ring}


def _first_with_slots(mib: int) -> Callable[[Ctx, dict], tuple[dict, dict]]:
    def run(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
        from pploader.io.device import PinnedRing
        return _pploader(ctx, PinnedRing(16, mib * MIB))
    return run


def _first_variant(huge_pages: bool, overlap_alloc: bool) -> Callable[[Ctx, dict],
                                                                    tuple[dict, dict]]:
    """The first load with transparent huge pages for the ring and/or the destinations
    allocated while the first reads run (the library's defaults: neither)."""
    def run(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
        from pploader.io.device import PinnedRing
        return _pploader(ctx, PinnedRing(huge_pages=huge_pages), overlap_alloc=overlap_alloc)
    return run


def _reused_with_slots(mib: int) -> Callable[[Ctx], dict]:
    def prep(ctx: Ctx) -> dict:
        from pploader.io.device import PinnedRing
        return {"ring": PinnedRing(16, mib * MIB, lazy=False)}
    return prep


def m_pploader_hostalloc(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """The first load with the pre-issue-17 ring (cudaHostAlloc per thread, timed)."""
    return _pploader(ctx, HostAllocRing())


def m_pploader_hostalloc_reused(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """A reload through a cudaHostAlloc'd ring made before the clock (fastsafetensors'
    bounce buffers are cudaHostAlloc'd; pploader's ring is page-locked by registering)."""
    return _pploader(ctx, prep["ring"])


def prep_hostalloc(ctx: Ctx) -> dict:
    ring = HostAllocRing()
    ring.prefault()
    return {"ring": ring}


def prep_reused(ctx: Ctx) -> dict:
    from pploader.io.device import PinnedRing
    return {"ring": PinnedRing(lazy=False)}


def m_pploader_reused(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """A reload: the ring exists (made and page-locked before the clock)."""
    return _pploader(ctx, prep["ring"])


def m_pploader_api(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """The public API a server calls: plan_stage + load_stage(device=cuda), all timed."""
    from pploader import Topology, load_stage, plan_stage
    t0 = time.perf_counter()
    staged = plan_stage(ctx.ckdir, Topology(ctx.pp, rank=ctx.stage))
    t1 = time.perf_counter()
    res = load_stage(staged, device=ctx.device)
    t2 = time.perf_counter()
    return ({i.name: res.state_dict[i.target] for i in staged.plan.items},
            {"logical_bytes": staged.plan.read_bytes, "api": "plan_stage + load_stage(cuda)",
             "plan_s": t1 - t0, "profile": {"load_stage_s": t2 - t1,
                                            "loader_s": res.report.seconds}})


Method = Callable[[Ctx, dict], tuple[dict, dict]]
METHODS: dict[str, tuple[Method, Optional[Callable[[Ctx], dict]]]] = {
    "raw_preadv16": (m_raw, prep_raw),
    "raw_preadv16_first": (m_raw, None),
    "pploader_first": (m_pploader_first, None),
    "pploader_api": (m_pploader_api, None),
    "pploader_first_8mib": (_first_with_slots(8), None),
    "pploader_first_4mib": (_first_with_slots(4), None),
    "pploader_first_thp": (_first_variant(True, False), None),
    "pploader_first_overlap": (_first_variant(False, True), None),
    "pploader_first_thp_overlap": (_first_variant(True, True), None),
    "pploader_reused_8mib": (m_pploader_reused, _reused_with_slots(8)),
    "pploader_hostalloc": (m_pploader_hostalloc, None),
    "pploader_hostalloc_reused": (m_pploader_hostalloc_reused, prep_hostalloc),
    "pploader_first_prep": (_variant(prepare=True), None),
    "pploader_first_populate": (_variant(populate=True), None),
    "pploader_first_early": (_variant(early=True), None),
    "pploader_first_job": (_variant(early=True, stop=True), None),
    "pploader_prepared": (m_pploader_reused, prep_prepared),
    "pploader_first_interleave": (_variant(interleave=True), None),
    "pploader_first_gap": (_variant(gap=1 << 20), None),
    "pploader_first_t8_32mib": (_variant(threads=8, slot_mib=32), None),
    "pploader_first_t32": (_variant(threads=32, slot_mib=16), None),
    "pploader_reused": (m_pploader_reused, prep_reused),
    "instanttensor_buf": (m_instanttensor_buf, None),
    "instanttensor": (m_instanttensor, None),
    "fastsafetensors_buf": (m_fastsafetensors, None),
    "fastsafetensors_odirect": (m_fastsafetensors, None),
    "fastsafetensors_odirect_b16m": (lambda c, p: m_fastsafetensors(c, p, 16 * MIB), None),
    "fastsafetensors_odirect_b256m": (lambda c, p: m_fastsafetensors(c, p, 256 * MIB), None),
    "st_readall": (m_st_readall, None),
}
METHOD_ENV = {"fastsafetensors_buf": {"FASTSAFETENSORS_ODIRECT": "0"},
              "fastsafetensors_odirect": {"FASTSAFETENSORS_ODIRECT": "1"},
              "fastsafetensors_odirect_b16m": {"FASTSAFETENSORS_ODIRECT": "1"},
              "fastsafetensors_odirect_b256m": {"FASTSAFETENSORS_ODIRECT": "1"}}
OPTIONAL = {"instanttensor": "instanttensor", "fastsafetensors": "fastsafetensors"}


def verify(ctx: Ctx, out: dict) -> str:
    """'ok', or what is wrong: names, shapes, dtypes, the first and last 4 KiB of every tensor
    and every byte of a few tensors (the embedding in 1 MiB windows) against the file."""
    problems = []
    missing, extra = set(ctx.tensors) - set(out), set(out) - set(ctx.tensors)
    if missing or extra:
        problems.append(f"{len(missing)} missing, {len(extra)} extra tensors")
    fds: dict[str, int] = {}

    def pread(file: str, n: int, off: int) -> bytes:
        fd = fds.get(file) or fds.setdefault(file, os.open(ctx.path(file), os.O_RDONLY))
        return os.pread(fd, n, off)

    names = sorted(set(out) & set(ctx.tensors))
    full = set(names[:: max(1, len(names) // 4)])
    for name in names:
        f, s, e, dt, shape = ctx.tensors[name]
        t = out[name]
        if list(t.shape) != list(shape) or t.dtype != _DT[dt]:
            problems.append(f"{name}: {tuple(t.shape)} {t.dtype}")
            continue
        u = t.reshape(-1).view(torch.uint8)
        n = e - s
        w = min(4096, n)
        windows = [(0, n)] if name in full and n <= 512 * MIB else [(0, w), (n - w, w)]
        if "embed" in name:  # 8 windows of 1 MiB across it (the whole of a smaller one)
            windows += [((n - MIB) * i // 7, MIB) for i in range(8)] if n > MIB else [(0, n)]
        for off, k in windows:
            if u[off:off + k].cpu().numpy().tobytes() != pread(f, k, s + off):
                problems.append(f"{name}: bytes differ at {off}")
                break
    for fd in fds.values():
        os.close(fd)
    return "ok" if not problems else "; ".join(problems[:3])
