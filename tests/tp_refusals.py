"""Which serving engine defines a TP split for each architecture the sweep refuses at TP=2.

Reads the sweep's JSON (``tests/generic_sweep.py --json``) and, for every architecture whose
TP=2 plan is refused, looks up from the installed engines' own sources (no imports of them):

- vLLM: the architecture in ``vllm/model_executor/models/registry.py`` (a native model file,
  or ``_TRANSFORMERS_SUPPORTED_MODELS``: vLLM's transformers backend), or the version that
  removed it (``_PREVIOUSLY_SUPPORTED_MODELS``);
- SGLang: an ``EntryClass`` naming it in ``sglang/srt/models/*.py``;
- transformers: whether the model's config gives a ``base_model_tp_plan`` and the model
  supports vLLM's attention interface (``_supports_attention_backend``): what vLLM's
  transformers backend (``--model-impl transformers``) needs to split an architecture it has
  no model file for; and whether the transformers installed beside vLLM (which it requires in a
  range, e.g. ``<5.20`` for vLLM 0.32) has the model type at all: the backend builds the model
  from that transformers, so a type added later has no vLLM split; and (from pploader's own
  reason) whether the backend refuses to build the model, a layer's attention calling no
  attention interface.

Writes the markdown list of docs/families.md ("TP=2 refusals and the engines")::

    python tests/tp_refusals.py sweep.json --vllm VLLM_SITE_PACKAGES --sglang SGLANG_SITE_PACKAGES
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any, Optional


def vllm_registry(site: Path) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(native architecture -> model module, transformers-backend architectures -> module,
    removed architecture -> the version that removed it) of vLLM's registry."""
    tree = ast.parse((site / "vllm/model_executor/models/registry.py").read_text())
    tables: dict[str, dict[str, Any]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and \
                len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out = {}
            for k, v in zip(node.value.keys, node.value.values):
                if isinstance(k, ast.Constant) and isinstance(k.value, str):
                    value = ast.literal_eval(v) if not isinstance(v, ast.Dict) else None
                    out[k.value] = value[0] if isinstance(value, tuple) else value
            tables[node.targets[0].id] = out
    backend = tables.get("_TRANSFORMERS_SUPPORTED_MODELS", {})
    native = {k: v for name, t in tables.items() if name.endswith("_MODELS") and name not in (
        "_TRANSFORMERS_SUPPORTED_MODELS", "_TRANSFORMERS_BACKEND_MODELS",
        "_PREVIOUSLY_SUPPORTED_MODELS", "_OOT_SUPPORTED_MODELS") for k, v in t.items()}
    return native, backend, tables.get("_PREVIOUSLY_SUPPORTED_MODELS", {})


def sglang_models(site: Path) -> dict[str, str]:
    """Architecture -> SGLang model module, from each module's ``EntryClass``."""
    out: dict[str, str] = {}
    for path in sorted((site / "sglang/srt/models").glob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets):
                for n in ast.walk(node.value):
                    if isinstance(n, ast.Name):
                        out.setdefault(n.id, path.stem)
    return out


def hf_tp(arch: str) -> tuple[bool, bool]:
    """(the config gives a ``base_model_tp_plan``, the model supports vLLM's attention
    backend) of transformers' ``arch``."""
    import transformers
    cls = getattr(transformers, arch, None)
    if cls is None:
        return False, False
    config = cls.config_class  # class attributes: some defaults do not validate
    subs = getattr(config, "sub_configs", None) or {}
    plans = [getattr(c, "base_model_tp_plan", None) for c in (config, *subs.values())
             if isinstance(c, type)]
    return any(plans), bool(getattr(cls, "_supports_attention_backend", False))


def vllm_transformers(site: Path) -> tuple[str, frozenset[str]]:
    """(version, model types) of the transformers installed beside vLLM in ``site`` (its
    ``models/`` folders; no import)."""
    dist = sorted(site.glob("transformers-*.dist-info"))
    version = dist[-1].name[len("transformers-"):-len(".dist-info")] if dist else "?"
    models = site / "transformers" / "models"
    return version, frozenset(p.name for p in models.iterdir() if p.is_dir()) \
        if models.is_dir() else frozenset()


def verdict(arch: str, native: dict[str, str], backend: dict[str, str], removed: dict[str, str],
            sglang: dict[str, str], model_type: str = "",
            hf: tuple[str, frozenset[str]] = ("", frozenset()), reason: str = "",
            released: str = "") -> tuple[bool, str]:
    """(whether some engine splits it, the engine column's text); ``hf``: the transformers
    beside vLLM (:func:`vllm_transformers`), ``model_type`` the architecture's, ``reason``
    pploader's refusal, ``released`` the hand-written family planning the architecture's
    release naming (:func:`release_family`)."""
    if "transformers backend refuses to build it" in reason:
        # pploader's hf_fusers.unbuilt_layers: a layer whose attention calls no attention
        # interface (vLLM's own check, with the transformers it runs: tests/vllm/fuser_truth.py)
        return False, ("no engine: vLLM's transformers backend refuses to build it (a layer's "
                       "attention does not call transformers' attention interface); " +
                       ("no SGLang model" if arch not in sglang else f"SGLang `{sglang[arch]}`"))
    found = []
    if arch in native:
        found.append(f"vLLM `{native[arch]}`")
    if arch in sglang:
        found.append(f"SGLang `{sglang[arch]}`")
    plan, attn = hf_tp(arch)
    version, types = hf
    lacking = bool(types) and model_type.replace("-", "_") not in types
    if (arch in backend or (plan and attn and not found)) and lacking:
        if not found:
            return False, (f"no engine: vLLM's transformers backend builds the model from the "
                           f"transformers vLLM requires ({version} installed with it), which "
                           f"has no `{model_type}`; no SGLang model")
    elif arch in backend or (plan and attn and not found):
        found.append("vLLM's transformers backend (the model's `base_model_tp_plan`)")
    if found and released:
        # the engines load only the model's release naming, which a hand-written family plans
        # (zaya, inkling); the naming transformers writes, which the sweep plans, none loads
        return False, (f"no engine loads this (transformers') naming: {', '.join(found)} "
                       f"load(s) only the release naming, which pploader plans with the "
                       f"hand-written family `{released}`")
    if found:
        return True, "split by " + ", ".join(found)
    why = ["not in vLLM's registry" + (f" (removed in {removed[arch]})" if arch in removed
                                       else ""), "no SGLang model"]
    why.append("its transformers config has no `base_model_tp_plan`" if not plan else
               "its transformers model does not support vLLM's attention backend")
    return False, "no engine: " + "; ".join(why)


def release_family(arch: str) -> str:
    """The hand-written family that plans ``arch`` in a naming other than transformers' (the
    release naming its engine loads: a family that takes only some configs, or other model
    types than the sweep's), else ""."""
    from pploader.families import FAMILIES
    for fam in FAMILIES:
        if arch in fam.architectures and (fam.config_match is not None or fam.model_types):
            return fam.name
    return ""


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweep")
    ap.add_argument("--vllm", required=True, help="site-packages holding vllm")
    ap.add_argument("--sglang", required=True, help="site-packages holding sglang")
    args = ap.parse_args(argv)
    native, backend, removed = vllm_registry(Path(args.vllm))
    sglang = sglang_models(Path(args.sglang))
    hf = vllm_transformers(Path(args.vllm))
    rows = [r for r in json.loads(Path(args.sweep).read_text())
            if str(r.get("tp2", "")).startswith("refused")]
    split = none = 0
    lines = ["| model type | architecture | first refused tensor: pploader's reason | engines |",
             "|---|---|---|---|"]
    for r in rows:
        some, text = verdict(r["architecture"], native, backend, removed, sglang,
                             str(r.get("model_type", "")), hf, str(r.get("tp2_reason", "")),
                             release_family(r["architecture"]))
        split, none = split + some, none + (not some)
        reason = str(r.get("tp2_reason", "")).split("no unambiguous split for ")[-1]
        reason = reason.split("; run with tp=1")[0].replace("|", "/")
        tensor = r["tp2"][len("refused: "):]
        lines.append(f"| {r['model_type']} | {r['architecture']} | `{tensor}`: {reason} | "
                     f"{text} |")
    print("\n".join(lines))
    print(f"\n{len(rows)} refused at TP=2: {split} split by some engine, {none} by none",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
