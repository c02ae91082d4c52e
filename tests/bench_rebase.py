"""A reload's planning: ``plan_stage`` afresh vs ``rebase_stage`` of the served plan onto a
checkpoint of the same layout (planning/rebase.py), at real scale.

    python tests/real_layouts.py --root /tmp/rl          # the sparse real layouts
    python tests/bench_rebase.py /tmp/rl/deepseek-v3 /tmp/rl/qwen3-next-80b-a3b [--repeat 5]

Each layout is copied (sparse) to a second directory, the "weight update". Per topology: the
median over ``--repeat`` of planning the copy afresh and of rebasing the plan of the original
onto it; the two plans are checked equal. Numbers: docs/benchmarks.md, "Reload planning"."""
from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from pathlib import Path
from statistics import median

from pploader import Topology, plan_stage
from pploader.planning.rebase import rebase_stage

TOPOLOGIES = (Topology(4, 1, 1, 1), Topology(2, 8, 1, 8 + 3), Topology(4, 1, 8, 8 + 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("layouts", nargs="+", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--copies", type=Path, default=Path("/tmp/rebase-copies"))
    args = ap.parse_args()
    print("| layout | rank | items | files | plan_stage ms | rebase_stage ms |")
    print("|---|---|---|---|---|---|")
    for src in args.layouts:
        dst = args.copies / src.name
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["cp", "-r", "--sparse=always", str(src), str(dst)], check=True)
        for topo in TOPOLOGIES:
            try:
                served = plan_stage(src, topo)
            except Exception as exc:  # noqa: BLE001 - e.g. EP on a dense model
                print(f"<!-- {src.name} {topo.describe()}: {exc} -->")
                continue
            fresh_s, rebase_s = [], []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                fresh = plan_stage(dst, topo)
                t1 = time.perf_counter()
                moved = rebase_stage(served, dst)
                t2 = time.perf_counter()
                if moved is None or moved.plan != fresh.plan:
                    raise SystemExit(f"{src.name} {topo.describe()}: rebased plan differs")
                fresh_s.append(t1 - t0)
                rebase_s.append(t2 - t1)
            print(f"| {src.name} | {topo.describe()} | {len(served.plan.items)} | "
                  f"{len(served.plan.paths)} | {median(fresh_s) * 1e3:.0f} | "
                  f"{median(rebase_s) * 1e3:.0f} |", flush=True)
    shutil.rmtree(args.copies, ignore_errors=True)


if __name__ == "__main__":
    main()
