"""SHA-256 of ``repr`` of plans over the real-scale layouts: a byte-for-byte plan check.

    python tests/plan_hashes.py [--root /tmp/scale-layouts] [--out FILE] [--compare FILE]

Run with the tree under test first on ``PYTHONPATH`` (or from its checkout). For every layout
under ``--root`` (``python tests/real_layouts.py --root DIR`` makes them) and every topology of
``TOPOLOGIES`` that suits it, one line per case: ``plan_all`` (every rank, with a fresh
CheckpointIndex) and a fresh single last rank (``plan_rank``); plus MTP drafts where the
model has MTP layers. A case that raises is hashed as its error's type and message, so
refusals are checked too. ``--compare`` diffs against an earlier ``--out`` (exit 1 on a
difference). Planning is deterministic, so equal hashes mean identical plans.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Callable

#: (pp, tp, ep, partition); a case whose sizes the model cannot take is hashed as its error
TOPOLOGIES: tuple[tuple[int, int, int, str], ...] = (
    (16, 1, 1, "even"), (1, 8, 1, "even"), (2, 8, 1, "even"), (8, 1, 8, "even"),
    (4, 1, 1, "even"), (1, 2, 1, "even"), (2, 2, 2, "even"), (4, 1, 1, "balanced"),
)
#: the large model's layouts besides PP16 are slow as plan_all: only its last rank there
SLOW_ALL = {("deepseek-v3", 2, 8, 1)}


def _digest(make: Callable[[], object]) -> str:
    """SHA-256 of repr of what ``make`` returns, or of its error (type and message)."""
    try:
        out = repr(make())
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        out = f"ERROR {type(exc).__name__}: {exc}"
    return hashlib.sha256(out.encode()).hexdigest()


def cases(model: Path) -> list[tuple[str, Callable[[], object]]]:
    """(case name, thunk) of every case for one layout directory."""
    from pploader.planning.checkpoint import open_checkpoint
    from pploader.planning.plan import make_windows, plan_all, plan_mtp, plan_rank
    from pploader.planning.spec import load_spec
    from pploader.planning.topology import Topology

    def spec_index():  # type: ignore[no-untyped-def]
        index = open_checkpoint(model)
        return load_spec(model).for_checkpoint(index.weight_map), index

    def one(pp: int, tp: int, ep: int, part: str) -> object:
        spec, index = spec_index()
        topo = Topology(pp, tp, ep, pp * tp * ep - 1)
        return plan_rank(spec, index, topo, make_windows(spec, index, pp, part)[topo.pp_rank])

    def every(pp: int, tp: int, ep: int, part: str) -> object:
        spec, index = spec_index()
        return plan_all(spec, index, pp, tp, ep, partition=part)

    def mtp(layer: int, tp: int) -> object:
        spec, index = spec_index()
        return plan_mtp(spec, index, layer, Topology(1, tp, 1, tp - 1))

    out: list[tuple[str, Callable[[], object]]] = []
    for pp, tp, ep, part in TOPOLOGIES:
        tag = f"{model.name} {pp}x{tp}x{ep} {part}"
        out.append((f"{tag} last-rank", lambda a=(pp, tp, ep, part): one(*a)))
        if (model.name, pp, tp, ep) not in SLOW_ALL:
            out.append((f"{tag} plan_all", lambda a=(pp, tp, ep, part): every(*a)))
    spec, _ = spec_index()
    for layer in range(spec.num_mtp_layers):
        for tp in (1, 8):
            out.append((f"{model.name} mtp{layer} tp{tp}", lambda a=(layer, tp): mtp(*a)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/scale-layouts")
    ap.add_argument("--only", default="", help="comma separated layout names (default: all)")
    ap.add_argument("--out", help="write the hashes here too")
    ap.add_argument("--compare", help="an earlier --out: report differences, exit 1 on any")
    args = ap.parse_args()
    import pploader
    print(f"# pploader from {Path(pploader.__file__).parent}", file=sys.stderr)
    only = set(filter(None, args.only.split(",")))
    lines = []
    for model in sorted(p for p in Path(args.root).iterdir() if (p / "config.json").is_file()):
        if only and model.name not in only:
            continue
        for name, make in cases(model):
            t0 = time.perf_counter()
            line = f"{_digest(make)}  {name}"
            print(line, f"({time.perf_counter() - t0:.1f} s)", flush=True)
            lines.append(line)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    if args.compare:
        old = dict(ln.split("  ", 1)[::-1] for ln in Path(args.compare).read_text().splitlines())
        new = dict(ln.split("  ", 1)[::-1] for ln in lines)
        diff = [k for k in new if k in old and old[k] != new[k]]
        print(f"# {len(new)} case(s), {len([k for k in new if k in old])} compared, "
              f"{len(diff)} differ" + "".join(f"\n#   DIFFERS: {k}" for k in diff))
        sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
