"""``pploader bench``'s arguments checked before anything is written or measured: value
types (argparse), the synthetic checkpoint's shape, output paths, free space.

Each refusal is a ``UsageError`` naming the flag (``pploader`` exits 2).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from ..cli_args_checks import check_writable_dir
from ..errors import UsageError

__all__ = ["check_bench_outputs", "check_bench_plan", "read_rendered", "MAX_SIZE_GB",
           "MAX_PLAN_TENSORS"]

GB = 1e9

#: the largest synthetic checkpoint ``bench`` writes (GB)
MAX_SIZE_GB = 100_000.0

#: the largest headers-only checkpoint for the planning timing (tensors)
MAX_PLAN_TENSORS = 2_000_000


def _gigabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB") from None
    if not 0 < value <= MAX_SIZE_GB:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text}: the size must be in (0, {MAX_SIZE_GB:g}] "
                                         "GB, e.g. 4.3")
    return value


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _scale(text: str) -> int:
    value = _whole(text)
    if value != 0 and not 2 <= value <= 1 << 20:
        raise argparse.ArgumentTypeError(f"{value}: give 0 (skip) or a factor of 2 or more")
    return value


def _tensors(text: str) -> int:
    value = _whole(text)
    if not 0 <= value <= MAX_PLAN_TENSORS:
        raise argparse.ArgumentTypeError(f"{value}: give 0 (skip) to {MAX_PLAN_TENSORS}")
    return value


def read_rendered(path: str) -> dict:
    """A document saved with ``--json``, for ``--render`` (one line when it is not one)."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except OSError as exc:
        raise UsageError(f"--render {path}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, RecursionError) as exc:
        raise UsageError(f"--render {path}: not a JSON document ({exc})") from None
    needed = ("config", "rows", "machine", "checkpoints")
    if not isinstance(doc, dict) or any(k not in doc for k in needed):
        raise UsageError(f"--render {path}: not a document saved by `pploader bench --json` "
                         f"(it needs {', '.join(needed)})")
    return doc


def check_bench_outputs(args: argparse.Namespace) -> None:
    """--markdown / --plot can be written (their directories probed now, not after the
    measurements)."""
    for flag, path in (("--markdown", args.markdown), ("--plot", args.plot)):
        if path:
            if os.path.isdir(path):
                raise UsageError(f"{flag} {path}: is a directory; give a file name")
            check_writable_dir(os.path.dirname(os.path.abspath(path)), flag)


def check_bench_plan(args: argparse.Namespace) -> None:
    """The synthetic checkpoint can be shaped and written: pp <= layers, the size holds the
    layers, and --dir has room for every checkpoint the run writes."""
    from .data import llama_shape
    if args.pp > args.layers:
        raise UsageError(f"--pp {args.pp} is more stages than --layers {args.layers}: give "
                         f"--pp {args.layers} or fewer")
    sizes = [args.size_gb] + ([args.size_gb / args.rss_scale] if args.rss_scale else [])
    for size in sizes:
        try:
            llama_shape(int(size * GB), args.layers)
        except ValueError as exc:
            flag = "--size-gb" if size == args.size_gb else "--rss-scale"
            raise UsageError(f"{flag}: {exc}; give a larger --size-gb or fewer --layers"
                             ) from None
    if Path(args.dir).resolve() == Path("/"):
        raise UsageError("--dir /: give a directory of its own (the run deletes what it writes)")
    from ..outputs import claim_output  # new, empty or an earlier bench's: nothing else touched
    root = claim_output(args.dir, "--dir", command="bench", reuse=True).path
    reused = sum(p.stat().st_size for p in root.glob("llama-*/*.safetensors") if p.is_file()) \
        if root.is_dir() else 0
    needed = int(sum(sizes) * GB) - reused
    free = shutil.disk_usage(next(p for p in [root, *root.parents] if p.exists())).free
    if needed > free:
        raise UsageError(f"--dir {root}: the checkpoints need {needed / GB:.2f} GB more and "
                         f"{free / GB:.2f} GB is free; give a smaller --size-gb, --rss-scale 0 "
                         "or another --dir")
