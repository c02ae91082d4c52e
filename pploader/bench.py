"""pploader bench (placeholder parser until the benchmark lands)."""
from __future__ import annotations

import argparse


def add_bench_parser(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("bench", help="benchmark pploader against read-all and raw preadv")
    p.add_argument("--size-gb", type=float, default=4.0)


def run_bench(args: argparse.Namespace) -> int:
    raise SystemExit("bench: not implemented yet")
