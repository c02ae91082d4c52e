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

__all__ = ["Ctx", "METHODS", "METHOD_ENV", "OPTIONAL", "Method", "verify", "read_header",
           "run_threads", "load_with_pploader", "pploader_variant", "DTYPES"]

MIB = 1 << 20
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


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


def read_header(path: str) -> tuple[int, dict]:
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
        base, head = read_header(ctx.path(f))
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
            out[name] = big[pos + ts - s:pos + te - s].view(DTYPES[v["dtype"]]).view(v["shape"])
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

def instanttensor_load(ctx: Ctx, buffered: bool) -> tuple[dict, dict]:
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


def m_instanttensor_buf(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    return instanttensor_load(ctx, True)


# ---- pploader ----------------------------------------------------------------------------

def load_with_pploader(ctx: Ctx, ring: Any, overlap_alloc: bool = False, early: bool = False,
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
    return load_with_pploader(ctx, None)


def pploader_variant(**kw: Any) -> Callable[[Ctx, dict], tuple[dict, dict]]:
    def run(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
        ring = None
        if "threads" in kw or "slot_mib" in kw:
            from pploader.io.device import PinnedRing
            ring = PinnedRing(kw.get("threads", 16), kw.get("slot_mib", 16) * MIB,
                              prepare=kw.get("early", False))
        rest = {k: v for k, v in kw.items() if k not in ("threads", "slot_mib")}
        return load_with_pploader(ctx, ring, **rest)
    return run


def prep_prepared(ctx: Ctx) -> dict:
    """The ring made and its preparation started when the server starts, then the server
    builds its model (0.3 s here; a real model's construction takes longer) before loading."""
    from pploader.io.device import PinnedRing
    ring = PinnedRing(prepare=True)
    time.sleep(0.3)
    return {"ring": ring}


def prep_reused(ctx: Ctx) -> dict:
    from pploader.io.device import PinnedRing
    return {"ring": PinnedRing(lazy=False)}


def m_pploader_reused(ctx: Ctx, prep: dict) -> tuple[dict, dict]:
    """A reload: the ring exists (made and page-locked before the clock)."""
    return load_with_pploader(ctx, prep["ring"])


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
    "pploader_first_prep": (pploader_variant(prepare=True), None),
    "pploader_first_populate": (pploader_variant(populate=True), None),
    "pploader_prepared": (m_pploader_reused, prep_prepared),
    "pploader_first_interleave": (pploader_variant(interleave=True), None),
    "pploader_reused": (m_pploader_reused, prep_reused),
    "instanttensor_buf": (m_instanttensor_buf, None),
    "fastsafetensors_buf": (m_fastsafetensors, None),
    "fastsafetensors_odirect": (m_fastsafetensors, None),
    "st_readall": (m_st_readall, None),
}
METHOD_ENV = {"fastsafetensors_buf": {"FASTSAFETENSORS_ODIRECT": "0"},
              "fastsafetensors_odirect": {"FASTSAFETENSORS_ODIRECT": "1"}}
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
        if list(t.shape) != list(shape) or t.dtype != DTYPES[dt]:
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
