"""The measured side of ``pploader bench``: page-cache control and the method registry.

Every measured method runs in a fresh process (``python -m pploader.bench.methods SPEC``) so
its peak RSS is its own. The protocol with the parent (pploader/bench/command.py) is line based:
the child does its untimed setup (imports, its plan, prefaulted destinations), prints
``READY``, waits for ``GO`` on stdin (meanwhile the parent sets the page-cache state and, for
ranks that run together, releases them at once), runs the method, prints ``RESULT {json}``.

Methods are registered by name for one device (``cpu`` here): another method or device
is one :func:`register` call, the parent needs no change. ``pploader bench --device cuda``
runs pploader/bench/cuda.py instead: its own GPU methods (raw ceiling, read-all, optional
competitors, pploader) on one checkpoint, cache state and process protocol.
"""
from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Optional, Sequence

from ..io.pagecache import resident_bytes_of_ranges

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..planning.plan import RankPlan
    from ..io.read import Reader
    from ..planning.topology import Topology

__all__ = ["Method", "METHODS", "register", "methods_for", "ChildSpec", "ChildCtx",
           "MethodOut", "resident_bytes", "evict", "make_resident", "child_main"]

_PAGE = os.sysconf("SC_PAGE_SIZE")
_RAW_CALL_BYTES = 1 << 30   # one preadv moves at most this much (Linux caps a call near 2 GiB)
_RAW_CHUNK_BYTES = 64 << 20  # per work item when several raw threads share the runs
_IOV_MAX = 1024


# ---- page cache ---------------------------------------------------------------------------
def resident_bytes(paths: Iterable[str]) -> int:
    """Bytes of ``paths`` in the page cache now (every page, mincore; raises if it can't tell)."""
    return sum(resident_bytes_of_ranges(p, [(0, os.path.getsize(p))], sample_bytes=0,
                                        strict=True)[0] for p in paths)


def evict(paths: Sequence[str]) -> int:
    """Drop ``paths`` from the page cache (fdatasync + POSIX_FADV_DONTNEED per file); returns
    the bytes still resident afterwards (mincore) so the caller can report and check it."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return resident_bytes(paths)


def make_resident(paths: Sequence[str]) -> int:
    """Read ``paths`` into the page cache unless fully resident; returns resident bytes."""
    if resident_bytes(paths) < sum(os.path.getsize(p) for p in paths):
        buf = bytearray(16 << 20)
        for path in paths:
            with open(path, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass
    return resident_bytes(paths)


# ---- registry -----------------------------------------------------------------------------
@dataclass(frozen=True)
class MethodOut:
    """What a method hands back: its tensors (None = it filled ``ctx.dests``), the bytes it
    moved by its own accounting, and free-form details."""

    tensors: Optional[Mapping[str, "torch.Tensor"]]
    accounted_bytes: int
    extra: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Method:
    """One measured way of loading a rank's stage.

    ``family``: ``pploader`` (a), ``readall`` (b, today's serving-stack pattern) or ``raw``
    (c, the ceiling). ``alloc``: ``into`` (caller-given prefaulted destinations, not timed),
    ``owned`` (fresh tensors, allocation timed) or ``stream`` (tensors copied into prefaulted
    destinations one by one and dropped; shows the bounded window)."""

    name: str
    family: str
    alloc: str
    device: str
    label: str
    run: Callable[["ChildCtx"], MethodOut]


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    METHODS[method.name] = method
    return method


def methods_for(device: str) -> list[Method]:
    return [m for m in METHODS.values() if m.device == device]


@dataclass(frozen=True)
class ChildSpec:
    """Everything a measured child needs (JSON on its command line)."""

    kind: str                  # "load" or "plan"
    model_dir: str
    pp: int = 1
    rank: int = 0
    method: str = ""
    threads: int = 1
    window_bytes: Optional[int] = None
    torch_threads: int = 1
    files: tuple[str, ...] = ()


@dataclass
class ChildCtx:
    """The untimed setup of a load child: its plan (for shapes and raw byte ranges) and the
    prefaulted destinations of ``into``/``stream`` methods."""

    spec: ChildSpec
    plan: "RankPlan"
    dests: dict = field(default_factory=dict)
    plan_s: float = 0.0

    @property
    def topology(self) -> "Topology":
        return _topology(self.spec)


def _topology(spec: ChildSpec) -> "Topology":
    from ..planning.topology import Topology
    return Topology(spec.pp, rank=spec.rank)


def _bytes_of(t: "torch.Tensor") -> memoryview:
    import torch
    flat = t.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")  # type: ignore[arg-type]


def _empty_like_plan(plan: "RankPlan", prefault: bool) -> dict:
    import torch

    from ..planning.checkpoint import DTYPES
    out = {}
    for item in plan.items:
        t = torch.empty(item.shape, dtype=DTYPES[item.dtype][0])
        if prefault:
            t.view(-1).view(torch.uint8).fill_(0)
        out[item.target] = t
    return out


# ---- (a) pploader -------------------------------------------------------------------------
def _pploader_reader(ctx: ChildCtx, mode: str = "owned") -> "Reader":
    from ..io.read import Reader
    from ..stage import plan_stage
    t0 = time.perf_counter()
    staged = plan_stage(ctx.spec.model_dir, ctx.topology)  # planning is part of the timing
    ctx.plan_s = time.perf_counter() - t0
    return Reader(staged.plan, window_bytes=ctx.spec.window_bytes, threads=ctx.spec.threads,
                  mode=mode)


def _reader_extra(reader: "Reader", ctx: ChildCtx) -> dict:
    return {"plan_s": ctx.plan_s, "read_s": reader.stats.seconds,
            "syscalls": reader.stats.syscalls, "window_bytes": reader.window_bytes,
            "peak_inflight_bytes": reader.stats.peak_inflight_bytes}


def run_a_into(ctx: ChildCtx) -> MethodOut:
    reader = _pploader_reader(ctx)
    reader.read_into(ctx.dests)
    return MethodOut(None, reader.stats.read_bytes, _reader_extra(reader, ctx))


def run_a_owned(ctx: ChildCtx) -> MethodOut:
    reader = _pploader_reader(ctx)
    out = dict(reader)
    return MethodOut(out, reader.stats.read_bytes, _reader_extra(reader, ctx))


def run_a_stream(ctx: ChildCtx) -> MethodOut:
    reader = _pploader_reader(ctx)
    for target, tensor in reader:
        ctx.dests[target].copy_(tensor)
        del tensor
    return MethodOut(None, reader.stats.read_bytes, _reader_extra(reader, ctx))


def run_a_borrow(ctx: ChildCtx) -> MethodOut:
    reader = _pploader_reader(ctx, mode="borrowed")
    for target, tensor in reader:
        ctx.dests[target].copy_(tensor)
        del tensor
    return MethodOut(None, reader.stats.read_bytes, _reader_extra(reader, ctx))


# ---- (c) raw preadv of exactly the ideal bytes ------------------------------------------------
def _runs(plan: "RankPlan") -> list[tuple[str, int, list[str]]]:
    """(path, offset, targets) of maximal runs of adjacent whole-tensor reads (PP plans)."""
    runs: list[tuple[str, int, list[str]]] = []
    end = None
    for item in plan.items:
        if len(item.ranges) != 1 or not item.direct or item.pad_rows:
            raise ValueError(f"raw method needs whole-tensor reads; {item.name} is sliced")
        off, n = item.ranges[0]
        path = plan.paths[item.file]
        if runs and runs[-1][0] == path and end == off:
            runs[-1][2].append(item.target)
        else:
            runs.append((path, off, [item.target]))
        end = off + n
    return runs


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> int:
    pending, done = [v for v in views if len(v)], 0
    while pending:
        batch: list = []
        size = 0
        for v in pending[:_IOV_MAX]:
            if batch and size + len(v) > _RAW_CALL_BYTES:
                break
            batch.append(v)
            size += len(v)
        got = os.preadv(fd, batch, offset)
        if got <= 0:
            raise OSError(f"short read at offset {offset}")
        offset += got
        done += got
        while got:
            if len(pending[0]) <= got:
                got -= len(pending.pop(0))
            else:
                pending[0], got = pending[0][got:], 0
    return done


def _raw(ctx: ChildCtx, outs: Mapping[str, "torch.Tensor"]) -> int:
    runs = _runs(ctx.plan)
    fds = {p: os.open(p, os.O_RDONLY) for p in dict.fromkeys(r[0] for r in runs)}
    try:
        work = []
        for path, offset, targets in runs:
            views, pos = [_bytes_of(outs[t]) for t in targets], offset
            if ctx.spec.threads == 1:
                work.append((fds[path], views, offset))
                continue
            chunk: list[memoryview] = []
            for v in views:  # split into ~64 MiB work items for the thread pool
                while len(v):
                    room = _RAW_CHUNK_BYTES - sum(len(c) for c in chunk)
                    chunk.append(v[:room])
                    v = v[room:]
                    if sum(len(c) for c in chunk) >= _RAW_CHUNK_BYTES:
                        work.append((fds[path], chunk, pos))
                        pos += sum(len(c) for c in chunk)
                        chunk = []
            if chunk:
                work.append((fds[path], chunk, pos))
        if ctx.spec.threads == 1:
            return sum(_preadv_all(*w) for w in work)
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(ctx.spec.threads) as pool:
            return sum(pool.map(lambda w: _preadv_all(*w), work))
    finally:
        for fd in fds.values():
            os.close(fd)


def run_c_into(ctx: ChildCtx) -> MethodOut:
    return MethodOut(None, _raw(ctx, ctx.dests))


def run_c_owned(ctx: ChildCtx) -> MethodOut:
    outs = _empty_like_plan(ctx.plan, prefault=False)  # allocation is part of the timing
    return MethodOut(outs, _raw(ctx, outs))


# ---- (b) read everything, keep the window (today's serving stacks) ----------------------------
def _readall(ctx: ChildCtx, keep: Callable[[str, "torch.Tensor"], None]) -> MethodOut:
    from safetensors import safe_open
    wanted = {item.name: item.target for item in ctx.plan.items}
    touched = 0
    for path in ctx.spec.files:
        with safe_open(path, framework="pt", device="cpu") as fh:
            for key in fh.keys():
                tensor = fh.get_tensor(key)
                touched += tensor.numel() * tensor.element_size()
                if key in wanted:
                    keep(wanted[key], tensor)
                del tensor
    return MethodOut(None, touched, {"files_opened": len(ctx.spec.files)})


def run_b_owned(ctx: ChildCtx) -> MethodOut:
    out: dict = {}
    res = _readall(ctx, lambda target, t: out.__setitem__(target, t.clone()))
    return MethodOut(out, res.accounted_bytes, res.extra)


def run_b_into(ctx: ChildCtx) -> MethodOut:
    return _readall(ctx, lambda target, t: ctx.dests[target].copy_(t))


for _m in (
        Method("a_into", "pploader", "into", "cpu", "pploader Reader.read_into(prefaulted)",
               run_a_into),
        Method("c_into", "raw", "into", "cpu", "raw os.preadv into prefaulted", run_c_into),
        Method("a_owned", "pploader", "owned", "cpu", "pploader Reader -> owned tensors",
               run_a_owned),
        Method("c_owned", "raw", "owned", "cpu", "raw torch.empty + os.preadv", run_c_owned),
        Method("b_owned", "readall", "owned", "cpu",
               "safe_open every shard, get_tensor every key, clone own", run_b_owned),
        Method("b_into", "readall", "into", "cpu",
               "safe_open every shard, get_tensor every key, copy_ own into prefaulted",
               run_b_into),
        Method("a_stream", "pploader", "stream", "cpu",
               "pploader Reader (owned), copy each into its prefaulted param, drop it",
               run_a_stream),
        Method("a_borrow", "pploader", "stream", "cpu",
               "pploader Reader (borrowed ring), copy each into its prefaulted param",
               run_a_borrow)):
    register(_m)


# ---- the child process ------------------------------------------------------------------------
def fingerprint(tensors: Mapping[str, "torch.Tensor"]) -> str:
    """crc32 over every tensor's name, size and first/last 4 KiB: cheap, catches misplacement."""
    crc = 0
    for name in sorted(tensors):
        data = _bytes_of(tensors[name])
        crc = zlib.crc32(f"{name}:{len(data)}".encode(), crc)
        crc = zlib.crc32(data[:4096], crc)
        crc = zlib.crc32(data[-4096:], crc)
    return f"{crc:08x}"


def _io() -> dict[str, int]:
    from ..report import proc_io
    return proc_io()


def _load_child(spec: ChildSpec) -> dict:
    import torch

    from ..report import current_rss_bytes, peak_rss_bytes, reset_peak_rss
    from ..stage import plan_stage
    torch.set_num_threads(spec.torch_threads)
    method = METHODS[spec.method]
    ctx = ChildCtx(spec, plan_stage(spec.model_dir, _topology(spec)).plan)
    if method.alloc in ("into", "stream"):
        ctx.dests = _empty_like_plan(ctx.plan, prefault=True)
    gc.collect()
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        raise SystemExit("parent went away")
    rss_idle = current_rss_bytes()
    hwm_reset = reset_peak_rss()
    io0, ru0 = _io(), resource.getrusage(resource.RUSAGE_SELF)
    wall0, t0 = time.time(), time.perf_counter()
    out = method.run(ctx)
    seconds = time.perf_counter() - t0
    wall1 = time.time()
    io1, ru1 = _io(), resource.getrusage(resource.RUSAGE_SELF)
    rss_peak = peak_rss_bytes()
    tensors = out.tensors if out.tensors is not None else ctx.dests
    kept = sum(t.numel() * t.element_size() for t in out.tensors.values()) \
        if out.tensors is not None else 0
    plan, w = ctx.plan, ctx.plan.window
    return {"method": method.name, "family": method.family, "alloc": method.alloc,
            "rank": spec.rank, "start_layer": w.start_layer, "end_layer": w.end_layer,
            "tensors": len(tensors), "ideal_bytes": plan.ideal_bytes,
            "accounted_bytes": out.accounted_bytes,
            "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
            "disk_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
            "syscr": io1.get("syscr", 0) - io0.get("syscr", 0),
            "seconds": seconds, "t_start": wall0, "t_end": wall1,
            "rss_idle": rss_idle, "rss_peak": rss_peak, "hwm_reset": hwm_reset,
            "kept_bytes": kept, "minflt": ru1.ru_minflt - ru0.ru_minflt,
            "cpu_s": (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime),
            "majflt": ru1.ru_majflt - ru0.ru_majflt, "files": list(plan.files),
            "fingerprint": fingerprint(tensors), "extra": dict(out.extra)}


def _plan_child(spec: ChildSpec) -> dict:
    """Time what ``pploader plan --pp P`` does: config, index, every header, every rank."""
    t0 = time.perf_counter()
    from ..planning.checkpoint import open_checkpoint
    from ..planning.plan import plan_all
    from ..planning.spec import load_spec
    t1 = time.perf_counter()
    model = load_spec(spec.model_dir)
    index = open_checkpoint(spec.model_dir)
    t2 = time.perf_counter()
    plans = plan_all(model, index, spec.pp)
    t3 = time.perf_counter()
    return {"tensors": len(index.weight_map), "pp": spec.pp, "import_s": t1 - t0,
            "index_s": t2 - t1, "plan_all_s": t3 - t2, "seconds": t3 - t1,
            "items": sum(len(p.items) for p in plans)}


def child_main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    raw = json.loads(args[0])
    raw["files"] = tuple(raw.get("files", ()))
    spec = ChildSpec(**raw)
    result = _plan_child(spec) if spec.kind == "plan" else _load_child(spec)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def spec_json(spec: ChildSpec) -> str:
    return json.dumps(asdict(spec))


if __name__ == "__main__":
    sys.exit(child_main())
