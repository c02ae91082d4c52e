"""What the generic family derives, for a before/after comparison of ``families/hf_meta.py``.

    PYTHONPATH=TREE python tests/derive_snapshot.py --out FILE [--tiny] [--compare OLD]

For every published config under ``tests/data/real_configs*`` (and, with ``--tiny``, the tiny
config of every causal-LM type of the sweep, tests/sweep_shrink.py), the ``MetaModel`` that
``hf_meta.derive`` returns (or its error's type and message) is pickled into ``FILE``.
``--compare`` loads an earlier ``--out`` (made with the other tree) and reports every config
whose MetaModel or family data (rules by pattern, closures by value) differs (exit 1 on any).
All configs are derived in this process (a build over 120 s is recorded as an error).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent



def _data(x: object) -> object:
    """``x`` as comparable, picklable data: callables by qualified name and closure values,
    shard rules by their fields, containers element by element."""
    from pploader.families.base import ShardRule
    if isinstance(x, ShardRule):
        return ("ShardRule", x.pattern, x.dim, x.pad, _data(x.segments), _data(x.units))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, _data({f.name: getattr(x, f.name)
                                         for f in dataclasses.fields(x) if f.compare}))
    if isinstance(x, (tuple, list)):
        return tuple(_data(v) for v in x)
    if isinstance(x, dict):
        return {k: _data(v) for k, v in x.items()}
    if callable(x) and not isinstance(x, type):
        cells = tuple(c.cell_contents for c in (getattr(x, "__closure__", None) or ()))
        return (getattr(x, "__qualname__", repr(x)), _data(cells))
    return x


def _family(cfg: dict) -> object:
    """The generic Family's data (see ``_data``; the layout of ``cfg`` as a value)."""
    from pploader.families.generic import family_for
    fam = family_for(cfg)
    out = {f: _data(getattr(fam, f)) for f in fam.__dataclass_fields__
           if f not in ("_compiled", "layout", "cache_dims")}
    out["layout"] = fam.layout(cfg)
    return out


def _derive(cfg: dict) -> object:
    """The MetaModel and the family data of ``cfg``, or the error as text."""
    import signal
    from pploader.families.hf_meta import derive

    def alarm(_sig: int, _frame: object) -> None:
        raise TimeoutError("over 120 s")
    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(120)
    try:
        return derive(cfg), _family(cfg)
    except Exception as exc:  # noqa: BLE001 - the error is what is compared
        return f"ERROR {type(exc).__name__}: {exc}"
    finally:
        signal.alarm(0)


def configs(tiny: bool) -> dict[str, dict]:
    """name -> config.json dict."""
    out = {}
    for folder in ("real_configs", "real_configs_generic"):
        for path in sorted((HERE / "data" / folder).glob("*.json")):
            out[path.stem] = json.loads(path.read_text())
    if tiny:
        sys.path.insert(0, str(HERE))
        import transformers
        from generic_sweep import causal_lm_types
        from sweep_shrink import model_config, tiny_config
        for model_type, arch in causal_lm_types().items():
            try:
                cls = getattr(transformers, arch)
                config = model_config(tiny_config(model_type), cls)
                config.architectures = [arch]
                out[f"tiny:{model_type}"] = json.loads(config.to_json_string())
            except Exception:  # noqa: BLE001 - not buildable: the sweep lists those
                continue
    return out


def _what(old: object, new: object) -> str:
    """Which part of two results differs: the MetaModel, family fields, or the error."""
    if not (isinstance(old, tuple) and isinstance(new, tuple)):
        return "error / outcome"
    parts = ["MetaModel"] if old[0] != new[0] else []
    parts += [f"family.{k}" for k in sorted(set(old[1]) | set(new[1]))
              if old[1].get(k) != new[1].get(k)]
    return ", ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--only", default="", help="comma separated config names")
    ap.add_argument("--compare")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(",")))
    results: dict[str, object] = {}
    for name, cfg in configs(args.tiny).items():
        if only and name not in only:
            continue
        results[name] = _derive(cfg)
        print(name, "error" if isinstance(results[name], str) else "ok", flush=True)
    Path(args.out).write_bytes(pickle.dumps(results))
    if args.compare:
        old = pickle.loads(Path(args.compare).read_bytes())
        diff = [n for n in results if n in old and old[n] != results[n]]
        print(f"# {len(results)} config(s), {len([n for n in results if n in old])} compared, "
              f"{len(diff)} differ" + "".join(f"\n#   DIFFERS: {n} ({_what(old[n], results[n])})"
                                               for n in diff))
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
