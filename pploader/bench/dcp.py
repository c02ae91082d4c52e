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
import compileall
import json
import os
import resource
import statistics
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
           "torch_hf": "dcp.load + torch's HuggingFaceStorageReader(thread_count=T)",
           "pploader_base": "the same pploader reader imported from --base DIR (A/B)"}


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
    p.add_argument("--repeat", type=int, default=1,
                   help="fresh-process trials per reader and cache, alternated (medians)")
    p.add_argument("--loads", default="first,reload",
                   help="timed loads per process: first (the reader made and set up, its import too with "
                   "--import-in-clock), "
                   "reload (a new reader, same process) (default both)")
    p.add_argument("--import-in-clock", action="store_true",
                   help="time the reader's import inside the first load (default: each rank "
                   "imports it at its start, as the docs' job does with `from pploader import "
                   "PPLoaderStorageReader` beside `import torch.distributed.checkpoint`; the "
                   "import's seconds are reported apart either way)")
    p.add_argument("--threads", type=int, default=None,
                   help="pploader reader threads (default: the backend's default)")
    p.add_argument("--range-cost", type=int, default=0,
                   help="pploader's range_cost_bytes (default 0: exact row runs; 65536 is "
                   "pploader's planner default: dim-1 shards of short rows read as a box)")
    p.add_argument("--hf-threads", type=int, default=None,
                   help="HuggingFaceStorageReader thread_count (default: 8 on cuda, 1 on cpu, "
                   "torch's fastest on the 2-core VM)")
    p.add_argument("--base", metavar="DIR", default=None,
                   help="a checkout (or `git archive`) of another pploader commit: adds the "
                   "reader pploader_base, its ranks importing pploader from DIR, alternated "
                   "with the others on the same files (A/B of a change)")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ppbench-dcp"))
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", action="store_true", help="print the JSON document, not tables")
    p.add_argument("--markdown", metavar="FILE", default=None, help="write a Markdown table")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


# ---- the measured rank process --------------------------------------------------------------
def _layout(model_dir: str, pp: int, tp: int) -> list[list[list[Any]]]:
    """Per rank: ``[name, stored shape, dtype, TP dim or None]`` of its stage's tensors, from
    pploader's plan (made in the parent, so a rank imports no pploader module before its
    clock: each rank imports only what a job imports)."""
    from ..planning.stage import plan_stage
    from ..planning.topology import Topology
    out = []
    for rank in range(pp * tp):
        topo = Topology(pp, tp, rank=rank)
        rows = []
        for item in plan_stage(model_dir, topo).plan.items:
            if item.dtype not in ("BF16", "F32"):
                raise SystemExit(f"bench --dcp: {item.name} is {item.dtype} (BF16/F32 only)")
            src = list(item.source_shape)
            dims = [d for d in range(len(src)) if item.shape[d] != src[d]]
            rows.append([item.name, src, item.dtype, dims[0] if dims and tp > 1 else None])
        out.append(rows)
    return out


def _state_dict(layout: list[list[Any]], tp_mesh: Any, tp: int, tp_rank: int,
                device: Any) -> dict:
    """This rank's stage as DCP destinations: DTensors on ``tp_mesh`` sharded on their TP
    dim, plain tensors where the stage reads them whole; NaN-filled."""
    import torch
    from torch.distributed.tensor import DTensor, Shard
    out = {}
    for name, src, code, dim in layout:
        dtype = torch.bfloat16 if code == "BF16" else torch.float32
        if dim is None:
            out[name] = torch.full(src, float("nan"), dtype=dtype, device=device)
            continue
        meta = torch.empty(src, device="meta")
        local = torch.full(meta.chunk(tp, dim)[tp_rank].shape, float("nan"), dtype=dtype,
                           device=device)
        out[name] = DTensor.from_local(local, tp_mesh, [Shard(dim)], run_check=False,
                                       shape=torch.Size(src), stride=meta.stride())
    return out


def _proc_io() -> dict[str, int]:
    """This process's ``/proc/self/io`` counters (empty where there is none)."""
    try:
        with open("/proc/self/io") as fh:
            return {k: int(v) for k, v in (ln.split(": ") for ln in fh if ": " in ln)}
    except OSError:
        return {}


def _import_reader(spec: dict) -> tuple[Any, float]:
    """The reader's class, imported as the docs' job does at its top
    (integration.md, "Torch-native jobs": ``from pploader import PPLoaderStorageReader``;
    torch's with ``import torch.distributed.checkpoint``), and the seconds that took."""
    t0 = time.perf_counter()
    reader_class: Any
    if spec["reader"].startswith("pploader"):
        from pploader import PPLoaderStorageReader
        reader_class = PPLoaderStorageReader
    else:
        from torch.distributed.checkpoint import HuggingFaceStorageReader
        reader_class = HuggingFaceStorageReader
    return reader_class, time.perf_counter() - t0


def _make_reader(spec: dict, mesh: Any, reader_class: Any) -> Any:
    """The reader as the docs make it (integration.md, "Torch-native jobs"): pploader's with
    the mesh's topology, torch's with ``thread_count``; made inside the clock."""
    if not spec["reader"].startswith("pploader"):
        return reader_class(spec["model"], thread_count=spec["hf_threads"])
    import pploader
    topo = pploader.mesh_topology(mesh) if mesh is not None else \
        pploader.Topology(spec["pp"], 1, rank=spec["rank"])
    extra = {k: v for k, v in (("threads", spec["threads"]),
                               ("range_cost_bytes", spec["range_cost"])) if v}
    return reader_class(spec["model"], topology=topo, **extra)


def _worker(spec: dict) -> None:
    """One rank: READY, then per load (``first`` in this fresh process, then ``reload``):
    wait for GO (the parent sets the page cache meanwhile), time reader + ``dcp.load``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    rank, world, cuda = spec["rank"], spec["world"], spec["device"] == "cuda"
    solo = spec["solo"]  # this rank alone (no process group): its stage, as rank ``rank``
    if cuda:
        torch.cuda.set_device(spec["local_rank"] % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = tp_mesh = None
    if not solo:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=spec["init"],
                                rank=rank, world_size=world)
        mesh = init_device_mesh(spec["device"], (spec["pp"], spec["tp"]),
                                mesh_dim_names=("pp", "tp"))
        tp_mesh = mesh["tp"]
    with open(spec["layout"]) as fh:
        layout = json.load(fh)[rank]
    state = _state_dict(layout, tp_mesh, spec["tp"], rank % spec["tp"], device)
    local = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}
    if cuda:
        torch.cuda.synchronize()
    reader_class, import_s = (None, 0.0) if spec["import_in_clock"] else _import_reader(spec)
    for load in spec["loads"]:
        if not solo:
            dist.barrier()
        print("READY", flush=True)
        if sys.stdin.readline().strip() != "GO":
            raise SystemExit("bench --dcp worker: no GO")
        io0, ru0, t0 = _proc_io(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if reader_class is None:  # --import-in-clock: the first load pays the import
            reader_class, import_s = _import_reader(spec)
        reader = _make_reader(spec, mesh, reader_class)
        dcp.load(state, storage_reader=reader, no_dist=solo)
        if cuda:
            torch.cuda.synchronize()
        seconds, io1 = time.perf_counter() - t0, _proc_io()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        ours = spec["reader"].startswith("pploader")
        row = {"rank": rank, "reader": spec["reader"], "load": load, "seconds": seconds,
               "import_s": import_s if load == spec["loads"][0] else 0.0,
               "local_bytes": sum(t.nbytes for t in local.values()),
               "reader_bytes": reader.read_bytes if ours else None,
               "header_bytes": reader.header_bytes if ours else None,
               "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
               "storage_read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
               "cpu_s": ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime,
               "minor_faults": ru1.ru_minflt - ru0.ru_minflt,
               "sums": {k: float(t.double().sum()) for k, t in local.items()}}
        print("RESULT " + json.dumps(row), flush=True)
        for t in local.values():  # the next load must write every byte again
            t.fill_(float("nan"))
    if not solo:
        dist.destroy_process_group()


# ---- the parent -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group(args: argparse.Namespace, model: str, layout: str, reader: str, cache: str,
           paths: Sequence[str]) -> list[dict]:
    """Fresh rank processes: their first ``dcp.load`` and a reload, every rank at once, the
    cache set (``cache``) before each while they wait."""
    from .methods import evict, make_resident
    world = args.pp * args.tp
    ranks = _ranks(args.ranks, world)
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    root = str(Path(args.base).resolve()) if reader == "pploader_base" else \
        str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    solo = len(ranks) < world
    if solo and args.tp > 1:
        raise SystemExit("bench --dcp: --ranks (a subset, each rank alone) needs --tp 1")
    loads = [x for x in args.loads.split(",") if x]
    procs = []
    for i, rank in enumerate(ranks):
        spec = dict(rank=rank, local_rank=i, world=world, pp=args.pp, tp=args.tp,
                    device=args.device, model=model, layout=layout, reader=reader, init=init,
                    solo=solo, threads=args.threads, hf_threads=args.hf_threads,
                    range_cost=args.range_cost, loads=loads,
                    import_in_clock=args.import_in_clock)
        procs.append(subprocess.Popen([sys.executable, "-m", "pploader.bench.dcp", "--worker",
                                       json.dumps(spec)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env))
    rows = []
    try:
        for _ in loads:
            for p in procs:
                line = p.stdout.readline()  # type: ignore[union-attr]
                if line.strip() != "READY":
                    raise RuntimeError("bench --dcp: a rank failed (its error is above)")
            if cache == "cold":
                evict(paths)
            else:
                make_resident(paths)
            for p in procs:
                p.stdin.write("GO\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            for p in procs:
                line = p.stdout.readline()  # type: ignore[union-attr]
                if not line.startswith("RESULT "):
                    raise RuntimeError("bench --dcp: a rank failed (its error is above)")
                rows.append(json.loads(line[7:]))
        for p in procs:
            p.communicate(timeout=args.timeout)
            if p.returncode != 0:
                raise RuntimeError(f"bench --dcp: a rank failed (exit {p.returncode})")
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
    """Per (cache, load, reader): each repetition's wall (its slowest rank), their median, and
    the per-rank numbers of the repetition at the median."""
    out = []
    for cache in dict.fromkeys(r["cache"] for r in rows):
        for load in dict.fromkeys(r["load"] for r in rows):
            for reader in dict.fromkeys(r["reader"] for r in rows):
                reps = [r for r in rows if (r["cache"], r["load"], r["reader"]) ==
                        (cache, load, reader)]
                if not reps:
                    continue
                walls = {k: max(r["seconds"] for r in reps if r["rep"] == k)
                         for k in dict.fromkeys(r["rep"] for r in reps)}
                order = sorted(walls, key=walls.__getitem__)
                mid = order[(len(order) - 1) // 2]
                mine = sorted((r for r in reps if r["rep"] == mid), key=lambda r: r["rank"])
                total = sum(r["local_bytes"] for r in mine)
                cpu = {k: sum(r["cpu_s"] for r in reps if r["rep"] == k) for k in walls}
                imports = {k: max(r.get("import_s", 0.0) for r in reps if r["rep"] == k)
                           for k in walls}
                out.append({"cache": cache, "load": load, "reader": reader,
                            "cpu_s": statistics.median(cpu.values()),
                            "import_s": statistics.median(imports.values()),
                            "wall_s": statistics.median(walls.values()),
                            "walls_s": [walls[k] for k in walls],
                            "gbps": total / statistics.median(walls.values()) / GB, "ranks": [
                                {"rank": r["rank"], "gbps": r["local_bytes"] / r["seconds"] / GB,
                                 "local_bytes": r["local_bytes"],
                                 "reader_bytes": r["reader_bytes"],
                                 "header_bytes": r["header_bytes"], "rchar": r["rchar"],
                                 "storage_read_bytes": r["storage_read_bytes"]} for r in mine]})
    return out


def _ratios(summary: list[dict]) -> list[dict]:
    """pploader's median wall / torch's, per (cache, load) where both ran (and the --base
    reader's: ``base_over_torch``)."""
    walls = {(s["cache"], s["load"], s["reader"]): s["wall_s"] for s in summary}
    out = []
    for c, ld, r in walls:
        if r != "pploader" or (c, ld, "torch_hf") not in walls:
            continue
        row = {"cache": c, "load": ld,
               "pploader_over_torch": walls[(c, ld, r)] / walls[(c, ld, "torch_hf")]}
        if (c, ld, "pploader_base") in walls:
            row["base_over_torch"] = walls[(c, ld, "pploader_base")] / walls[(c, ld, "torch_hf")]
        out.append(row)
    return out


def _markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"{m['date_utc']}, {m['host']} ({m.get('cpu', '?')}, {m['cpus']} CPUs), commit "
             f"{m['commit'] or '?'}, torch "
             f"{m['torch']}, device {doc['device']}, PP={doc['pp']} x TP={doc['tp']}, "
             f"checkpoint {doc['checkpoint_bytes'] / GB:.3f} GB, {doc['repeat']} fresh-process "
             f"trials per cell (alternated); `{doc['command']}`", "",
             "| cache | load | reader | median wall s | trials (s) | GB/s (all ranks) | CPU s "
             "(all ranks, median) | import s (slowest rank, median) | bytes read / local "
             "shards (reader; rchar; storage) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        ratios = "; ".join(
            f"r{r['rank']}: " + (f"{r['reader_bytes'] / r['local_bytes']:.3f}; "
                                 if r["reader_bytes"] is not None else "-; ")
            + f"{r['rchar'] / r['local_bytes']:.3f}; {r['storage_read_bytes'] / r['local_bytes']:.3f}"
            for r in s["ranks"])
        trials = ", ".join(f"{w:.3f}" for w in s["walls_s"])
        lines.append(f"| {s['cache']} | {s['load']} | {s['reader']} | {s['wall_s']:.3f} | "
                     f"{trials} | {s['gbps']:.2f} | {s['cpu_s']:.2f} | "
                     f"{s.get('import_s', 0.0):.3f} | {ratios} |")
    if doc["ratios"]:
        base = any("base_over_torch" in r for r in doc["ratios"])
        lines += ["", "| cache | load | pploader's median time / torch's |"
                  + (" --base's / torch's |" if base else ""),
                  "|---|---|---|" + ("---|" if base else "")]
        lines += [f"| {r['cache']} | {r['load']} | {r['pploader_over_torch']:.2f} |"
                  + (f" {r['base_over_torch']:.2f} |" if base else "")
                  for r in doc["ratios"]]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    """The pploader checkout's commit (``git describe``), or "" outside a checkout."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, timeout=10, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker is not None:
        _worker(json.loads(args.worker))
        return 0

    from .data import checkpoint_files, write_synthetic
    readers = [r for r in args.readers.split(",") if r]
    if args.base is not None and "pploader_base" not in readers:
        readers.insert(1, "pploader_base")
    if "pploader_base" in readers and args.base is None:
        raise SystemExit("bench --dcp: the reader pploader_base needs --base DIR")
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
    # pploader's modules byte-compiled, as an installed package has them (pip compiles on
    # install; a checkout under PYTHONDONTWRITEBYTECODE=1 would compile them in every rank's
    # first load, inside the clock: torch's own modules are compiled)
    compileall.compile_dir(str(Path(__file__).resolve().parents[1]), quiet=2)
    if args.base is not None:
        compileall.compile_dir(str(Path(args.base) / "pploader"), quiet=2)
    if args.hf_threads is None:
        args.hf_threads = 8 if args.device == "cuda" else 1
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        layout = os.path.join(tmp, "layout.json")
        with open(layout, "w") as fh:
            json.dump(_layout(model, args.pp, args.tp), fh)
        for rep in range(args.repeat):
            for cache in caches:
                for reader in (readers if rep % 2 == 0 else readers[::-1]):
                    got = _group(args, model, layout, reader, cache, paths)
                    rows.extend(dict(r, rep=rep) for r in got)
                    walls = {ld: max(r["seconds"] for r in got if r["load"] == ld)
                             for ld in dict.fromkeys(r["load"] for r in got)}
                    sys.stderr.write(f"[bench --dcp] rep {rep} {cache} {reader}: " + ", ".join(
                        f"{ld} {w:.3f}s" for ld, w in walls.items()) + "\n")
    for rep in range(args.repeat):  # both readers fill every tensor alike
        for cache in caches:
            for load in dict.fromkeys(r["load"] for r in rows):
                sums = {r["reader"]: {(r["rank"], k): v for k, v in r["sums"].items()}
                        for r in rows if (r["rep"], r["cache"], r["load"]) == (rep, cache, load)}
                if len({json.dumps(sorted(s.items()), default=str) for s in sums.values()}) > 1:
                    raise SystemExit(f"bench --dcp: readers loaded different values ({cache})")
    from .machine import machine_info
    summary = _summary([{k: v for k, v in r.items() if k != "sums"} for r in rows])
    doc = {"machine": dict(machine_info(Path(model)), commit=_commit()),
           "command": "pploader bench --dcp -- " + " ".join(argv if argv is not None
                                                            else sys.argv[1:]),
           "device": args.device, "pp": args.pp, "tp": args.tp, "model": model,
           "repeat": args.repeat, "hf_threads": args.hf_threads,
           "checkpoint_bytes": sum(os.path.getsize(p) for p in paths),
           "summary": summary, "ratios": _ratios(summary),
           "rows": [{k: v for k, v in r.items() if k != "sums"} for r in rows]}
    text = _markdown(doc)
    if args.markdown:
        Path(args.markdown).write_text(text)
    sys.stdout.write(json.dumps(doc, indent=1) + "\n" if args.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
