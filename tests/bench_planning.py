"""Planning time before/after, in fresh processes (CPU seconds of the process, and wall).

    python tests/bench_planning.py BASELINE_TREE NEW_TREE   (each holds a pploader/ package)

Needs the sparse DeepSeek-V3 layout: ``python tests/real_layouts.py --root /tmp/scale-layouts``.
Numbers: docs/benchmarks.md, "Planning at real scale"."""
import json, subprocess, sys, os
CODE = r'''
import time, sys, json
w0 = time.perf_counter(); c0 = time.process_time()
from pploader.planning.checkpoint import open_checkpoint
from pploader.planning.plan import make_windows, plan_rank, plan_all
from pploader.planning.spec import load_spec
from pploader.planning.topology import Topology
P, layout, mode = sys.argv[1], sys.argv[2], sys.argv[3]
pp, tp, ep = (int(x) for x in layout.split("x"))
w1 = time.perf_counter(); c1 = time.process_time()
spec = load_spec(P); index = open_checkpoint(P); spec = spec.for_checkpoint(index.weight_map)
if mode == "one":
    topo = Topology(pp, tp, ep, pp * tp * ep - 1)
    plan_rank(spec, index, topo, make_windows(spec, index, pp, "even")[topo.pp_rank])
else:
    plan_all(spec, index, pp, tp, ep)
print(json.dumps({"wall": time.perf_counter() - w1, "cpu": time.process_time() - c1}))
'''
P = "/tmp/scale-layouts/deepseek-v3"
cases = [(l, "one") for l in ("16x1x1", "8x1x8", "2x8x1")] + [("16x1x1", "all")]
rows = []
for layout, mode in cases:
    row = [layout, mode]
    for tree in sys.argv[1:3]:
        best = None
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", CODE, P, layout, mode], capture_output=True,
                                 text=True, cwd="/tmp", env=dict(os.environ, PYTHONPATH=tree))
            r = json.loads(out.stdout.strip().splitlines()[-1])
            best = r if best is None or r["cpu"] < best["cpu"] else best
        row.append(best)
    rows.append(row)
    b, a = row[2], row[3]
    print(f"| {layout} (PPxTPxEP) | {mode} | {b['cpu']:.2f} ({b['wall']:.2f}) | {a['cpu']:.2f} ({a['wall']:.2f}) | {b['cpu']/a['cpu']:.1f}x |", flush=True)
