"""TP stage loads on GPUs: direct strided reads vs read-and-redistribute (row shares
+ NCCL all-to-all on the device) vs ``--exchange-cost auto``, warm and cold, every TP rank on
its own GPU, all ranks at once (docs/benchmarks-gpu.md).

    torchrun --standalone --nproc_per_node N -m benchmarks.tp_gpu_loads --model DIR \\
        [--repeat 2] [--cold-repeat 1] [--states warm,cold] [--out FILE.json]

Per load and rank: seconds of the load (``load_stage``'s reader; planning excluded, a pinned
ring made before the clock and reused, as a server's reload does), bytes read vs the rank's
ideal, bytes exchanged, the main thread's time in the exchange and waiting for reads. Every
load is compared bitwise with the first direct load of the same rank. Also times one
all-to-all of 256 MiB per peer (the link) and the residency that ``auto`` saw.
``--device cpu`` (gloo) runs the same on CPUs (a check of this script, not a GPU figure).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    from pploader.distributed.comm import Comm

__all__ = ["main", "tp_bench"]

MODES = ("direct", "redistribute", "auto")


def _link_gbps(comm: "Comm", device: str, per_peer: int = 256 << 20) -> float:
    """Bytes this rank sends to others / s in one all-to-all of ``per_peer`` bytes per peer."""
    import torch
    tp = comm.topology.tp_size
    send = torch.ones(per_peer * tp, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    splits = [per_peer] * tp
    best = float("inf")
    for _ in range(3):
        comm.agree(None)
        start = time.perf_counter()
        comm.all_to_all_bytes(recv, splits, send, splits)
        if send.is_cuda:
            torch.cuda.synchronize(send.device)
        best = min(best, time.perf_counter() - start)
    return per_peer * (tp - 1) / best / 1e9


def tp_bench(comm: "Comm", model: str, device: str, *, repeat: int = 2, cold_repeat: int = 1,
             states: tuple[str, ...] = ("warm", "cold")) -> dict[str, Any]:
    """Every mode x state x repeat on every rank at once; rank 0's result has all ranks."""
    import torch
    from pploader.io.transfer.exchange import auto_exchange_cost
    from pploader.planning.checkpoint import open_checkpoint
    from pploader.report import proc_io
    from pploader.stage import load_stage, plan_stage
    from pploader.bench.cuda import evict, warm
    topo = comm.topology
    paths = [str(p) for p in open_checkpoint(model).paths.values()]
    kind = device.partition(":")[0]
    ring = None
    if kind == "cuda":
        from pploader.io.device import PinnedRing
        ring = PinnedRing(lazy=False)
    reference: Optional[dict[str, torch.Tensor]] = None
    link = _link_gbps(comm, device)
    rows: list[dict] = []
    for state in states:
        for trial in range(repeat if state == "warm" else cold_repeat):
            for mode in MODES:
                if comm.rank == 0:
                    (warm if state == "warm" else evict)(paths)
                comm.agree(None)
                auto = auto_exchange_cost(paths, kind) if mode == "auto" else None
                cost = {"direct": None, "redistribute": 0.5}.get(mode) if auto is None else \
                    float(comm.agree(None, auto[0])[0])  # rank 0's value on every rank
                staged = plan_stage(model, topo, exchange_cost=cost)
                comm.agree(None)
                before = proc_io().get("rchar", 0)
                start = time.perf_counter()
                res = load_stage(staged, device=device, ring=ring,
                                 comm=comm if cost is not None else None)
                wall = time.perf_counter() - start
                rchar = proc_io().get("rchar", 0) - before
                if reference is None:
                    reference = res.state_dict
                    same = True
                else:
                    same = res.state_dict.keys() == reference.keys() and all(
                        torch.equal(v.view(torch.uint8), reference[k].view(torch.uint8))
                        for k, v in res.state_dict.items())
                ex = staged.plan.redistribute
                row = {"state": state, "trial": trial, "mode": mode, "rank": topo.rank,
                       "exchange_cost": cost, "resident": None if auto is None else
                       round(auto[1], 4), "seconds": round(res.report.seconds, 4),
                       "wall_s": round(wall, 4), "read_bytes": res.stats.read_bytes,
                       "rchar": rchar, "ideal_bytes": staged.plan.ideal_bytes,
                       "gbps": round(staged.plan.ideal_bytes / res.report.seconds / 1e9, 3),
                       "exchanged_tensors": len(ex.targets) if ex else 0,
                       "bitwise_equal_direct": bool(same),
                       **res.report.extra.get("redistribute", {})}
                del res
                rows += comm.agree(None, row)
                if comm.rank == 0:
                    r = [x for x in rows[-topo.world_size:]]
                    print(f"[tp{topo.tp_size}] {state} {trial} {mode:12s} " + " | ".join(
                        f"r{x['rank']} {x['seconds']:.3f}s {x['gbps']:.2f}GB/s "
                        f"{x['read_bytes'] / x['ideal_bytes']:.3f}x" for x in r)
                        + f" eq={all(x['bitwise_equal_direct'] for x in r)}", flush=True)
    return {"tp": topo.tp_size, "device": device, "link_gbps_per_rank": round(link, 2),
            "rows": rows}


def main(argv: Optional[list[str]] = None) -> int:
    from pploader.distributed.bootstrap import init_distributed
    from pploader.distributed.comm import Comm
    from pploader.planning.topology import Topology
    p = argparse.ArgumentParser(prog="python -m benchmarks.tp_gpu_loads")
    p.add_argument("--model", required=True)
    p.add_argument("--repeat", type=int, default=2, help="warm repeats")
    p.add_argument("--cold-repeat", type=int, default=1)
    p.add_argument("--states", default="warm,cold")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    launch = init_distributed(backend="nccl" if args.device == "cuda" else "gloo",
                              timeout_s=600)
    device = "cpu"
    if args.device == "cuda":
        import torch
        local = int(os.environ.get("LOCAL_RANK", launch.rank))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    topo = Topology.for_world(launch.world_size, launch.rank, tp=launch.world_size)
    comm = Comm(topo, timeout_s=600)
    try:
        out = tp_bench(comm, args.model, device, repeat=args.repeat, cold_repeat=args.cold_repeat,
                       states=tuple(s for s in args.states.split(",") if s))
        if comm.rank == 0:
            text = json.dumps(out)
            if args.out:
                with open(args.out, "w") as fh:
                    fh.write(text)
            else:
                print(text)
    finally:
        comm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
