"""Tables, targets, JSON, Markdown and the plot of ``pploader bench`` (pure over its rows).

Byte ratios are over each rank's ideal bytes: ``acct`` is the method's own accounting (the
reader's bytes for pploader, the preadv total for raw, every tensor get_tensor returned for
read-all), ``rchar`` the /proc/self/io read-syscall bytes (mmap faults do not show there),
``disk`` its /proc/self/io read_bytes (storage reads it caused; 0 when warm), ``cache+`` the
page-cache residency the run added to the checkpoint files (mincore; ranks alone only).
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Iterable, Optional, Sequence

__all__ = ["render", "summarize", "targets", "text_tables", "markdown_report", "plot"]

GB = 1e9
MiB = 1 << 20


def _wall(rows: Sequence[dict], mode: str) -> float:
    if mode == "alone":
        return max(r["seconds"] for r in rows)
    return max(r["t_end"] for r in rows) - min(r["t_start"] for r in rows)


def _best(rows: Iterable[dict]) -> dict[tuple, list[dict]]:
    """(size, cache, mode, method) -> per-rank rows, best of the repetitions: per rank for
    ranks alone (each is its own experiment, as on its own node), the repetition with the best
    wall for ranks together (they share one node and one page cache)."""
    reps: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        reps[(r["size"], r["cache"], r["mode"], r["method"])][r["rep"]].append(r)
    out = {}
    for key, by_rep in reps.items():
        if key[2] == "alone":
            by_rank: dict[int, dict] = {}
            for r in (r for rows_ in by_rep.values() for r in rows_):
                if r["rank"] not in by_rank or r["seconds"] < by_rank[r["rank"]]["seconds"]:
                    by_rank[r["rank"]] = r
            out[key] = [by_rank[k] for k in sorted(by_rank)]
        else:
            rep = min(by_rep, key=lambda k: _wall(by_rep[k], key[2]))
            out[key] = sorted(by_rep[rep], key=lambda r: r["rank"])
    return out


def _rank_line(r: dict, mode: str) -> dict:
    ideal = r["ideal_bytes"] or 1
    added = r["resident_after"] - r["resident_before"] if mode == "alone" else None
    return {"rank": r["rank"], "layers": f"{r['start_layer']}-{r['end_layer'] - 1}",
            "ideal_bytes": r["ideal_bytes"], "acct": r["accounted_bytes"] / ideal,
            "rchar": r["rchar"] / ideal, "disk": r["disk_read_bytes"] / ideal,
            "cache_added": None if added is None else added / ideal,
            "seconds": r["seconds"], "gbps": r["ideal_bytes"] / r["seconds"] / GB,
            "cpu_s": r.get("cpu_s"), "rss_peak": r["rss_peak"], "rss_idle": r["rss_idle"],
            "rss_over": r["rss_peak"] - r["rss_idle"] - r["kept_bytes"],
            "fingerprint": r["fingerprint"]}


def summarize(doc: dict) -> list[dict]:
    """One entry per (size, cache, mode, method): per-rank lines and a job total."""
    cfg = doc["config"]
    order = {"size": ["main"], "cache": cfg["caches"], "mode": cfg["modes"],
             "method": cfg["methods"]}

    def rank(key: tuple) -> tuple:
        return tuple(order[k].index(v) if v in order[k] else len(order[k]) + hash(v) % 97
                     for k, v in zip(("size", "cache", "mode", "method"), key))

    out = []
    for (size, cache, mode, method), rows in sorted(_best(doc["rows"]).items(),
                                                    key=lambda kv: rank(kv[0])):
        lines = [_rank_line(r, mode) for r in rows]
        ideal = sum(r["ideal_bytes"] for r in rows)
        wall = _wall(rows, mode)
        total = {"rank": "all", "layers": "", "ideal_bytes": ideal,
                 "acct": sum(r["accounted_bytes"] for r in rows) / ideal,
                 "rchar": sum(r["rchar"] for r in rows) / ideal,
                 "disk": sum(r["disk_read_bytes"] for r in rows) / ideal,
                 "cache_added": (rows[0]["resident_after"] - rows[0]["resident_before"]) / ideal
                 if mode == "together" else None,
                 "seconds": wall, "gbps": ideal / wall / GB,
                 "cpu_s": sum(r.get("cpu_s") or 0.0 for r in rows),
                 "rss_peak": max(r["rss_peak"] for r in rows), "rss_idle": None,
                 "rss_over": max(r["rss_peak"] - r["rss_idle"] - r["kept_bytes"] for r in rows),
                 "fingerprint": ""}
        out.append({"size": size, "cache": cache, "mode": mode, "method": method,
                    "family": rows[0]["family"], "alloc": rows[0]["alloc"],
                    "window_bytes": rows[0]["extra"].get("window_bytes"),
                    "ranks": lines, "total": total})
    return out


def _find(summary: Sequence[dict], size: str, cache: str, mode: str, method: str
          ) -> Optional[dict]:
    for s in summary:
        if (s["size"], s["cache"], s["mode"], s["method"]) == (size, cache, mode, method):
            return s
    return None


def _fingerprint_problems(summary: Sequence[dict]) -> list[str]:
    seen: dict[tuple, dict[str, str]] = defaultdict(dict)
    for s in summary:
        for line in s["ranks"]:
            seen[(s["size"], line["rank"])][f"{s['method']}/{s['cache']}/{s['mode']}"] = \
                line["fingerprint"]
    return [f"size {size} rank {rank}: {fps}" for (size, rank), fps in sorted(seen.items())
            if len(set(fps.values())) > 1]


def targets(doc: dict, summary: Sequence[dict]) -> list[dict]:
    """The issue's targets, each with the measured value and PASS/MISS."""
    out: list[dict] = []

    def add(name: str, want: str, value: str, ok: Optional[bool], note: str = "") -> None:
        out.append({"target": name, "want": want, "measured": value,
                    "status": "n/a" if ok is None else "PASS" if ok else "MISS", "note": note})

    a_rows = [(s, ln) for s in summary if s["family"] == "pploader" and s["size"] == "main"
              for ln in s["ranks"]]
    if a_rows:
        acct = max(ln["acct"] for _, ln in a_rows)
        rchar = max(ln["rchar"] for _, ln in a_rows)
        add("pploader bytes read / ideal, every rank (reader accounting; rchar)", "<= 1.01",
            f"max {acct:.4f}; rchar max {rchar:.4f}", max(acct, rchar) <= 1.01)
        cold = [ln["disk"] for s, ln in a_rows if s["cache"] == "cold" and s["mode"] == "alone"]
        if cold:
            add("pploader storage reads / ideal, cold, ranks alone (read_bytes)", "(info)",
                f"max {max(cold):.4f}", None, "kernel read-ahead past a rank's last byte")
    for alloc in ("into", "owned"):
        for cache in ("warm", "cold"):
            for mode in ("alone", "together"):
                a = _find(summary, "main", cache, mode, f"a_{alloc}")
                c = _find(summary, "main", cache, mode, f"c_{alloc}")
                if a and c:
                    ratio = a["total"]["gbps"] / c["total"]["gbps"]
                    worst = min(x["gbps"] / y["gbps"] for x, y in zip(a["ranks"], c["ranks"]))
                    add(f"(a) vs (c), {alloc}, {cache}, ranks {mode}", ">= 0.90",
                        f"{ratio:.3f} (worst rank {worst:.3f}; {a['total']['gbps']:.2f} vs "
                        f"{c['total']['gbps']:.2f} GB/s)", ratio >= 0.9)
    for cache in ("cold", "warm"):
        for alloc in ("into", "owned"):
            a = _find(summary, "main", cache, "alone", f"a_{alloc}")
            b = _find(summary, "main", cache, "alone", f"b_{alloc}")
            if a and b:
                speed = b["total"]["seconds"] / a["total"]["seconds"]
                add(f"ranks alone, {cache}, {alloc}: wall of (b) / wall of (a)", ">= 2.5",
                    f"{speed:.2f}x ({b['total']['seconds']:.2f}s vs {a['total']['seconds']:.2f}s)",
                    speed >= 2.5)
    small = doc["config"].get("rss_scale", 0)
    for name in ("a_stream", "a_borrow", "a_into", "a_owned"):
        big = _find(summary, "main", "warm", "alone", name)
        little = _find(summary, f"1/{small}", "warm", "alone", name)
        if big and little:
            window = big["window_bytes"] or 0
            over_big, over_small = big["total"]["rss_over"], little["total"]["rss_over"]
            add(f"peak RSS over idle{' - kept' if name == 'a_owned' else ''}, {name}, "
                f"checkpoint x{small}", f"flat, <= window + 64 MiB = "
                f"{(window + 64 * MiB) / MiB:.0f} MiB",
                f"{over_small / MiB:.0f} -> {over_big / MiB:.0f} MiB",
                max(over_big, over_small) <= window + 64 * MiB)
    for alloc in ("into", "owned"):
        a, b = (_find(summary, "main", "warm", "alone", f"{f}_{alloc}") for f in ("a", "b"))
        if a and b:
            worse = [ln["rank"] for ln, lb in zip(a["ranks"], b["ranks"])
                     if ln["rss_peak"] >= lb["rss_peak"]]
            add(f"peak RSS of (a) below (b), {alloc}, every rank (warm, alone)", "below",
                f"max {a['total']['rss_peak'] / MiB:.0f} vs {b['total']['rss_peak'] / MiB:.0f} "
                "MiB", not worse)
    plan = doc.get("plan")
    if plan:
        add(f"plan --pp {plan['pp']} for {plan['tensors']} tensors", "<= 1 s",
            f"{plan['seconds']:.3f} s (index {plan['index_s']:.3f} + plan_all "
            f"{plan['plan_all_s']:.3f})", plan["seconds"] <= 1.0)
    bad = _fingerprint_problems(summary)
    measured = bool(summary)  # nothing measured (no rows): nothing passes
    add("same bytes from every method (crc of each tensor's ends)", "equal",
        "nothing measured" if not measured else "equal" if not bad else "; ".join(bad)[:300],
        not bad if measured else None)
    return out


_COLUMNS = ("method", "cache", "mode", "rank", "layers", "ideal GB", "acct/ideal",
            "rchar/ideal", "disk/ideal", "cache+/ideal", "sec", "cpu s", "GB/s",
            "peak RSS MiB", "RSS over MiB")


def _cells(s: dict, line: dict) -> list[str]:
    def ratio(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.3f}"
    return [s["method"], s["cache"], s["mode"], str(line["rank"]), line["layers"],
            f"{line['ideal_bytes'] / GB:.3f}", ratio(line["acct"]), ratio(line["rchar"]),
            ratio(line["disk"]), ratio(line["cache_added"]), f"{line['seconds']:.3f}",
            "-" if line["cpu_s"] is None else f"{line['cpu_s']:.3f}", f"{line['gbps']:.2f}",
            f"{line['rss_peak'] / MiB:.0f}", f"{line['rss_over'] / MiB:.0f}"]


def _rows_of(summary: Sequence[dict], size: str, per_rank: bool) -> list[list[str]]:
    out = []
    for s in summary:
        if s["size"] != size:
            continue
        if per_rank:
            out += [_cells(s, ln) for ln in s["ranks"]]
        out.append(_cells(s, s["total"]))
    return out


def _text(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def _md(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _sizes(summary: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(s["size"] for s in summary))


def text_tables(doc: dict, summary: Sequence[dict], checks: Sequence[dict]) -> str:
    parts = [f"pploader bench: {doc['command']}"]
    for size in _sizes(summary):
        ck = doc["checkpoints"].get(size, {})
        parts.append(f"\ncheckpoint {size}: {ck.get('data_bytes', 0) / GB:.2f} GB, "
                     f"{len(ck.get('files', []))} shards, shape {ck.get('shape')}")
        parts.append(_text(_COLUMNS, _rows_of(summary, size, per_rank=True)))
    parts.append("\ntargets:")
    parts.append(_text(("status", "target", "want", "measured"),
                       [[c["status"], c["target"], c["want"], c["measured"]] for c in checks]))
    return "\n".join(parts)


def markdown_report(doc: dict, summary: Sequence[dict], checks: Sequence[dict],
                    plot_path: Optional[str] = None) -> str:
    m = doc["machine"]
    out = [f"Run started {m.get('date_utc')} on {m.get('host')}: {m.get('cpus')} CPUs "
           f"({m.get('cpu')}), {m.get('mem_total_gib')} GiB RAM, kernel {m.get('kernel')}, "
           f"{m.get('filesystem')}, read_ahead_kb {m.get('read_ahead_kb')}; Python "
           f"{m.get('python')}, torch {m.get('torch')}, safetensors {m.get('safetensors')}. "
           f"Run time {doc.get('elapsed_s')} s.", "", "```", doc["command"], "```", ""]
    labels = doc["config"]["labels"]
    out += ["| method | what it does |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in labels.items()]
    out.append("")
    out += ["### Targets", "", _md(("status", "target", "want", "measured"),
                                   [[c["status"], c["target"], c["want"], c["measured"]]
                                    for c in checks]), ""]
    for size in _sizes(summary):
        ck = doc["checkpoints"].get(size, {})
        out += [f"### Checkpoint {size}: {ck.get('data_bytes', 0) / GB:.2f} GB, "
                f"{len(ck.get('files', []))} shards", "",
                f"Shape: `{json.dumps(ck.get('shape'))}`; shard bytes "
                f"{[round(b / GB, 3) for b in ck.get('file_bytes', [])]} GB.", "",
                _md(_COLUMNS, _rows_of(summary, size, per_rank=False)), "",
                "<details><summary>per rank</summary>", "",
                _md(_COLUMNS, _rows_of(summary, size, per_rank=True)), "", "</details>", ""]
    if plot_path:
        out += [f"![GB/s and bytes read per rank]({plot_path})", ""]
    return "\n".join(out)


def plot(summary: Sequence[dict], path: str) -> None:
    """Two rows (GB/s; bytes read / ideal) x one column per cache/mode, bars per rank."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    main = [s for s in summary if s["size"] == "main"]
    panels = list(dict.fromkeys((s["cache"], s["mode"]) for s in main))
    methods = list(dict.fromkeys(s["method"] for s in main))
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 7), squeeze=False)
    width = 0.8 / max(1, len(methods))
    for col, (cache, mode) in enumerate(panels):
        for i, method in enumerate(methods):
            s = _find(main, "main", cache, mode, method)
            if s is None:
                continue
            xs = [ln["rank"] + (i - (len(methods) - 1) / 2) * width for ln in s["ranks"]]
            moved = [ln["disk"] if (cache, mode) == ("cold", "alone") else ln["acct"]
                     for ln in s["ranks"]]
            axes[0][col].bar(xs, [ln["gbps"] for ln in s["ranks"]], width, label=method)
            axes[1][col].bar(xs, moved, width, label=method)
        axes[0][col].set_title(f"{cache} cache, ranks {mode}")
        axes[0][col].set_ylabel("GB/s of ideal bytes")
        axes[1][col].set_ylabel("storage reads / ideal" if (cache, mode) == ("cold", "alone")
                                else "bytes returned by the API / ideal")
        axes[1][col].axhline(1.0, color="k", lw=0.6)
        for row in (0, 1):
            axes[row][col].set_xlabel("PP rank")
            axes[row][col].set_xticks(sorted({ln["rank"] for s in main for ln in s["ranks"]}))
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(methods), fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(doc: dict, *, as_json: bool = False, markdown: Optional[str] = None,
           plot_path: Optional[str] = None, **_: object) -> int:
    """Print and write what was asked; exit code 1 when methods disagreed on the bytes."""
    summary = summarize(doc)
    checks = targets(doc, summary)
    doc = dict(doc, summary=summary, targets=checks)
    if plot_path:
        try:
            plot(summary, plot_path)
        except ImportError as exc:
            sys.stderr.write(f"pploader bench: --plot needs matplotlib (pip install "
                             f"'pploader[bench]'): {exc}\n")
            plot_path = None
    if markdown:
        link = os.path.relpath(plot_path, os.path.dirname(os.path.abspath(markdown))) \
            if plot_path else None
        with open(markdown, "w") as fh:
            fh.write(markdown_report(doc, summary, checks, link) + "\n")
    if as_json:
        json.dump(doc, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(text_tables(doc, summary, checks))
    if not doc.get("rows") and not doc.get("plan"):
        sys.stderr.write("pploader bench: measured nothing (no rows): no target can pass\n")
        return 1
    return 1 if any(c["status"] == "MISS" and c["target"].startswith("same bytes")
                    for c in checks) else 0
