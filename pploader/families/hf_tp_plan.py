"""TP rules from transformers' ``base_model_tp_plan``, as vLLM's transformers backend applies it.

vLLM serves an architecture it has no model file for through its transformers backend
(``vllm/model_executor/models/transformers/``, vLLM 0.32): it builds transformers' base
model and walks its modules once, replacing them by vLLM's layers:

- an ``nn.Linear`` takes the style of the first key of the base model's ``tp_plan`` (the
  config's ``base_model_tp_plan`` with its children's plans) that ``re.match``-es its name,
  both prefixed ``model.`` (a prefix match: ``layers.*.mlp`` also names ``layers.0.mlp.fc``):
  ``colwise`` / ``colwise_gather_output`` -> ``ColumnParallelLinear`` (weight rows and bias
  split evenly), ``rowwise`` / ``rowwise_split_input`` -> ``RowParallelLinear`` (weight
  columns split, bias whole), ``replicate`` or no key -> ``ReplicatedLinear`` (whole);
- before the plan, its fusers trace each module's forward and merge sibling projections
  whatever the plan says: q / k / v into a ``QKVParallelLinear`` (split by heads, a KV head
  replicated when there are fewer than TP), a GLU's gate / up into a
  ``MergedColumnParallelLinear``, and the projection after them row-parallel; which ones,
  per module class, is recorded in ``hf_fusers`` (a class it records takes that, its other
  linears the plan's style; another keeps the rules below);
- the vocabulary embeddings (the input embedding's ``nn.Embedding``s and any whose size is a
  ``*vocab_size`` of the config) -> ``VocabParallelEmbedding``, the head -> ``ParallelLMHead``
  (its bias too); every other parameter and buffer is held whole.

:func:`plan_splits` writes that down per tensor from the meta model (``hf_meta``), for the
architectures of :data:`TRANSFORMERS_BACKEND`; :func:`with_plan` turns it into the generic
family's rules where its own would refuse. Refused, naming tensor and reason: a style the
backend has no linear class for (it would fall back to a replicated linear, against the
plan's split; a non-string style, which it rejects), a linear the plan leaves replicated
beside a sibling the fusers could merge it with, in a class ``hf_fusers`` does not record
(the trace decides, not the plan), a head parameter other than the weight / bias, and every
tensor of an architecture the transformers vLLM accepts lacks (``hf_fusers.NOT_BUILT``). Sizes that do not divide are refused by the planner
(``planning/shard.py``), as vLLM's ``divide`` asserts. Stacked / per-expert expert tensors
(vLLM's ``FusedMoE``) are left to the generic rules. The plan is the installed
transformers' own: vLLM must run with the same version.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional, Sequence

from ..errors import PlanError
from .base import ShardRule, SpecView
from .hf_fusers import NOT_BUILT, fused_splits, unbuilt_layers

__all__ = ["TRANSFORMERS_BACKEND", "plan_splits", "with_plan", "rule_of"]

#: architectures vLLM 0.32 serves only through its transformers backend (no vLLM or SGLang
#: model file; ``tests/tp_refusals.py``) whose tensors the generic rules cannot all split
TRANSFORMERS_BACKEND = frozenset({
    "AriaTextForCausalLM", "AXK2ForCausalLM", "CodeGenForCausalLM", "DiffLlamaForCausalLM",
    "DogeForCausalLM", "DoryForCausalLM", "FlexOlmoForCausalLM", "FlintForCausalLM",
    "GPTNeoXForCausalLM", "Lfm3ForCausalLM", "MiniMaxForCausalLM",
    "Phi4MultimodalForCausalLM"})

COLUMN = frozenset({"colwise", "colwise_gather_output"})
ROW = frozenset({"rowwise", "rowwise_split_input"})
REPLICATE = "replicate"

#: how a tensor is held (values of :func:`plan_splits`): split on dim 0 / dim 1, whole,
#: vocabulary-parallel, by heads of ``heads:<head_dim>`` rows, or ``refuse:<why>``
DIM0, DIM1, WHOLE, VOCAB = "dim0", "dim1", "whole", "vocab"


def plan_splits(model: Any, layers_path: str) -> dict[str, str]:
    """How vLLM's transformers backend holds each state-dict tensor of ``model`` (the causal
    LM on ``meta``), keyed by name; a decoder layer's tensors by their name inside the layer
    (``self_attn.q_proj.weight``). Expert tensors are left out (the generic rules decide)."""
    from torch import nn
    base = model.base_model
    base_path = next((n for n, m in model.named_modules() if m is base), "")
    plan = dict(getattr(base, "tp_plan", None) or {})
    sizes = set(_vocab_sizes(model.config))
    embed = base.get_input_embeddings()
    vocab = {id(m) for m in embed.modules() if isinstance(m, nn.Embedding)} if \
        isinstance(embed, nn.Module) else set()
    vocab |= {id(m) for m in base.modules()
              if isinstance(m, nn.Embedding) and m.num_embeddings in sizes}
    text = model.config.get_text_config()
    head_dim, head_size = getattr(text, "head_dim", None), _head_size(text)
    found: dict[str, str] = {}

    def put(path: str, how: str) -> None:
        found.setdefault(path, how)

    def walk(module: Any, rel: str) -> None:
        linears = {n: c for n, c in module.named_children() if isinstance(c, nn.Linear)}
        styles = {n: _style(plan, _join(rel, n)) for n in linears}
        fused = fused_splits(module, linears, head_size)
        splits = _linear_splits(module, linears, styles, head_dim) if fused is None else \
            {n: fused.get(n) or _plan_split(styles[n]) for n in linears}
        for name, how in splits.items():
            for pname in ("weight", "bias"):
                if getattr(linears[name], pname, None) is not None:
                    put(_join(rel, f"{name}.{pname}"), _param_how(how, pname))
        for name, child in module.named_children():
            if name in linears:
                continue
            if id(child) in vocab:
                put(_join(rel, f"{name}.weight"), VOCAB)
            walk(child, _join(rel, name))

    walk(base, "")
    unbuilt: Optional[str] = None
    if type(model).__name__ in NOT_BUILT:
        unbuilt = (f"vLLM 0.32, whose transformers backend would serve it, requires "
                   f"transformers <5.20, which has no model type "
                   f"{NOT_BUILT[type(model).__name__]!r}: no engine defines its split")
    elif found:
        num = getattr(model.config.get_text_config(), "num_hidden_layers", None)
        missing = unbuilt_layers(model.get_submodule(layers_path), num) \
            if isinstance(num, int) else []  # (the decoder layers: not a tower's)
        if missing:
            idx, cls = missing[0]
            unbuilt = (f"vLLM's transformers backend refuses to build it (layer {idx}, "
                       f"{cls}: none of its modules calls transformers' attention interface, "
                       f"from which vLLM makes each layer's attention; {len(missing)} such "
                       "layer(s)): no engine serves it")
    prefix = base_path + "." if base_path else ""
    layers = layers_path + "."
    out: dict[str, str] = {}
    heads = _head_keys(model)
    state = model.state_dict()
    for key, tensor in state.items():
        if _expert(key):
            continue  # vLLM's FusedMoE: the generic rules' stacked / per-expert split
        if not key.startswith(prefix):
            how = VOCAB if key in heads else \
                "refuse:not held by vLLM's transformers backend (it builds the base model " \
                "and an lm_head of weight and bias only)"
        else:
            how = found.get(key[len(prefix):], WHOLE)
        if unbuilt is not None:
            how = "refuse:" + unbuilt
        comp = _comp(key, layers)
        if comp in out:
            if out[comp] != how:
                out[comp] = f"refuse:its layers are held differently ({out[comp]}, {how})"
            continue
        out[comp] = how
        for name in _saved(model, key, tensor):  # the checkpoint's spelling (save_pretrained)
            out.setdefault(_comp(name, layers), how)
    return out


def _comp(key: str, layers: str) -> str:
    """``key`` inside its decoder layer (``self_attn.q_proj.weight``), or whole."""
    if key.startswith(layers):
        idx, _, comp = key[len(layers):].partition(".")
        if idx.isdigit():
            return comp
    return key


def _saved(model: Any, key: str, tensor: Any) -> list[str]:
    """The name(s) ``save_pretrained`` writes ``key`` under (transformers' conversion
    mapping reverted); none where the conversion needs several tensors at once."""
    from ..errors import ConfigError
    from .hf_ties import revert_one
    try:
        return [n for n in revert_one(model, key, tensor) if n != key]
    except ConfigError:
        return []


def _join(rel: str, name: str) -> str:
    return f"{rel}.{name}" if rel else name


def _style(plan: Mapping[str, Any], rel: str) -> Any:
    """The plan style of the module at ``rel`` (below the base model), as vLLM's
    ``recursive_replace`` finds it: the first key matching from the start, both prefixed."""
    qual = "model." + rel
    key = next((p for p in plan if re.match("model." + p, qual)), None)
    return plan.get(key, REPLICATE) if key is not None else REPLICATE


def _linear_splits(module: Any, linears: Mapping[str, Any], styles: Mapping[str, Any],
                   head_dim: Optional[int]) -> dict[str, str]:
    """The split of each linear child of ``module`` (see the module docstring)."""
    out: dict[str, str] = {}
    mergeable: dict[tuple[int, bool], list[str]] = {}  # what vLLM's fusers could merge
    for name, lin in linears.items():
        mergeable.setdefault((lin.in_features, lin.bias is None), []).append(name)
    column = [n for n in linears if isinstance(styles[n], str) and styles[n] in COLUMN]
    for name, lin in linears.items():
        style = styles[name]
        if not isinstance(style, str):
            out[name] = f"refuse:plan style {style!r} is not a string (vLLM raises)"
        elif style in COLUMN:  # (style: a string from here on)
            group = [n for n in mergeable[(lin.in_features, lin.bias is None)]
                     if isinstance(styles[n], str) and styles[n] in COLUMN]
            hd = getattr(module, "head_dim", None) or head_dim
            out[name] = f"heads:{hd}" if len(group) >= 3 and isinstance(hd, int) and hd > 0 \
                and lin.out_features % hd == 0 else DIM0  # q / k / v: QKVParallelLinear
        elif style in ROW:
            out[name] = DIM1
        elif style != REPLICATE and _asks_split(style):
            out[name] = (f"refuse:plan style {style!r}: vLLM's transformers backend has no "
                         "linear class for it (it would hold the weight whole, against the "
                         "plan's split)")
        elif len(mergeable[(lin.in_features, lin.bias is None)]) > 1 or column:
            out[name] = ("refuse:the plan leaves it replicated, but vLLM's transformers backend "
                         "may fuse it with its sibling projections (QKV / GLU / merged "
                         "column) by tracing the module's forward, which shards them; the "
                         f"plan does not say which, and {type(module).__name__} is not a "
                         "class whose fusion pploader records (families/hf_fusers.py)")
        else:
            out[name] = WHOLE
    return out


def _plan_split(style: Any) -> str:
    """The split of a linear vLLM's fusers leave to the plan: its style's linear class."""
    if not isinstance(style, str):
        return f"refuse:plan style {style!r} is not a string (vLLM raises)"
    if style in COLUMN:
        return DIM0
    if style in ROW:
        return DIM1
    if style != REPLICATE and _asks_split(style):
        return (f"refuse:plan style {style!r}: vLLM's transformers backend has no linear "
                "class for it (it would hold the weight whole, against the plan's split)")
    return WHOLE


def _head_size(text: Any) -> Optional[int]:
    """The model's head size as vLLM reads it: ``head_dim``, else hidden size / heads."""
    hd = getattr(text, "head_dim", None)
    if isinstance(hd, int) and hd > 0:
        return hd
    hidden, heads = getattr(text, "hidden_size", None), getattr(text, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads \
        else None


def _asks_split(style: str) -> bool:
    """Whether a style vLLM has no linear class for asks a linear to be split
    (``packed_colwise``, ``local_rowwise``); a style of another module kind that a plan key
    reaches by its prefix match (``embed_tokens``'s ``embedding_rowwise`` on
    ``embed_tokens_extend.*``) asks nothing of it: vLLM's fallback, whole, stands."""
    return ("colwise" in style or "rowwise" in style) and not style.startswith("embedding")


def _param_how(how: str, pname: str) -> str:
    """A linear's split applied to its ``pname``: a row-parallel bias is whole (added once
    after the reduce); a column-parallel one splits with the rows."""
    return WHOLE if pname == "bias" and how == DIM1 else how


def _vocab_sizes(config: Any) -> Sequence[int]:
    """Every ``*vocab_size*`` integer of the config and its sub-configs (vLLM's
    ``_vocab_embeddings``)."""
    out: list[int] = []
    for key, value in vars(config).items():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            out.extend(_vocab_sizes(value))
        elif "vocab_size" in key and isinstance(value, int) and not isinstance(value, bool):
            out.append(value)
    return out


def _head_keys(model: Any) -> frozenset[str]:
    """The head's weight and bias names (vLLM's ``ParallelLMHead`` holds both)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return frozenset()
    names = {n for n, m in model.named_modules() if m is head}
    return frozenset(f"{n}.{p}" for n in names for p in ("weight", "bias"))


def _expert(key: str) -> bool:
    return "experts" in key.split(".")[:-1]


# ---- rules ------------------------------------------------------------------------------------

def _refuse(comp: str, why: str) -> Callable[[SpecView], tuple[int, ...]]:
    def refuse(spec: SpecView) -> tuple[int, ...]:
        raise PlanError(f"tensor parallelism refused for {spec.architecture} (vLLM's "
                        f"transformers backend, the model's base_model_tp_plan): {comp}: "
                        f"{why}; run with tp=1")  # plan_rank names the tensor
    return refuse


def rule_of(pattern: str, comp: str, shape: tuple[int, ...], how: str) -> ShardRule:
    """The ShardRule of one component held ``how`` (a :func:`plan_splits` value)."""
    if how == WHOLE:
        return ShardRule(pattern, None)
    if how == DIM0:
        return ShardRule(pattern, 0)
    if how == DIM1:
        return ShardRule(pattern, 1) if len(shape) == 2 else \
            ShardRule(pattern, 0, segments=_refuse(comp, f"row-parallel {list(shape)}"))
    if how == VOCAB:
        return ShardRule(pattern, 0, pad=True)
    if how.startswith("heads:"):
        heads = shape[0] // int(how.split(":", 1)[1])
        return ShardRule(pattern, 0, units=lambda _spec: heads)
    return ShardRule(pattern, 0, segments=_refuse(comp, how.split(":", 1)[-1]))


def _refuses(rule: ShardRule) -> bool:
    """Whether a generic rule refuses TP (``generic._refuse``'s closure)."""
    return getattr(rule.segments, "__qualname__", "").startswith("_refuse.")


def with_plan(rules: Sequence[ShardRule], comps: Mapping[str, tuple[int, ...]],
              splits: Mapping[str, str]) -> tuple[ShardRule, ...]:
    """``rules`` (the generic family's, one per component of ``comps``, in order), with the
    plan's rule for every component :func:`plan_splits` holds (``splits``), where some
    generic rule refuses; unchanged otherwise (the generic TP plans already derived stay)."""
    if not splits or not any(_refuses(r) for r in rules):
        return tuple(rules)
    out = []
    for rule, (comp, shape) in zip(rules, comps.items()):
        how = splits.get(comp.replace("#", "0"))
        out.append(rule if how is None else rule_of(rule.pattern, comp, shape, how))
    return tuple(out)
