"""Where a benchmark's numbers come from: CPU, memory, disk, file system, versions (one dict in
every ``pploader bench`` / ``--dcp`` document)."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

__all__ = ["machine_info"]


def machine_info(directory: Path) -> dict:
    """Where the numbers come from: CPU, memory, disk, file system, versions."""
    import safetensors
    import torch
    info: dict = {"date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "host": platform.node(), "kernel": platform.release(),
                  "cpus": os.cpu_count(), "python": platform.python_version(),
                  "torch": torch.__version__, "safetensors": safetensors.__version__}
    try:
        with open("/proc/cpuinfo") as fh:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in fh
                                if ln.startswith("model name")), "?")
        with open("/proc/meminfo") as fh:
            info["mem_total_gib"] = round(int(fh.readline().split()[1]) / 2**20, 1)
        st = os.stat(directory)
        dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        info["block_device"] = dev
        ra = Path(f"/sys/dev/block/{dev}/queue/read_ahead_kb")
        if not ra.exists():
            ra = Path(f"/sys/dev/block/{dev}/../queue/read_ahead_kb")
        if ra.exists():
            info["read_ahead_kb"] = int(ra.read_text())
        best = ""
        with open("/proc/mounts") as fh:
            for line in fh:
                src, mnt, fstype = line.split()[:3]
                if str(directory.resolve()).startswith(mnt) and len(mnt) >= len(best):
                    best, info["filesystem"] = mnt, f"{fstype} on {src} ({mnt})"
    except (OSError, StopIteration, ValueError):
        pass
    return info
