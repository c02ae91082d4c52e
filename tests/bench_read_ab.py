"""Read path before/after: ``Reader.read_into`` of one PP rank, warm, in fresh processes.

    python tests/bench_read_ab.py BASELINE_TREE NEW_TREE MODEL_DIR [--ranks 0,3] [--repeat 6]

Each tree holds a ``pploader/`` package (``git archive REV pploader | tar -x -C DIR``); works
with the flat layout before issue 14 and the phase folders after it. MODEL_DIR: e.g. the
benchmark's ``/tmp/ppbench/llama-4.3GB-32L-5s`` (``pploader bench --keep``). The files are
read once first (warm page cache); runs alternate between the trees; prints per tree and rank
the sorted seconds. Numbers: the A/B of the 2026-11-26 restructure, in the history of
docs/benchmarks.md."""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r'''
import json, sys, time
tree, model, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, tree)
import torch
torch.set_num_threads(1)
from pploader import Topology, plan_stage
try:
    from pploader.io.read import Reader
    from pploader.planning.checkpoint import DTYPES
except ImportError:  # the flat layout before issue 14
    from pploader.read import Reader
    from pploader.checkpoint import DTYPES
plan = plan_stage(model, Topology(4, rank=rank)).plan
dests = {}
for i in plan.items:  # prefaulted destinations, outside the clock
    t = torch.empty(i.nbytes, dtype=torch.uint8)
    t.fill_(0)
    dests[i.target] = t.view(DTYPES[i.dtype][0]).view(i.shape)
t0 = time.perf_counter()
reader = Reader(plan)
reader.read_into(dests)
print(json.dumps({"s": time.perf_counter() - t0, "bytes": reader.stats.read_bytes}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("model")
    ap.add_argument("--ranks", default="0,3")
    ap.add_argument("--repeat", type=int, default=6)
    args = ap.parse_args()
    for f in sorted(Path(args.model).glob("*.safetensors")):  # warm the page cache
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    times: dict = {}
    for _ in range(args.repeat):
        for rank in (int(r) for r in args.ranks.split(",")):
            for tree in (args.before, args.after):
                out = subprocess.run([sys.executable, "-c", CHILD, tree, args.model, str(rank)],
                                     capture_output=True, text=True, check=True, cwd="/tmp")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                times.setdefault((tree, rank), []).append(res["s"])
    for (tree, rank), ts in sorted(times.items()):
        print(f"{tree} rank {rank}: median {statistics.median(ts):.3f} s, sorted "
              + " ".join(f"{t:.3f}" for t in sorted(ts)))


if __name__ == "__main__":
    main()
