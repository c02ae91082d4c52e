"""The record of the last green ``pytest -m gpu`` run, and the one definition of the GPU path.

CI has no GPU, so nothing there runs the GPU tests. Instead ``.ci/gpu_check.sh`` (on a
2-GPU machine) runs them and, when they are green, writes ``tests/gpu/LAST_RUN``: the commit,
date, device, pass counts and a digest of the GPU-path sources. The CPU test
``tests/gpu/test_gpu_stale.py`` recomputes the digest and fails when those sources changed since
that run, so a change to the GPU path cannot land without a GPU run.

The GPU-path sources (``gpu_path_sources``), defined here and nowhere else:
- every ``pploader/**/*.py`` whose text matches ``GPU_PATH_PATTERN`` (``cuda``,
  ``DeviceLoader``, ``PinnedRing``, ``nccl``, ``pin_memory``; ``open_backend(``: a call or
  definition that may dispatch to the CUDA read backend; ``def materialise(``: the shared step
  that backend runs on device tensors), except the benchmark modules
  (``bench*.py``, ``*_bench.py``: ``pytest -m gpu`` does not run them; their numbers live in
  docs/benchmarks-gpu.md); ``pploader/bench/`` is a folder, not such a module: its matching
  modules count;
- the modules of the repository's ``benchmarks/`` (harnesses, not in the wheel) that the GPU
  tests (``tests/gpu/*.py``) import, directly or through another ``benchmarks`` module;
- the GPU tests and their fixtures: ``tests/gpu/test_gpu.py``, ``tests/bind_models.py``,
  ``tests/conftest.py``;
- this file (a change to the definition is a change to the guard).

A file that starts or stops matching changes the set, hence the digest: that also needs a run.

Usage (``.ci/gpu_check.sh`` does this)::

    python3 tests/gpu/last_run.py record JUNIT_XML --device "2x NVIDIA H100" [--commit SHA]
    python3 tests/gpu/last_run.py check      # exit 1 (and say which files) when stale
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAST_RUN = Path(__file__).resolve().parent / "LAST_RUN"
GPU_PATH_PATTERN = re.compile(
    r"cuda|DeviceLoader|PinnedRing|nccl|pin_memory|open_backend\(|def materialise\(")
GPU_TESTS = ("tests/gpu/test_gpu.py", "tests/bind_models.py", "tests/conftest.py",
             "tests/gpu/last_run.py")
MIN_GPUS = 2
HOW_TO_FIX = ("run `./.ci/gpu_check.sh` on a 2-GPU machine (it runs `pytest -m gpu` and "
              "writes tests/gpu/LAST_RUN when green) and commit tests/gpu/LAST_RUN")


def _is_bench(path: Path) -> bool:
    return path.name.startswith("bench") or path.stem.endswith("_bench")


_HARNESS_IMPORT = re.compile(r"^\s*(?:from\s+benchmarks(?:\.(\w+))?\s+import\s+([\w ,()]+)"
                             r"|import\s+benchmarks\.(\w+))", re.M)


def harness_imports(text: str, root: Path = ROOT, relative: bool = False) -> set[str]:
    """``benchmarks/NAME.py`` paths that ``text`` imports (``from benchmarks.x import``,
    ``from benchmarks import x``, ``import benchmarks.x``; with ``relative``, the text of a
    harness, also ``from .x import``)."""
    names: set[str] = set()
    for sub, listed, plain in _HARNESS_IMPORT.findall(text):
        if plain or sub:
            names.add(plain or sub)
        else:
            names.update(n.split(" as ")[0].strip(" ()") for n in listed.split(","))
    if relative:
        names.update(re.findall(r"^\s*from\s+\.(\w+)\s+import", text, re.M))
    return {f"benchmarks/{n}.py" for n in names if n and (root / "benchmarks" / f"{n}.py").exists()}


def gpu_harnesses(root: Path = ROOT) -> list[str]:
    """The benchmarks/ modules the GPU tests import, and those these import (transitively)."""
    todo = sorted((root / "tests" / "gpu").glob("*.py"))
    found: set[str] = set()
    while todo:
        path = todo.pop()
        text = path.read_text(encoding="utf-8")
        for rel in sorted(harness_imports(text, root, path.parent.name == "benchmarks") - found):
            found.add(rel)
            todo.append(root / rel)
    return sorted(found)


def gpu_path_sources(root: Path = ROOT) -> list[str]:
    """Repository-relative paths of the GPU-path sources (sorted)."""
    found = [p for p in sorted((root / "pploader").rglob("*.py"))
             if not _is_bench(p) and GPU_PATH_PATTERN.search(p.read_text(encoding="utf-8"))]
    rel = [p.relative_to(root).as_posix() for p in found] + gpu_harnesses(root)
    return sorted(rel + [t for t in GPU_TESTS if (root / t).exists()])


def file_digests(root: Path = ROOT) -> dict[str, str]:
    """sha256 of each GPU-path source (line endings normalised)."""
    return {rel: hashlib.sha256((root / rel).read_bytes().replace(b"\r\n", b"\n")).hexdigest()
            for rel in gpu_path_sources(root)}


def sources_digest(files: dict[str, str]) -> str:
    """One digest over the set of files and their contents."""
    return hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in sorted(files.items()))
                          .encode()).hexdigest()


def junit_counts(junit_xml: Path) -> dict[str, int]:
    """passed / failed / errors / skipped from pytest's ``--junitxml`` report."""
    root = ET.parse(junit_xml).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) for s in suites)
    errors = sum(int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return {"passed": tests - failed - errors - skipped, "failed": failed, "errors": errors,
            "skipped": skipped}


def record(junit_xml: Path, device: str, gpus: int, commit: str, root: Path = ROOT,
           out: Path = LAST_RUN) -> dict:
    """Write LAST_RUN for a green run; raise SystemExit (nothing written) otherwise."""
    counts = junit_counts(junit_xml)
    if counts["failed"] or counts["errors"] or counts["passed"] == 0:
        raise SystemExit(f"not recording: pytest -m gpu was not green: {counts}")
    if counts["skipped"] or gpus < MIN_GPUS:
        raise SystemExit(f"not recording: {counts['skipped']} GPU tests skipped on {gpus} GPU(s); "
                         f"the record needs every GPU test to run ({MIN_GPUS} GPUs)")
    files = file_digests(root)
    data = {"commit": commit, "date": datetime.datetime.now(datetime.timezone.utc)
            .strftime("%Y-%m-%dT%H:%M:%SZ"), "device": device, "gpus": gpus, **counts,
            "sources_sha256": sources_digest(files), "sources": files}
    out.write_text(json.dumps(data, indent=1) + "\n")
    return data


def stale_files(root: Path = ROOT, last_run: Path = LAST_RUN) -> tuple[list[str], dict]:
    """(GPU-path files added, removed or changed since the recorded run, the record)."""
    data = json.loads(last_run.read_text())
    now, then = file_digests(root), data.get("sources", {})
    changed = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
    if not changed and sources_digest(now) != data.get("sources_sha256"):
        changed = ["(digest mismatch)"]
    return changed, data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="write LAST_RUN from a green junit report")
    rec.add_argument("junit_xml", type=Path)
    rec.add_argument("--device", required=True)
    rec.add_argument("--gpus", type=int, required=True)
    rec.add_argument("--commit", default="unknown")
    rec.add_argument("--copy-to", type=Path, default=None, help="also write LAST_RUN here")
    sub.add_parser("check", help="exit 1 when the GPU-path sources changed since LAST_RUN")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        data = record(args.junit_xml, args.device, args.gpus, args.commit)
        if args.copy_to is not None:
            args.copy_to.mkdir(parents=True, exist_ok=True)
            (args.copy_to / "LAST_RUN").write_text(LAST_RUN.read_text())
        print(LAST_RUN.read_text())
        print(f"recorded: {data['passed']} passed on {data['device']}")
        return 0
    if not LAST_RUN.exists():
        print(f"no tests/gpu/LAST_RUN: {HOW_TO_FIX}")
        return 1
    changed, data = stale_files()
    if changed:
        print(f"GPU-path sources changed since the last GPU run ({data.get('commit')}, "
              f"{data.get('date')}): {', '.join(changed)}\n{HOW_TO_FIX}")
        return 1
    print(f"GPU record current: {data['passed']} passed on {data['device']} ({data['date']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
