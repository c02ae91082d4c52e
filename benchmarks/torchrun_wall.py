"""What the user waits for (``python -m benchmarks.gpu_field --cli-wall``): the wall time of
``torchrun --nproc_per_node=N -m pploader load --device cuda`` next to a bare torchrun script
that only imports torch and starts NCCL (the floor every torchrun job pays), for a tiny
checkpoint and for a real-size one, warm and cold; the API's own load seconds (rank reports
of ``--json``) beside them. Trials alternate so host drift hits both alike.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

__all__ = ["cli_wall", "BARE_SCRIPT"]

BARE_SCRIPT = """\
import os, torch, torch.distributed as dist
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
dist.barrier()
dist.destroy_process_group()
"""


def _torchrun(nproc: int, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}"] + args


def _timed(cmd: list[str], env: dict) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    return time.perf_counter() - t0, p.returncode, p.stdout + p.stderr[-2000:]


def _api_seconds(out: str) -> Optional[list[float]]:
    try:
        start = out.index("{")
        doc = json.loads(out[start:out.rindex("}") + 1])
        return [r.get("seconds") for r in doc["ranks"]]
    except (ValueError, KeyError, TypeError):
        return None


def cli_wall(tiny_dir: str, big_dir: str, nproc: int, trials: int,
             warm: Callable[[list[str]], float], evict: Callable[[list[str]], float]) -> list[dict]:
    """Rows: bare torchrun vs the CLI on the tiny model (``trials`` each, alternating), then
    the CLI on ``big_dir`` warm and cold (``trials`` each)."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               OMP_NUM_THREADS="1")
    bare = Path("/tmp/pploader_bare_nccl.py")
    bare.write_text(BARE_SCRIPT)
    rows: list[dict] = []

    def load(model: str) -> list[str]:
        return _torchrun(nproc, ["-m", "pploader", "load", "--model", model, "--pp", str(nproc),
                                 "--device", "cuda", "--no-pools", "--json"])

    for t in range(trials):
        for name, cmd in (("bare_torchrun_nccl", _torchrun(nproc, [str(bare)])),
                          ("cli_load_tiny", load(tiny_dir))):
            sec, rc, out = _timed(cmd, env)
            rows.append({"what": name, "trial": t, "wall_s": sec, "rc": rc,
                         "api_s": _api_seconds(out) if "cli" in name else None,
                         **({"tail": out[-600:]} if rc else {})})
            print(f"[cli-wall] {name:20s} trial {t}: {sec:.2f} s rc={rc}", flush=True)
    files = sorted(str(p) for p in Path(big_dir).glob("*.safetensors"))
    for t in range(trials):
        for cache in ("warm", "cold"):
            resident = warm(files) if cache == "warm" else evict(files)
            sec, rc, out = _timed(load(big_dir), env)
            rows.append({"what": f"cli_load_big_{cache}", "trial": t, "wall_s": sec, "rc": rc,
                         "resident_before": round(resident, 3), "api_s": _api_seconds(out),
                         **({"tail": out[-600:]} if rc else {})})
            print(f"[cli-wall] big {cache} trial {t}: {sec:.2f} s rc={rc} api "
                  f"{rows[-1]['api_s']}", flush=True)
    return rows
