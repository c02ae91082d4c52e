"""Would DMA straight from the page cache beat the pinned ring?

The pinned ring moves each warm byte over host memory three times: the kernel's copy reads the
page cache and writes a slot, then the GPU's DMA reads the slot. With four stages loading at once
that traffic, not the disks or the links, is what they share (docs/benchmarks-gpu.md). Page-
locking the page cache's own pages (``mmap`` + ``cudaHostRegister(ReadOnly)``) would leave one
pass. This measures both on the same files, each stage alone and all at once (each stage on its
own GPU, in fresh processes, started together):

- ``ring``: ``threads`` x 2 slots of ``chunk`` bytes, page-locked before the clock; each thread
  ``preadv``s a chunk into a slot and copies it to the device on its own stream;
- ``register_chunks``: the files ``mmap``ed; each thread page-locks a chunk of the mapping,
  copies it, and unlocks it once the copy is done (register and unregister timed, summed);
- ``register_files``: each whole file page-locked at once, then copied on ``threads`` streams
  (the three phases timed apart).

Warm only (a cold mapping would be faulted in page by page). Every destination is checked
against the file at three 1 MiB windows.

    python -m benchmarks.page_cache_dma --dir /tmp/pcd --mib 8192 --gpus 4 [--out OUT]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from pploader.bench.gpu_methods import run_threads

__all__ = ["main"]

MIB = 1 << 20
_READ_ONLY = 8  # cudaHostRegisterReadOnly: the mapping is PROT_READ
Result = tuple[float, dict]


def _write_stages(root: Path, stages: int, stage_mib: int, files: int = 2) -> None:
    """``stages`` folders of ``files`` files (``stage_mib`` MiB per stage) of random bytes,
    each MiB stamped so that misplaced data is caught; kept in the page cache by the writes.
    Files already there with the right size are kept."""
    per_file = stage_mib // files * MIB
    gen = torch.Generator().manual_seed(0)
    block = torch.randint(0, 256, (min(64 * MIB, per_file),), dtype=torch.uint8, generator=gen)
    if per_file % block.numel():
        raise ValueError(f"{stage_mib} MiB per stage: use a multiple of {files * 64} MiB")
    for stage in range(stages):
        folder = root / str(stage)
        folder.mkdir(parents=True, exist_ok=True)
        for f in range(files):
            path = folder / f"part{f}.bin"
            if path.exists() and path.stat().st_size == per_file:
                continue
            with open(path, "wb") as out:
                for i in range(per_file // block.numel()):
                    block[::MIB] = (stage * 131 + f * 17 + i) % 256
                    out.write(block.numpy().tobytes())
    os.sync()


def _stage_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("part*.bin"))


def _chunks(sizes: list[int], chunk: int) -> list[tuple[int, int, int]]:
    return [(i, off, min(chunk, size - off)) for i, size in enumerate(sizes)
            for off in range(0, size, chunk)]


def ring(paths: list[Path], dsts: list[torch.Tensor], device: int, threads: int,
         chunk: int) -> Result:
    """The pinned ring (the loader's path, with the least Python per chunk)."""
    cudart = torch.cuda.cudart()
    slots = [[torch.zeros(chunk, dtype=torch.uint8) for _ in range(2)] for _ in range(threads)]
    for mine in slots:
        for s in mine:
            if int(cudart.cudaHostRegister(s.data_ptr(), chunk, 0)) != 0:
                raise RuntimeError("cudaHostRegister of a ring slot failed")
    work = iter([(i, off, n, dsts[i][off:off + n])
                 for i, off, n in _chunks([p.stat().st_size for p in paths], chunk)])
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    torch.cuda.synchronize()
    start = time.perf_counter()

    def worker(t: int) -> None:
        stream = torch.cuda.Stream()
        torch.cuda.set_stream(stream)
        events = [torch.cuda.Event(), torch.cuda.Event()]
        views = [memoryview(s.numpy()) for s in slots[t]]  # type: ignore[arg-type]
        for j, (i, off, n, dst) in enumerate(work):  # a list iterator: one taker per item
            b = j & 1
            if j >= 2:
                events[b].synchronize()
            got = 0
            while got < n:
                got += os.preadv(fds[i], [views[b][got:n]], off + got)
            dst.copy_(slots[t][b][:n], non_blocking=True)
            events[b].record()
        stream.synchronize()

    try:
        run_threads(threads, worker, device)
        torch.cuda.synchronize()
        return time.perf_counter() - start, {}
    finally:
        for fd in fds:
            os.close(fd)
        for mine in slots:
            for s in mine:
                cudart.cudaHostUnregister(s.data_ptr())


def _mapped(paths: list[Path]) -> list[tuple[mmap.mmap, torch.Tensor]]:
    out = []
    for path in paths:
        with open(path, "rb") as fh:
            mapping = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
        with warnings.catch_warnings():  # read-only buffer: never written through
            warnings.simplefilter("ignore", UserWarning)
            out.append((mapping, torch.frombuffer(mapping, dtype=torch.uint8)))
    return out


def register_chunks(paths: list[Path], dsts: list[torch.Tensor], device: int, threads: int,
                    chunk: int) -> Result:
    """Page-lock the mapped page cache chunk by chunk, copy, unlock after the copy."""
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    maps = _mapped(paths)
    work = iter(_chunks([m[1].numel() for m in maps], chunk))
    reg_s, unreg_s = [0.0] * threads, [0.0] * threads

    def worker(t: int) -> None:
        stream = torch.cuda.Stream()
        torch.cuda.set_stream(stream)
        pending: list[tuple[torch.cuda.Event, int]] = []

        def unlock(event: torch.cuda.Event, ptr: int) -> None:
            event.synchronize()
            t0 = time.perf_counter()
            cudart.cudaHostUnregister(ptr)
            unreg_s[t] += time.perf_counter() - t0

        for i, off, n in work:
            src = maps[i][1][off:off + n]
            t0 = time.perf_counter()
            err = int(cudart.cudaHostRegister(src.data_ptr(), n, _READ_ONLY))
            reg_s[t] += time.perf_counter() - t0
            if err != 0:
                raise RuntimeError(f"cudaHostRegister(ReadOnly) of {paths[i]} failed: {err}")
            dsts[i][off:off + n].copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            pending.append((event, src.data_ptr()))
            if len(pending) > 2:
                unlock(*pending.pop(0))
        for event, ptr in pending:
            unlock(event, ptr)

    run_threads(threads, worker, device)
    torch.cuda.synchronize()
    return time.perf_counter() - start, {"register_s_summed": round(sum(reg_s), 3),
                                         "unregister_s_summed": round(sum(unreg_s), 3)}


def register_files(paths: list[Path], dsts: list[torch.Tensor], device: int, threads: int,
                   chunk: int) -> Result:
    """Page-lock each whole mapped file, copy on ``threads`` streams, unlock."""
    cudart = torch.cuda.cudart()
    start = time.perf_counter()
    maps = _mapped(paths)
    for path, (_, src) in zip(paths, maps):
        if int(cudart.cudaHostRegister(src.data_ptr(), src.numel(), _READ_ONLY)) != 0:
            raise RuntimeError(f"cudaHostRegister(ReadOnly) of {path} failed")
    registered = time.perf_counter()
    streams = [torch.cuda.Stream() for _ in range(threads)]
    for k, (i, off, n) in enumerate(_chunks([m[1].numel() for m in maps], chunk)):
        with torch.cuda.stream(streams[k % threads]):
            dsts[i][off:off + n].copy_(maps[i][1][off:off + n], non_blocking=True)
    torch.cuda.synchronize()
    copied = time.perf_counter()
    for _, src in maps:
        cudart.cudaHostUnregister(src.data_ptr())
    end = time.perf_counter()
    return end - start, {"register_s": round(registered - start, 3),
                         "copy_s": round(copied - registered, 3),
                         "unregister_s": round(end - copied, 3)}


METHODS: dict[str, Callable[..., Result]] = {
    "ring": ring, "register_chunks": register_chunks, "register_files": register_files}


def _verify(paths: list[Path], dsts: list[torch.Tensor]) -> None:
    for path, dst in zip(paths, dsts):
        size = path.stat().st_size
        with open(path, "rb") as fh:
            for off in (0, size // 3, size - MIB):
                fh.seek(off)
                want = torch.frombuffer(bytearray(fh.read(MIB)), dtype=torch.uint8)
                if not torch.equal(dst[off:off + MIB].cpu(), want):
                    raise AssertionError(f"{path}: wrong bytes at offset {off}")


def _child(folder: Path, device: int, methods: list[str], start_at: float) -> None:
    """One process, one GPU: run ``methods`` (``name:threads:chunk_mib``) in order."""
    torch.cuda.set_device(device)
    paths = _stage_files(folder)
    dsts = [torch.empty(p.stat().st_size, dtype=torch.uint8, device="cuda") for p in paths]
    total = sum(p.stat().st_size for p in paths)
    torch.cuda.synchronize()
    while time.time() < start_at:  # the stages of a "together" round start at once
        time.sleep(0.001)
    for spec in methods:
        name, threads, chunk_mib = spec.split(":")
        for d in dsts:
            d.zero_()
        torch.cuda.synchronize()
        row: dict = {"device": device, "method": name, "threads": int(threads),
                     "chunk_mib": int(chunk_mib), "GB": round(total / 1e9, 2)}
        try:
            seconds, extra = METHODS[name](paths, dsts, device, int(threads),
                                           int(chunk_mib) * MIB)
            _verify(paths, dsts)
            row.update(seconds=round(seconds, 3), GBps=round(total / seconds / 1e9, 2), **extra)
        except Exception as exc:  # noqa: BLE001 - reported as the row's result
            row["error"] = repr(exc)
        print(json.dumps(row), flush=True)


def _spawn(root: Path, device: int, methods: list[str], start_at: float = 0.0
           ) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.page_cache_dma", "--child", str(root / str(device)),
         "--device", str(device), "--methods", ",".join(methods), "--start-at", str(start_at)],
        stdout=subprocess.PIPE, text=True)


def _rows(proc: subprocess.Popen, **tags: object) -> list[dict]:
    out, _ = proc.communicate()
    return [{**json.loads(line), **tags} for line in out.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/pcd", help="where the stages' files are written")
    ap.add_argument("--mib", type=int, default=8192, help="MiB per stage (default 8 GiB)")
    ap.add_argument("--gpus", type=int, default=0, help="stages = GPUs (default: all)")
    ap.add_argument("--alone", default="ring:16:16,register_chunks:16:64,register_files:16:64,"
                    "ring:16:2,ring:16:16,register_chunks:4:256",
                    help="methods of the alone runs on GPU 0, as name:threads:chunk_mib")
    ap.add_argument("--together", default="ring:16:16,register_chunks:16:64",
                    help="methods run by every GPU at once, one round each, twice")
    ap.add_argument("--out", help="folder for page_cache_dma.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--device", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--methods", help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(Path(args.child), args.device, args.methods.split(","), args.start_at)
        return
    gpus = args.gpus or torch.cuda.device_count()
    from pploader.outputs import claim_output, own_entries  # never into a directory of the user's
    target = claim_output(args.dir, "--dir", command="bench.page_cache_dma", reuse=True)
    root = target.path
    own_entries(target, [str(stage) for stage in range(gpus)])
    t0 = time.perf_counter()
    _write_stages(root, gpus, args.mib)
    rows: list[dict] = [{"setup": "write", "seconds": round(time.perf_counter() - t0, 1),
                         "stages": gpus, "MiB_per_stage": args.mib}]
    rows += _rows(_spawn(root, 0, args.alone.split(",")), mode="alone")
    for _ in range(2):
        for method in args.together.split(","):
            start_at = time.time() + 15  # past every child's import and CUDA start
            procs = [_spawn(root, d, [method], start_at) for d in range(gpus)]
            rows += [r for p in procs for r in _rows(p, mode=f"together x{gpus}")]
    rows += [r for d in range(1, gpus)
             for r in _rows(_spawn(root, d, args.together.split(",")), mode="alone")]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "page_cache_dma.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
