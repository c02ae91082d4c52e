"""Per-rank reports: what each rank planned and did, one table on rank 0, JSON, progress."""
from __future__ import annotations

import shutil
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence, TextIO

__all__ = ["RankReport", "format_table", "format_bytes", "peak_rss_bytes", "reset_peak_rss",
           "current_rss_bytes", "proc_io", "ProgressBar", "plan_table"]


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM)."""
    return _status_kb("VmHWM")


def current_rss_bytes() -> int:
    return _status_kb("VmRSS")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs); False when not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def proc_io() -> dict[str, int]:
    """/proc/self/io counters (rchar = bytes read through read syscalls, cache hits included)."""
    out = {}
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                k, v = line.split(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


@dataclass
class RankReport:
    """One rank's load, in the stable JSON form documented in docs/usage.md."""

    rank: int
    pp_rank: int
    tp_rank: int
    ep_rank: int
    start_layer: int
    end_layer: int
    tensors: int
    ideal_bytes: int
    read_bytes: int
    header_bytes: int
    seconds: float
    peak_rss_bytes: int
    rss_growth_bytes: int = 0
    files: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.ideal_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["gb_per_s"] = round(self.gbps, 3)
        out["read_over_ideal"] = round(self.read_bytes / self.ideal_bytes, 4) \
            if self.ideal_bytes else None
        return out


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([line, "-" * len(line), *body])


def format_table(reports: Sequence[dict]) -> str:
    """The per-rank table printed by rank 0 after ``pploader load``."""
    rows = []
    for r in reports:
        ideal = r["ideal_bytes"]
        rows.append([str(r["rank"]), f"{r['pp_rank']}/{r['tp_rank']}/{r['ep_rank']}",
                     f"{r['start_layer']}-{r['end_layer'] - 1}", str(r["tensors"]),
                     format_bytes(ideal), format_bytes(r["read_bytes"]),
                     f"{r['read_bytes'] / ideal:.3f}" if ideal else "-",
                     f"{r['seconds']:.2f}", f"{r.get('gb_per_s', 0):.2f}",
                     format_bytes(r["peak_rss_bytes"])])
    total_ideal = sum(r["ideal_bytes"] for r in reports)
    total_read = sum(r["read_bytes"] for r in reports)
    wall = max((r["seconds"] for r in reports), default=0.0)
    rows.append(["all", "", "", str(sum(r["tensors"] for r in reports)),
                 format_bytes(total_ideal), format_bytes(total_read),
                 f"{total_read / total_ideal:.3f}" if total_ideal else "-", f"{wall:.2f}",
                 f"{total_ideal / wall / 1e9:.2f}" if wall else "-", ""])
    return _table(["rank", "pp/tp/ep", "layers", "tensors", "ideal", "read", "read/ideal",
                   "sec", "GB/s", "peak RSS"], rows)


def plan_table(summaries: Sequence[dict]) -> str:
    """The per-rank table printed by ``pploader plan``."""
    rows = [[str(s["rank"]), f"{s['pp_rank']}/{s['tp_rank']}/{s['ep_rank']}",
             f"{s['start_layer']}-{s['end_layer'] - 1}",
             ("E" if s["has_embed"] else "") + ("H" if s["has_head"] else ""),
             "-" if s["experts"] is None else f"{s['experts'][0]}-{s['experts'][1] - 1}",
             str(s["num_tensors"]), format_bytes(s["ideal_bytes"]),
             format_bytes(s["planned_read_bytes"]), str(len(s["files"]))] for s in summaries]
    return _table(["rank", "pp/tp/ep", "layers", "globals", "experts", "tensors", "ideal",
                   "planned read", "files"], rows)


class ProgressBar:
    """Rank 0's job-wide progress bar (tqdm), fed by a callable returning bytes loaded so far.

    A thread polls ``current`` every ``interval_s``; the bar is closed (its last line
    written and ``stream`` flushed) when the block ends, so tables printed afterwards follow it.
    """

    def __init__(self, total_bytes: int, current: Callable[[], int], *,
                 stream: TextIO = sys.stderr, interval_s: float = 0.5,
                 enabled: Optional[bool] = None) -> None:
        self.total, self.current, self.stream, self.interval = total_bytes, current, stream, \
            interval_s
        self.enabled = stream.isatty() if enabled is None else enabled
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._bar: Any = None

    def _poll(self, final: bool = False) -> None:
        try:
            done = self.total if final else min(self.current(), self.total)
        except (RuntimeError, OSError):
            return
        if done > self._bar.n:
            self._bar.update(done - self._bar.n)

    def __enter__(self) -> "ProgressBar":
        if self.enabled:
            from tqdm import tqdm
            sys.stdout.flush()
            self._bar = tqdm(total=self.total, desc="pploader", unit="B", unit_scale=True,
                             unit_divisor=1024, file=self.stream, mininterval=self.interval,
                             ncols=min(100, shutil.get_terminal_size((100, 20)).columns or 100),
                             nrows=20, leave=True)

            def loop() -> None:
                while not self._stop.wait(self.interval):
                    self._poll()
            self._thread = threading.Thread(target=loop, name="pploader-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if exc_type is None:
                self._poll(final=True)
            self._bar.close()
            self.stream.flush()
