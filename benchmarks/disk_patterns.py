"""What the disk delivers to one stage, cold: O_DIRECT read rates per request size and thread
count over the checkpoint (``python -m benchmarks.gpu_field --disk``, :func:`disk_patterns`),
and the disk's best pattern for the stage (``--disk-best``, :func:`disk_best`): O_DIRECT reads of exactly the bytes a loader needs (or of the whole needed files, as
fastsafetensors reads them) into page-aligned host buffers, no GPU, under several request
patterns. The requests are cut by the pinned backend's own planner (``io.requests.chunks``),
so the pattern that wins is one the loader can adopt. GB = 10^9 bytes.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Any

from pploader.io.requests import Chunk as _Chunk
from pploader.io.requests import Piece as _Piece
from pploader.io.requests import chunks as _chunks
from pploader.io.requests import interleave_files as _interleave_files

__all__ = ["PATTERNS", "stage_pieces", "read_pattern", "disk_best", "disk_patterns"]

MIB = 1 << 20
GB = 1e9
# name: (threads, request MiB, order, what): order "file" = requests file by file (pploader's
# default), "interleave" = round-robin over the files, "streams" = each thread its own
# contiguous share of one file (threads / files streams per file); what "stage" = the needed
# bytes, "files" = whole needed files from the first needed byte to the end
PATTERNS: dict[str, tuple[int, int, str, str]] = {
    "q16x16_file": (16, 16, "file", "stage"),
    "q16x16_interleave": (16, 16, "interleave", "stage"),
    "q32x16_file": (32, 16, "file", "stage"),
    "q8x64_file": (8, 64, "file", "stage"),
    "q16x64_interleave": (16, 64, "interleave", "stage"),
    "streams1_per_file_x64": (0, 64, "streams", "stage"),
    "streams4_per_file_x16": (4, 16, "streams", "stage"),
    "q16x16_wholefiles": (16, 16, "file", "files"),
    "streams1_per_file_x16": (1, 16, "streams", "stage"),
    "streams2_per_file_x16": (2, 16, "streams", "stage"),
    "streams1_wholefiles_x16": (1, 16, "streams", "files"),
    "q16x4_file": (16, 4, "file", "stage"),
}


def stage_pieces(plan: Any) -> list[_Piece]:
    """The plan's ranges as pieces (file names are paths here)."""
    return [_Piece(plan.paths[i.file], off, n, k, 0) for k, i in enumerate(plan.items)
            for off, n in i.ranges if n]


def _whole_files(pieces: list[_Piece]) -> list[_Piece]:
    first: dict[str, int] = {}
    for p in pieces:
        first[p.file] = min(first.get(p.file, p.offset), p.offset)
    return [_Piece(f, o, os.path.getsize(f) - o, k, 0) for k, (f, o) in enumerate(first.items())]


def read_pattern(pieces: list[_Piece], threads: int, request_mib: int, order: str,
                 what: str = "stage") -> dict:
    """Read the pieces' bytes with O_DIRECT in the named pattern; GB/s of bytes read."""
    if what == "files":
        pieces = _whole_files(pieces)
    chunks = _chunks(pieces, request_mib * MIB, 4096)
    files = sorted({c.file for c in chunks})
    if order == "interleave":
        chunks = _interleave_files(chunks)
    queues: list[list[_Chunk]]
    if order == "streams":  # per file, `threads` (0: 1) contiguous shares
        per = max(1, threads)
        queues = []
        for f in files:
            mine = [c for c in chunks if c.file == f]
            step = -(-len(mine) // per)
            queues += [mine[i:i + step] for i in range(0, len(mine), step)]
    else:
        queues = [chunks] * threads  # one shared queue
    shared = iter(chunks)
    lock = threading.Lock()
    done = [0] * len(queues)
    errors: list[BaseException] = []
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files}

    def worker(i: int) -> None:
        buf = mmap.mmap(-1, request_mib * MIB)
        view = memoryview(buf)
        own = iter(queues[i]) if order == "streams" else None
        try:
            while True:
                if own is not None:
                    c = next(own, None)
                else:
                    with lock:
                        c = next(shared, None)
                if c is None:
                    break
                want = -(-c.length // 4096) * 4096
                got = 0
                while got < c.length:
                    n = os.preadv(fds[c.file], [view[got:want]], c.offset + got)
                    if n <= 0:
                        raise OSError(f"short read {c.file}@{c.offset + got}")
                    got += n
                done[i] += got
        except BaseException as exc:  # noqa: BLE001 - reported in the row
            errors.append(exc)
        finally:
            view.release()
            buf.close()
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(queues))]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    sec = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    total = sum(done)
    return {"threads": len(queues), "request_mib": request_mib, "order": order, "what": what,
            "requests": len(chunks), "bytes": total, "seconds": sec, "gbps": total / sec / GB,
            "error": repr(errors[0])[:200] if errors else None}


def disk_best(plan: Any, names: list[str], rounds: int = 2) -> list[dict]:
    """Every named pattern on the stage's bytes, ``rounds`` times (forward, then backward, so
    a drift of the disk shows)."""
    pieces = stage_pieces(plan)
    rows = []
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            threads, req, order, what = PATTERNS[name]
            row = dict(read_pattern(pieces, threads, req, order, what), pattern=name, round=r)
            rows.append(row)
            print(f"[disk-best] {name:24s} round {r}: {row['gbps']:.2f} GB/s "
                  f"({row['bytes'] / GB:.2f} GB, {row['requests']} requests, "
                  f"{row['threads']} threads){' ' + row['error'] if row['error'] else ''}",
                  flush=True)
    return rows


def disk_patterns(paths: list[str], per_config_bytes: int = 1 << 30,
                  request_mib: tuple[int, ...] = (4, 16, 64),
                  threads: tuple[int, ...] = (4, 8, 16, 32)) -> list[dict]:
    """O_DIRECT read rate per (request size, threads): each thread reads its own contiguous
    region sequentially (one stream each). Every configuration reads different bytes of the
    checkpoint (no cache on the way, the host's included)."""
    sizes = [os.path.getsize(p) for p in paths]
    space = sum(sizes)

    def locate(pos: int) -> tuple[str, int, int]:
        for p, n in zip(paths, sizes):
            if pos < n:
                return p, pos, n - pos
            pos -= n
        raise ValueError(pos)

    per_config_bytes = min(per_config_bytes, space // (len(request_mib) * len(threads)))
    rows, base = [], 0
    for req in request_mib:
        for nthreads in threads:
            region = max(4096, per_config_bytes // nthreads // 4096 * 4096)
            if base + region * nthreads > space:
                base = 0
            done = [0] * nthreads

            def worker(i: int, start: int) -> None:
                buf = mmap.mmap(-1, req * MIB)
                path, off, left = locate(start)
                left += off % 4096          # file sizes are not page multiples
                off -= off % 4096
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                try:
                    end = off + min(region, left // 4096 * 4096)
                    while off < end:
                        n = os.preadv(fd, [memoryview(buf)[:min(req * MIB, end - off)]], off)
                        if n <= 0:
                            break
                        off += n
                        done[i] += n
                finally:
                    os.close(fd)
                    buf.close()
            ts = [threading.Thread(target=worker, args=(i, (base + i * region) // 4096 * 4096))
                  for i in range(nthreads)]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            sec = time.perf_counter() - t0
            base += region * nthreads
            rows.append({"request_mib": req, "threads": nthreads, "bytes": sum(done),
                         "seconds": sec, "gbps": sum(done) / sec / GB})
            print(f"[disk] O_DIRECT {req:3d} MiB x {nthreads:2d} threads: "
                  f"{rows[-1]['gbps']:.2f} GB/s", flush=True)
    return rows
