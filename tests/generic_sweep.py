"""Acceptance sweep of the generic family over every causal-LM architecture transformers has.

For each model type in transformers' causal-LM mapping: build a tiny configuration (sizes
shrunk: 4 layers, hidden 64, 4 heads, 4 experts, vocab 128, ...), instantiate it on the CPU and
``save_pretrained`` it (sharded). Architectures where that fails are listed as not buildable.
Then, through pploader's own entry points:

- ``pploader plan <dir> --pp 2`` (the CLI, in-process) must succeed;
- a 2-rank PP load (both ranks' ``plan_rank`` + ``Reader``) must cover every checkpoint tensor
  exactly once (a tied embedding also as the last stage's head) and be bitwise equal to
  ``safe_open``; MoE models also PP=2 x EP=2 (each rank only its experts' bytes);
- TP=2 planning is tried and its outcome recorded (derived split, or the refusal message);
- the PP=2 forward built from the loaded stages (``integrations.hf.build_stage``, both stages
  in this process) is compared with transformers' own logits of the saved model; a model
  whose layer order the integration cannot split is recorded as "refused: <its reason>".

Run (the table in docs/families.md comes from this)::

    PYTHONPATH=$PWD python tests/generic_sweep.py --json /tmp/sweep.json --markdown /tmp/sweep.md

``--types a,b`` restricts the model types. tests/families/test_generic_sweep.py runs a subset.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch

from sweep_shrink import LAYERS, model_config, tiny_config  # noqa: F401 - re-exported

MAX_PARAMS = 20_000_000


class Timeout(Exception):
    pass


def _alarm(_sig: int, _frame: Any) -> None:
    raise Timeout("timed out")


def causal_lm_types() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    out = {}
    for model_type, arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        out[model_type] = arch if isinstance(arch, str) else arch[0]
    return dict(sorted(out.items()))


def _checkpoint(model_type: str, arch: str, out: Path) -> torch.nn.Module:
    import transformers
    config = model_config(tiny_config(model_type), getattr(transformers, arch))
    config.architectures = [arch]
    with torch.device("meta"):  # refuse what the shrink did not make tiny (sub-configs)
        params = sum(p.numel() for p in getattr(transformers, arch)._from_config(
            config, dtype=torch.float32).parameters())
    if params > MAX_PARAMS:
        raise ValueError(f"the shrunk config still has {params / 1e6:.0f}M parameters")
    torch.manual_seed(0)
    model = getattr(transformers, arch)._from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(out, max_shard_size="40KB")
    as_released(model_type, out, config.to_dict())
    return model


def as_released(model_type: str, out: Path, config: dict) -> None:
    """Rewrite what transformers' save splits unlike the released checkpoints (its reverse
    conversion cuts a fused tensor in equal parts; pploader/families/saved_splits.py): an
    OLMo-hybrid's ``{q,k,v}_conv1d`` become [key, key, value] rows, as released and as vLLM
    loads them (transformers concatenates them back on load either way)."""
    if model_type != "olmo_hybrid":
        return
    from safetensors.torch import load_file, save_file
    key = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    files = sorted(out.glob("*.safetensors"))
    tensors = {f: load_file(f) for f in files}
    where = {n: f for f, ts in tensors.items() for n in ts}
    for name in [n for n in where if n.endswith(".linear_attn.q_conv1d.weight")]:
        parts = [name[:-len("q_conv1d.weight")] + c + "_conv1d.weight" for c in "qkv"]
        fused = torch.cat([tensors[where[n]][n] for n in parts])
        for n, piece in zip(parts, fused.split([key, key, value])):
            tensors[where[n]][n] = piece.clone()
    for f, ts in tensors.items():  # same names, files and total bytes: the index holds
        save_file(ts, f, metadata={"format": "pt"})


def _load_check(spec: Any, index: Any, ref: dict, pp: int, ep: int) -> int:
    """Plans of every rank, loads them, checks coverage and bytes; returns tensors read."""
    from pploader.io.read import Reader
    from pploader.planning.plan import plan_all
    plans = plan_all(spec, index, pp, 1, ep)
    seen: dict[str, set[int]] = {}
    lent: dict[str, set[int]] = {}
    total = 0
    resolved = spec.for_checkpoint(index.weight_map)
    shared_targets = {t for t, _, w in resolved.family.shared if w != "every"}
    every = {t for t, _, w in resolved.family.shared if w == "every"}  # read by each stage
    for plan in plans:
        got = dict(Reader(plan))
        for item in plan.items:
            want = ref[item.name]
            if plan.experts is not None and item.shape != tuple(want.shape):
                e0, e1 = plan.experts
                # 3-d: one row per expert (LongCat's zero experts' rows after the routed
                # ones, read by no rank); 2-d: E x rows flattened (DBRX)
                rows = 1 if want.dim() >= 3 else want.shape[0] // spec.num_experts
                want = want[e0 * rows:e1 * rows]
            tensor = got[item.target]
            if tensor.dtype != want.dtype or not torch.equal(
                    tensor.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                raise AssertionError(f"rank {plan.topology.rank}: {item.name} differs from safe_open")
            total += 1
        borrowed = {i.name for i in plan.items if i.target != i.name and i.target in
                    shared_targets}  # a tied copy's source, read for a layer of this stage
        for name in set(plan.tensors) - borrowed:
            seen.setdefault(name, set()).add(plan.topology.pp_rank)
        for name in borrowed:
            lent.setdefault(name, set()).add(plan.topology.pp_rank)
    # a stored tensor no stage runs under its own name (a per-layer adapter kept in a tied
    # block's first layer): planned by the stages borrowing it for the layer that runs it
    seen.update({n: s for n, s in lent.items() if n not in seen})
    missing = sorted(set(index.weight_map) - set(seen))
    if missing:
        raise AssertionError(f"never planned: {missing[:4]}")
    for name, stages in seen.items():
        role = resolved.family.classify(name, resolved.num_layers, resolved.num_mtp_layers)
        replica = resolved.tie_word_embeddings and role is not None and role.role == "embed"
        if len(stages) != (pp if name in every else 1 + (pp > 1 and replica)):
            raise AssertionError(f"{name} planned by stages {sorted(stages)}")
    return total


def stage_needs(model: torch.nn.Module, layer: int, raw: bool = False) -> set[str]:
    """The checkpoint names decoder layer ``layer`` of ``model`` runs with, from the module
    tree alone (independent of pploader's accounting): every parameter and persistent buffer
    registered under the layer, tied copies included (``state_dict`` keeps every path), as
    transformers' own conversion mapping spells them on disk (``raw``: as the module tree
    names them, ``save_pretrained(save_original_format=False)``)."""
    from transformers.core_model_loading import revert_weight_conversion
    from pploader.families.hf_meta import find_layers_path
    path = find_layers_path(model, len(_decoder_layers(model)))
    idle = tuple(p + "." for p in unrun_adapters(model))
    state = {k: v for k, v in model.state_dict().items() if k.startswith(f"{path}.{layer}.")
             and not k.startswith(idle)}
    return set(state) if raw else set(revert_weight_conversion(model, state))


_UNRUN: dict[int, frozenset[str]] = {}


def unrun_adapters(model: torch.nn.Module) -> frozenset[str]:
    """Module paths of per-layer adapter list entries (``*_adapter_list.{k}``, Zamba2's shared
    block LoRA adapters) that a forward of ``model`` never calls, observed with forward hooks
    (not from the model's own bookkeeping): a tied block holds every hybrid layer's adapter,
    each layer runs one. Empty for models without such lists."""
    found = _UNRUN.get(id(model))
    if found is not None:
        return found
    lists = [(n, m) for n, m in model.named_modules(remove_duplicate=False)
             if n.endswith("_adapter_list") and isinstance(m, torch.nn.ModuleList)]
    every = {f"{n}.{k}" for n, m in lists for k in range(len(m))}
    called: set[str] = set()
    hooks = [entry.register_forward_hook(lambda *_a, p=f"{n}.{k}": called.add(p))
             for n, m in lists for k, entry in enumerate(m)]
    try:
        if hooks:
            vocab = model.config.get_text_config().vocab_size
            with torch.no_grad():
                model(input_ids=torch.arange(5).unsqueeze(0) % vocab, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    found = _UNRUN[id(model)] = frozenset(every - called)
    return found


def _decoder_layers(model: torch.nn.Module) -> list:
    text = model.config.get_text_config()
    return [None] * int(getattr(text, "num_hidden_layers"))


def exactness_check(model: torch.nn.Module, spec: Any, index: Any, pp: int) -> None:
    """Independent exactness at PP=``pp`` (one layer per stage at pp = layers): for every
    stage, the names its layers need (``stage_needs``) are exactly the layer names it loads
    (plan targets), and every stored tensor is loaded by some stage. Catches a plan that
    reads every stored tensor once yet leaves a layer without a weight it runs (a tied copy
    such as Zamba's shared block)."""
    from pploader.planning.plan import plan_all
    resolved = spec.for_checkpoint(index.weight_map)
    fam = resolved.family
    plans = plan_all(spec, index, pp, 1, 1)
    loaded: set[str] = set()
    raw = set().union(*(stage_needs(model, i, raw=True) for i in range(  # the module tree's
        resolved.num_layers))) <= set(index.weight_map)                  # names, every layer
    for plan in plans:
        targets = {i.target for i in plan.items}
        loaded |= targets | {i.name for i in plan.items}  # stored ones read for a copy too
        w = plan.window
        need: set[str] = set()
        for layer in range(w.start_layer, w.end_layer):
            need |= stage_needs(model, layer, raw)
        layer_targets = {t for t in targets if (r := fam.classify(
            t, resolved.num_layers, resolved.num_mtp_layers)) is not None and r.placement == "layer"}
        if need != layer_targets:
            raise AssertionError(
                f"PP={pp} stage {w.pp_rank} (layers {w.start_layer}-{w.end_layer - 1}): needs "
                f"but does not load {sorted(need - layer_targets)[:4]}, loads but does not "
                f"need {sorted(layer_targets - need)[:4]}")
    stored = set(index.weight_map)
    if not stored <= loaded | {n for n in stored if (r := fam.classify(
            n, resolved.num_layers, resolved.num_mtp_layers)) is not None and r.placement in
            ("mtp", "ignored")}:
        raise AssertionError(f"PP={pp}: never loaded {sorted(stored - loaded)[:4]}")


def pools_outcome(spec: Any, index: Any) -> str:
    """What default ``pploader load`` (pools on) does at PP=2 after planning: "ok" when every
    stage's cache geometry is derived, else "refused before reading: ..." (the planning-step
    check of ``job._plan``, exit 2 naming --no-pools)."""
    from pploader import PPLoaderError
    from pploader.cache.geometry import stage_geometry
    from pploader.planning.plan import make_windows
    try:
        for window in make_windows(spec, index, 2):
            stage_geometry(spec.for_checkpoint(index.weight_map), window, 1)
    except PPLoaderError as exc:
        return f"refused before reading: {exc.detail[:80]}"
    return "ok"


def _forward(arch: str, path: Path) -> str:
    """PP=2 logits from pploader-loaded stages vs transformers' ``from_pretrained`` of the
    same checkpoint (the reference: the same load path, incl. its buffer initialisation)."""
    import transformers
    from pploader.integrations.hf import build_stage
    from pploader.planning.topology import Topology
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    try:
        ref = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            want = ref(input_ids=ids, use_cache=False).logits
    except Exception as exc:  # noqa: BLE001 - transformers itself cannot run it
        return f"no reference: transformers' from_pretrained + forward fails ({type(exc).__name__})"
    from pploader import PPLoaderError
    stages = [build_stage(path, Topology(2, rank=r)) for r in range(2)]
    try:
        with torch.no_grad():
            got = stages[1].forward(ids, stages[0].forward(ids))
    except PPLoaderError as exc:  # the integration's own refusal (a layer order it cannot split)
        return f"refused: {exc}"
    if torch.equal(got, want):
        return "bit-identical"
    diff = (got - want).abs().max().item()
    if math.isfinite(diff) and torch.allclose(got, want, rtol=1e-4, atol=1e-5):
        return f"close (max diff {diff:.1e})"
    raise AssertionError(f"PP=2 logits differ from transformers' (max diff {diff:.3g})")


def check(model_type: str, arch: str, workdir: Path, *, forward: bool = True) -> dict[str, Any]:
    """One architecture end to end; a dict with result exact / refused / not built / error."""
    from pploader import PPLoaderError
    from pploader.planning.checkpoint import open_checkpoint
    from pploader.planning.plan import plan_all
    from pploader.planning.spec import load_spec
    from pploader.cli import main as cli_main
    from helpers import reference_tensors
    row: dict[str, Any] = {"model_type": model_type, "architecture": arch}
    out = workdir / model_type
    try:
        model = _checkpoint(model_type, arch, out)
    except Timeout:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers cannot build/save it tiny on CPU
        return {**row, "result": "not built", "reason": f"{type(exc).__name__}: {exc}"[:200]}
    try:
        spec, index = load_spec(out), open_checkpoint(out)
        row["family"] = spec.family.name
        row["kinds"] = sorted(set(spec.layer_kinds))
        row["experts"] = spec.num_experts
        with contextlib.redirect_stdout(io.StringIO()):
            rc = cli_main(["plan", "--model", str(out), "--pp", "2"])
        if rc != 0:
            raise AssertionError(f"pploader plan --pp 2 exited {rc}")
        ref = reference_tensors(out)
        row["tensors"] = len(ref)
        _load_check(spec, index, ref, 2, 1)
        layouts = ["PP=2"]
        if spec.num_experts:
            _load_check(spec, index, ref, 2, 2)
            layouts.append("PP=2xEP=2")
        row["loads"] = layouts
        pp_all = min(spec.num_layers, 4)
        exactness_check(model, spec, index, pp_all)  # one layer per stage: every boundary
        row["exact_pp"] = pp_all
        row["pools"] = pools_outcome(spec, index)
        try:
            plan_all(spec, index, 2, 2, 1)
            row["tp2"] = "ok"
        except PPLoaderError as exc:
            row["tp2"] = f"refused: {exc.tensor or exc.detail[:60]}"
            row["tp2_reason"] = exc.detail
    except Timeout:
        raise
    except PPLoaderError as exc:
        return {**row, "result": "refused", "reason": str(exc)[:300]}
    except Exception as exc:  # noqa: BLE001 - a bug: reported as such
        return {**row, "result": "error", "reason": f"{type(exc).__name__}: {exc}"[:300],
                "trace": traceback.format_exc()[-1500:]}
    row["result"] = "exact"
    if forward:
        try:
            row["forward"] = _forward(arch, out)
        except Timeout:
            raise
        except Exception as exc:  # noqa: BLE001 - recorded, the load itself was exact
            row["forward"] = f"not matched: {type(exc).__name__}: {exc}"[:200]
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model type | architecture | family | result | layer kinds | loads | TP=2 | "
             "PP=2 forward | pools |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        result = r["result"] if r["result"] == "exact" else f"{r['result']}: {r.get('reason', '')}"
        result = result.replace("|", "/").replace("\n", " ").split(" (not a decoder")[0]
        result = result.split("; hand-written families:")[0][:160]
        family = r.get("family", "")
        family = "generic" if family.startswith("generic") else family
        lines.append(f"| {r['model_type']} | {r['architecture']} | {family} | {result} | "
                     f"{', '.join(r.get('kinds', []))} | {', '.join(r.get('loads', []))} | "
                     f"{r.get('tp2', '')} | {r.get('forward', '')} | "
                     f"{r.get('pools', '')} |".replace("\n", " "))
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--markdown", default="")
    ap.add_argument("--timeout", type=int, default=180)
    ap.add_argument("--no-forward", action="store_true")
    args = ap.parse_args(argv)
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    types = causal_lm_types()
    if args.types:
        types = {t: types[t] for t in args.types.split(",")}
    rows = []
    signal.signal(signal.SIGALRM, _alarm)
    with tempfile.TemporaryDirectory() as tmp:
        for model_type, arch in types.items():
            start = time.perf_counter()
            signal.alarm(args.timeout)
            try:
                row = check(model_type, arch, Path(tmp), forward=not args.no_forward)
            except Timeout:
                row = {"model_type": model_type, "architecture": arch, "result": "error",
                       "reason": f"timed out after {args.timeout} s"}
            finally:
                signal.alarm(0)
            row["seconds"] = round(time.perf_counter() - start, 1)
            rows.append(row)
            print(f"{model_type:28s} {row['result']:9s} {row.get('forward', '')[:40]:40s} "
                  f"{row.get('reason', '')[:110]}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows))
    return 0 if all(r["result"] != "error" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
