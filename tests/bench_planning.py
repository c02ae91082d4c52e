"""Planning time before/after, in fresh processes (CPU seconds of the process, and wall).

    python tests/bench_planning.py BASELINE_TREE NEW_TREE [--repeat N] [--cases ...]

Each tree holds a ``pploader/`` package (e.g. ``git archive REV pploader | tar -x -C DIR``).
Needs the sparse DeepSeek-V3 layout: ``python tests/real_layouts.py --root /tmp/scale-layouts``.
Rows: one rank's own plan (the last rank: ``load_spec`` + ``open_checkpoint`` + ``make_windows``
+ ``plan_rank`` with the default options, i.e. header parsing and the redistribution choice
included; pploader's imports excluded; a generic-family model's transformers imports, which
``load_spec`` makes, included), ``warm:``: the same with the architecture's transformers
modules imported before the clock starts (as in an engine or ``pploader load``, which import
them anyway), ``plan:``: the same with the model's family derived before the clock (a process
planning another rank), every rank (``plan_all``), and ``python -m pploader plan --help``
(wall, imports included). Runs alternate between the trees; the best of ``--repeat`` counts.
``--model`` takes several layouts (comma separated), one table block each. Numbers:
docs/benchmarks.md, "Planning"."""
import argparse
import json
import os
import platform
import struct
import subprocess
import sys
import time
from pathlib import Path

CODE = r'''
import time, sys, json
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import make_windows, plan_rank, plan_all
from pploader.planning.spec import load_spec
from pploader.planning.topology import Topology
P, layout, mode = sys.argv[1], sys.argv[2], sys.argv[3]
pp, tp, ep = (int(x) for x in layout.split("x"))
if mode in ("warm", "plan"):  # the architecture's transformers modules, as an engine has them
    import transformers
    getattr(transformers, json.load(open(P + "/config.json"))["architectures"][0], None)
if mode == "plan":  # the family derived before the clock (a process planning its 2nd rank)
    load_spec(P)
w1 = time.perf_counter(); c1 = time.process_time()
spec = load_spec(P); index = open_checkpoint(P); spec = spec.for_checkpoint(index.weight_map)
if mode in ("one", "warm", "plan"):
    topo = Topology(pp, tp, ep, pp * tp * ep - 1)
    plan = plan_rank(spec, index, topo, make_windows(spec, index, pp, "even")[topo.pp_rank])
    n = len(plan.items)
else:
    n = sum(len(p.items) for p in plan_all(spec, index, pp, tp, ep))
print(json.dumps({"wall": time.perf_counter() - w1, "cpu": time.process_time() - c1,
                  "items": n}))
'''
CASES = ("one:16x1x1,one:1x8x1,one:2x8x1,one:8x1x8,all:16x1x1,all:2x8x1,help")


def _run(tree: str, case: str, model: str) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    if case == "help":
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "pploader", "plan", "--help"],
                             capture_output=True, text=True, cwd="/tmp", env=env)
        assert out.returncode == 0, out.stderr
        return {"wall": time.perf_counter() - t0, "cpu": float("nan"), "items": 0}
    mode, layout = case.split(":")
    out = subprocess.run([sys.executable, "-c", CODE, model, layout, mode], capture_output=True,
                         text=True, cwd="/tmp", env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def json_floor(model: str, repeat: int = 5) -> str:
    """CPU seconds of ``orjson.loads`` of the index and of every shard header (best of
    ``repeat``): what any per-process plan that parses them in Python spends at least."""
    import orjson
    root = Path(model)
    raws = [(root / "model.safetensors.index.json").read_bytes()]
    for path in sorted(root.glob("*.safetensors")):
        with open(path, "rb") as fh:
            raws.append(fh.read(struct.unpack("<Q", fh.read(8))[0]))
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        for raw in raws:
            orjson.loads(raw)
        best = min(best, time.process_time() - t0)
    return (f"# JSON floor: orjson.loads of the index ({len(raws[0]) / 1e6:.1f} MB) and "
            f"{len(raws) - 1} headers ({sum(map(len, raws[1:])) / 1e6:.1f} MB): {best:.3f} s "
            f"CPU, best of {repeat}")


#: The least a plan that keeps one record per tensor costs, whatever its code: parse the index
#: and every header (orjson), one 6-field tuple per tensor, one 10-field tuple per item (all in
#: C passes, no check, no roles, no TP logic), sorted by one int key. Runs in a fresh process,
#: like the plans (fresh memory is slow to touch on some VMs, and a plan pays for it too).
SKELETON = r'''
import gc, json, struct, sys, time, orjson
from itertools import repeat
from operator import add, itemgetter
from pathlib import Path
gc.disable()
root = Path(sys.argv[1])
c0 = time.process_time()
index = orjson.loads((root / "model.safetensors.index.json").read_bytes())["weight_map"]
files = sorted(set(index.values()))
records = {}
for f in files:
    with open(root / f, "rb") as fh:
        obj = orjson.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
    obj.pop("__metadata__", None)
    names, infos = list(obj), list(obj.values())
    offs = list(map(itemgetter("data_offsets"), infos))
    records.update(zip(names, zip(names, repeat(f), map(itemgetter("dtype"), infos),
                                  map(tuple, map(itemgetter("shape"), infos)),
                                  map(itemgetter(0), offs), map(itemgetter(1), offs))))
names = list(index)
recs = list(map(records.__getitem__, names))
starts = list(map(itemgetter(4), recs))
shapes = list(map(itemgetter(3), recs))
items = list(zip(names, names, map(itemgetter(1), recs), map(itemgetter(2), recs), shapes,
                 shapes, zip(zip(starts, map(itemgetter(5), recs))), shapes, repeat(()),
                 repeat(0)))
order = {f: i << 48 for i, f in enumerate(files)}
keys = list(map(add, map(order.__getitem__, map(itemgetter(2), items)), starts))
items = list(map(items.__getitem__, sorted(range(len(items)), key=keys.__getitem__)))
print(json.dumps({"cpu": time.process_time() - c0, "items": len(items)}))
'''


#: The least a plan costs that keeps no per-tensor record at all and does only what issue 16
#: itself requires before any planning: parse the index (strict accounting: every name in it is
#: owned once) and every header (the rank reads part of every tensor), gather each header's
#: offsets, shapes and dtypes into numpy columns, check span = numel x itemsize and that the
#: spans tile each data region, and check that the headers hold exactly the index's names in
#: the index's files. No roles, no TP selection, no items, no exchange. Fresh process.
COLUMNAR = r"""
import gc, json, os, struct, sys, time, orjson
from itertools import chain
from operator import itemgetter
from pathlib import Path
import numpy as np
gc.disable()
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
root = Path(sys.argv[1])
c0 = time.process_time()
index = orjson.loads((root / "model.safetensors.index.json").read_bytes())["weight_map"]
files = sorted(set(index.values()))
headers, data_lens = [], []
for f in files:
    with open(root / f, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        obj = orjson.loads(fh.read(n))
        data_lens.append(os.fstat(fh.fileno()).st_size - 8 - n)
    obj.pop("__metadata__", None)
    headers.append(obj)
c1 = time.process_time()
names = list(chain.from_iterable(headers))
infos = list(chain.from_iterable(h.values() for h in headers))
count = len(infos)
offsets = np.fromiter(chain.from_iterable(map(itemgetter("data_offsets"), infos)),
                      dtype=np.int64, count=2 * count).reshape(-1, 2)
shapes = list(map(itemgetter("shape"), infos))
ndim = np.fromiter(map(len, shapes), dtype=np.int64, count=count)
dims = np.fromiter(chain.from_iterable(shapes), dtype=np.int64)
itemsize = np.fromiter(map(ITEMSIZE.__getitem__, map(itemgetter("dtype"), infos)),
                       dtype=np.int64, count=count)
padded = np.ones((count, max(int(ndim.max()), 1)), dtype=np.int64)
padded[np.arange(padded.shape[1]) < ndim[:, None]] = dims
assert (padded.prod(axis=1) * itemsize == offsets[:, 1] - offsets[:, 0]).all()
file_id = np.repeat(np.arange(len(files)), list(map(len, headers)))
order = np.lexsort((offsets[:, 0], file_id))
begin, end, fid = offsets[order, 0], offsets[order, 1], file_id[order]
first = np.r_[True, fid[1:] != fid[:-1]]
last = np.r_[first[1:], True]
assert (begin[first] == 0).all() and (begin[~first] == end[np.flatnonzero(~first) - 1]).all()
assert (end[last] == np.array(data_lens)[fid[last]]).all()
assert dict(zip(names, map(files.__getitem__, file_id.tolist()))) == index
c2 = time.process_time()
print(json.dumps({"cpu": c2 - c0, "parse": c1 - c0, "tensors": count}))
"""


def columnar_floor(model: str, repeat: int = 5) -> str:
    """CPU seconds of :data:`COLUMNAR` (best and worst of ``repeat`` fresh processes)."""
    runs = [json.loads(subprocess.run([sys.executable, "-c", COLUMNAR, model], check=True,
                                      capture_output=True, text=True).stdout) for _ in range(repeat)]
    cpu = sorted(r["cpu"] for r in runs)
    parse = sorted(r["parse"] for r in runs)
    return (f"# columnar floor: index + headers parsed ({parse[0]:.3f}-{parse[-1]:.3f} s), "
            f"numpy columns, span and tiling checks, names and files equal to the index's; no "
            f"per-tensor record, no roles, no TP, no items ({runs[0]['tensors']} tensors): "
            f"{cpu[0]:.3f} s CPU best, {cpu[-1]:.3f} s worst of {repeat} fresh processes")


def skeleton_floor(model: str, repeat: int = 5) -> str:
    """CPU seconds of :data:`SKELETON` (best of ``repeat`` fresh processes)."""
    runs = [json.loads(subprocess.run([sys.executable, "-c", SKELETON, model], check=True,
                                      capture_output=True, text=True).stdout) for _ in range(repeat)]
    return (f"# record-per-tensor floor: index + headers parsed, one record and one item per "
            f"tensor ({runs[0]['items']}), sorted, no check: "
            f"{min(r['cpu'] for r in runs):.3f} s CPU, best of {repeat} fresh processes")


def _row(before: str, after: str, case: str, model: str, repeat: int) -> None:
    """One table row: ``repeat`` runs of each tree, alternating; the best of each counts."""
    key = "wall" if case == "help" else "cpu"
    runs: list[list[dict]] = [[], []]
    for _ in range(repeat):
        for i, tree in enumerate((before, after)):  # alternating
            runs[i].append(_run(tree, case, model))
    b, a = (min(r, key=lambda x: x[key]) for r in runs)
    trials = " / ".join(" ".join(f"{x[key]:.2f}" for x in r) for r in runs)
    print(f"| {Path(model).name} | {case} | {a['items']} | {b['cpu']:.3f} ({b['wall']:.3f}) | "
          f"{a['cpu']:.3f} ({a['wall']:.3f}) | {b[key] / a[key]:.1f}x | {trials} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--model", default="/tmp/scale-layouts/deepseek-v3",
                    help="layout directories, comma separated (tests/real_layouts.py makes them)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cases", default=CASES, help="comma separated: one:PPxTPxEP, "
                    "warm:PPxTPxEP, plan:PPxTPxEP, all:PPxTPxEP, help")
    ap.add_argument("--floor", action="store_true", help="also print the JSON parse floor, "
                    "the record-per-tensor floor and the columnar floor")
    args = ap.parse_args()
    print(f"# {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, python "
          f"{platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"load {os.getloadavg()[0]:.1f}")
    print("| layout | case (PPxTPxEP) | items | before: CPU s (wall s) | after: CPU s (wall s) "
          "| speed-up (CPU; wall for --help) | all trials, CPU s: before / after |")
    print("|---|---|---|---|---|---|---|")
    for model in args.model.split(","):
        for case in filter(None, args.cases.split(",")):  # --cases "": the floors only
            _row(args.before, args.after, case, model, args.repeat)
    if args.floor:
        for model in args.model.split(","):
            print(json_floor(model))
            print(skeleton_floor(model))
            print(columnar_floor(model))
    print(f"# load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
