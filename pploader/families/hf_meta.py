"""What a transformers model's checkpoint holds, derived from the model built on ``meta``.

Used by the generic family (``generic.py``). Nothing here reads weights or allocates memory:
the architecture class named in ``config.json`` is instantiated on the ``meta`` device, and its
state dict goes through the same steps ``save_pretrained`` applies (keys ignored on save, tied
weights removed, transformers 5's conversion mapping reverted to the original naming). Each
state-dict key is also reverted on its own, which tells where every checkpoint name comes from:
its decoder layer, its expert (stacked 3-D parameters or per-expert modules) and whether it is
registered before the decoder layers (first stage) or after them (last stage). One layer of
each kind is derived and the others named after it; ``hf_check.py`` cross-checks that against
the whole-state conversion on sampled layers.

transformers is imported here (and in its helper modules) only when a generic family is built.
"""
from __future__ import annotations

import json
import logging
import re
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ..errors import ConfigError
from .hf_check import check_conversion, pin_conversions, sampled_layers
from .hf_experts import declared_experts, halved_experts, ids_below, routed_count
from .hf_tp_plan import TRANSFORMERS_BACKEND, plan_splits
from .hf_multimodal import PREFIXED, encoder_keys, prefixed_conversions, tower_paths
from .saved_splits import released_shapes
from .hf_ties import (first_uses, loop_uses, revert_one, saved_names, saved_pairs,
                      tied_copies, unrun_entries)

if TYPE_CHECKING:  # pragma: no cover
    from .meta_store import MetaStore

logger = logging.getLogger(__name__)

__all__ = ["Naming", "MetaModel", "derive", "use_store", "build_meta_model", "hf_config", "loop_uses"]

Shapes = dict[str, tuple[int, ...]]
_DIGIT = re.compile(r"\d+")


@dataclass(frozen=True)
class Naming:
    """One on-disk naming of the checkpoint (original = ``save_pretrained`` default; the
    transformers naming = ``save_original_format=False``; prefixed = the original with the
    prefixes transformers strips on load, as older VL checkpoints store them)."""

    name: str
    template: Mapping[str, tuple[int, ...]]     # every tensor name -> shape
    layer_prefix: str                           # regex, group 1 = layer id
    first: tuple[str, ...]                      # non-layer names on the first stage
    last: tuple[str, ...]                       # non-layer names on the last stage
    expert_pattern: Optional[str]               # on the component; group 1 = expert id
    fused_components: tuple[str, ...]           # components stacking experts on dim 0
    embed: Optional[str]                        # the input embedding's name
    head: Optional[str]                         # the output head's name (absent when tied)
    head_shape: tuple[int, ...] = ()            # its shape (also when tied)
    #: parameters the model ties to a stored one, the head's tie aside: (target as this naming
    #: would spell it, the stored source, where the target is used: "layer" / "first" / "last")
    shared: tuple[tuple[str, str, str], ...] = ()
    encoder: tuple[str, ...] = ()               # first-stage names of vision / audio encoders
    unrun: tuple[str, ...] = ()                 # stored layer names their layer does not run


@dataclass(frozen=True)
class MetaModel:
    """Everything the generic family needs from the meta model (plain data, picklable)."""

    architecture: str
    model_type: str
    num_layers: int
    num_experts: int
    moe_layers: frozenset[int]
    layer_params: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]  # per layer, unconverted
    namings: tuple[Naming, ...]                 # original first
    dtypes: Mapping[str, str] = field(default_factory=dict)  # original name -> torch dtype
    tied: tuple[tuple[str, str], ...] = ()      # (target, source) removed as tied
    text_config: Mapping[str, Any] = field(default_factory=dict)
    #: stacked experts' ``gate_up_proj`` / ``down_proj`` (relative to a layer) whose module
    #: splits the fused gate/up output in halves, gate first (``halved_experts``)
    halved: frozenset[str] = frozenset()
    #: how vLLM's transformers backend holds each tensor (``hf_tp_plan.plan_splits``; only
    #: for ``hf_tp_plan.TRANSFORMERS_BACKEND``)
    tp_plan: Mapping[str, str] = field(default_factory=dict)


def hf_config(config: Mapping[str, Any]) -> Any:
    """The transformers config object of a parsed ``config.json`` (by ``model_type``)."""
    from transformers import CONFIG_MAPPING
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ConfigError(f"model_type {model_type!r} is not known to the installed transformers",
                          file="config.json")
    try:
        cls = CONFIG_MAPPING[model_type]
        return cls.from_dict(cls._decode_special_floats(dict(config)))  # {"__float__": "Infinity"}
    except Exception as exc:  # noqa: BLE001 - any config validation error, reported as such
        raise ConfigError(f"transformers cannot read this {model_type} config: "
                          f"{type(exc).__name__}: {exc}", file="config.json") from None


def build_meta_model(config: Mapping[str, Any]) -> Any:
    """The architecture named in ``config.json``, instantiated on ``meta`` (no memory)."""
    import torch
    import transformers
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if cls is None or not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise ConfigError(f"architecture {arch!r} is not a model class of the installed "
                          f"transformers {transformers.__version__}", file="config.json")
    hf = hf_config(config)
    raw = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(raw).replace("torch.", ""), torch.float32)
    try:
        with torch.device("meta"):
            model = cls._from_config(hf, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - the model's own constructor failed
        raise ConfigError(f"transformers cannot build {arch} on the meta device: "
                          f"{type(exc).__name__}: {exc}", file="config.json") from None
    return model


_MEMO: dict[str, MetaModel] = {}   # per config (its sorted JSON), at most _MEMO_SIZE
_MEMO_SIZE = 64
#: where derived structures are kept between processes (meta_store.py); the CLI sets it
_STORE: list[Optional["MetaStore"]] = [None]


def use_store(store: Optional["MetaStore"]) -> None:
    """Keep derived structures in ``store`` (None: in memory only, the library default)."""
    _STORE[0] = store


def derive(config: Mapping[str, Any]) -> MetaModel:
    """The checkpoint structure of ``config`` (cached per config: the model is built once
    per process, or once per machine with a store)."""
    key = json.dumps(config, sort_keys=True, default=str)
    meta = _MEMO.get(key)
    if meta is None:
        store = _STORE[0]
        meta = store.load(key) if store is not None else None
        if meta is None:
            meta = _derive(json.loads(key))
            if store is not None:
                store.save(key, meta)
        if len(_MEMO) >= _MEMO_SIZE:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = meta
    return meta


def find_layers_path(model: Any, num_hidden: Optional[int]) -> str:
    """Path of the decoder-layer ModuleList: a ModuleList beside the input embedding."""
    from torch import nn
    try:
        embed = model.get_input_embeddings()  # type: ignore[operator]
    except NotImplementedError as exc:  # PPFormulaNet: transformers cannot name the embedding
        raise ConfigError(f"{type(model).__name__}: no input embedding ({exc})") from None
    for path, module in model.named_modules():
        children = dict(module.named_children())
        if not any(c is embed for c in children.values()):
            continue
        lists = [n for n, c in children.items()  # (not a list of per-codebook embeddings)
                 if isinstance(c, nn.ModuleList) and len(c) and c is not embed]
        if len(lists) > 1 and num_hidden is not None:
            lists = [n for n in lists if len(children[n]) == num_hidden]
        if len(lists) == 1:
            return f"{path}.{lists[0]}" if path else lists[0]
        break
    found = [path for path, module in model.named_modules()  # e.g. BERT-style encoder.layer
             if isinstance(module, nn.ModuleList) and num_hidden and len(module) == num_hidden]
    if len(found) > 1:  # leave out towers: sub-models with their own (vision, audio) config
        towers = tower_paths(model)
        found = [p for p in found if not any(p.startswith(t + ".") for t in towers)]
    if len(found) == 1:
        return found[0]
    raise ConfigError(f"{type(model).__name__}: no single list of decoder layers beside the input "
                      "embedding (not a decoder-only layout the generic family understands)")


def _experts_of(layer: Any) -> tuple[int, dict[str, int]]:
    """(experts, {relative key: expert id, -1 for stacked, -2 for stacked with extra rows past
    the routed experts}) of one decoder layer."""
    from torch import nn
    count, keys = 0, {}
    for path, module in layer.named_modules():
        if path.rpartition(".")[2] != "experts":
            continue
        own = dict(module.named_parameters(recurse=False))
        if isinstance(module, nn.ModuleList):
            count = max(count, len(module))
            for key, _ in module.named_parameters():
                keys[f"{path}.{key}"] = int(key.split(".")[0])
        elif own:
            big = [p.shape[0] for p in own.values() if p.dim() >= 3]
            routed = routed_count(module, big)
            if not routed:
                continue
            count = max(count, routed)
            for name, p in own.items():  # -2: extra rows past the routed experts (LongCat)
                if p.dim() >= 2 and p.shape[0] == routed:
                    keys[f"{path}.{name}"] = -1
                elif p.dim() >= 3 and p.shape[0] > routed:
                    keys[f"{path}.{name}"] = -2
    if not keys:
        count, keys = declared_experts(layer)
    return count, keys


def forward_order(model: Any, layers_path: str) -> dict[str, str]:
    """``{path: "first" | "last"}`` for the children (and own parameters / buffers) of the
    module holding the decoder layers, by where its ``forward`` first uses them: before the
    layer loop = first stage, after = last stage. Registration order is not enough (BART-style
    decoders register ``layernorm_embedding`` after the layers and run it before them; a VL
    model registers its vision tower after the language model and runs it first, through a
    helper such as ``get_image_features``: ``self.<method>(...)`` calls count as using what the
    method uses, two levels deep). Read from the source (static: a forward on ``meta`` stops at
    data-dependent mask code). Names the forward does not reach are left out: callers fall
    back to registration order."""
    parent_path, _, layers_name = layers_path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    first_use = first_uses(type(parent), "forward", 2)
    if layers_name not in first_use:
        return {}
    # the layers run where the forward itself calls them (``self.language_model(...)``: after
    # ``self.language_model.get_input_embeddings()`` in Fuyu) or else names them (the layer
    # loop), not in a helper that only touches them (RWKV's ``self._rescale_layers()``)
    direct = first_uses(type(parent), "forward", 0)
    boundary = first_uses(type(parent), "forward", 0, calls=True).get(
        layers_name, direct.get(layers_name, first_use[layers_name]))
    prefix = parent_path + "." if parent_path else ""
    own = [n for n, _ in parent.named_children()]
    own += [n for n, _ in parent.named_parameters(recurse=False)]
    own += [n for n, _ in parent.named_buffers(recurse=False)]
    return {prefix + name: "first" if first_use[name] < boundary else "last"
            for name in own if name in first_use and name != layers_name}


def _saved_state(model: Any) -> tuple[dict, list[tuple[str, str]]]:
    """The state dict ``save_pretrained`` starts from: ignored keys and tied copies removed."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict
    state = model.state_dict()
    for key in list(getattr(model, "_keys_to_ignore_on_save", None) or []):
        state.pop(key, None)
    before = set(state)
    state = remove_tied_weights_from_state_dict(state, model)
    tied_map = dict(getattr(model, "all_tied_weights_keys", {}) or {})
    tied = [(t, tied_map.get(t, "")) for t in sorted(before - set(state))]
    return state, tied


def _derive(config: Mapping[str, Any]) -> MetaModel:
    model = build_meta_model(config)
    pin_conversions(model)  # looked up once, not on each revert below
    text = model.config.get_text_config()
    layers_path = find_layers_path(model, getattr(text, "num_hidden_layers", None))
    layers = model.get_submodule(layers_path)
    num_layers = len(layers)
    full_state = model.state_dict()  # tied copies too: where each one sits, what layers run
    every_key = list(full_state)
    state, tied = _saved_state(model)
    keys = list(state)
    lp = layers_path + "."
    first_layer_pos = next((i for i, k in enumerate(keys) if k.startswith(lp)), len(keys))
    order: dict[str, str] = {}  # the layer list's parent first, then each ancestor's forward
    parts = layers_path.split(".")
    for depth in range(len(parts), 0, -1):
        for path, side in forward_order(model, ".".join(parts[:depth])).items():
            order.setdefault(path, side)
    stage_of = {k: next((v for m, v in order.items() if k.startswith(m + ".")),
                        "first" if pos < first_layer_pos else "last")
                for pos, k in enumerate(keys) if not k.startswith(lp)}
    stage_of.update({k: order[k] for k in stage_of if k in order})  # own parameters, buffers

    per_layer_experts = [_experts_of(layer) for layer in layers]
    counts = {c for c, _ in per_layer_experts if c}
    if len(counts) > 1:
        raise ConfigError(f"layers have different expert counts {sorted(counts)}")
    num_experts = counts.pop() if counts else 0
    moe_layers = frozenset(i for i, (c, _) in enumerate(per_layer_experts) if c)
    halved = frozenset().union(*(halved_experts(layer) for layer in layers))

    # provenance: per key of one representative layer per structure, plus every global
    reps: dict[tuple, int] = {}
    layer_of: dict[str, tuple[int, str]] = {}
    for k in keys:
        if k.startswith(lp):
            idx, _, rel = k[len(lp):].partition(".")
            layer_of[k] = (int(idx), rel)
    by_layer: dict[int, list[tuple[str, tuple[int, ...]]]] = {i: [] for i in range(num_layers)}
    for k, (j, rel) in layer_of.items():  # one pass (not one per layer: 18 k keys x 46 layers)
        by_layer[j].append((rel, tuple(state[k].shape)))
    signature = {}
    for i in range(num_layers):
        sig = tuple(by_layer[i])
        signature[i] = sig
        reps.setdefault(sig, i)

    embed_param = getattr(model.get_input_embeddings(), "weight", None)  # type: ignore[operator]
    # (None: several embeddings, e.g. MusicGen's one per codebook; placed as first-stage globals)
    head_mod = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)  # a tied parameter: its first (source) name
    # the embedding's saved name: a tied copy registered earlier (CamemBERT's
    # ``lm_head.decoder``) is removed on save, the tie source stays
    embed_key = next((n for n, p in model.named_parameters(remove_duplicate=False)
                      if p is embed_param and n in state), names.get(id(embed_param)))
    head_key = None
    if head_mod is not None and getattr(head_mod, "weight", None) is not None:
        aliases = [n for n, p in model.named_parameters(remove_duplicate=False)
                   if p is head_mod.weight and not n.startswith(layers_path) and n != embed_key]
        own = {f"{n}.weight" for n, m in model.named_modules(remove_duplicate=False)
               if m is head_mod}  # the head's own name, not another tied copy's (ProphetNet)
        head_key = next((n for n in aliases if n in own), aliases[0] if aliases else None)
    shared_pairs = tied_copies(model, tied, state, every_key, lp, order, head_key)
    idle = unrun_entries(model, layers_path)  # per-layer list entries a layer does not run
    shared_pairs = [p for p in shared_pairs if not idle(p[0])]
    unrun = [k for k in every_key if idle(k)]  # stored ones and tied copies' targets
    loop = loop_uses(model, layers_path)  # stored once outside the layers, run by each
    shared_pairs += [(k, k, "every") for k in keys if not k.startswith(lp)
                     and any(k.startswith(p + ".") or k == p for p in loop)]

    encoders = encoder_keys(model, layers_path, stage_of)
    namings, names_of = [], []
    for fmt in ("original", "transformers", PREFIXED):
        with prefixed_conversions(model) if fmt == PREFIXED else nullcontext(True) as on:
            if not on:
                continue
            how = "transformers" if fmt == "transformers" else "original"
            try:
                naming, of_layer = _naming(how, model, state, keys, layer_of, reps, signature,
                                           lp, stage_of, per_layer_experts, num_experts,
                                           embed_key, head_key, encoders, fmt == "original")
                namings.append(replace(naming, name=fmt,
                                       shared=saved_pairs(how, model, state, shared_pairs),
                                       unrun=saved_names(how, model, full_state, unrun)))
                names_of.append(of_layer)
            except ConfigError as exc:
                if fmt != PREFIXED:
                    raise  # the older naming is an extra: such checkpoints stay refused
                logger.debug("%s: no prefixed naming: %s", config.get("architectures"), exc)
    dtypes = check_conversion(model, state, layer_of, sampled_layers(signature, reps, state, lp),
                              namings[0].template, names_of[0])  # (the original naming)
    namings = namings[:1] + [n for n in namings[1:]  # only namings that differ
                             if dict(n.template) != dict(namings[0].template)]
    # what each layer runs with, tied copies included (Zamba2's hybrid layers after the first
    # hold the shared block only as a tied copy: still attention, for the layer kinds)
    ran: dict[int, list[tuple[str, tuple[int, ...]]]] = {i: [] for i in range(num_layers)}
    for k, v in full_state.items():
        if k.startswith(lp):
            idx, _, rel = k[len(lp):].partition(".")
            if idx.isdigit() and int(idx) in ran:
                ran[int(idx)].append((rel, tuple(v.shape)))
    layer_params = tuple(tuple(ran[i]) for i in range(num_layers))
    return MetaModel(str(config["architectures"][0]), str(config.get("model_type")), num_layers,
                     num_experts, moe_layers, layer_params, tuple(namings), dtypes, tuple(tied),
                     _text_values(text), halved,
                     plan_splits(model, layers_path) if config["architectures"][0] in
                     TRANSFORMERS_BACKEND else {})


#: Standard config names, read through transformers' aliases (``attribute_map``: n_head...).
_STANDARD = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "vocab_size", "num_hidden_layers", "intermediate_size", "tie_word_embeddings")


def _text_values(text: Any) -> dict[str, Any]:
    """The text config as a dict, plus the standard names it spells differently."""
    out = dict(text.to_dict())
    for key in _STANDARD:
        if key not in out or out[key] is None:
            value = getattr(text, key, None)
            if isinstance(value, (int, bool)):
                out[key] = value
    return out


def _naming(fmt: str, model: Any, state: dict, keys: list[str],  # noqa: C901
            layer_of: dict[str, tuple[int, str]], reps: dict, signature: dict, lp: str,
            stage_of: dict[str, str], per_layer_experts: list, num_experts: int,
            embed_key: Optional[str], head_key: Optional[str], encoders: set[str],
            by_layer: bool = False) -> tuple[Naming, dict[int, dict[str, str]]]:
    """The names one on-disk naming gives every state-dict key (see module docstring), and
    (``by_layer``) per layer its saved names -> the same component's in its representative."""
    from transformers.core_model_loading import revert_weight_conversion
    memo: dict[str, dict[str, tuple[int, ...]]] = {}

    def saved(key: str) -> dict[str, tuple[int, ...]]:
        if fmt == "transformers":
            return {key: tuple(state[key].shape)}
        if key not in memo:  # (callers never change what it returns)
            memo[key] = {n: tuple(t.shape) for n, t in revert_one(model, key, state[key]).items()}
        return memo[key]

    template: Shapes = {}
    first: list[str] = []
    last: list[str] = []
    prefixes: set[str] = set()
    components_of: dict[int, dict[str, tuple[int, ...]]] = {}
    expert_names: dict[str, Optional[int]] = {}   # component -> expert id (None: unknown yet)
    fused: set[str] = set()
    encoder: list[str] = []
    for pos, key in enumerate(keys):
        if key in layer_of:
            continue
        out = saved(key)
        template.update(out)
        (first if stage_of[key] == "first" else last).extend(out)
        encoder.extend(out if key in encoders else ())
    embed = next(iter(saved(embed_key))) if embed_key and embed_key in state else None
    head = next(iter(saved(head_key))) if head_key and head_key in state else None
    if head_key and head is None:  # tied: the head's name as this naming would spell it
        head = head_key if fmt == "transformers" else next(iter(revert_one(  # (a VL model's
            model, head_key, model.get_parameter(head_key))), head_key)  # language_model.lm_head)
    for rep in sorted(set(reps.values())):
        comps: dict[str, tuple[int, ...]] = {}
        _, expert_keys = per_layer_experts[rep]
        layer_keys = {k: rel for k, (i, rel) in layer_of.items() if i == rep}
        # the whole layer at once: conversions may merge several tensors into one
        whole = ({k: tuple(state[k].shape) for k in layer_keys} if fmt == "transformers" else
                 released_shapes(model.config.model_type, model.config.get_text_config(),
                                 {n: tuple(t.shape) for n, t in revert_weight_conversion(
                                     model, {k: state[k] for k in layer_keys}).items()}))
        for name, shape in whole.items():
            prefix, comp = _split_layer(name, rep)
            prefixes.add(prefix)
            comps[comp] = shape
        for key, rel in layer_keys.items():  # experts: where each expert tensor went
            if rel not in expert_keys:
                continue
            out = saved(key)
            for name, shape in out.items():
                comp = _split_layer(name, rep)[1]
                if comps.get(comp) != shape:
                    raise ConfigError(f"expert tensor {key} is merged with others on save")
                if expert_keys[rel] < 0 and len(out) == 1 and shape == tuple(state[key].shape):
                    fused.add(comp)  # -2 (rows past the routed experts, LongCat's zero
                    # experts): split too, each EP rank its routed block (planning/items.py)
                else:
                    expert_names[comp] = expert_keys[rel] if expert_keys[rel] >= 0 else None
        components_of[rep] = comps
    if len(prefixes) != 1:
        raise ConfigError(f"decoder layers saved under several prefixes {sorted(prefixes)}")
    prefix = prefixes.pop()
    layer_names: dict[int, dict[str, str]] = {}  # saved name -> its representative's
    rep_names = {r: [f"{prefix}{r}.{comp}" for comp in comps]
                 for r, comps in components_of.items()}
    for i, sig in signature.items():
        comps = components_of[reps[sig]]
        names = [f"{prefix}{i}.{comp}" for comp in comps]
        template.update(zip(names, comps.values()))
        if by_layer:  # (what the conversion check needs)
            layer_names[i] = dict(zip(names, rep_names[reps[sig]]))
    head_shape = tuple(model.get_parameter(head_key).shape) if head_key else ()
    return Naming(fmt, template, re.escape(prefix) + r"(\d+)\.", tuple(first), tuple(last),
                  _expert_regex(expert_names, num_experts), tuple(sorted(fused)), embed, head,
                  head_shape, encoder=tuple(encoder)), layer_names


def _split_layer(name: str, layer: int) -> tuple[str, str]:
    """(prefix up to and including ``{layer}.``, component) of a saved layer tensor name."""
    m = re.search(rf"(^|\.){layer}\.", name)
    if m is None:
        raise ConfigError(f"saved name {name!r} does not carry its layer id {layer}")
    return name[:m.end() - len(f"{layer}.")], name[m.end():]


def _expert_regex(comps: Mapping[str, Optional[int]], num_experts: int) -> Optional[str]:
    """One regex (group 1 = expert id) over the per-expert components of a layer."""
    if not comps:
        return None
    groups: dict[tuple, list[tuple[str, ...]]] = {}
    for comp in comps:
        tokens = tuple(comp.split("."))
        skeleton = tuple("#" if _DIGIT.fullmatch(t) else t for t in tokens)
        groups.setdefault(skeleton, []).append(tokens)
    befores, afters = set(), set()
    extra = False
    for skeleton, members in groups.items():
        digit_pos = [i for i, t in enumerate(skeleton) if t == "#"]
        ids = {i: {int(m[i]) for m in members} for i in digit_pos}
        pos = next((i for i in digit_pos if ids[i] == set(range(num_experts))),
                   next((i for i in digit_pos if ids[i] > set(range(num_experts))), None))
        if pos is None:
            raise ConfigError(f"cannot tell the expert id in {'.'.join(members[0])}")
        extra |= max(ids[pos]) >= num_experts
        for m in members:
            befores.add(re.escape(".".join(m[:pos]) + ".") if pos else "")
            afters.add(re.escape("." + ".".join(m[pos + 1:])))
    alt = lambda xs: "(?:" + "|".join(sorted(xs)) + ")"  # noqa: E731
    # ids past the routed count (LongCat's zero experts' gate/up) are layer tensors, not split
    return alt(befores) + (f"({ids_below(num_experts)})" if extra else r"(\d+)") + alt(afters)
