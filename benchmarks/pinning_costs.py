"""Where a process's first pinned staging ring spends its time.

Each case runs in a fresh process after CUDA's context is made (as a server's first load would
be), so "first call" costs are seen. Cases:

- ``hostalloc``: ``torch.empty(pin_memory=True)`` (cudaHostAlloc through torch's caching host
  allocator): the first 16 MiB, a second 16 MiB, then 512 MiB in one call.
- ``hostalloc16``: 16 threads each pinning 2 x 16 MiB at once (the old lazy ring's start).
- ``register``: pageable memory, first touch (page faults + zeroing) and ``cudaHostRegister``
  timed apart, whole 512 MiB and per 16 MiB slot; and registering memory already touched.
- ``register16``: 16 threads each registering its own 32 MiB (untouched) at once.
- ``dest``: allocating one llama-8B PP=2 stage's destination tensors on the device (291
  tensors, 8.03 GB), first and second time in the process.

    python -m benchmarks.pinning_costs [--out DIR]     # prints one JSON line per case
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

__all__ = ["main"]

MIB = 1 << 20


def _cudart():  # type: ignore[no-untyped-def]
    import torch
    return torch.cuda.cudart()


def _register(ptr: int, nbytes: int) -> float:
    start = time.perf_counter()
    err = _cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    return time.perf_counter() - start


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def case_hostalloc() -> dict:
    import torch
    keep = []
    first = _timed(lambda: keep.append(torch.empty(16 * MIB, dtype=torch.uint8, pin_memory=True)))
    second = _timed(lambda: keep.append(torch.empty(16 * MIB, dtype=torch.uint8, pin_memory=True)))
    big = _timed(lambda: keep.append(torch.empty(512 * MIB, dtype=torch.uint8, pin_memory=True)))
    return {"first_16MiB_s": first, "second_16MiB_s": second, "then_512MiB_s": big,
            "512MiB_GBps": 512 * MIB / big / 1e9}


def _threads(n: int, fn: Callable[[int], float]) -> dict:
    each = [0.0] * n
    start = time.perf_counter()
    ts = [threading.Thread(target=lambda i=i: each.__setitem__(i, fn(i))) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "min_thread_s": min(each), "max_thread_s": max(each)}


def case_hostalloc16() -> dict:
    import torch
    keep: list = []
    return _threads(16, lambda i: _timed(lambda: keep.append(
        torch.empty(32 * MIB, dtype=torch.uint8, pin_memory=True))))


def case_register() -> dict:
    import torch
    n = 512 * MIB
    buf = torch.empty(n, dtype=torch.uint8)
    touch = _timed(lambda: buf.fill_(0))
    whole = _register(buf.data_ptr(), n)
    slots = torch.empty(n, dtype=torch.uint8)  # fresh: register per 16 MiB slot, untouched
    per = [_register(slots.data_ptr() + o, 16 * MIB) for o in range(0, n, 16 * MIB)]
    again = torch.empty(n, dtype=torch.uint8)
    again.fill_(1)
    _register(again.data_ptr(), n)
    _cudart().cudaHostUnregister(again.data_ptr())
    rereg = _register(again.data_ptr(), n)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst.copy_(again, non_blocking=True)
    torch.cuda.synchronize()
    ok = bool((dst[:4096] == 1).all())
    def h2d_copy() -> None:
        dst.copy_(again, non_blocking=True)
        torch.cuda.synchronize()

    h2d = _timed(h2d_copy)
    return {"touch_512MiB_s": touch, "register_touched_512MiB_s": whole,
            "register_untouched_16MiB_first_s": per[0], "register_untouched_16MiB_median_s":
            sorted(per)[len(per) // 2], "register_untouched_32x16MiB_sum_s": sum(per),
            "reregister_512MiB_s": rereg, "h2d_from_registered_GBps": n / h2d / 1e9,
            "h2d_ok": ok, "is_pinned": bool(again.is_pinned())}


def case_register_thp() -> dict:
    """As ``register`` on an anonymous mapping advised MADV_HUGEPAGE (2 MiB pages)."""
    import mmap
    import torch
    n = 512 * MIB
    out: dict[str, object] = {}
    for name, huge in (("thp", True), ("4k", False)):
        mm = mmap.mmap(-1, n + 2 * MIB, flags=mmap.MAP_PRIVATE)
        if huge:
            mm.madvise(mmap.MADV_HUGEPAGE)
        raw = torch.frombuffer(mm, dtype=torch.uint8)
        skip = -raw.data_ptr() % (2 * MIB)
        buf = raw[skip:skip + n]
        out[f"{name}_touch_512MiB_s"] = _timed(lambda: buf.fill_(0))
        out[f"{name}_register_512MiB_s"] = _register(buf.data_ptr(), n)
        mm2 = mmap.mmap(-1, n + 2 * MIB, flags=mmap.MAP_PRIVATE)
        if huge:
            mm2.madvise(mmap.MADV_HUGEPAGE)
        fresh = torch.frombuffer(mm2, dtype=torch.uint8)
        per = [_register(fresh.data_ptr() + o, 16 * MIB) for o in range(0, n, 16 * MIB)]
        out[f"{name}_register_untouched_32x16MiB_sum_s"] = sum(per)
    try:
        out["thp_enabled"] = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
        out["AnonHugePages"] = [x for x in open("/proc/meminfo") if "AnonHugePages" in x][0].strip()
    except OSError:
        pass
    return out


def case_register16() -> dict:
    import torch
    bufs = [torch.empty(32 * MIB, dtype=torch.uint8) for _ in range(16)]
    return _threads(16, lambda i: _register(bufs[i].data_ptr(), 32 * MIB))


def case_dest() -> dict:
    import torch
    h, inter, kv, vocab = 4096, 14336, 1024, 128256
    shapes = [(vocab, h)] + [s for _ in range(16) for s in
                             [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter),
                              (h,), (h,)]]
    out = {}
    for name in ("first", "second"):
        start = time.perf_counter()
        ts = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes]
        torch.cuda.synchronize()
        out[f"{name}_s"] = time.perf_counter() - start
        out["tensors"], out["bytes"] = len(ts), sum(t.nbytes for t in ts)
        del ts
    return out


CASES = {"hostalloc": case_hostalloc, "hostalloc16": case_hostalloc16,
         "register": case_register, "register_thp": case_register_thp,
         "register16": case_register16, "dest": case_dest}


def _child(name: str) -> None:
    import torch
    start = time.perf_counter()
    torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    row = {"case": name, "cuda_init_s": time.perf_counter() - start}
    try:
        row.update(CASES[name]())
    except Exception as exc:  # noqa: BLE001 - reported in the row
        row["error"] = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description="profile a first pinned ring")
    ap.add_argument("--child", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT") or ".")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES), help="comma list of " + ",".join(CASES))
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child)
        return []
    rows = []
    for _ in range(args.repeat):
        for name in args.cases.split(","):
            p = subprocess.run([sys.executable, "-m", "benchmarks.pinning_costs", "--child", name],
                               capture_output=True, text=True, timeout=120)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            row = json.loads(line[-1][7:]) if line else {"case": name, "error": p.stderr[-400:]}
            print("[pinning] " + json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                             for k, v in row.items()}), flush=True)
            rows.append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "pinning.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
