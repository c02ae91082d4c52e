"""``pploader bench --dcp``: ``dcp.load`` with pploader's storage reader vs torch's
``HuggingFaceStorageReader``, into the DTensor local shards of PP x TP stages, CPU or GPU,
warm and cold page cache: seconds, GB/s and bytes read per rank.

Each measurement starts ``pp x tp`` fresh rank processes (gloo on CPU, NCCL on GPU) that
build their stage's state dict (pploader's plan names the stage's tensors and their TP dim;
DTensor ``Shard(dim)`` on the mesh's tp dim, plain tensors for replicated ones, NaN-filled),
report READY, wait while the parent sets the page cache (evict or read), then time one
``dcp.load``. Both readers must fill every rank's tensors identically (per-tensor sums are
compared). GB = 1e9 bytes; GB/s per rank = its local shards' bytes / its load seconds.

    python -m pploader.bench.dcp --size-gb 1 --pp 2 --tp 2                   # CPU
    python -m pploader.bench.dcp --size-gb 16 --pp 2 --tp 1 --device cuda    # GPU
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["main", "READERS"]

GB = 1e9
#: reader name -> what it is (the table's legend)
READERS = {"pploader": "dcp.load + pploader.integrations.dcp.PPLoaderStorageReader",
           "torch_hf": "dcp.load + torch's HuggingFaceStorageReader(thread_count=T)"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pploader bench --dcp", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="an existing save_pretrained directory (default: write a synthetic "
                   "llama-shaped bf16 checkpoint of --size-gb under --dir)")
    p.add_argument("--size-gb", type=float, default=1.0, help="synthetic size (default 1)")
    p.add_argument("--layers", type=int, default=8, help="synthetic layers (default 8)")
    p.add_argument("--shards", type=int, default=4, help="synthetic shard files (default 4)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--tp", type=int, default=1, help="TP ranks per stage (default 1)")
    p.add_argument("--ranks", default=None,
                   help="comma list of ranks to run, each alone without a process group "
                   "(default: all pp x tp together; e.g. 0: stage 0 of PP=2 on one GPU; --tp 1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--readers", default="pploader,torch_hf", help="comma list of "
                   + ", ".join(READERS))
    p.add_argument("--caches", default="warm,cold", help="warm,cold (default both)")
    p.add_argument("--repeat", type=int, default=1, help="repetitions (best wall kept)")
    p.add_argument("--threads", type=int, default=None,
                   help="pploader reader threads (default: the backend's default)")
    p.add_argument("--range-cost", type=int, default=0,
                   help="pploader's range_cost_bytes (default 0: exact row runs; 65536 is "
                   "pploader's planner default: dim-1 shards of short rows read as a box)")
    p.add_argument("--hf-threads", type=int, default=8,
                   help="HuggingFaceStorageReader thread_count (default 8)")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ppbench-dcp"))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", action="store_true", help="print the JSON document, not tables")
    p.add_argument("--markdown", metavar="FILE", default=None, help="write a Markdown table")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


# ---- the measured rank process --------------------------------------------------------------
def _state_dict(model_dir: str, topo: Any, tp_mesh: Any, device: Any) -> dict:
    """This rank's stage as DCP destinations: DTensors on ``tp_mesh`` sharded where
    pploader's plan shards the tensor (its TP dim), plain tensors where it reads it whole;
    NaN-filled."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    from ..stage import plan_stage
    plan = plan_stage(model_dir, topo).plan
    out = {}
    for item in plan.items:
        dtype = torch.bfloat16 if item.dtype == "BF16" else torch.float32 \
            if item.dtype == "F32" else None
        if dtype is None:
            raise SystemExit(f"bench --dcp: {item.name} is {item.dtype} (BF16/F32 only)")
        src = item.source_shape
        dims = [d for d in range(len(src)) if item.shape[d] != src[d]]
        if not dims or topo.tp_size == 1:
            out[item.name] = torch.full(src, float("nan"), dtype=dtype, device=device)
            continue
        d = dims[0]
        local_shape = torch.empty(src, device="meta").chunk(topo.tp_size, d)[topo.tp_rank].shape
        local = torch.full(local_shape, float("nan"), dtype=dtype, device=device)
        out[item.name] = DTensor.from_local(local, tp_mesh, [Shard(d)], run_check=False,
                                            shape=torch.Size(src),
                                            stride=torch.empty(src, device="meta").stride())
    return out


def _worker(spec: dict) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from ..integrations.dcp import PPLoaderStorageReader
    from ..report import proc_io
    from ..planning.mesh import mesh_topology
    from ..planning.topology import Topology
    rank, world, cuda = spec["rank"], spec["world"], spec["device"] == "cuda"
    solo = spec["solo"]  # this rank alone (no process group): its stage, as rank ``rank``
    if cuda:
        torch.cuda.set_device(spec["local_rank"] % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if solo:
        topo, tp_mesh = Topology.for_world(world, rank, pp=spec["pp"]), None
    else:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=spec["init"],
                                rank=rank, world_size=world)
        mesh = init_device_mesh(spec["device"], (spec["pp"], spec["tp"]),
                                mesh_dim_names=("pp", "tp"))
        topo, tp_mesh = mesh_topology(mesh), mesh["tp"]
    state = _state_dict(spec["model"], topo, tp_mesh, device)
    if spec["reader"] == "pploader":
        import pploader.io.registry as registry
        reader: Any = PPLoaderStorageReader(spec["model"], threads=spec["threads"],
                                            range_cost_bytes=spec["range_cost"],
                                            staging_device=device if cuda else None)
        registry.select_backend(device)  # backend modules imported before the timed load
    else:
        reader = dcp.HuggingFaceStorageReader(spec["model"], thread_count=spec["hf_threads"])
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
    if not solo:
        dist.barrier()
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        raise SystemExit("bench --dcp worker: no GO")
    io0, t0 = proc_io(), time.perf_counter()
    dcp.load(state, storage_reader=reader, no_dist=solo)
    if cuda:
        torch.cuda.synchronize()
    seconds, io1 = time.perf_counter() - t0, proc_io()
    sums = {k: float(t.double().sum()) for k, t in local.items()}
    row = {"rank": rank, "reader": spec["reader"], "seconds": seconds,
           "local_bytes": sum(t.nbytes for t in local.values()),
           "reader_bytes": reader.read_bytes if spec["reader"] == "pploader" else None,
           "header_bytes": reader.header_bytes if spec["reader"] == "pploader" else None,
           "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
           "storage_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
           "sums": sums}
    print("RESULT " + json.dumps(row), flush=True)
    if not solo:
        dist.destroy_process_group()


# ---- the parent -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group(args: argparse.Namespace, model: str, reader: str, cache: str,
           paths: Sequence[str]) -> list[dict]:
    """One timed ``dcp.load`` on every rank at once, the cache set while they wait."""
    from .methods import evict, make_resident
    world = args.pp * args.tp
    ranks = _ranks(args.ranks, world)
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    solo = len(ranks) < world
    if solo and args.tp > 1:
        raise SystemExit("bench --dcp: --ranks (a subset, each rank alone) needs --tp 1")
    procs = []
    for i, rank in enumerate(ranks):
        spec = dict(rank=rank, local_rank=i, world=world, pp=args.pp, tp=args.tp,
                    device=args.device, model=model, reader=reader, init=init, solo=solo,
                    threads=args.threads, hf_threads=args.hf_threads,
                    range_cost=args.range_cost)
        procs.append(subprocess.Popen([sys.executable, "-m", "pploader.bench.dcp", "--worker",
                                       json.dumps(spec)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env))
    try:
        for p in procs:
            line = p.stdout.readline()  # type: ignore[union-attr]
            if line.strip() != "READY":
                raise RuntimeError("bench --dcp: a rank failed before READY (its error is above)")
        if cache == "cold":
            evict(paths)
        else:
            make_resident(paths)
        for p in procs:
            p.stdin.write("GO\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        rows = []
        for p in procs:
            out, _ = p.communicate(timeout=args.timeout)
            got = [ln[7:] for ln in out.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 0 or not got:
                raise RuntimeError(f"bench --dcp: a rank failed (exit {p.returncode})")
            rows.append(json.loads(got[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [dict(r, cache=cache) for r in rows]


def _ranks(text: Optional[str], world: int) -> list[int]:
    if text is None:
        return list(range(world))
    ranks = [int(x) for x in text.split(",") if x.strip()]
    if not ranks or any(not 0 <= r < world for r in ranks):
        raise SystemExit(f"bench --dcp: --ranks {text!r} outside 0..{world - 1}")
    return ranks


def _summary(rows: list[dict]) -> list[dict]:
    """Per (cache, reader): the best repetition's per-rank GB/s, bytes and the aggregate."""
    out = []
    for cache in dict.fromkeys(r["cache"] for r in rows):
        for reader in dict.fromkeys(r["reader"] for r in rows):
            reps = [r for r in rows if (r["cache"], r["reader"]) == (cache, reader)]
            best = min(dict.fromkeys(r["rep"] for r in reps),
                       key=lambda k: max(r["seconds"] for r in reps if r["rep"] == k))
            mine = sorted((r for r in reps if r["rep"] == best), key=lambda r: r["rank"])
            total, wall = sum(r["local_bytes"] for r in mine), max(r["seconds"] for r in mine)
            out.append({"cache": cache, "reader": reader, "wall_s": wall,
                        "gbps": total / wall / GB, "ranks": [
                            {"rank": r["rank"], "gbps": r["local_bytes"] / r["seconds"] / GB,
                             "local_bytes": r["local_bytes"], "reader_bytes": r["reader_bytes"],
                             "header_bytes": r["header_bytes"], "rchar": r["rchar"],
                             "storage_read_bytes": r["storage_read_bytes"]} for r in mine]})
    return out


def _markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"{m['date_utc']}, {m['host']} ({m['cpu']}, {m['cpus']} CPUs), torch "
             f"{m['torch']}, device {doc['device']}, PP={doc['pp']} x TP={doc['tp']}, "
             f"checkpoint {doc['checkpoint_bytes'] / GB:.2f} GB; `{doc['command']}`", "",
             "| cache | reader | wall s | GB/s (all ranks) | per rank GB/s | bytes read / "
             "local shards (reader; rchar; storage) |", "|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        per = ", ".join(f"{r['gbps']:.2f}" for r in s["ranks"])
        ratios = "; ".join(
            f"r{r['rank']}: " + (f"{r['reader_bytes'] / r['local_bytes']:.3f}; "
                                 if r["reader_bytes"] is not None else "-; ")
            + f"{r['rchar'] / r['local_bytes']:.3f}; {r['storage_read_bytes'] / r['local_bytes']:.3f}"
            for r in s["ranks"])
        lines.append(f"| {s['cache']} | {s['reader']} | {s['wall_s']:.3f} | {s['gbps']:.2f} | "
                     f"{per} | {ratios} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker is not None:
        _worker(json.loads(args.worker))
        return 0
    import torch

    from .data import checkpoint_files, write_synthetic
    readers = [r for r in args.readers.split(",") if r]
    caches = [c for c in args.caches.split(",") if c]
    if not set(readers) <= set(READERS) or not set(caches) <= {"warm", "cold"}:
        raise SystemExit(f"bench --dcp: readers from {', '.join(READERS)}, caches warm,cold")
    if args.model is None:  # under --dir: new, empty or an earlier bench's (pploader.outputs)
        from ..outputs import claim_output, own_entries
        target = claim_output(args.dir, "--dir", command="bench --dcp", reuse=True)
        out = target.path / f"llama-{args.size_gb:g}GB-{args.layers}L-{args.shards}s"
        own_entries(target, [out.name])
        write_synthetic(out, int(args.size_gb * GB), args.layers, shards=args.shards)
        model = str(out)
    else:
        model = args.model
    paths = checkpoint_files(model)
    rows: list[dict] = []
    for rep in range(args.repeat):
        for cache in caches:
            for reader in (readers if rep % 2 == 0 else readers[::-1]):
                got = _group(args, model, reader, cache, paths)
                rows.extend(dict(r, rep=rep) for r in got)
                sys.stderr.write(f"[bench --dcp] rep {rep} {cache} {reader}: wall "
                                 f"{max(r['seconds'] for r in got):.3f}s\n")
    for rep in range(args.repeat):  # both readers fill every tensor alike
        for cache in caches:
            sums = {r["reader"]: {(r["rank"], k): v for k, v in r["sums"].items()}
                    for r in rows if (r["rep"], r["cache"]) == (rep, cache)}
            if len({json.dumps(sorted(s.items()), default=str) for s in sums.values()}) > 1:
                raise SystemExit(f"bench --dcp: readers loaded different values ({cache})")
    doc = {"machine": {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "host": platform.node(), "cpu": platform.processor() or
                       platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__},
           "command": "pploader bench --dcp -- " + " ".join(argv if argv is not None
                                                            else sys.argv[1:]),
           "device": args.device, "pp": args.pp, "tp": args.tp, "model": model,
           "checkpoint_bytes": sum(os.path.getsize(p) for p in paths),
           "summary": _summary([{k: v for k, v in r.items() if k != "sums"} for r in rows])}
    text = _markdown(doc)
    if args.markdown:
        Path(args.markdown).write_text(text)
    sys.stdout.write(json.dumps(doc, indent=1) + "\n" if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
