"""Sweep of the generic family over transformers' image-text-to-text mapping (the numbers in
docs/families.md, "Vision-language models").

For each model type: the tiny config of tests/sweep_shrink.py, built on the CPU and saved twice
(``save_pretrained`` and ``save_original_format=False``); each copy planned at PP = 2, 3, 4,
checked by ``generic_sweep.exactness_check`` at PP = 4 (per stage, the names its layers run
with equal the layer names it loads; every stored tensor loaded), and planned at PP=2 x TP=2
(derived, or the tensor refused). Run::

    PYTHONPATH=$PWD python tests/vl_sweep.py [--types a,b] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import generic_sweep


def vl_types() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import \
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as names
    return {t: a if isinstance(a, str) else a[0] for t, a in sorted(names.items())}


def _naming(model: Any, path: Path) -> str:
    from pploader.planning.checkpoint import open_checkpoint
    from pploader.planning.plan import plan_all
    from pploader.planning.spec import load_spec
    spec, index = load_spec(path), open_checkpoint(path)
    for pp in (2, 3, 4):
        plan_all(spec, index, pp)
    generic_sweep.exactness_check(model, spec, index, min(4, spec.num_layers))
    try:
        plan_all(spec, index, 2, 2)
        return "exact; TP=2 derived"
    except Exception as exc:  # noqa: BLE001 - a refusal names its tensor
        return f"exact; TP=2 refused: {getattr(exc, 'tensor', None) or exc}"


def check(model_type: str, arch: str, root: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"type": model_type, "architecture": arch}
    try:
        model = generic_sweep._checkpoint(model_type, arch, root / "original")
        model.save_pretrained(root / "transformers", max_shard_size="40KB",
                              save_original_format=False)
    except Exception as exc:  # noqa: BLE001 - transformers cannot build it tiny on the CPU
        return {**row, "built": f"{type(exc).__name__}: {exc}"[:160]}
    for naming in ("original", "transformers"):
        try:
            row[naming] = _naming(model, root / naming)
        except Exception as exc:  # noqa: BLE001 - recorded: a refusal or a failed check
            row[naming] = f"{type(exc).__name__}: {exc}"[:240]
    return row


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.disable(logging.WARNING)
    types = vl_types()
    if args.types:
        types = {t: types[t] for t in args.types.split(",")}
    rows = []
    for model_type, arch in types.items():
        with tempfile.TemporaryDirectory() as tmp:
            row = check(model_type, arch, Path(tmp))
        rows.append(row)
        print(json.dumps(row)[:400], flush=True)
    exact = [r for r in rows if all(str(r.get(n, "")).startswith("exact")
                                    for n in ("original", "transformers"))]
    print(f"{len(rows)} types, {sum('built' not in r for r in rows)} built, "
          f"{len(exact)} exact in both namings")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
