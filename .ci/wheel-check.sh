#!/usr/bin/env bash
# The wheel a user installs: build it (pip wheel --no-deps), install it into a fresh venv
# (torch's CPU wheel first), then from a temp dir outside the repository run
# `pploader make-tiny llama`, `pploader plan` and a 2-rank torchrun `pploader load`.
#   .ci/wheel-check.sh            # PPLOADER_TORCH overrides the torch pin (default torch==2.13.0)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/pploader-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
unset PYTHONPATH                       # only the installed wheel may be imported
step() { echo "[wheel-check $(date +%T)] $*"; }

step "fresh venv in $WORK"
python3 -m venv "$WORK/venv"
PY="$WORK/venv/bin/python"
"$PY" -m pip install -q --upgrade pip setuptools wheel
step "torch (CPU wheel) first"
"$PY" -m pip install -q "${PPLOADER_TORCH:-torch==2.13.0}"
step "build the wheel"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WORK/dist" "$ROOT"
WHEEL="$(ls "$WORK"/dist/pploader-*.whl)"
"$PY" - "$WHEEL" "$ROOT" <<'PY'
import sys, zipfile
from pathlib import Path
names = zipfile.ZipFile(sys.argv[1]).namelist()
need = ["pploader/py.typed", "pploader/tiny_configs/tiny-llama.json"]
missing = [n for n in need if n not in names]
assert not missing, f"wheel lacks {missing}"
assert any(n.endswith("LICENSE") for n in names), "wheel lacks LICENSE"
# no experiment harness: nothing of benchmarks/, no module named like one anywhere, and
# pploader/bench/ exactly as in the tree (what `pploader bench` runs)
root = Path(sys.argv[2])
harnesses = {p.name for p in (root / "benchmarks").glob("*.py") if p.name != "__init__.py"}
shipped = [n for n in names if n.startswith("benchmarks/") or n.rsplit("/", 1)[-1] in harnesses]
assert not shipped, f"wheel holds experiment harnesses: {shipped}"
bench = sorted(n for n in names if n.startswith("pploader/bench/") and n.endswith(".py"))
tree = sorted(p.relative_to(root).as_posix() for p in (root / "pploader/bench").glob("*.py"))
assert bench == tree, f"wheel's pploader/bench/ {bench} != the tree's {tree}"
print(f"wheel has {len(names)} files incl. {', '.join(need)} and LICENSE; "
      f"no harness of benchmarks/ ({len(harnesses)} checked)")
PY
step "install $(basename "$WHEEL")"
"$PY" -m pip install -q "$WHEEL"

cd "$WORK"                             # outside the repository from here on
"$PY" -c "import pploader, sys; assert '$ROOT' not in pploader.__file__, pploader.__file__"
step "pploader make-tiny llama"
"$WORK/venv/bin/pploader" make-tiny llama "$WORK/tiny"
step "pploader plan"
"$WORK/venv/bin/pploader" plan --model "$WORK/tiny" --pp 2 --tp 2 >/dev/null
"$WORK/venv/bin/pploader" plan --model "$WORK/tiny" --pp 2 --json | "$PY" -c \
  "import json, sys; d = json.load(sys.stdin); assert len(d['ranks']) == 2, d"
step "torchrun pploader load (2 ranks)"
OMP_NUM_THREADS=1 "$WORK/venv/bin/torchrun" --standalone --nproc_per_node=2 -m pploader load \
  --model "$WORK/tiny" --pp 2 --json > "$WORK/load.json"
"$PY" -c "import json; d = json.load(open('$WORK/load.json')); \
assert [r['rank'] for r in d['ranks']] == [0, 1] and all(r['read_bytes'] for r in d['ranks']), d"
step "ok"
